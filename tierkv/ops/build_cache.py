"""The on-disk cache of extension builds: one library per build name, built where no other build
can see it half done, under a lock that dies with its holder.

torch's ``cpp_extension.load`` guards a build directory with a ``lock`` file it creates and
deletes itself: a build killed midway leaves the file behind, and every later build into that
directory waits for it forever (and a serving process that starts one waits with it). Here:

- the lock is an ``flock`` on ``<root>/<name>.lock``: the kernel drops it when its holder exits,
  however it exits, so a lock is never stale; the holder writes its pid and start time into
  the file, for the messages of whoever waits (``build_lock``, bounded by ``wait_s``);
- each build runs in a staging directory of its own (``<root>/<name>.build-<pid>``), and only
  a finished library is moved (``os.replace``) to ``<root>/<name>/<name>.so``: a library there
  is always whole, and a killed build leaves only its staging directory, which the next build
  removes (``clear_leftovers``) and ``describe`` reports as an interrupted build;
- a ``lock`` file torch left in ``<root>/<name>/`` (an interrupted build of an older tierkv)
  is no longer in any build's way, and is removed with the other leftovers.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("tierkv.ops")

DEFAULT_WAIT_S = 600.0
"""How long a build waits for another process's build of the same sources (a build takes about
30-60 s; a holder alive past this is stuck): ``TIERKV_BUILD_WAIT_S`` overrides it."""
_TELL_EVERY_S = 15.0


class BuildBusy(RuntimeError):
    """Another live process holds the build lock for longer than the caller would wait."""


def library_path(root: Path, name: str) -> Path:
    """Where the finished library of build ``name`` lives."""
    return root / name / f"{name}.so"


def lock_path(root: Path, name: str) -> Path:
    """The file whose flock guards builds of ``name`` (its content: the holder's pid and start)."""
    return root / f"{name}.lock"


def staging_dir(root: Path, name: str, pid: int | None = None) -> Path:
    """The private build directory of process ``pid`` (default: this one)."""
    return root / f"{name}.build-{os.getpid() if pid is None else pid}"


def wait_bound() -> float:
    """Seconds to wait for another process's build (``TIERKV_BUILD_WAIT_S``, else the default)."""
    raw = os.environ.get("TIERKV_BUILD_WAIT_S", "").strip()
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_WAIT_S
    except ValueError:
        logger.warning("TIERKV_BUILD_WAIT_S=%r is not a number of seconds; using %.0f", raw, DEFAULT_WAIT_S)
        return DEFAULT_WAIT_S


def holder(root: Path, name: str) -> dict[str, float] | None:
    """The live process building ``name`` now ({"pid", "since"}), or None when nobody is."""
    path = lock_path(root, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict[str, float]:
    try:
        info = json.loads(os.pread(fd, 256, 0).decode() or "{}")
        return {"pid": float(info["pid"]), "since": float(info["since"])}
    except (ValueError, KeyError, TypeError, OSError):
        return {"pid": -1.0, "since": time.time()}


@contextmanager
def build_lock(root: Path, name: str, wait_s: float) -> Iterator[None]:
    """Hold the build lock of ``name``, waiting at most ``wait_s`` for a live holder (saying
    every few seconds who it waits for); raises ``BuildBusy`` past that."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path(root, name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = time.monotonic()
        next_word = started
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            now = time.monotonic()
            info = _read_holder(fd)
            who = f"process {int(info['pid'])} (building for {time.time() - info['since']:.0f} s)"
            if now - started >= wait_s:
                raise BuildBusy(f"the kernels are being built by {who} into {root}; gave up waiting after "
                                f"{wait_s:.0f} s (TIERKV_BUILD_WAIT_S)")
            if now >= next_word:
                logger.warning("tierkv: waiting for the kernel build of %s (at most %.0f s more)", who,
                               wait_s - (now - started))
                next_word = now + _TELL_EVERY_S
            time.sleep(min(0.2, max(0.0, wait_s - (now - started))))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "since": time.time()}).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def leftovers(root: Path, name: str) -> list[Path]:
    """What interrupted builds of ``name`` left: staging directories of processes that are
    gone, and a ``lock`` torch left in the library's directory (an older tierkv built there)."""
    found = []
    for path in sorted(root.glob(f"{name}.build-*")):
        pid = path.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not _alive(int(pid)) or int(pid) == os.getpid():
            found.append(path)
    torch_lock = root / name / "lock"
    if torch_lock.exists():
        found.append(torch_lock)
    return found


def clear_leftovers(root: Path, name: str) -> None:
    """Remove what interrupted builds left (call with the build lock held: no live build of
    this name is running then, except orphaned compilers of a killed one, whose output is
    thrown away with their directory)."""
    for path in leftovers(root, name):
        logger.warning("tierkv: removing %s, left by an interrupted kernel build", path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def install(staging: Path, root: Path, name: str) -> Path:
    """Move the library a build left in ``staging`` to its place (atomically) and drop the rest."""
    target = library_path(root, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging / f"{name}.so", target)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def describe(root: Path, name: str) -> str:
    """Why the library of ``name`` is not in ``root``, in words for ``tierkv info`` and logs."""
    building = holder(root, name)
    if building is not None:
        return (f"being built by process {int(building['pid'])} for {time.time() - building['since']:.0f} s "
                f"(into {root}); it loads once the build lands")
    left = leftovers(root, name)
    if left:
        return (f"an earlier build was interrupted (it left {left[0]}); `python -m tierkv.ops build` starts over, "
                "as does the next serving start, in the background")
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
