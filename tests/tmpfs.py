"""Small tmpfs mounts: a disk that really fills up (ENOSPC from the kernel, not a mock)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tierkv.testing.requirements import missing


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (mount's syntax: ``3m``) at ``mount`` (created), unmounted on
    exit. Needs root: without it the test skips, or fails under CI."""
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        missing("root (to mount a small tmpfs)", done.stderr.strip() or f"mount exited {done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
