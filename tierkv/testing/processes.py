"""Serving-engine processes for tests and benchmarks: each one the leader of a process group of
its own, and stopped with its whole group, however the caller ends.

A serving engine starts processes of its own: vLLM an engine core and a worker per rank,
``vllm serve`` the same behind its API server, SGLang a scheduler and a detokenizer. Killing
the process a test started leaves those running (re-parented to init, gigabytes of memory
each, still pinned to the test's cores). So ``start_group`` starts the engine in a new
session (``start_new_session=True``: its own process group, which its children inherit) and
``stop_group`` signals the whole group: TERM, a grace period, then KILL to whatever is
left, the leader's children included even when the leader has already exited.

Every group started here is remembered until it is stopped, and ``stop_all_groups`` stops
what is left: it runs at interpreter exit (``atexit``), and the test suite's session end calls
it too, so a group is stopped even when its caller never reached its own cleanup. Callers
still stop their group in a ``finally`` (or a fixture's teardown): that is what runs when
pytest-timeout interrupts a test (its signal method raises in the test), on a failed assert
and on a timeout of their own.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_STARTED: dict[int, subprocess.Popen[Any]] = {}  # group id (the leader's pid) -> leader, until stopped
_LOCK = threading.Lock()


def start_group(args: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **popen_kwargs)`` as the leader of a new process group (a new
    session), remembered until ``stop_group`` stops it."""
    process: subprocess.Popen[Any] = subprocess.Popen(list(args), start_new_session=True, **popen_kwargs)
    with _LOCK:
        _STARTED[process.pid] = process
    return process


def group_alive(process: subprocess.Popen[Any]) -> bool:
    """Whether a live process of ``process``'s group still exists (the leader, or a child of it
    that outlived it). A zombie (dead, waiting for a parent that may never reap it: in a
    container, PID 1 often does not) is not live; where /proc cannot tell, any member counts."""
    members = group_members(process.pid)
    if members is not None:
        return any(state not in ("Z", "X") for state in members.values())
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: it exists
        return True
    return True


def group_members(group: int) -> dict[int, str] | None:
    """The processes of process group ``group`` and each one's state letter, from /proc (None:
    no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    states = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if len(fields) > 2 and fields[2] == str(group):  # state, ppid, pgrp after the command's ")"
            states[int(entry.name)] = fields[0]
    return states


def stop_group(process: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """Stop ``process`` and every process of its group: SIGTERM to the group, up to ``grace_s``
    for them to exit, then SIGKILL to the group; the leader is reaped. Safe to call again, and
    on a group whose leader already exited (its children may not have)."""
    _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    while group_alive(process) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_group(process, signal.SIGKILL)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): nothing more to do here
        pass
    with _LOCK:
        _STARTED.pop(process.pid, None)


def stop_all_groups() -> int:
    """Stop every group ``start_group`` started and nothing stopped yet; how many."""
    with _LOCK:
        left = list(_STARTED.values())
    for process in left:
        stop_group(process, grace_s=2.0)
    return len(left)


def _signal_group(process: subprocess.Popen[Any], signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass  # the group is gone


atexit.register(stop_all_groups)
