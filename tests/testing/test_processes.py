"""tierkv.testing.processes: a serving engine's process group is stopped whole, children
included, even after its leader was killed alone (what left vLLM's engine core and worker
running, re-parented to init, when a test killed only the process it had started)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tierkv.testing.processes import group_alive, start_group, stop_all_groups, stop_group

# the leader starts a child (as vLLM starts its engine core) that ignores SIGTERM, says its pid, and waits
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped by its new parent, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def ended_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` ends within ``seconds`` (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + seconds
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not running(pid)


def start_leader() -> tuple[subprocess.Popen[str], int]:
    leader = start_group([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True)
    assert leader.stdout is not None
    return leader, int(leader.stdout.readline())


def test_stop_group_ends_the_child_a_killed_leader_left_behind() -> None:
    leader, child = start_leader()
    try:
        leader.kill()  # the direct child only, as the test did
        leader.wait(30)
        assert running(child), "the leader's child outlives a kill of the leader alone"
        assert group_alive(leader)
    finally:
        stop_group(leader, grace_s=1.0)
    assert ended_within(child, 30), "stop_group left the leader's child running"
    assert not group_alive(leader)


def test_stop_group_kills_what_ignores_sigterm_and_is_safe_to_repeat() -> None:
    leader, child = start_leader()
    stop_group(leader, grace_s=1.0)  # TERM: the leader ends, the child ignores it; then KILL
    assert leader.returncode is not None and ended_within(child, 30)
    stop_group(leader, grace_s=1.0)  # a group already gone: nothing to do, no error


def test_stop_all_groups_stops_what_nothing_stopped() -> None:
    """What the suite's session end (tests/conftest.py) and interpreter exit run."""
    leader, child = start_leader()
    assert stop_all_groups() >= 1
    assert ended_within(child, 30) and leader.returncode is not None
    assert stop_all_groups() == 0, "every group is forgotten once stopped"
