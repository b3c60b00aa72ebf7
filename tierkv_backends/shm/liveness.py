"""Whether the process in a pool's slot lives, asked of the kernel: every attached process holds
an open-file-description lock (``F_OFD_SETLK``) on one byte of the pool file per slot, far past
its end (``tierkv_backends.shm.layout.LIVENESS_BASE``). The kernel drops it when the process
dies (or closes the pool), whatever pid namespace or container it runs in, and keeps it while the
process is stopped, frozen or swapped out.

Why not pids and heartbeats: a pid means something only in its pid namespace, and a heartbeat
that stopped cannot tell a dead process from a stopped one. Taking a stopped process for dead and
freeing what it was writing lets it, once resumed, write into memory that is another chunk's by
then. With the lock, a slot's room is freed only when its process is gone; a stopped process's
holds are taken back by its lease instead (``tierkv_backends.shm.pool``), which is safe
because a hold's bytes are checked on release.

OFD locks (Linux 3.15+) belong to the open file description, not the process: two pools opened in
one process do not see each other's locks as their own, and closing another descriptor of the
file does not drop them (a POSIX ``lockf`` lock would). A child forked without exec shares the
description, so a slot stays alive until the child exits too: space comes back later, never
early.
"""

from __future__ import annotations

import fcntl
import struct

from tierkv_backends.shm.layout import LIVENESS_BASE

_FLOCK = "hhqqi4x"  # struct flock on Linux x86_64 / aarch64: type, whence, start, len, pid


def _request(kind: int, slot: int) -> bytes:
    return struct.pack(_FLOCK, kind, 0, LIVENESS_BASE + slot, 1, 0)


def claim(fd: int, slot: int) -> bool:
    """Take ``slot``'s liveness lock for this open file description; False when a live process
    holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _request(fcntl.F_WRLCK, slot))
    except (BlockingIOError, PermissionError):
        return False
    return True


def give_up(fd: int, slot: int) -> None:
    """Drop ``slot``'s liveness lock (the process leaves the pool)."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _request(fcntl.F_UNLCK, slot))


def held_elsewhere(fd: int, slot: int) -> bool:
    """Whether another open file description (a live process, or another pool of this one)
    holds ``slot``'s liveness lock."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _request(fcntl.F_WRLCK, slot))
    return struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK
