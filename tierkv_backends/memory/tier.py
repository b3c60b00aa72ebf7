"""Shared machinery of the memory tiers (``cpu`` and ``gpu``): slabs on one device,
bounded by an effective capacity, with a pluggable eviction policy and demotion.

Chunks live in slabs from ``tierkv_backends.memory.slabs`` (by default a pool allocated and
touched once at start-up). Besides the backend contract, a memory tier lets the engine
move bytes without intermediate copies:

- ``MemoryTier.reserve`` sets slabs aside for chunks that a caller then writes in place
  (a connector gathers a paged cache straight into them) and ``MemoryTier.commit``\\ s;
- ``MemoryTier.hold`` hands out the bytes of resident chunks, valid until released even
  if the chunk is evicted or replaced meanwhile (a background fill reads from them; a
  connector scatters from them).

When a tier must make room it hands its victims to ``demote_sink`` (set by the engine
in write-back mode, or under memory pressure) before freeing them, so a chunk leaves a
memory tier only after the tier below holds it. Victims are held while they are being
demoted, and a chunk being read is never chosen.

Over 400 lines (about 435) by choice: reservations, commits, holds, eviction and demotion
are one state machine over one index and one slab pool (a cancelled reserve gives back what
eviction already freed; a hold outlives eviction), and splitting it would share that state
across modules. The slab allocators are apart (``tierkv_backends.memory.slabs``), and so are the
copies (``tierkv.routing.offload``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tierkv.backend import DemoteSink, StorageBackend, check_batch, check_destinations, fits_destination
from tierkv.backend.options import Option, format_size
from tierkv.chunks.keys import CacheKey, count_by_scope, in_scope
from tierkv.chunks.kvlayout import nbytes_of
from tierkv.chunks.memory import can_pin_memory, empty_host, size_class
from tierkv.errors import CapacityError, ConfigError
from tierkv.policy.planner import HOST_MEMORY_SEED, SpeedSeed
from tierkv.policy.residency import EVICTION_POLICIES, make_index
from tierkv.routing import offload
from tierkv_backends.memory.leases import Leases, spare_leased_last
from tierkv_backends.memory.slabs import LazySlabs, SlabArena

logger = logging.getLogger("tierkv_backends.memory_tier")

_MAX_ROOM_ATTEMPTS = 8
# A put waits at most this long for held slabs (of evicted chunks still being read) to come back.
_HELD_WAIT_S = 10.0

ChunkLayout = tuple[tuple[int, ...], torch.dtype]
EVICTION_OPTION = Option("str", "lru", choices=EVICTION_POLICIES, doc="eviction policy")
PREALLOCATE_OPTION = Option("bool", True, doc="allocate and touch the whole capacity at start-up "
                                              "(false: grow slab by slab on first use)")
RETAIN_SHARE_OPTION = Option("float", 0.5, minimum=0.0,
                             doc="the share of the tier's capacity that retained chunks (hints that keep a "
                                 "prefix through evictions: Engine.retain, a request's retain_s) may take, 0 to 1")


@dataclass
class Resident:
    """One chunk held in a slab."""

    slab: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    readers: int = 0
    retired: bool = False  # replaced or evicted while held: free after the last holder

    def view(self) -> torch.Tensor:
        return self.slab[: self.nbytes].view(self.dtype).view(self.shape)


class Hold:
    """The bytes of one resident chunk, kept valid until ``release`` (idempotent)."""

    __slots__ = ("_tier", "_resident", "_pinned_key", "chunk")

    def __init__(self, tier: MemoryTier, resident: Resident, pinned_key: CacheKey | None) -> None:
        self._tier: MemoryTier | None = tier
        self._resident = resident
        self._pinned_key = pinned_key
        self.chunk = resident.view()

    def release(self) -> None:
        tier, self._tier = self._tier, None
        if tier is not None:
            tier._unhold(self._resident, self._pinned_key)


@dataclass
class Reservation:
    """A slab set aside for ``key``; write ``chunk`` in place, then commit or abort."""

    key: CacheKey
    resident: Resident

    @property
    def chunk(self) -> torch.Tensor:
        return self.resident.view()


def available_memory() -> int | None:
    """Bytes of memory the kernel says can be allocated without swapping (``MemAvailable``);
    None where /proc/meminfo does not say (another OS)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def refuse_beyond_available_memory(name: str, capacity: int) -> None:
    """A preallocated host tier touches its whole capacity at start: one larger than the
    memory available now would end with the OOM killer, not an error. Refuse it, naming both."""
    available = available_memory()
    if available is not None and capacity > available:
        raise ConfigError(f"tier {name!r}: capacity {format_size(capacity)} is more than the {format_size(available)} "
                          "of memory available on this machine now (MemAvailable): give a smaller capacity, or "
                          "preallocate: false to allocate as chunks arrive (then the machine's memory, not the "
                          "capacity, bounds the tier)")


