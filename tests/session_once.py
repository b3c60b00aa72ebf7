"""Work made once per test session, however many pytest-xdist workers ask for it.

A session fixture runs once per xdist worker; a vLLM reference run (half a minute of a
2-core machine) or a model saved to disk and read by vLLM processes of several modules should
run once. :func:`once` makes it under a file lock in the directory every worker of the
session shares (the parent of each worker's base temp dir), keeps its JSON result there, and
hands the same result to every later caller, in any worker. Its files stay in that directory,
so a vLLM process of another worker can read what a process of this one stored (a tier's path,
a model's path: tierkv keys a chunk by the model's path too).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's directory every xdist worker sees (the base temp dir without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Any:
    """``make(directory)``'s result (JSON), made by the first caller of the session and read by
    every other; ``directory`` (``<shared root>/once-<name>``) keeps what ``make`` wrote there.
    A ``make`` that raised is made again by the next caller."""
    root = shared_root(tmp_path_factory)
    directory, done = root / f"once-{name}", root / f"once-{name}.json"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here while this one makes it
        if done.exists():
            return json.loads(done.read_text())
        directory.mkdir(exist_ok=True)
        result = make(directory)
        done.write_text(json.dumps(result))
        return result
