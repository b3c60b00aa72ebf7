"""Shared machinery of the memory tiers (``cpu`` and ``gpu``): slabs on one device,
bounded by an effective capacity, with a pluggable eviction policy and demotion.

When a tier must make room it hands its victims to ``demote_sink`` (set by the engine
in write-back mode, or under memory pressure) before freeing them, so a chunk leaves a
memory tier only after the tier below holds it. Victims are pinned while they are being
demoted, and a chunk being read is never chosen.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tierkv.backend import StorageBackend, check_batch
from tierkv.errors import CapacityError
from tierkv.keys import CacheKey
from tierkv.memory import can_pin_memory, copy_into, empty_host, size_class
from tierkv.options import Option, format_size
from tierkv.policy import EVICTION_POLICIES, make_index

logger = logging.getLogger(__name__)

# Batches that copy more than this run in a worker thread instead of on the event loop.
THREAD_COPY_BYTES = 1 << 20
_MAX_ROOM_ATTEMPTS = 8

DemoteSink = Callable[[list[CacheKey], list[torch.Tensor]], Awaitable[None]]
EVICTION_OPTION = Option("str", "lru", choices=EVICTION_POLICIES, doc="eviction policy")


class SlabAllocator:
    """Slabs by size class on one device, never more than ``limit`` bytes allocated.

    Released slabs are kept for reuse; idle slabs of other sizes are freed when a new
    size does not otherwise fit.
    """

    def __init__(self, limit: int, device: torch.device, pinned: bool) -> None:
        self.limit = limit
        self.device = device
        self.pinned = pinned
        self.allocated = 0
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        size = size_class(nbytes)
        idle = self._idle.get(size)
        if idle:
            return idle.pop()
        for other in list(self._idle):
            while self._idle[other] and self.allocated + size > self.limit:
                self.allocated -= self._idle[other].pop().numel()
        if self.allocated + size > self.limit:
            return None
        self.allocated += size
        return torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)

    def release(self, slab: torch.Tensor) -> None:
        self._idle[slab.numel()].append(slab)

    def trim(self) -> None:
        """Free every idle slab (give memory back now, e.g. under pressure)."""
        for slabs in self._idle.values():
            self.allocated -= sum(s.numel() for s in slabs)
        self._idle.clear()

    def clear(self) -> None:
        self._idle.clear()
        self.allocated = 0


@dataclass
class Resident:
    """One chunk held in a slab."""

    slab: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    readers: int = 0
    retired: bool = False  # replaced or evicted while in use: free after the last reader

    def view(self) -> torch.Tensor:
        return self.slab[: self.nbytes].view(self.dtype).view(self.shape)


class MemoryTier(StorageBackend):
    """A capacity-bounded tier of slabs on one device (see module docstring)."""

    requires_capacity: ClassVar[bool] = True

    def __init__(self, name: str, capacity: int | None, device: torch.device, pinned: bool,
                 eviction: str = "lru") -> None:
        super().__init__(name, capacity)
        assert self.capacity is not None  # requires_capacity guarantees it
        self.device = device
        self.pinned = pinned
        self.eviction = eviction
        self.capacity_limit = self.capacity
        self.demote_sink: DemoteSink | None = None
        self._resident: dict[CacheKey, Resident] = {}
        self._index = make_index(eviction)
        self._reserved = 0
        self._slabs = SlabAllocator(self.capacity, device, pinned)
        self.counters.update({"demotions": 0, "demotion_failures": 0})

    # -- accounting --------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes + self._reserved

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_limit

    def set_capacity_limit(self, limit: int) -> None:
        """Effective capacity (memory pressure), never above the configured one."""
        self.capacity_limit = max(0, min(int(limit), self.capacity or 0))
        self._slabs.limit = self.capacity or 0

    async def shrink_to_limit(self) -> int:
        """Demote and free chunks until usage is within the effective capacity; returns bytes freed."""
        before = self.used_bytes
        victims = self._index.victims(0, self.capacity_limit)
        if victims is None:  # pinned readers hold the rest: free what we can
            victims = [k for k in self._index.keys() if not self._index.is_pinned(k)]
        if victims:
            await self._evict(victims, must_free=True)
        self._slabs.trim()
        return before - self.used_bytes

    # -- copies (overridden by devices with their own streams) --------------------------
    async def copy_chunks(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (dst, src) pair, off the event loop when large."""
        if sum(dst.numel() * dst.element_size() for dst, _ in pairs) > THREAD_COPY_BYTES:
            await asyncio.to_thread(self._copy_pairs, pairs)
        else:
            self._copy_pairs(pairs)

    @staticmethod
    def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            copy_into(dst, src)

    def empty_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor a get hands to the caller (pooled host memory by default)."""
        return empty_host(shape, dtype)

    # -- writes ---------------------------------------------------------------------------
    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        self._ensure_open()
        check_batch(keys, chunks)
        latest = dict(zip(keys, chunks))  # later duplicates win
        sizes = {key: size_class(chunk.numel() * chunk.element_size()) for key, chunk in latest.items()}
        for size in sizes.values():
            self._check_fits(size)
            if size > self.capacity_limit:
                raise CapacityError(f"tier {self.name!r}: memory pressure leaves {format_size(self.capacity_limit)}, "
                                    f"too little for a {format_size(size)} chunk")
        need = sum(sizes.values()) - sum(self._index.size_of(k) or 0 for k in latest)
        await self._make_room(need, protect=latest.keys())
        placed: list[tuple[CacheKey, Resident, torch.Tensor]] = []
        for key, chunk in latest.items():
            slab = self._slabs.allocate(sizes[key])
            if slab is None:
                for _, resident, _ in placed:
                    self._slabs.release(resident.slab)
                self._reserved -= sum(r.slab.numel() for _, r, _ in placed)
                raise CapacityError(f"tier {self.name!r}: memory for a {format_size(sizes[key])} chunk is exhausted")
            self._reserved += slab.numel()
            placed.append((key, Resident(slab, chunk.dtype, tuple(chunk.shape), chunk.numel() * chunk.element_size()),
                           chunk))
        try:
            await self.copy_chunks([(resident.view(), chunk.detach()) for _, resident, chunk in placed])
        finally:
            self._reserved -= sum(r.slab.numel() for _, r, _ in placed)
        for key, resident, _ in placed:
            self._drop(key)
            self._resident[key] = resident
            self._index.add(key, resident.slab.numel())
        return len(keys)

    async def _make_room(self, need: int, protect: Any) -> None:
        for _ in range(_MAX_ROOM_ATTEMPTS):
            victims = self._index.victims(need + self._reserved, self.capacity_limit, protect=protect)
            if victims is None:
                raise CapacityError(
                    f"tier {self.name!r}: no room for {format_size(need)}: the rest of its "
                    f"{format_size(self.capacity_limit)} is being read, written or demoted"
                )
            if not victims:
                return
            await self._evict(victims, must_free=False)
        raise CapacityError(f"tier {self.name!r}: concurrent writers kept taking the room made for {format_size(need)}")

    async def _evict(self, victims: list[CacheKey], must_free: bool) -> None:
        """Demote ``victims`` (when a sink is set), then free them.

        If demotion fails, the chunks stay unless ``must_free`` (pressure: the memory must
        be given back now, and the failure is counted).
        """
        residents = {key: self._resident[key] for key in victims if key in self._resident}
        if self.demote_sink is not None and residents:
            for key, resident in residents.items():
                resident.readers += 1
                self._index.pin(key)
            try:
                await self.demote_sink(list(residents), [r.view() for r in residents.values()])
                self.counters["demotions"] += len(residents)
            except Exception as exc:
                self.counters["demotion_failures"] += len(residents)
                logger.warning("tier %r: demoting %d chunk(s) failed: %s", self.name, len(residents), exc)
                if not must_free:
                    raise CapacityError(f"tier {self.name!r}: cannot make room: demotion to the next tier "
                                        f"failed ({exc})") from exc
            finally:
                for key, resident in residents.items():
                    self._index.unpin(key)
                    self._release_reader(resident)
        for key, resident in residents.items():
            if self._resident.get(key) is resident:  # not replaced while it was being demoted
                self._count_eviction(resident.slab.numel())
                self._drop(key)

    def _release_reader(self, resident: Resident) -> None:
        resident.readers -= 1
        if resident.retired and not resident.readers:
            self._slabs.release(resident.slab)

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
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        results: list[torch.Tensor | None] = []
        for key, resident in zip(keys, found):
            if resident is None:
                results.append(None)
                continue
            resident.readers += 1
            self._index.pin(key)
            self._index.touch(key)
            out = self.empty_output(resident.shape, resident.dtype)
            pairs.append((out, resident.view()))
            results.append(out)
        try:
            await self.copy_chunks(pairs)
        finally:
            for key, resident in zip(keys, found):
                if resident is not None:
                    self._index.unpin(key)
                    self._release_reader(resident)
        return results

    async def contains(self, key: CacheKey) -> bool:
        self._ensure_open()
        return key in self._resident

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        self._ensure_open()
        return [key in self._resident for key in keys]

    def resident_keys(self) -> list[CacheKey]:
        """Keys held now, first to be evicted first."""
        return list(self._index.keys())

    async def close(self) -> None:
        self._resident.clear()
        self._index = make_index(self.eviction)
        self._slabs.clear()
        await super().close()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "chunks": len(self._resident), "device": str(self.device), "pinned": self.pinned,
                "eviction": self.eviction, "configured_capacity_bytes": self.capacity,
                "allocated_bytes": self._slabs.allocated}


def pinned_default(requested: bool | None, tier: str) -> bool:
    """Pin when asked (or by default) and possible; say once why not when asked and impossible."""
    if requested and not can_pin_memory():
        logger.info("tier %r: pinned memory needs CUDA, which is not available; using pageable memory", tier)
    return can_pin_memory() if requested is None else bool(requested) and can_pin_memory()
