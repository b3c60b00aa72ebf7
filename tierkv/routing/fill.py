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
between tiers. ``FillWorker`` queues the fills of a put and writes them below.

A fill never holds a memory tier hostage: a fill to tiers that take nothing now (full,
unhealthy, under pressure) is dropped when it is queued, not held; queued fills whose tiers
stopped taking writes are dropped when the memory tier they read from needs their memory
(``FillWorker.reclaim``), and so are the oldest of the others once that tier has waited
for them as long as it waits for any held slab; and one batch in flight reads at most half
of its memory tier. So a lower tier that is full, failing or slow costs fills (counted in
``dropped_fills``), never a store the memory tier has room for.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.chunks import copies, ownership
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.memory import empty_host
from tierkv.routing import offload
from tierkv.tiers.tier import Tier, release_all

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
    source: int | None = None  # the memory tier whose memory the chunks are (held), if any
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

    async def take(self, max_bytes: int | Callable[[FillJob], int]) -> list[FillJob]:
        """Wait for work and take queued jobs for the same tiers from the same source, up to
        ``max_bytes`` (or ``max_bytes(first job)``; at least one job)."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._jobs))
            taken = [self._jobs.popleft()]
            total, limit = taken[0].nbytes, max_bytes(taken[0]) if callable(max_bytes) else max_bytes
            while (self._jobs and total + self._jobs[0].nbytes <= limit and self._jobs[0].levels == taken[0].levels
                   and self._jobs[0].source == taken[0].source):
                total += self._jobs[0].nbytes
                taken.append(self._jobs.popleft())
            self._active += 1
            return taken

    async def drop_where(self, doomed: Callable[[FillJob], bool], budget: int | None = None) -> list[FillJob]:
        """Drop queued (not running) jobs for which ``doomed(job)``, oldest first, until their
        bytes reach ``budget`` (all of them without one); the jobs dropped (counted, released)."""
        async with self._changed:
            dropped: list[FillJob] = []
            kept: deque[FillJob] = deque()
            freed = 0
            for job in self._jobs:
                if (budget is None or freed < budget) and doomed(job):
                    dropped.append(job)
                    freed += job.nbytes
                else:
                    kept.append(job)
            if not dropped:
                return []
            self._jobs = kept
            for job in dropped:
                self.queued_bytes -= job.nbytes
                for key, chunk in zip(job.keys, job.chunks):
                    if self._pending.get(key) is chunk:
                        del self._pending[key]
                self._drop(job)
            self._changed.notify_all()
            return dropped

    async def done(self, jobs: list[FillJob]) -> None:
        """Mark jobs from ``take`` as written (or given up)."""
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
        (``taken``, from ``Tier.put``'s ``fill_holds``), so it stays valid even if the
        tier evicts the chunk before the fill runs; otherwise chunks that are views of the
        caller's memory (``owned`` False) are snapshotted first, since the caller may reuse it.
        ``cancelled`` (set when the store's caller was cancelled): the fill does not wait for
        room in a full queue but is dropped (``FillQueue.put``). ``targets``: only these
        tiers below (a late fill of chunks that became worth admitting), else all of them.
        """
        if not self.fills_below(level):
            return
        below = targets if targets is not None else list(range(level + 1, len(self.tiers)))
        taking = [target for target in below if self.tiers[target].admits()]
        for target in set(below) - set(taking):  # full, unhealthy or under pressure: dropped now, not held
            self.tiers[target].metrics.add("dropped_fills", len(keys))
        if not taking:
            if taken:
                release_all(taken)
            return
        below = taking
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
            queued = await self.queue.put(FillJob(keys, chunks, below, release, level if tier.in_place else None),
                                          cancelled)
        except BaseException:  # cancelled while waiting for room: the job never got in
            if release is not None:
                release()
            raise
        if not queued:
            for target in below:
                self.tiers[target].metrics.add("dropped_fills", len(keys))

    async def reclaim(self, level: int, need: int, waited: bool) -> int:
        """Memory tier ``level`` needs ``need`` bytes that queued fills hold: drop those whose
        tiers take nothing now; once the tier has waited (``waited``), the oldest of the rest
        too, up to ``need``. The bytes given back (to the tier when the holds are released)."""
        def doomed(job: FillJob) -> bool:
            return job.source == level and not any(self.tiers[target].admits() for target in job.levels)
        dropped = await self.queue.drop_where(doomed)
        if waited and sum(job.nbytes for job in dropped) < need:
            dropped += await self.queue.drop_where(lambda job: job.source == level, need)
        for job in dropped:
            for target in job.levels:
                self.tiers[target].metrics.add("dropped_fills", len(job.keys))
        if dropped:
            logger.info("tier %r: %d fill(s) below dropped to make room for a store (%s)", self.tiers[level].name,
                        sum(len(job.keys) for job in dropped),
                        "the tiers below waited too long" if waited else "the tiers below take nothing now")
        return sum(job.nbytes for job in dropped)

    def _batch_bytes(self, job: FillJob) -> int:
        """How many bytes one fill batch may read: at most half of a memory tier it reads from
        (the rest stays free for stores while it is written below)."""
        if job.source is None:
            return FILL_BATCH_BYTES
        capacity = self.tiers[job.source].backend.capacity_bytes
        return min(FILL_BATCH_BYTES, max(1, capacity // 2)) if capacity else FILL_BATCH_BYTES

    async def run(self) -> None:
        """Take queued jobs and write them to their tiers, until cancelled."""
        while True:
            jobs = await self.queue.take(self._batch_bytes)
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
