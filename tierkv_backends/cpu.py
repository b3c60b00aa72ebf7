"""``cpu`` tier: chunks in host memory (pinned when CUDA is present), bounded, LRU.

Chunks are copied into recycled slabs rather than fresh allocations: allocating large
host buffers (pinned ones especially) costs far more than the copy itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from tierkv.backend import StorageBackend
from tierkv.errors import CapacityError
from tierkv.keys import CacheKey
from tierkv.memory import allocate_bytes, can_pin_memory, copy_into, empty_host, size_class
from tierkv.options import Option, format_size
from tierkv.policy import LRUIndex

logger = logging.getLogger(__name__)

# Batches that copy more than this run in a worker thread instead of on the event loop.
_THREAD_COPY_BYTES = 1 << 20


class SlabAllocator:
    """Host slabs by size class, never more than ``limit`` bytes allocated in total.

    Released slabs are kept for reuse; idle slabs of other sizes are freed when a new
    size does not otherwise fit.
    """

    def __init__(self, limit: int, pinned: bool) -> None:
        self.limit = limit
        self.pinned = pinned
        self.allocated = 0
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        size = size_class(nbytes)
        idle = self._idle.get(size)
        if idle:
            return idle.pop()
        for other in list(self._idle):
            if self.allocated + size <= self.limit:
                break
            while self._idle[other] and self.allocated + size > self.limit:
                self.allocated -= self._idle[other].pop().numel()
        if self.allocated + size > self.limit:
            return None
        self.allocated += size
        return allocate_bytes(size, self.pinned)

    def release(self, slab: torch.Tensor) -> None:
        self._idle[slab.numel()].append(slab)

    def clear(self) -> None:
        self._idle.clear()
        self.allocated = 0


@dataclass
class _Resident:
    slab: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    readers: int = 0
    retired: bool = False  # replaced or evicted while being read: free after the last reader

    def view(self) -> torch.Tensor:
        return self.slab[: self.nbytes].view(self.dtype).view(self.shape)


class CPUBackend(StorageBackend):
    """Host-memory tier, capacity-bounded with least-recently-used eviction."""

    requires_capacity: ClassVar[bool] = True
    options: ClassVar[dict[str, Option]] = {
        "pinned": Option("bool", None, doc="pin host memory (default: when CUDA is available)"),
    }

    def __init__(self, name: str, capacity: int | None = None, pinned: bool | None = None) -> None:
        super().__init__(name, capacity)
        assert self.capacity is not None  # requires_capacity guarantees it
        if pinned and not can_pin_memory():
            logger.info("tier %r: pinned memory needs CUDA, which is not available; using pageable memory", name)
        self.pinned = can_pin_memory() if pinned is None else bool(pinned) and can_pin_memory()
        self._resident: dict[CacheKey, _Resident] = {}
        self._index: LRUIndex[CacheKey] = LRUIndex()
        self._slabs = SlabAllocator(self.capacity, self.pinned)

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    # -- writes ---------------------------------------------------------------------------
    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        self._ensure_open()
        if len(keys) != len(chunks):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(chunks)} chunks")
        latest = dict(zip(keys, chunks))  # later duplicates win
        for chunk in latest.values():
            self._check_fits(size_class(chunk.numel() * chunk.element_size()))
        placed: list[tuple[CacheKey, _Resident, torch.Tensor]] = []
        try:
            for key, chunk in latest.items():
                placed.append((key, self._reserve(key, chunk, protect=latest.keys()), chunk))
        except CapacityError:
            for _, resident, _ in placed:
                self._slabs.release(resident.slab)
                self._index.used_bytes -= resident.slab.numel()
            raise
        total = sum(resident.nbytes for _, resident, _ in placed)
        if total > _THREAD_COPY_BYTES:
            await asyncio.to_thread(self._copy_in, placed)
        else:
            self._copy_in(placed)
        for key, resident, _ in placed:
            self._index.used_bytes -= resident.slab.numel()  # reserved; add() counts it again
            self._drop(key)
            self._resident[key] = resident
            self._index.add(key, resident.slab.numel())
        return len(keys)

    def _reserve(self, key: CacheKey, chunk: torch.Tensor, protect: object) -> _Resident:
        """Evict as needed and take a slab for ``chunk`` (counted as used until placed)."""
        nbytes = chunk.numel() * chunk.element_size()
        size = size_class(nbytes)
        replaced = self._index.size_of(key) or 0
        victims = self._index.victims(size - replaced, self.capacity or 0, protect=protect)  # type: ignore[arg-type]
        if victims is None:
            raise CapacityError(
                f"tier {self.name!r}: no room for a {format_size(nbytes)} chunk: the rest of its "
                f"{format_size(self.capacity or 0)} is being read or written"
            )
        for victim in victims:
            self._count_eviction(self._index.size_of(victim) or 0)
            self._drop(victim)
        slab = self._slabs.allocate(nbytes)
        if slab is None:
            raise CapacityError(f"tier {self.name!r}: host memory for a {format_size(nbytes)} chunk is exhausted")
        self._index.used_bytes += slab.numel()
        return _Resident(slab, chunk.dtype, tuple(chunk.shape), nbytes)

    @staticmethod
    def _copy_in(placed: list[tuple[CacheKey, _Resident, torch.Tensor]]) -> None:
        for _, resident, chunk in placed:
            copy_into(resident.view(), chunk.detach())

    def _drop(self, key: CacheKey) -> bool:
        resident = self._resident.pop(key, None)
        if resident is None:
            return False
        self._index.remove(key)
        if resident.readers:
            resident.retired = True
        else:
            self._slabs.release(resident.slab)
        return True

    async def delete(self, key: CacheKey) -> bool:
        self._ensure_open()
        return self._drop(key)

    # -- reads ---------------------------------------------------------------------------------
    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        self._ensure_open()
        found = [self._resident.get(key) for key in keys]
        jobs: list[tuple[_Resident, torch.Tensor]] = []
        results: list[torch.Tensor | None] = []
        for key, resident in zip(keys, found):
            if resident is None:
                results.append(None)
                continue
            resident.readers += 1
            self._index.pin(key)
            self._index.touch(key)
            out = empty_host(resident.shape, resident.dtype)
            jobs.append((resident, out))
            results.append(out)
        try:
            if sum(r.nbytes for r, _ in jobs) > _THREAD_COPY_BYTES:
                await asyncio.to_thread(self._copy_out, jobs)
            else:
                self._copy_out(jobs)
        finally:
            for key, resident in zip(keys, found):
                if resident is not None:
                    self._index.unpin(key)
                    resident.readers -= 1
                    if resident.retired and not resident.readers:
                        self._slabs.release(resident.slab)
        return results

    @staticmethod
    def _copy_out(jobs: list[tuple[_Resident, torch.Tensor]]) -> None:
        for resident, out in jobs:
            copy_into(out, resident.view())

    async def contains(self, key: CacheKey) -> bool:
        self._ensure_open()
        return key in self._resident

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        self._ensure_open()
        return [key in self._resident for key in keys]

    async def close(self) -> None:
        self._resident.clear()
        self._index = LRUIndex()
        self._slabs.clear()
        await super().close()

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "chunks": len(self._resident), "pinned": self.pinned,
                "allocated_bytes": self._slabs.allocated}
