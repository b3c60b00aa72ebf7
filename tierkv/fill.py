"""The bounded queue of background fills (write-through copies to lower tiers).

A put is acknowledged once the first tier that admits it holds it; its copies to the
lower tiers wait here, reading either that tier's own copy (held until the fill is done,
so a memory tier may evict the chunk meanwhile) or a private snapshot, so the caller may
reuse its buffers at once and the queue's memory is bounded. When the queue is full a put
either waits for room (back-pressure) or its fill is dropped and counted, as configured. A
put whose caller was cancelled never waits for room: its fill is queued if there is room and
otherwise dropped and counted (its chunks stay in the tier that took them), so a cancellation
returns promptly and the queue stays bounded.
Chunks waiting here are still served by reads, so an acknowledged chunk never goes missing
between tiers. :class:`FillWorker` queues the fills of a put and writes them below.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv import copies, offload, ownership
from tierkv.keys import CacheKey
from tierkv.memory import empty_host
from tierkv.tier import Tier, release_all

logger = logging.getLogger("tierkv.engine")

FILL_BATCH_BYTES = 256 << 20
"""The worker writes up to this many bytes of queued jobs to the tiers below at once."""


@dataclass
class FillJob:
    """Chunks to write to the tiers at ``levels``; ``release`` is called once they are no
    longer needed (written, given up or dropped)."""

    keys: list[CacheKey]
    chunks: list[torch.Tensor]
    levels: list[int]
    release: Callable[[], None] | None = None
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(c.numel() * c.element_size() for c in self.chunks)


class FillQueue:
    """FIFO of fill jobs bounded by bytes; see the module docstring."""

    def __init__(self, max_bytes: int, when_full: str = "wait") -> None:
        self.max_bytes = max_bytes
        self.when_full = when_full
        self.queued_bytes = 0
        self.dropped_chunks = 0
        self.dropped_bytes = 0
        self.completed_chunks = 0
        self._jobs: deque[FillJob] = deque()
        self._pending: dict[CacheKey, torch.Tensor] = {}
        self._active = 0
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._jobs)

    def pending(self, key: CacheKey) -> torch.Tensor | None:
        """The snapshot of ``key`` if it is waiting to be written (or being written)."""
        return self._pending.get(key)

    async def put(self, job: FillJob, cancelled: asyncio.Event | None = None) -> bool:
        """Queue ``job``; False when it was dropped because the queue is full.

        ``cancelled``: set when the put's caller was cancelled; from then on the job does not
        wait for room (``when_full: wait``) but is dropped if there is none.
        """
        async with self._changed:
            def has_room() -> bool:
                # a job larger than the whole queue still goes through when the queue is empty
                return self.queued_bytes + job.nbytes <= self.max_bytes or (not self._jobs and not self._active)

            if not has_room():
                if self.when_full == "drop":
                    self._drop(job)
                    return False
                if cancelled is None:
                    await self._changed.wait_for(has_room)
                elif not await self._room_unless(has_room, cancelled):
                    logger.debug("fill of %d chunk(s) (%d bytes) dropped: its store was cancelled while the "
                                 "fill queue was full", len(job.keys), job.nbytes)
                    self._drop(job)
                    return False
            self._jobs.append(job)
            self.queued_bytes += job.nbytes
            for key, chunk in zip(job.keys, job.chunks):
                self._pending[key] = chunk
            self._changed.notify_all()
            return True

    def _drop(self, job: FillJob) -> None:
        self.dropped_chunks += len(job.keys)
        self.dropped_bytes += job.nbytes
        if job.release is not None:
            job.release()

    async def _room_unless(self, has_room: Callable[[], bool], cancelled: asyncio.Event) -> bool:
        """Wait until ``has_room()`` or ``cancelled`` is set; whether there is room. Called and
        returns with the condition's lock held (the wait for room gives it up meanwhile)."""
        if cancelled.is_set():
            return has_room()
        room = asyncio.ensure_future(self._changed.wait_for(has_room))
        gave_up = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait({room, gave_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gave_up.cancel()
            room.cancel()
            # Condition.wait takes the lock back before it ends, however it ends: only then is
            # it ours again (one loop turn); a cancellation meanwhile is delivered after
            interrupted = False
            while not room.done():
                try:
                    await asyncio.wait({room})
                except asyncio.CancelledError:
                    interrupted = True
            if not room.cancelled():
                room.exception()  # retrieved: its error, if any, is the lock's and already handled
            if interrupted:
                raise asyncio.CancelledError
        return has_room()

    async def take(self, max_bytes: int) -> list[FillJob]:
        """Wait for work and take queued jobs, up to ``max_bytes`` (at least one job)."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._jobs))
            taken = [self._jobs.popleft()]
            total = taken[0].nbytes
            while self._jobs and total + self._jobs[0].nbytes <= max_bytes and self._jobs[0].levels == taken[0].levels:
                total += self._jobs[0].nbytes
                taken.append(self._jobs.popleft())
            self._active += 1
            return taken

    async def done(self, jobs: list[FillJob]) -> None:
        """Mark jobs from :meth:`take` as written (or given up)."""
        async with self._changed:
            for job in jobs:
                self.queued_bytes -= job.nbytes
                self.completed_chunks += len(job.keys)
                for key, chunk in zip(job.keys, job.chunks):
                    if self._pending.get(key) is chunk:
                        del self._pending[key]
                if job.release is not None:
                    job.release()
            self._active -= 1
            self._changed.notify_all()

    async def join(self) -> None:
        """Wait until every queued job has been written."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._jobs and not self._active)

    def stats(self) -> dict[str, int | str]:
        return {"jobs": len(self._jobs), "bytes": self.queued_bytes, "max_bytes": self.max_bytes,
                "when_full": self.when_full, "dropped_chunks": self.dropped_chunks,
                "dropped_bytes": self.dropped_bytes, "completed_chunks": self.completed_chunks}


class FillWorker:
    """Write-through: queues the copies of what a tier took for the tiers below it, and
    writes them there in the background (one task, started by the router)."""

    def __init__(self, tiers: Sequence[Tier], queue: FillQueue, counter: copies.CopyCounter,
                 write_through: bool) -> None:
        self.tiers = tiers
        self.queue = queue
        self.counter = counter
        self.write_through = write_through

    def fills_below(self, level: int) -> bool:
        """Whether a put into tier ``level`` is copied to the tiers below it."""
        return self.write_through and level + 1 < len(self.tiers)

    async def add(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor], owned: list[bool],
                  taken: list[Any] | None = None, *, cancelled: asyncio.Event | None = None,
                  targets: list[int] | None = None) -> None:
        """Queue copies of what tier ``level`` just took for the tiers below.

        From an in-place tier the fill reads the tier's own copy, held since the commit
        (``taken``, from :meth:`Tier.put`'s ``fill_holds``), so it stays valid even if the
        tier evicts the chunk before the fill runs; otherwise chunks that are views of the
        caller's memory (``owned`` False) are snapshotted first, since the caller may reuse it.
        ``cancelled`` (set when the store's caller was cancelled): the fill does not wait for
        room in a full queue but is dropped (:meth:`FillQueue.put`). ``targets``: only these
        tiers below (a late fill of chunks that became worth admitting), else all of them.
        """
        if not self.fills_below(level):
            return
        below = targets if targets is not None else list(range(level + 1, len(self.tiers)))
        release = None
        tier = self.tiers[level]
        if tier.in_place:
            if not taken:
                taken = tier.hold(keys, pin=False)
            held = [(key, h) for key, h in zip(keys, taken) if h is not None]  # None only if the batch repeated it
            keys = [key for key, _ in held]
            holds = [h for _, h in held]
            chunks = [h.chunk for h in holds]

            def release() -> None:
                release_all(holds)
        else:
            pairs = [(empty_host(tuple(c.shape), c.dtype), c) for c, mine in zip(chunks, owned) if not mine]
            await offload.copy_pairs(pairs)
            fresh = iter(dst for dst, _ in pairs)
            chunks = [c if mine else next(fresh) for c, mine in zip(chunks, owned)]
        try:
            queued = await self.queue.put(FillJob(keys, chunks, below, release), cancelled)
        except BaseException:  # cancelled while waiting for room: the job never got in
            if release is not None:
                release()
            raise
        if not queued:
            for target in below:
                self.tiers[target].metrics.add("dropped_fills", len(keys))

    async def run(self) -> None:
        """Take queued jobs and write them to their tiers, until cancelled."""
        while True:
            jobs = await self.queue.take(FILL_BATCH_BYTES)
            try:
                keys = [k for job in jobs for k in job.keys]
                chunks = [c for job in jobs for c in job.chunks]
                # every level's put has stopped before the jobs' held slabs are released
                await ownership.gather(*(self._fill(self.tiers[level], keys, chunks) for level in jobs[0].levels))
            except Exception:
                logger.exception("background fill failed")
            finally:
                await self.queue.done(jobs)

    async def _fill(self, tier: Tier, keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
        if not tier.admits():
            tier.metrics.add("dropped_fills", len(keys))
            return
        flags = tier.admit(keys, [chunk.nbytes for chunk in chunks])
        if not all(flags):  # not reused enough to be worth this tier (counted as rejected)
            keys = [key for key, flag in zip(keys, flags) if flag]
            chunks = [chunk for chunk, flag in zip(chunks, flags) if flag]
            if not keys:
                return
        with copies.on_path(self.counter, "fill"):
            try:
                await tier.put(keys, chunks)
            except Exception:
                tier.metrics.add("dropped_fills", len(keys))
                return
            self.counter.add_delivered("fill", sum(c.nbytes for c in chunks))
