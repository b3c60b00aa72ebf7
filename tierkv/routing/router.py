"""The tier router: chunk keys and tensors across the stack of tiers, nothing about prompts.

One module of about 565 lines, by choice: one class whose state (the tiers, the fill worker, the
dirty set, background tasks, the calls running) every method shares; what could stand alone
already does (locate, reads, fill, offload, write_back, calls beside it).

It decides *which* tier: the first that admits a put (``TierRouter.put`` is the one
store loop), where a read goes (``tierkv.routing.locate``, then the one-pass read of
``tierkv.routing.reads``), how lower-tier hits move up (promotion) and evictions move down
(demotion, write-back), and it owns the lifecycle (the fill worker of ``tierkv.routing.fill``,
memory-pressure watchers of ``tierkv.tiers.tier_pressure``, background tasks, close). How one
tier is asked, and what that cost it (counters, health, speed, full, pressure), is its
``tierkv.tiers.tier.Tier`` handle's business. The prompt API (``tierkv.engine.async_engine``)
holds a router and uses only its public methods.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, ClassVar

import torch

from tierkv.backend import registry
from tierkv.backend.contract import StorageBackend, check_batch
from tierkv.chunks import copies, ownership, transfer
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.kvlayout import nbytes_of
from tierkv.config.loader import EngineConfig
from tierkv.errors import BackendClosedError, ConfigError, TierKVError, TierUnavailableError
from tierkv.policy import residency as policy
from tierkv.policy.admission import FrequencySketch
from tierkv.policy.planner import HOST_MEMORY_SEED, TierSpeed
from tierkv.policy.pressure import MemoryProbe
from tierkv.routing import locate
from tierkv.routing.calls import CallGate
from tierkv.routing.fill import FillQueue, FillWorker
from tierkv.routing.locate import FILL_QUEUE, FILL_QUEUE_LEVEL, Level, Levels
from tierkv.routing.offload import gathered, source_writer
from tierkv.routing.reads import Reader
from tierkv.routing.write_back import DirtyChunks
from tierkv.tiers.tier import B, Layouts, Tier, Writer, rejection, release_all
from tierkv.tiers.tier_pressure import nvml_status

logger = logging.getLogger("tierkv.engine")

_FLUSH_BATCH = 64  # dirty chunks read and written down together by a write-back flush


def build_tiers(config: EngineConfig) -> list[StorageBackend]:
    """Instantiate every configured tier, closing the ones already built if one fails."""
    tiers: list[StorageBackend] = []
    try:
        for tier in config.tiers:
            backend_cls = registry.load(tier.backend, where=f"{tier.path}.backend")
            try:
                tiers.append(backend_cls.from_options(tier.name, tier.capacity, tier.options))
            except TierKVError:
                raise
            except Exception as exc:
                raise ConfigError(f"{tier.path}: cannot open tier {tier.name!r} ({tier.backend}): {exc}") from exc
    except BaseException:
        for built in tiers:
            _close_quietly(built)
        raise
    return tiers


def _close_quietly(backend: StorageBackend) -> None:
    """Close a tier built before a later tier failed to start, to its end: on a loop of its
    own (on a thread of its own when the caller runs in one), so no task is left behind."""
    def close() -> None:
        try:
            asyncio.run(backend.close())
        except Exception:
            logger.exception("closing tier %r after a failed start-up", backend.name)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        close()
        return
    thread = threading.Thread(target=close, name=f"tierkv-close-{backend.name}")
    thread.start()
    thread.join()


class TierRouter:
    """Routes batches of chunk keys across the tiers (see the module docstring)."""

    close_grace_s: ClassVar[float] = 10.0
    """How long ``close`` waits for the calls already running before it closes the tiers."""

    def __init__(self, config: EngineConfig, probes: Mapping[str, MemoryProbe] | None = None) -> None:
        self.config = config
        self.write_policy = config.write_policy
        # counts of sightings (stores, reads that found a chunk), kept only when a tier filters by them
        self.sketch = FrequencySketch() if any(tier.admission.filters for tier in config.tiers) else None
        # write-through tiers that take a chunk once it is reused (a hit may owe them a late fill)
        self._late_fill_levels = [level for level, tier in enumerate(config.tiers)
                                  if tier.admission.policy == "reused" and self.write_policy == "write_through"]
        self.tiers = [Tier(backend, level, tier.promote, config.health, tier.admission, self.sketch, tier.codec)
                      for level, (backend, tier) in enumerate(zip(build_tiers(config), config.tiers))]
        """The handles of the tiers, fastest first: every call into a backend goes through one."""
        self._speeds = {tier.name: tier.speed for tier in self.tiers}
        self._speeds[FILL_QUEUE] = TierSpeed(HOST_MEMORY_SEED)  # acknowledged chunks still in host memory
        self._fill = FillQueue(config.background.queue_bytes, config.background.when_full)
        self.copies = copies.CopyCounter()
        self._fills = FillWorker(self.tiers, self._fill, self.copies, self.write_policy == "write_through")
        self._reader = Reader(self.tiers, self._fill, self._promote_hits, config.health.timeout_s)
        self._inflight: dict[CacheKey, asyncio.Future[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._fill_worker: asyncio.Task[None] | None = None
        self._probes = dict(probes or {})
        self._nvml_state = nvml_status()
        self._started = False
        self._calls = CallGate()  # the calls running; close() shuts it before it closes a tier
        self._closing: asyncio.Future[None] | None = None  # the first close(), which later ones wait for
        self._closed = False  # the tiers are being closed (or are): a store failing now failed because of it
        self._dirty: DirtyChunks | None = DirtyChunks() if self.write_policy == "write_back" else None
        if self.write_policy == "write_back":
            for level, tier in enumerate(self.tiers[:-1]):
                tier.demote_to(functools.partial(self._demote, level))
        for level, tier in enumerate(self.tiers):
            if tier.in_place and self._fills.fills_below(level):
                tier.reclaim_with(functools.partial(self._fills.reclaim, level))

    @property
    def backends(self) -> tuple[StorageBackend, ...]:
        """The tiers' backends, fastest first (read-only: ``wrap_tier`` puts a wrapper in)."""
        return tuple(tier.backend for tier in self.tiers)

    def tier(self, name: str) -> Tier:
        """The handle of the tier called ``name``."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier named {name!r}; expected one of {[tier.name for tier in self.tiers]}")

    def wrap_tier(self, name: str, wrapper: Callable[[StorageBackend], B]) -> B:
        """Put ``wrapper(backend)`` in the place of tier ``name``'s backend (see ``Tier.wrap``)."""
        return self.tier(name).wrap(wrapper)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the fill worker and the pressure watchers (needs the running loop); idempotent."""
        if self._started:
            return
        self._started = True
        self._fill_worker = asyncio.get_running_loop().create_task(self._fills.run())
        for tier in self.tiers:
            tier.watch_pressure(self._probes.get(tier.name), self.config.pressure, self.spawn)

    def ensure_open(self) -> None:
        """Raise BackendClosedError once ``close`` has begun (from any thread)."""
        self._calls.check()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background: ``flush`` waits for it, a failure is logged."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("background operation failed: %r", task.exception())

    async def flush(self) -> None:
        """Wait until every background operation (fills, prefetches, demotions) has landed;
        under write-back, then write every chunk a memory tier holds alone to the tier below
        (returns once they have landed there)."""
        await self._join_background()
        if self._dirty is not None:
            await self._write_dirty()

    async def _join_background(self) -> None:
        await self._fill.join()
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self._fill.join()

    async def _write_dirty(self) -> None:
        """Write-back's flush: the dirty chunks of each memory tier, top first, written down in
        batches straight from the tier's memory, held (pinned) until the write is over. A level
        is read again after the one above it was flushed (a middle memory tier may have taken
        chunks from above meanwhile). Chunks no tier below takes stay dirty (a later flush tries
        again); chunks that left their tier without landing below (``DirtyChunks.lose``)
        are reported once. Either way TierUnavailableError says how many, after every batch was
        tried: the flush returns only when every chunk dirty at its start is committed below."""
        assert self._dirty is not None
        unwritten: dict[str, int] = {}
        for level, tier in enumerate(self.tiers[:-1]):
            pending = self._dirty.pending(level)
            for start in range(0, len(pending), _FLUSH_BATCH):
                batch = pending[start : start + _FLUSH_BATCH]
                holds: list[Any] = []
                held: list[tuple[CacheKey, torch.Tensor]] = []
                try:
                    chunks, holds = await tier.chunks_to_copy(batch)
                    held = [(key, chunk) for key, chunk in zip(batch, chunks) if chunk is not None]
                    # a dirty key its tier no longer holds left without landing below: lost
                    self._dirty.lose(level, [key for key, chunk in zip(batch, chunks)
                                             if chunk is None and self._dirty.is_dirty(level, key)])
                    held = [(key, chunk) for key, chunk in held if self._dirty.is_dirty(level, key)]
                    if held:
                        await self._write_down(level, [key for key, _ in held], [chunk for _, chunk in held],
                                               "flushed")
                        self._dirty.clean(level, [key for key, _ in held])
                except TierUnavailableError:
                    unwritten[tier.name] = unwritten.get(tier.name, 0) + len(held)
                    continue
                finally:
                    release_all(holds)
        problems = [f"no tier below took {count} of tier {name!r} dirty chunk(s); they stay in memory and a "
                    "later flush tries again" for name, count in unwritten.items()]
        for level, count in sorted(self._dirty.take_lost().items()):
            self.tiers[level].metrics.add("dirty_lost", count)
            problems.append(f"{count} dirty chunk(s) of tier {self.tiers[level].name!r} left it before a tier below "
                            "took them (forced out by memory pressure while their demotion failed, or deleted "
                            "from that tier alone)")
        if problems:
            raise TierUnavailableError("flush: " + "; ".join(problems))

    async def close(self, flush: bool = True) -> None:
        """Refuse new calls, let the running ones end (up to ``close_grace_s``), flush
        (``flush=False``: without writing write-back's dirty chunks down; they are lost with
        the memory tiers), then close every tier. A call that began before ``close()`` thus
        completes against open tiers, and every later one raises BackendClosedError.
        Idempotent: a second caller waits for the first's close to end."""
        if self._closing is not None:
            if not self._closing.done():
                await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        try:
            await self._close(flush)
        finally:
            self._closing.set_result(None)

    async def _close(self, flush: bool) -> None:
        left = await self._calls.shut(self.close_grace_s)
        if left:
            logger.warning("tierkv: closing the tiers under %d call(s) still running %.0f s after close()", left,
                           self.close_grace_s)
        if flush:
            try:
                await self.flush()
            except TierUnavailableError as exc:  # close anyway: what no tier below takes is lost
                logger.warning("tierkv: closing with chunks only in memory: %s", exc)
        else:
            await self._join_background()
        self._closed = True
        if self._fill_worker is not None:
            self._fill_worker.cancel()
            await asyncio.gather(self._fill_worker, return_exceptions=True)
        for tier in self.tiers:
            await tier.stop_watching()
        for tier in self.tiers:
            await tier.close()

    # -- where chunks are -------------------------------------------------------------------
    async def levels(self, keys: Sequence[CacheKey]) -> Levels:
        """The level of the highest tier holding each key (``tierkv.routing.locate``); None if nowhere."""
        with self._calls.call():
            return await locate.levels(self.tiers, self._fill, keys)

    def levels_nowait(self, keys: Sequence[CacheKey]) -> Levels | None:
        """``levels`` from in-memory indexes, from any thread; None when that needs I/O."""
        return locate.levels_nowait(self.tiers, self._fill, keys)

    def read_levels(self, keys: Sequence[CacheKey]) -> Levels:
        """Where ``read_into`` should look for each chunk, without I/O (see ``tierkv.routing.locate``)."""
        return locate.read_levels(self.tiers, self._fill, keys)

    def names(self, levels: Sequence[Level | None]) -> list[str | None]:
        """The tier name (or ``tierkv.routing.locate.FILL_QUEUE``) of each level, for callers."""
        return locate.names(self.tiers, levels)

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by any tier (or waits in the fill queue)."""
        return [level is not None for level in await self.levels(keys)]

    # -- stores -----------------------------------------------------------------------------
    async def put(self, keys: Sequence[CacheKey], source: transfer.ChunkSource,
                  ranges: Sequence[tuple[int, int]]) -> int:
        """Store the chunks ``source`` gives for token ``ranges`` under ``keys``; chunks written.

        The first tier that admits the batch gets one copy of each byte, straight from the
        source (an in-place tier lets the source write into its memory); the tiers below are
        filled from that copy."""
        keys, ranges = list(keys), list(ranges)
        layouts = [(source.chunk_shape(end - start), source.dtype) for start, end in ranges]
        nbytes = sum(nbytes_of(shape, dtype) for shape, dtype in layouts)
        return await self._store(keys, nbytes, functools.partial(self._put_source, keys, source, ranges, layouts))

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Store chunks per the write policy; returns how many were acknowledged.

        The call fails only when no tier took the batch; a tier that fails is counted,
        and skipped for a while after repeated failures.
        """
        self.ensure_open()
        check_batch(keys, chunks)
        keys, chunks = list(keys), list(chunks)
        return await self._store(keys, sum(c.nbytes for c in chunks),
                                 functools.partial(self._put_chunks, keys, chunks))

    async def _store(self, keys: list[CacheKey], nbytes: int,
                     put_at: Callable[[Tier, asyncio.Event], Awaitable[int]]) -> int:
        """The one store loop: ``put_at`` the first tier that admits the batch, else an error
        naming every tier and why it was skipped. ``put_at``'s event is set when the caller is
        cancelled (its fill then does not wait for room in the queue)."""
        with self._calls.call():
            return await self._store_in_first(keys, nbytes, put_at)

    async def _store_in_first(self, keys: list[CacheKey], nbytes: int,
                              put_at: Callable[[Tier, asyncio.Event], Awaitable[int]]) -> int:
        """``_store``'s loop, a call the gate admitted."""
        await self.start()
        if not keys:
            return 0
        if self.sketch is not None:
            self.sketch.add(keys)
        with copies.on_path(self.copies, "store"):
            self.copies.add_delivered("store", nbytes)
            skipped: dict[str, str] = {}
            errors: list[BaseException] = []
            for tier in self.tiers:
                if not tier.admits(skipped):
                    continue
                try:
                    # once a tier put has begun, a cancellation waits for it (its copy owns the
                    # caller's memory) and for its fill to be queued or, when the queue is full,
                    # dropped: a cancelled call never waits for room (when_full: wait)
                    cancelled = asyncio.Event()
                    return await ownership.finish(put_at(tier, cancelled), on_cancel=cancelled.set)
                except Exception as exc:
                    errors.append(exc)
                    skipped[tier.name] = rejection(exc)
        if self._closed:  # the tiers were closed under a store that outlasted close()'s grace
            raise BackendClosedError(f"engine closed while a store of {len(keys)} chunk(s) was running") from (
                errors[0] if errors else None)
        held = locate.held_anywhere(self.tiers, self._fill, keys)
        if all(held):  # nothing to save: a tier that cannot take writes now holds them all
            logger.debug("tierkv: a store of %d chunk(s) no tier took is already cached", len(keys))
            return 0
        reasons = "; ".join(f"{tier.name!r}: {skipped.get(tier.name, 'not tried')}" for tier in self.tiers)
        raise TierUnavailableError(f"no tier took the {len(keys)} chunk(s) ({len(keys) - sum(held)} of them cached "
                                   f"nowhere): {reasons}") from (errors[0] if errors else None)

    async def _put_source(self, keys: list[CacheKey], source: transfer.ChunkSource, ranges: list[tuple[int, int]],
                          layouts: Layouts, tier: Tier, cancelled: asyncio.Event) -> int:
        """Put the chunks into ``tier`` (one copy, from ``source``) and queue their fill."""
        if tier.in_place:
            return await self._put_and_fill(tier, keys, cancelled, layouts=layouts,
                                            write=source_writer(source, keys, ranges))
        views = [source.view(start, end) for start, end in ranges]
        chunks = [view if view is not None else await gathered(source, shape, rng)
                  for view, (shape, _), rng in zip(views, layouts, ranges)]
        return await self._put_and_fill(tier, keys, cancelled, chunks, owned=[view is None for view in views])

    async def _put_chunks(self, keys: list[CacheKey], chunks: list[torch.Tensor], tier: Tier,
                          cancelled: asyncio.Event) -> int:
        return await self._put_and_fill(tier, keys, cancelled, chunks, owned=[False] * len(chunks))

    async def _put_and_fill(self, tier: Tier, keys: list[CacheKey], cancelled: asyncio.Event,
                            chunks: list[torch.Tensor] | None = None, *, owned: list[bool] | None = None,
                            layouts: Layouts | None = None, write: Writer | None = None) -> int:
        # an in-place tier's chunks, held from their commit until the fill has them
        holds: list[Any] | None = [] if tier.in_place and self._fills.fills_below(tier.level) else None
        try:
            stored = await tier.put(keys, chunks, layouts=layouts, write=write, fill_holds=holds,
                                    on_commit=self._dirty_on_commit(tier, keys))
            await self._fills.add(tier.level, keys, chunks or [], owned or [], holds, cancelled=cancelled)
        except BaseException:
            release_all(holds or [])
            raise
        return stored

    async def batched_delete(self, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys`` from every tier (after the background fills already queued have
        landed, so none writes a key back); returns how many (key, tier) copies were removed.

        A tier that fails is counted and skipped, as for reads: the call removes what it can.
        """
        with self._calls.call():
            await self._fill.join()
            if self._dirty is not None:
                self._dirty.discard(keys)
            removed = 0
            for tier in self.tiers:
                if tier.available():
                    removed += await tier.delete(keys)
            return removed

    # -- reads ------------------------------------------------------------------------------
    async def read_into(self, keys: list[CacheKey], levels: Sequence[int | None], ranges: list[tuple[int, int]],
                        sink: transfer.ChunkSink, *, caller_owned: bool, preloaded: torch.Tensor | None = None,
                        deadline: float | None = None) -> int:
        """Read each chunk into ``sink`` from where ``read_levels`` put it (the one-pass
        read of ``tierkv.routing.reads``); the number of leading chunks delivered. ``caller_owned``:
        the sink's memory is the caller's (a tier that streams before it verifies reads into
        staging); ``preloaded``: chunk 0, already read."""
        with self._calls.call():
            await self.start()  # a read may queue work (late fills) and a reader's memory tiers are watched too
            delivered = await self._reader.read_into(keys, levels, ranges, sink, caller_owned, preloaded, deadline)
            self._sighted(keys[:delivered], levels[:delivered])
            return delivered

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Chunks for ``keys`` in order (None for misses), each from the highest tier holding it,
        once the prefetches moving them have landed. Hits below the top are promoted."""
        with self._calls.call():
            await self.start()
            await self.wait_inflight(keys)
            chunks = await self._reader.get(keys)
            if self.sketch is not None:
                self.sketch.add([key for key, chunk in zip(keys, chunks) if chunk is not None])
            return chunks

    async def get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """``batched_get`` without waiting for prefetches (fresh tensors, safe to abandon)."""
        with self._calls.call():
            return await self._reader.get(keys)

    async def get_from(self, level: int, keys: list[CacheKey]) -> list[torch.Tensor | None]:
        """Get ``keys`` from tier ``level`` only (within the health timeout; errors are misses)."""
        return await self.tiers[level].get(keys)

    async def wait_inflight(self, keys: Sequence[CacheKey], deadline: float | None = None) -> int:
        """Wait for the prefetches moving these keys (until ``deadline`` at most); how many
        leading keys are ready (a key still moving at the deadline ends the usable prefix)."""
        waiting = {id(f): f for f in (self._inflight.get(key) for key in keys) if f is not None}
        if waiting:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait(list(waiting.values()), timeout=timeout)
        for index, key in enumerate(keys):
            future = self._inflight.get(key)
            if future is not None and not future.done():
                return index
        return len(keys)

    async def prefetch(self, keys: Sequence[CacheKey], levels: Sequence[int | None]) -> None:
        """Start moving the chunks located at ``levels`` below the top up; returns at once.
        A read of them meanwhile waits for the chunks still in flight (``wait_inflight``)."""
        self.ensure_open()  # what it starts runs in the background, which close() waits for
        await self.start()
        moving = [key for key, level in zip(keys, levels) if level and key not in self._inflight]
        if not moving:
            return
        loop = asyncio.get_running_loop()
        for key in moving:
            self._inflight[key] = loop.create_future()
        self.spawn(self._prefetch(moving))

    async def _prefetch(self, keys: list[CacheKey]) -> None:
        try:
            await self._reader.get(keys)
        finally:
            for key in keys:
                future = self._inflight.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(None)

    def _sighted(self, keys: Sequence[CacheKey], levels: Sequence[Level | None]) -> None:
        """Count a read's hits; under write-through, a chunk held by a memory tier whose count
        just reached a lower tier's ``reused`` threshold is filled down now (it was turned
        away when it was stored)."""
        if self.sketch is None or not keys:
            return
        self.sketch.add(keys)
        if not self._late_fill_levels:
            return
        counts = self.sketch.estimate(keys)
        reached = {target: self.tiers[target].admission.just_reached(counts) for target in self._late_fill_levels}
        due: dict[tuple[int, tuple[int, ...]], list[CacheKey]] = {}
        for index, (key, level) in enumerate(zip(keys, levels)):
            if level is None or level == FILL_QUEUE_LEVEL or not self.tiers[level].in_place:
                continue
            targets = tuple(target for target, flags in reached.items() if target > level and flags[index])
            if targets:
                due.setdefault((level, targets), []).append(key)
        for (level, targets), late in due.items():
            self.spawn(self._fills.add(level, late, [], [], targets=list(targets)))

    # -- moving chunks between tiers ----------------------------------------------------------
    async def _promote_hits(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
        lossy = self.tiers[level].lossy
        with copies.on_path(self.copies, "promote"):
            for target in policy.promotion_targets(level):
                tier = self.tiers[target]
                if not tier.promote or (lossy and tier.persistent) or not tier.admits():
                    continue  # a lossy chunk goes up into this process's memory only, never under an exact key others read
                flags = tier.admit(keys, [chunk.nbytes for chunk in chunks], unrecorded=1)  # this hit
                taken = [(key, chunk) for key, chunk, flag in zip(keys, chunks, flags) if flag]
                if not taken:
                    continue
                try:
                    await tier.put([key for key, _ in taken], [chunk for _, chunk in taken])
                except Exception:
                    continue  # counted by Tier.put; the hit is still served
                tier.metrics.add("promotions", len(taken))

    def _dirty_on_commit(self, tier: Tier, keys: Sequence[CacheKey]) -> Callable[[], None] | None:
        """Write-back: what marks ``keys`` dirty when ``tier`` (a memory tier with tiers below)
        commits them -- at the commit itself, so no eviction can see them clean; None when
        they cannot be dirty there."""
        dirty = self._dirty
        if dirty is None or tier.level >= len(self.tiers) - 1 or tier.persistent:
            return None
        level, keys = tier.level, list(keys)
        return lambda: dirty.mark(level, keys)

    async def _demote(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
        """Demotion sink of tier ``level`` (write-back): its dirty chunks go to the next tier
        below that takes them; clean ones (a copy is below: promoted from there, or flushed)
        are just let go. Raises when no tier below took the dirty ones: the memory tier then
        keeps them (or, made to free memory, drops them: the next flush reports them lost)."""
        assert self._dirty is not None
        dirty = [index for index, key in enumerate(keys) if self._dirty.is_dirty(level, key)]
        if dirty:
            await self._write_down(level, [keys[i] for i in dirty], [chunks[i] for i in dirty], "demotions")
            self._dirty.clean(level, [keys[i] for i in dirty])

    async def _write_down(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor], metric: str) -> None:
        """Write dirty chunks of tier ``level`` to the next tier below that takes them (counted
        as ``metric`` at ``level``); returns once that tier has committed them. No admission
        rule turns them away and nothing is skipped as present: a dirty chunk has no copy below,
        and write-back's flush promises it one (a chunk that is below already is clean and
        never gets here). A memory tier in the middle takes them dirty."""
        for tier in self.tiers[level + 1:]:
            if not tier.admits():
                continue
            try:
                await tier.put(keys, chunks, on_commit=self._dirty_on_commit(tier, keys))
            except Exception:
                continue
            self.tiers[level].metrics.add(metric, len(keys))
            return
        raise TierUnavailableError(f"no tier below {self.tiers[level].name!r} could take {len(keys)} "
                                   f"{'demoted' if metric == 'demotions' else 'flushed'} chunk(s)")

    # -- what it cost -------------------------------------------------------------------------
    def speeds(self) -> Mapping[str, TierSpeed]:
        """Each tier's measured get speed by name (and the fill queue's), for the cost model."""
        return self._speeds

    def stats(self) -> dict[str, Any]:
        """The fill queue, background work, memory pressure, copies and per-tier counters."""
        return {
            "fill_queue": self._fill.stats(),
            "background_tasks": len(self._background),
            "inflight_prefetch_chunks": len(self._inflight),
            "pressure": {"nvml": self._nvml_state,
                         **{tier.name: tier.pressure.describe() for tier in self.tiers if tier.pressure}},
            "copies": self.copies.snapshot(),
            "tiers": {tier.name: tier.stats() for tier in self.tiers},
        }