class MemoryTier(StorageBackend):
    """A capacity-bounded tier of slabs on one device (see module docstring)."""

    speed_seed: ClassVar[SpeedSeed] = HOST_MEMORY_SEED  # a memory copy
    requires_capacity: ClassVar[bool] = True
    #: SupportsPressure: host memory (the gpu tier says True: accelerator memory, watched via NVML)
    device_memory: ClassVar[bool] = False

    def __init__(self, name: str, capacity: int | None, device: torch.device, pinned: bool,
                 eviction: str = "lru", preallocate: bool = True, retain_share: float = 0.5) -> None:
        super().__init__(name, capacity)
        self._leases: Leases[CacheKey] = Leases(retain_share)  # checked first: a bad share allocates nothing
        assert self.capacity is not None  # requires_capacity guarantees it
        self.device = device
        self.pinned = pinned
        self.removal_listener: Callable[[CacheKey], None] | None = None
        self.eviction = eviction
        self.capacity_limit = self.capacity
        self.demote_sink: DemoteSink | None = None
        # write-through: gives back memory that queued fills to the tiers below hold (see _allocate)
        self.reclaim: Callable[[int, bool], Awaitable[int]] | None = None
        self._resident: dict[CacheKey, Resident] = {}
        self._index = make_index(eviction)
        self._reserved = 0
        self._retired_held = 0  # bytes of evicted or replaced chunks whose slabs are still held
        self._slab_freed: asyncio.Event | None = None
        self._slabs: SlabArena | LazySlabs
        if preallocate:
            if device.type == "cpu":
                refuse_beyond_available_memory(name, self.capacity)
            self._slabs = SlabArena(self.capacity, device, pinned)
            logger.info("tier %r: preallocated %s on %s%s in %.2fs", name, format_size(self._slabs.allocated),
                        device, " (pinned)" if pinned else "", self._slabs.startup_s)
        else:
            self._slabs = LazySlabs(self.capacity, device, pinned)
        # demotions: the router's count (Tier.metrics); retained_evictions: leased chunks evicted
        self.counters.update({"demotion_failures": 0, "retained_evictions": 0})

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

    async def shrink_to_limit(self) -> int:
        """Demote and free chunks until usage is within the effective capacity, and give the
        memory back; returns the bytes of chunks freed."""
        before = self.used_bytes
        victims = self._victims(0, self.capacity_limit)
        if victims is None:  # held readers pin the rest: free what we can
            victims = [k for k in self._index.keys() if not self._index.is_pinned(k)]
        if victims:
            await self._evict(victims, must_free=True)
        self._slabs.trim(self.capacity_limit)
        if self._slabs.allocated > self.capacity_limit:  # a pool gives memory back by whole segments
            segments = self._slabs.segments_to_empty(self.capacity_limit)
            emptied = [key for key, resident in self._resident.items()
                       if self._slabs.segment_of(resident.slab) in segments and not self._index.is_pinned(key)]
            if emptied:
                await self._evict(emptied, must_free=True)
            self._slabs.trim(self.capacity_limit)
        return before - self.used_bytes

    # -- copies (overridden by devices with their own streams) --------------------------
    async def copy_chunks(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (dst, src) pair, off the event loop when large (the engine's one threshold,
        ``tierkv.routing.offload``); the destinations are slabs or a caller's memory, so a
        cancellation waits for the copy."""
        await offload.copy_pairs(pairs)

    def empty_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor a get hands to the caller (pooled host memory by default)."""
        return empty_host(shape, dtype)

    # -- writes in place ------------------------------------------------------------------
    async def reserve(self, keys: Sequence[CacheKey], layouts: Sequence[ChunkLayout]) -> list[Reservation]:
        """Set slabs aside for chunks of the given (shape, dtype), making room as a put would.

        The caller writes each reservation's ``chunk`` and then calls ``commit`` (the
        chunks become visible) or ``abort``. Later duplicate keys win.
        """
        self._ensure_open()
        if len(keys) != len(layouts):
            raise ValueError(f"reserve got {len(keys)} keys but {len(layouts)} layouts")
        latest = dict(zip(keys, layouts))
        sizes = {key: size_class(nbytes_of(*layout)) for key, layout in latest.items()}
        for size in sizes.values():
            self._check_fits(size)
            if size > self.capacity_limit:
                raise CapacityError(f"tier {self.name!r}: memory pressure leaves {format_size(self.capacity_limit)}, "
                                    f"too little for a {format_size(size)} chunk")
        need = sum(sizes.values()) - sum(self._index.size_of(k) or 0 for k in latest)
        protected = frozenset(latest)  # one set for the whole batch: a store of n chunks stays O(n)
        await self._make_room(need, protect=protected)
        reservations: list[Reservation] = []
        try:
            for key, (shape, dtype) in latest.items():
                # may evict (and demote, in write-back) to make room: a cancellation can land here
                slab = await self._allocate(sizes[key], protected)
                if slab is None:
                    raise CapacityError(f"tier {self.name!r}: memory for a {format_size(sizes[key])} chunk is "
                                        "exhausted (the rest is held by readers or background fills)")
                self._reserved += slab.numel()
                reservations.append(Reservation(key, Resident(slab, dtype, tuple(shape),
                                                              nbytes_of(shape, dtype))))
        except BaseException:  # failed or cancelled: nothing was written yet, give back what was set aside
            self.abort(reservations)
            raise
        return reservations

    def commit(self, reservations: Iterable[Reservation]) -> None:
        """Make reserved chunks resident (replacing older values of their keys)."""
        for reservation in reservations:
            self._reserved -= reservation.resident.slab.numel()
            self._drop(reservation.key, keep_lease=True)  # a newer copy of a retained chunk stays retained
            self._resident[reservation.key] = reservation.resident
            self._index.add(reservation.key, reservation.resident.slab.numel())

    def abort(self, reservations: Iterable[Reservation]) -> None:
        """Give reserved slabs back unused."""
        for reservation in reservations:
            self._reserved -= reservation.resident.slab.numel()
            self._slabs.release(reservation.resident.slab)

    async def _allocate(self, size: int, protected: frozenset[CacheKey]) -> torch.Tensor | None:
        """A slab, evicting further least-recently-used chunks while the pool is fragmented,
        and waiting (bounded) for slabs of evicted chunks that are still held (a background
        fill reading them) to come back. ``protected``: keys never evicted for it (the batch's).
        Before waiting, ``reclaim`` drops the queued fills holding them whose tiers take nothing
        now, and after the wait the oldest of the others: a store the tier has room for is never
        refused because of copies waiting for a full, failing or slow tier below."""
        deadline = asyncio.get_running_loop().time() + _HELD_WAIT_S
        while True:
            if self._slab_freed is not None:
                self._slab_freed.clear()
            slab = self._slabs.allocate(size)
            if slab is not None:
                return slab
            victim = next((k for k in spare_leased_last(self._index.keys(), self._leases.live())
                           if k not in protected and not self._index.is_pinned(k)), None)
            if victim is not None:
                await self._evict([victim], must_free=False)
                continue
            left = deadline - asyncio.get_running_loop().time()
            if not self._retired_held:
                return None
            if self.reclaim is not None and await self.reclaim(size, left <= 0):
                continue  # their holds were released: the slabs are free
            if left <= 0:
                return None
            if self._slab_freed is None:
                self._slab_freed = asyncio.Event()
            try:
                await asyncio.wait_for(self._slab_freed.wait(), left)
            except asyncio.TimeoutError:
                return None

    async def put_with(self, keys: Sequence[CacheKey], layouts: Sequence[ChunkLayout],
                       write: Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]],
                       on_commit: Callable[[], None] | None = None) -> int:
        """Reserve slabs, let ``write`` fill them (key -> chunk view), then commit them; nothing
        is committed if ``write`` fails. ``on_commit`` runs right after the commit, before any
        other task can evict the chunks (the engine holds them there for its background fill).

        ``write`` must not return (nor raise, cancelled or not) while a copy into the views
        still runs (``tierkv.chunks.ownership``): the slabs are given back as soon as it ended.
        """
        reservations = await self.reserve(keys, layouts)
        try:
            await write({r.key: r.chunk for r in reservations})
        except BaseException:
            self.abort(reservations)
            raise
        self.commit(reservations)
        if on_commit is not None:
            on_commit()
        return len(keys)

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        self._ensure_open()
        check_batch(keys, chunks)
        latest = dict(zip(keys, chunks))  # later duplicates win

        async def write(views: dict[CacheKey, torch.Tensor]) -> None:
            await self.copy_chunks([(view, latest[key].detach()) for key, view in views.items()])
        await self.put_with(list(latest), [(tuple(c.shape), c.dtype) for c in latest.values()], write)
        return len(keys)

    def next_victims(self, chunk_nbytes: Sequence[int]) -> list[CacheKey] | None:
        """The chunks an eviction for chunks of ``chunk_nbytes`` bytes would take, in order
        (see ``tierkv.backend.NamesVictims``); slabs are rounded up to size classes."""
        need = sum(size_class(nbytes) for nbytes in chunk_nbytes)
        return self._victims(need + self._reserved, self.capacity_limit)

    def _victims(self, need: int, capacity: int, protect: Iterable[CacheKey] = ()) -> list[CacheKey] | None:
        """The eviction policy's victims for ``need`` more bytes within ``capacity``, sparing
        leased chunks while the others make room; then (a lease is a bias) leased ones too,
        after every other. None when even that is not enough (readers pin the rest)."""
        leased = self._leases.live()
        if not leased:
            return self._index.victims(need, capacity, protect=protect)
        protected = set(protect)
        spared = self._index.victims(need, capacity, protect=protected | leased)
        if spared is not None:
            return spared
        excess = self._index.used_bytes + need - capacity
        chosen: list[CacheKey] = []
        for key in spare_leased_last(self._index.keys(), leased):
            if excess <= 0:
                break
            if key not in protected and not self._index.is_pinned(key):
                chosen.append(key)
                excess -= self._index.size_of(key) or 0
        return chosen if excess <= 0 else None

    def retain(self, keys: Sequence[CacheKey], seconds: float) -> list[bool]:
        """Keep each resident chunk of ``keys`` through evictions for ``seconds`` (a longer lease
        it has is kept; 0 releases); whether each is resident. Leased chunks are evicted after
        every other, so a lease is a bias, never a deadlock.

        Raises:
            RetentionRefusedError: if the leases would pass ``retain_share`` of the capacity
                (nothing was retained).
            ValueError: if ``seconds`` is negative or not finite.
        """
        self._ensure_open()
        return self._leases.retain(keys, seconds, self._index.size_of, self.capacity or 0, f"tier {self.name!r}")

    async def _make_room(self, need: int, protect: Any) -> None:
        for _ in range(_MAX_ROOM_ATTEMPTS):
            victims = self._victims(need + self._reserved, self.capacity_limit, protect=protect)
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
            except Exception as exc:
                self.counters["demotion_failures"] += len(residents)
                logger.warning("tier %r: demoting %d chunk(s) failed: %s", self.name, len(residents), exc)
                if not must_free:
                    raise CapacityError(f"tier {self.name!r}: cannot make room: demotion to the next tier "
                                        f"failed ({exc})") from exc
            finally:
                for key, resident in residents.items():
                    self._unhold(resident, key)
        leased = self._leases.live()
        for key, resident in residents.items():
            if self._resident.get(key) is resident:  # not replaced while it was being demoted
                self._count_eviction(resident.slab.numel())
                self.counters["retained_evictions"] += key in leased
                self._drop(key)

    def _unhold(self, resident: Resident, pinned_key: CacheKey | None) -> None:
        if pinned_key is not None:
            self._index.unpin(pinned_key)
        resident.readers -= 1
        if resident.retired and not resident.readers:
            self._retired_held -= resident.slab.numel()
            self._slabs.release(resident.slab)
            if self._slab_freed is not None:
                self._slab_freed.set()

    def _drop(self, key: CacheKey, keep_lease: bool = False) -> bool:
        resident = self._resident.pop(key, None)
        if resident is None:
            return False
        self._index.remove(key)
        if not keep_lease:
            self._leases.forget(key)
        if self.removal_listener is not None:  # e.g. vLLM's KV events: the chunk left this tier
            self.removal_listener(key)
        if resident.readers:
            resident.retired = True
            self._retired_held += resident.slab.numel()
        else:
            self._slabs.release(resident.slab)
        return True

    async def delete(self, key: CacheKey) -> bool:
        self._ensure_open()
        return self._drop(key)

    # -- reads ---------------------------------------------------------------------------------
    def hold(self, keys: Sequence[CacheKey], pin: bool = True) -> list[Hold | None]:
        """The bytes of each resident chunk (None for misses), valid until each hold is released.

        ``pin``: the chunk is not evicted while held (a short read). Without it the chunk may
        be evicted or replaced meanwhile, and its slab is reused only after the release (a
        background fill reading from it must not block eviction).
        """
        self._ensure_open()
        holds: list[Hold | None] = []
        for key in keys:
            resident = self._resident.get(key)
            if resident is None:
                holds.append(None)
                continue
            resident.readers += 1
            self._index.touch(key)
            if pin:
                self._index.pin(key)
            holds.append(Hold(self, resident, key if pin else None))
        return holds

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        holds = self.hold(keys)
        outs = [None if h is None else self.empty_output(tuple(h.chunk.shape), h.chunk.dtype) for h in holds]
        try:
            await self.copy_chunks([(out, h.chunk) for out, h in zip(outs, holds) if out is not None and h])
        finally:
            for hold in holds:
                if hold is not None:
                    hold.release()
        return outs

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """One copy per chunk, slab -> destination, while the chunk is pinned."""
        check_destinations(keys, outs)
        holds = self.hold(keys)
        hits = [h is not None and fits_destination(out, h.chunk.shape, h.chunk.dtype) for h, out in zip(holds, outs)]
        try:
            await self.copy_chunks([(out, h.chunk) for out, h, hit in zip(outs, holds, hits) if hit and h])
        finally:
            for hold in holds:
                if hold is not None:
                    hold.release()
        return hits

    async def contains(self, key: CacheKey) -> bool:
        self._ensure_open()
        return key in self._resident

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        self._ensure_open()
        return [key in self._resident for key in keys]

    def batched_contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        resident = self._resident
        return [key in resident for key in keys]

    def scope_usage(self) -> dict[str, dict[str, int]]:
        return count_by_scope(self._index.sized_items())

    def resident_keys(self) -> list[CacheKey]:
        """Keys held now, first to be evicted first."""
        return list(self._index.keys())

    async def drop_scope(self, model_name: str, scope: str) -> int:
        self._ensure_open()
        dropped = 0
        for key in self.resident_keys():
            if in_scope(key, model_name, scope):
                dropped += bool(await self.delete(key))
        return dropped

    async def close(self) -> None:
        self._resident.clear()
        self._retired_held = 0
        self._leases.clear()
        self._index = make_index(self.eviction)
        self._slabs.clear()
        await super().close()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "chunks": len(self._resident), "device": str(self.device), "pinned": self.pinned,
                "eviction": self.eviction, "configured_capacity_bytes": self.capacity,
                "allocated_bytes": self._slabs.allocated, "preallocated": self._slabs.preallocated,
                "retained_bytes": self._leases.retained_bytes(self._index.size_of)}


def pinned_default(requested: bool | None, tier: str) -> bool:
    """Pin when asked (or by default) and possible; say once why not when asked and impossible."""
    if requested and not can_pin_memory():
        logger.info("tier %r: pinned memory needs CUDA, which is not available; using pageable memory", tier)
    return can_pin_memory() if requested is None else bool(requested) and can_pin_memory()
