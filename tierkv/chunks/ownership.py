"""The ownership rule for memory handed to a copy, enforced here and nowhere else.

Memory handed to a copy (a memory tier's slab, a slice of a caller's ``out``, a paged-cache
block, a staging buffer) belongs to that copy until the copy has *finished*: nobody frees,
reuses or returns it earlier, and nothing is written into a caller's memory after the call
that was given it has returned -- by completion, error, timeout, deadline or cancellation.

Two tools keep the rule:

- ``finish`` / ``in_thread``: work that writes into borrowed memory runs to its end
  even when the awaiting task is cancelled. The cancellation is delivered (``CancelledError``
  is re-raised) only after the work stopped, so the caller's ``finally`` / ``except`` blocks
  that free or reuse the memory run when nobody writes into it any more. Copies in memory
  are bounded (milliseconds), so waiting for them costs nothing a caller would notice.
- ``WriteGrant``: where waiting is not an option (a network read the caller gave up on
  at a timeout or deadline), the worker asks the grant before it writes each piece, and the
  owner ``WriteGrant.revoke``\\ s it before it hands the memory back. ``revoke`` returns
  once no piece is being written, and no piece starts after it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["WriteGrant", "finish", "gather", "in_thread"]


async def finish(work: Awaitable[T], on_cancel: Callable[[], None] | None = None) -> T:
    """Await ``work`` to its end even if the awaiting task is cancelled.

    On cancellation the work keeps running; once it has stopped (result or error, which is
    dropped), ``CancelledError`` is raised as usual. A second cancellation while waiting
    does not cut the wait short either. ``on_cancel`` is called at the first cancellation,
    before the wait: it tells the work that nobody waits for it any more, so the parts of it
    that need not run to their end (a wait for room in the fill queue) can stop early.
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        await _until_done(task)
        raise


async def _until_done(task: asyncio.Future[Any]) -> None:
    """Wait for ``task`` to stop, ignoring its outcome and further cancellations."""
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue
        except BaseException:  # the work's own error: the caller is already being cancelled
            break
    if task.done() and not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in a worker thread; return (or deliver a cancellation) only when it has stopped."""
    return await finish(asyncio.to_thread(functools.partial(fn, *args, **kwargs)))


async def gather(*work: Awaitable[T]) -> list[T]:
    """Run ``work`` concurrently; their results in order (the first error is raised).

    Unlike ``asyncio.gather``, it returns or raises only once every piece has stopped: on
    an error the others run to their end, and on cancellation every piece is cancelled (each
    may still finish its copy, see ``finish``) and waited for before ``CancelledError``
    is re-raised. ``asyncio.gather`` would return at the first piece that stopped, while
    others still write into memory the caller is about to free or return.
    """
    tasks = [asyncio.ensure_future(piece) for piece in work]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        for task in tasks:
            await _until_done(task)
        raise
    errors = [task.exception() for task in tasks]
    for error in errors:
        if error is not None:
            raise error
    return [task.result() for task in tasks]


class WriteGrant:
    """Permission to write into memory somebody else owns, revocable by the owner.

    The worker wraps each write in ``write``; the owner calls ``revoke`` before it
    frees, reuses or returns the memory (for instance when it stops waiting for the worker).
    After ``revoke`` returns, no write is in progress and none will start.
    """

    __slots__ = ("_active", "_changed", "_revoked")

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._active = 0  # writes in progress (pieces of one call copy in parallel)
        self._revoked = False

    @property
    def revoked(self) -> bool:
        return self._revoked

    def write(self, copy: Callable[[], Any]) -> bool:
        """Run ``copy`` unless the grant was revoked; whether it ran. Writers of one grant copy
        in parallel (each into its own part of the memory)."""
        with self._changed:
            if self._revoked:
                return False
            self._active += 1
        try:
            copy()
        finally:
            with self._changed:
                self._active -= 1
                if not self._active:
                    self._changed.notify_all()
        return True

    def revoke(self) -> None:
        """Stop all further writes; wait for those in progress to end (copies: bounded)."""
        with self._changed:
            self._revoked = True
            while self._active:
                self._changed.wait()
