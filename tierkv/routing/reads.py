"""The one-pass read: chunks from the tiers they were located in, into a sink.

First every tier reads the chunks located in it, all tiers at once; a chunk a tier turns
out not to have is then asked of the tiers below, in order. A chunk goes straight into the
sink's destination (one copy) unless the sink has none for it (an unaligned first chunk,
per-layer tensors), or the tier streams before it verifies and the destination is the
caller's, or the read may be abandoned (a deadline or a tier timeout): then it is read into
a pooled chunk buffer and copied once it is in. Chunks acknowledged but not yet written
below are served from the fill queue. Hits below the top tier go to ``promote``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence

import torch

from tierkv.backend.contract import fits_destination
from tierkv.chunks import ownership, transfer
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.memory import empty_host
from tierkv.policy import residency as policy
from tierkv.routing.fill import FillQueue
from tierkv.routing.locate import FILL_QUEUE_LEVEL
from tierkv.routing.offload import off_loop
from tierkv.tiers.tier import Tier

Promote = Callable[[int, list[CacheKey], list[torch.Tensor]], Awaitable[None]]
"""Copies hits of tier ``level`` up (the router's promotion)."""
Ranges = list[tuple[int, int]]


class Reader:
    """Reads located chunks into sinks, and plain tiered gets (see the module docstring)."""

    def __init__(self, tiers: Sequence[Tier], fill: FillQueue, promote: Promote, timeout: float | None) -> None:
        self.tiers = tiers
        self.fill = fill
        self.promote = promote
        self.timeout = timeout

    async def read_into(self, keys: list[CacheKey], levels: Sequence[int | None], ranges: Ranges,
                        sink: transfer.ChunkSink, caller_owned: bool, preloaded: torch.Tensor | None = None,
                        deadline: float | None = None) -> int:
        """Read each chunk into ``sink`` from the tier it was located in (``levels``, from
        ``tierkv.routing.locate.read_levels``); the number of leading chunks delivered."""
        done = [False] * len(keys)
        staged: dict[int, torch.Tensor] = {}
        if preloaded is not None:
            staged[0], done[0] = preloaded, True
        self._from_fill_queue([i for i in range(len(keys)) if levels[i] == FILL_QUEUE_LEVEL], keys, ranges, sink, done)
        first_round: dict[int, list[int]] = {}
        for index in range(len(keys)):
            level = levels[index]
            if not done[index] and level is not None and level >= 0:
                first_round.setdefault(level, []).append(index)
        reads = [(level, asked) for level, asked in first_round.items() if self.tiers[level].available()]
        # ownership.gather, not asyncio.gather: a cancelled retrieve returns only once every
        # tier's read into the sink has stopped
        for (_, asked), got in zip(reads, await ownership.gather(
                *(self._read_level(self.tiers[level], asked, keys, ranges, sink, caller_owned, staged, deadline)
                  for level, asked in reads))):
            for index, hit in zip(asked, got):
                done[index] = hit
        # a chunk the top tier evicted after it was located may still wait in the fill queue
        self._from_fill_queue([i for i in range(len(keys)) if not done[i]], keys, ranges, sink, done)
        pending = [i for i in range(len(keys)) if not done[i]]
        for tier in self.tiers:  # second round: what a tier did not have, from the tiers below
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            asked = [i for i in pending if levels[i] is not None and levels[i] < tier.level]  # type: ignore[operator]
            if not asked or not tier.available():
                continue
            for index, hit in zip(asked, await self._read_level(tier, asked, keys, ranges, sink, caller_owned,
                                                                  staged, deadline)):
                done[index] = hit
            pending = [i for i in pending if not done[i]]
        delivered = policy.first_missing(done)
        late = [(staged[i], ranges[i]) for i in sorted(staged) if i < delivered]
        if late:
            await off_loop(functools.partial(_read_all, sink, late), sum(chunk.nbytes for chunk, _ in late))
        return delivered

    async def get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Each chunk as a tensor of its own (None for misses), from the highest tier holding it."""
        results: list[torch.Tensor | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for tier in self.tiers:
            if not missing:
                break
            if not tier.available():
                continue
            got = await tier.get([keys[i] for i in missing])
            still: list[int] = []
            hits: list[int] = []
            for index, chunk in zip(missing, got):
                if chunk is None:
                    still.append(index)
                else:
                    results[index] = chunk
                    hits.append(index)
            if hits and tier.level > 0:
                await self.promote(tier.level, [keys[i] for i in hits], [results[i] for i in hits])  # type: ignore[misc]
            missing = still
        for index in missing:  # acknowledged but not yet written below: serve the snapshot
            snapshot = self.fill.pending(keys[index])
            if snapshot is not None:
                results[index] = snapshot.clone()
        return results

    def _from_fill_queue(self, indices: list[int], keys: list[CacheKey], ranges: Ranges, sink: transfer.ChunkSink,
                         done: list[bool]) -> None:
        """Copy the chunks ``indices`` that are acknowledged but not yet written below from the
        fill queue's copy, now (the fill may release those bytes at the next await)."""
        for index in indices:
            if done[index]:
                continue
            chunk = self.fill.pending(keys[index])
            start, end = ranges[index]
            if chunk is not None and fits_destination(chunk, sink.chunk_shape(end - start), sink.dtype):
                sink.read_from(chunk, start, end)
                done[index] = True

    async def _read_level(self, tier: Tier, asked: list[int], keys: list[CacheKey], ranges: Ranges,
                          sink: transfer.ChunkSink, caller_owned: bool, staged: dict[int, torch.Tensor],
                          deadline: float | None) -> list[bool]:
        """``tier`` reads chunks ``asked`` (into the sink, or into ``staged`` buffers); hits."""
        requested = list(asked)
        hits: dict[int, bool] = {}
        if tier.in_place:  # chunks the sink has no destination for are copied out of held slabs
            borrowed = [i for i in asked if sink.destination(*ranges[i]) is None]
            if borrowed:
                hits.update(zip(borrowed, await self._read_held(tier, keys, ranges, borrowed, sink)))
                asked = [i for i in asked if i not in hits]
        if asked:
            may_abandon = (deadline is not None or self.timeout is not None) and not tier.in_place
            stage = may_abandon or (caller_owned and tier.streams_into_destination)
            targets = []
            for index in asked:
                start, end = ranges[index]
                target = None if stage else sink.destination(start, end)
                if target is None:
                    target = staged[index] = empty_host(sink.chunk_shape(end - start), sink.dtype)
                targets.append(target)
            got = await tier.get_into([keys[i] for i in asked], targets, deadline, abandonable=stage)
            hits.update(zip(asked, got))
            for index, hit, target in zip(asked, got, targets):
                if not hit and staged.get(index) is target:
                    # a miss, or a read abandoned at the deadline that may still be writing: never
                    # reuse it, never copy it out (a later round reads the chunk afresh)
                    del staged[index]
            if tier.level > 0 and any(got):
                await self.promote(tier.level, [keys[i] for i, hit in zip(asked, got) if hit],
                                   [t for t, hit in zip(targets, got) if hit])
        return [hits.get(i, False) for i in requested]

    async def _read_held(self, tier: Tier, keys: list[CacheKey], ranges: Ranges, indices: list[int],
                         sink: transfer.ChunkSink) -> list[bool]:
        """Copy chunks of an in-place tier straight from its (pinned) slabs into the sink."""
        started = time.perf_counter()
        holds = tier.hold([keys[i] for i in indices], pin=True)
        try:
            hits = [h is not None and fits_destination(h.chunk, sink.chunk_shape(ranges[i][1] - ranges[i][0]),
                                                       sink.dtype) for i, h in zip(indices, holds)]
            work = [(h.chunk, ranges[i]) for i, h, hit in zip(indices, holds, hits) if hit and h is not None]
            await off_loop(functools.partial(_read_all, sink, work), sum(chunk.nbytes for chunk, _ in work))
            if tier.level > 0 and work:
                await self.promote(tier.level, [keys[i] for i, hit in zip(indices, hits) if hit],
                                   [chunk for chunk, _ in work])
        finally:
            for hold in holds:
                if hold is not None:
                    hold.release()
        tier.count_read(len(hits), [chunk for chunk, _ in work], started)
        return hits


def _read_all(sink: transfer.ChunkSink, work: list[tuple[torch.Tensor, tuple[int, int]]]) -> None:
    """Copy each whole chunk into the sink at its token range (done when this returns: the
    chunks' holds are released next)."""
    transfer.read_all(sink, [(chunk, start, end) for chunk, (start, end) in work])
