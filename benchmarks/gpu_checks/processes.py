"""Bounded subprocesses: start one in its own process group, wait for it, kill the group past its time.

Every step of the check that runs code (a part, pytest, the compiler, compute-sanitizer, pip)
runs through here, so a hung step ends with everything it started and its log's tail says why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .context import REPO


@dataclass
class Finished:
    """A finished (or killed) process: its exit code, whether it ran out of time, its output's end."""

    returncode: int
    timed_out: bool
    seconds: float
    tail: str


def tail_of(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log (a compiler's or pytest's verdict is at the end)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def start(command: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own process group (so a timeout ends it and everything it started),
    its output going to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as handle:
        handle.write(f"$ {' '.join(command)}\n".encode())
        handle.flush()
        return subprocess.Popen(list(command), stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)


def finish(process: subprocess.Popen[bytes], log: Path, timeout_s: float, started: float) -> Finished:
    """Wait for a process started by ``start``; past ``timeout_s`` kill its process group."""
    timed_out = False
    try:
        process.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the group this check created for it
        except ProcessLookupError:
            pass
        process.wait()
    return Finished(process.returncode, timed_out, time.monotonic() - started, tail_of(log))


def run_bounded(command: Sequence[str], log: Path, env: dict[str, str], timeout_s: float) -> Finished:
    """Run ``command`` to the end or to ``timeout_s``, whichever comes first."""
    started = time.monotonic()
    return finish(start(command, log, env), log, timeout_s, started)
