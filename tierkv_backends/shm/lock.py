"""The ``shm`` pool's one lock, never waited on without bound: a thread lock within the process,
then an ``flock`` on the pool file, both taken without blocking and retried with short sleeps
until a deadline.

Why a deadline: a process stopped while it holds the lock (SIGSTOP, a debugger, a frozen
container, a throttled or swapped-out process) keeps its ``flock`` until it runs again, and a
blocking ``flock`` would stop every serving process on the node with it. Here a waiter gives up
after ``timeout_s`` (``PoolBusyError``: a store goes to the next tier, a read is a miss) and,
until it next finds the lock free, tries once per call without waiting: a stopped holder costs
each other process one wait of at most ``timeout_s``, then nothing but misses. Lookups never take
the lock.

The asynchronous form (``PoolLock.acquire_async``) sleeps on the event loop, so a wait
never stalls it; a body run under the lock must not await (the thread lock is the event loop
thread's while it runs).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import threading
import time
from collections.abc import Callable, Iterator

from tierkv.errors import TierUnavailableError

logger = logging.getLogger("tierkv_backends.shm_pool")

_FIRST_SLEEP_S = 50e-6
_LONGEST_SLEEP_S = 2e-3


class PoolBusyError(TierUnavailableError):
    """The pool's lock was not free within the wait (its holder is stopped, or far too slow)."""


class PoolLock:
    """Thread lock + ``flock`` with a deadline (see the module docstring); re-entrant within one
    thread (an inner acquire is told it is not the outermost)."""

    def __init__(self, fd: int, timeout_s: float, describe_holder: Callable[[], str], where: str,
                 path: str) -> None:
        self._fd = fd
        self.timeout_s = timeout_s
        self._describe_holder = describe_holder
        self._where = where
        self._path = path
        self._thread = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self.stuck_since: float | None = None  # a wait timed out and the lock has not been free since
        self.timeouts = 0

    def try_acquire(self) -> bool:
        """Take the lock if it is free now."""
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        if not self._thread.acquire(blocking=False):
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._thread.release()
            return False
        except BaseException:
            self._thread.release()
            raise
        self._owner, self._depth = me, 1
        if self.stuck_since is not None:
            logger.warning("%s: the lock of the pool at %s is free again after %.1fs", self._where, self._path,
                           time.monotonic() - self.stuck_since)
            self.stuck_since = None
        return True

    @property
    def outermost(self) -> bool:
        """Whether the current holding is the outermost one (the caller owns the lock)."""
        return self._depth == 1

    def release(self) -> None:
        self._depth -= 1
        if self._depth:
            return
        self._owner = None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread.release()

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lock within ``wait_s`` (default ``timeout_s``; one try while stuck), else
        ``PoolBusyError``. Blocks the calling thread meanwhile."""
        pauses = self._pauses(wait_s)
        while not self.try_acquire():
            time.sleep(next(pauses))

    async def acquire_async(self, wait_s: float | None = None) -> None:
        """``acquire``, sleeping on the event loop between tries."""
        pauses = self._pauses(wait_s)
        while not self.try_acquire():
            await asyncio.sleep(next(pauses))

    def _pauses(self, wait_s: float | None) -> Iterator[float]:
        """The sleeps between tries (doubling, up to the deadline), then ``PoolBusyError``."""
        deadline = self._deadline(wait_s)
        pause = _FIRST_SLEEP_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._give_up()
            yield min(pause, left)
            pause = min(2 * pause, _LONGEST_SLEEP_S)

    def _deadline(self, wait_s: float | None) -> float:
        if self.stuck_since is not None and wait_s is None:
            return time.monotonic()  # stuck: one try, no wait
        return time.monotonic() + (self.timeout_s if wait_s is None else wait_s)

    def _give_up(self) -> None:
        self.timeouts += 1
        first = self.stuck_since is None
        if first:
            self.stuck_since = time.monotonic()
        holder = self._describe_holder()
        if first:
            logger.warning("%s: the lock of the pool at %s was not free within %.2fs (held by %s); until it is, "
                           "stores skip the pool and reads miss it without waiting", self._where, self._path,
                           self.timeout_s, holder)
        raise PoolBusyError(f"{self._where}: the pool's lock at {self._path!r} is held by {holder} "
                            f"(waited {self.timeout_s:g}s; lock_timeout_s)")
