"""A busy machine for crash and concurrency tests: one spinning process per core, so the code
under test runs with its threads descheduled at arbitrary points (a race that a quiet machine
hides shows up here; the invariant must hold by construction, not by timing)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SPIN = "while True:\n    pass\n"


@contextmanager
def busy_cores(count: int | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Keep ``count`` cores (default: all) busy with spinning processes while the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(count or os.cpu_count() or 2)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(30)
