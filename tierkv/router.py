"""The tier router: chunk keys and tensors across the stack of tiers, nothing about prompts.

Which tier takes a put (the first that admits it), how the tiers below are filled (a
bounded background queue, write-through) or fed (demotion on eviction, write-back), where a
read goes (one pass: in-memory indexes first, a tier without one is asked with gets), how
lower-tier hits move up (promotion), and what a failing, slow or pressured tier costs (a
health breaker, timeouts and deadlines, capacity that follows memory pressure). Each tier's
get speed is measured here for the cost model (:mod:`tierkv.planner`).

It is one state machine over shared state (health, fills in flight, holds on slabs), which
is why it is one module; the prompt API (:mod:`tierkv.async_engine`) builds on it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch

from tierkv import copies, ownership, policy, registry, transfer
from tierkv.backend import InPlaceTier, StorageBackend, check_batch, fits_destination
from tierkv.config import EngineConfig
from tierkv.errors import (
    BackendClosedError,
    CapacityError,
    ChunkFormatError,
    ConfigError,
    TierFullError,
    TierKVError,
    TierUnavailableError,
)
from tierkv.fill import FillJob, FillQueue
from tierkv.keys import CacheKey
from tierkv.memory import copy_into, empty_host
from tierkv.metrics import TierMetrics
from tierkv.planner import HOST_MEMORY_SEED, TierSpeed
from tierkv.policy import TierHealth
from tierkv.pressure import HostMemoryProbe, MemoryProbe, PressureMonitor, open_device_probe
from tierkv.tier_pressure import TierPressure, nvml_status

logger = logging.getLogger("tierkv.engine")

T = TypeVar("T")

FILL_QUEUE = "fill-queue"
"""Where a chunk is that was acknowledged but not yet written to the tiers below (level -1)."""

_OFFLOAD_COPY_BYTES = 4 << 20
_FILL_BATCH_BYTES = 256 << 20


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
    """Best-effort close of a tier built before a later tier failed to start."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    try:
        if loop is None:
            asyncio.run(backend.close())
        else:
            loop.create_task(backend.close())
    except Exception:
        logger.exception("closing tier %r after a failed start-up", backend.name)


class TierRouter:
    """Routes batches of chunk keys across the tiers (see the module docstring); the base of
    :class:`~tierkv.AsyncEngine`, which adds prompts, keys and the cost-aware plan."""

    def __init__(self, config: EngineConfig, probes: Mapping[str, MemoryProbe] | None = None) -> None:
        self.config = config
        self.write_policy = config.write_policy
        self.tiers: list[StorageBackend] = build_tiers(config)
        self._promote = [tier.promote for tier in config.tiers]
        self._metrics = {tier.name: TierMetrics() for tier in self.tiers}
        self._speeds = {tier.name: TierSpeed(type(tier).speed_seed) for tier in self.tiers}
        self._speeds[FILL_QUEUE] = TierSpeed(HOST_MEMORY_SEED)  # acknowledged chunks still in host memory
        health = config.health
        self._health = {tier.name: TierHealth(health.failure_threshold, health.retry_after_s) for tier in self.tiers}
        self._timeout = health.timeout_s
        self._full_retry_s = health.retry_after_s
        self._full: dict[str, tuple[float, str]] = {}  # tier -> (when it said full, what it said)
        self._fill = FillQueue(config.background.queue_bytes, config.background.when_full)
        self._inflight: dict[CacheKey, asyncio.Future[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._fill_worker: asyncio.Task[None] | None = None
        self._probes = dict(probes or {})
        self._pressure: dict[str, TierPressure] = {}
        self._nvml_state = nvml_status()
        self._copies = copies.CopyCounter()
        self._started = False
        self._closed = False
        if self.write_policy == "write_back":
            for level, tier in enumerate(self.tiers[:-1]):
                if hasattr(tier, "demote_sink"):
                    tier.demote_sink = functools.partial(self._demote, level)

    async def locate_keys(self, keys: Sequence[CacheKey]) -> list[int | None]:
        """Index of the highest tier holding each key; -1 for the fill queue; None if nowhere."""
        self._ensure_open()
        found: list[int | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            if not self._available(level):
                continue
            try:
                flags = await self._timed(tier.batched_contains([keys[i] for i in missing]))
            except Exception as exc:
                self._tier_failed(level, "contains", exc)
                continue
            # an answered contains is not a healthy tier: an index can answer while every read
            # fails, and resetting the failure streak here would never let the breaker trip
            missing = _place(found, missing, flags, level)
        return self._or_fill_queue(found, missing, keys)

    def _locate_nowait(self, keys: Sequence[CacheKey]) -> list[int | None] | None:
        """:meth:`locate_keys` from in-memory indexes only (reads shared state, changes nothing)."""
        now = time.monotonic()
        top: list[bool] | None = None
        if keys and self._health[self.tiers[0].name].available(now):
            top = self.tiers[0].batched_contains_nowait(keys)
            if top is None:
                return None
            if all(top):  # the common answer to a hit: every chunk in the top tier
                return [0] * len(keys)
        found: list[int | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            if level == 0:
                flags = top
            elif self._health[tier.name].available(now):
                flags = tier.batched_contains_nowait([keys[i] for i in missing])
                if flags is None:
                    return None
            else:
                flags = None
            if flags is None:
                continue
            missing = _place(found, missing, flags, level)
        return self._or_fill_queue(found, missing, keys)

    def _or_fill_queue(self, found: list[int | None], missing: list[int], keys: Sequence[CacheKey]
                       ) -> list[int | None]:
        """Mark the chunks no tier holds that are still waiting in the fill queue (level -1)."""
        for index in missing:
            if self._fill.pending(keys[index]) is not None:
                found[index] = -1
        return found

    def _locate_for_read(self, keys: Sequence[CacheKey]) -> list[int | None]:
        """Where to read each chunk from, without I/O: the highest tier whose in-memory index
        holds it; chunks no indexed tier holds go to the first available tier without an
        index (read directly: a miss there is a get that finds nothing), else the fill queue."""
        found: list[int | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        now = time.monotonic()
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            if not self._health[tier.name].available(now):
                continue
            flags = tier.batched_contains_nowait([keys[i] for i in missing])
            if flags is None:
                for index in missing:
                    if self._fill.pending(keys[index]) is not None:
                        found[index] = -1
                    else:
                        found[index] = level
                return found
            missing = _place(found, missing, flags, level)
        return self._or_fill_queue(found, missing, keys)

    async def _prefetch(self, keys: list[CacheKey]) -> None:
        try:
            await self._get_tiered(keys)
        finally:
            for key in keys:
                future = self._inflight.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(None)

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Store chunks per the write policy; returns how many were acknowledged.

        The call fails only when no tier took the batch; a tier that fails is counted,
        and skipped for a while after repeated failures.
        """
        self._ensure_open()
        await self._start()
        check_batch(keys, chunks)
        if not keys:
            return 0
        keys, chunks = list(keys), list(chunks)
        with copies.on_path(self._copies, "store"):
            self._copies.add_delivered("store", sum(c.nbytes for c in chunks))
            skipped: dict[str, str] = {}
            errors: list[BaseException] = []
            for level in range(len(self.tiers)):
                if not self._admits(level, skipped):
                    continue
                try:  # a cancellation waits for the put and its fill (see AsyncEngine.store_from)
                    return await ownership.finish(self._put_and_fill(level, keys, chunks))
                except Exception as exc:
                    errors.append(exc)
                    skipped[self.tiers[level].name] = _rejection(exc)
        raise self._no_tier_took(len(keys), skipped) from (errors[0] if errors else None)

    async def _put_and_fill(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> int:
        holds: list[Any] = []
        try:
            stored = await self._tier_put(level, keys, chunks, fill_holds=holds)
            await self._queue_fill(level, keys, chunks, [False] * len(chunks), holds)
        except BaseException:
            _release_all(holds)
            raise
        return stored

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Chunks for ``keys`` in order (None for misses), each from the highest tier holding it.

        Hits below the top tier are copied into the tiers above that promote.
        """
        self._ensure_open()
        await self._start()
        await self._await_inflight(keys)
        return await self._get_tiered(keys)

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by any tier (or waits in the fill queue)."""
        return [level is not None for level in await self.locate_keys(keys)]

    async def batched_delete(self, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys`` from every tier (after the background fills already queued have
        landed, so none writes a key back); returns how many (key, tier) copies were removed.

        A tier that fails is counted and skipped, as for reads: the call removes what it can.
        """
        self._ensure_open()
        await self._fill.join()
        removed = 0
        for level, tier in enumerate(self.tiers):
            if not self._available(level):
                continue
            for key in keys:
                try:
                    removed += bool(await self._timed(tier.delete(key)))
                except Exception as exc:
                    self._tier_failed(level, "delete", exc)
                    break
        return removed

    async def flush(self) -> None:
        """Wait until every background operation (fills, prefetches, demotions) has landed."""
        await self._fill.join()
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self._fill.join()

    async def close(self) -> None:
        """Flush, then close every tier. Idempotent."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        if self._fill_worker is not None:
            self._fill_worker.cancel()
            await asyncio.gather(self._fill_worker, return_exceptions=True)
        for pressure in self._pressure.values():
            await pressure.monitor.stop()
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception:
                logger.exception("closing tier %r", tier.name)

    def _tier_stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: the backend's own stats, the router's counters, health, speed and pressure."""
        tiers = {}
        for level, tier in enumerate(self.tiers):
            entry = {**tier.stats(), **self._metrics[tier.name].snapshot()}
            entry["corrupt_chunks"] = tier.counters.get("corrupt_chunks", 0) + self._metrics[tier.name].counters[
                "corrupt_chunks"]
            entry["health"] = self._health[tier.name].state()
            entry["promote"] = self._promote[level]
            entry["speed"] = self._speeds[tier.name].snapshot()
            full = self._full.get(tier.name)
            entry["full"] = None if full is None else {"for_s": round(time.monotonic() - full[0], 3), "error": full[1]}
            if tier.name in self._pressure:
                entry["pressure"] = self._pressure[tier.name].describe()
            tiers[tier.name] = entry
        return tiers

    async def _start(self) -> None:
        """Start the fill worker and the pressure monitors (needs the running loop)."""
        if self._started:
            return
        self._started = True
        self._fill_worker = asyncio.get_running_loop().create_task(self._run_fills())
        cfg = self.config.pressure
        for level, tier in enumerate(self.tiers):
            if not hasattr(tier, "set_capacity_limit"):
                continue
            device = getattr(tier, "device", torch.device("cpu"))
            is_gpu_tier = type(tier).__name__ == "GPUBackend"
            probe: MemoryProbe | None = self._probes.get(tier.name)
            reason = ""
            if probe is None:
                if is_gpu_tier:
                    probe, why = open_device_probe(str(device))
                    reason = "" if probe else f"nvml unavailable: {why}; static capacity"
                else:
                    probe = HostMemoryProbe()
            high, low = ((cfg.gpu_high_watermark, cfg.gpu_low_watermark) if is_gpu_tier
                         else (cfg.host_high_watermark, cfg.host_low_watermark))
            if reason:
                logger.info("tier %r: %s", tier.name, reason)
            state = TierPressure(self, level, high, low)
            state.monitor = PressureMonitor(probe, cfg.poll_interval_ms / 1000, state.on_reading, reason)
            self._pressure[tier.name] = state
            state.monitor.start()

    def _ensure_open(self) -> None:
        if self._closed:
            raise BackendClosedError("engine is closed")

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("background operation failed: %r", task.exception())

    def _available(self, level: int) -> bool:
        tier = self.tiers[level]
        if self._health[tier.name].available(time.monotonic()):
            return True
        self._metrics[tier.name].add("skipped_unhealthy")
        return False

    def _admits(self, level: int, skipped: dict[str, str] | None = None) -> bool:
        """Whether new chunks may be written to this tier now (healthy, not under pressure, not
        full); when not, why goes into ``skipped`` (tier name -> reason)."""
        name = self.tiers[level].name
        pressure = self._pressure.get(name)
        if pressure is not None and not pressure.admitting:
            self._metrics[name].add("skipped_pressure")
            if skipped is not None:
                skipped[name] = f"under memory pressure (capacity now {self.tiers[level].capacity_bytes} bytes)"
            return False
        full = self._full.get(name)
        if full is not None:
            now = time.monotonic()
            if now < full[0] + self._full_retry_s:  # bounded: then one put is let through to see
                if skipped is not None:
                    skipped[name] = (f"full for {now - full[0]:.1f}s (asked again in "
                                     f"{full[0] + self._full_retry_s - now:.1f}s): {full[1]}")
                return False
        if self._available(level):
            return True
        if skipped is not None:
            skipped[name] = self._unhealthy_reason(level)
        return False

    def _unhealthy_reason(self, level: int) -> str:
        health = self._health[self.tiers[level].name]
        now = time.monotonic()
        retry_at = health.retry_at if health.retry_at is not None else now
        return (f"unhealthy for {max(0.0, now - (retry_at - health.cooldown_s)):.1f}s after "
                f"{health.consecutive_failures} failures in a row (retried in {max(0.0, retry_at - now):.1f}s; "
                f"last error: {health.last_error})")

    def _no_tier_took(self, count: int, skipped: dict[str, str]) -> TierUnavailableError:
        """The error of a put no tier took: every tier and why it was skipped or failed."""
        reasons = "; ".join(f"{tier.name!r}: {skipped.get(tier.name, 'not tried')}" for tier in self.tiers)
        return TierUnavailableError(f"no tier took the {count} chunk(s): {reasons}")

    async def _timed(self, awaitable: Awaitable[T]) -> T:
        if self._timeout is None:
            return await awaitable
        return await asyncio.wait_for(awaitable, self._timeout)

    async def _timed_owned(self, awaitable: Awaitable[T], timeout: float | None = None, *,
                           run_to_end: bool = False) -> T:
        """``awaitable``, which copies into or out of memory it was lent, with a timeout
        (``timeout``, else the health timeout): a cancellation of the caller is delivered
        only once it stopped (:func:`tierkv.ownership.finish`; ``asyncio.wait_for`` alone stops
        waiting when it is cancelled again while it cancels). At the timeout it is cancelled
        and waited for, or with ``run_to_end`` (a backend whose worker threads outlive its
        cancelled coroutine) left to finish before the timeout is raised."""
        timeout = self._timeout if timeout is None else timeout
        if timeout is None:
            return await ownership.finish(awaitable)
        if run_to_end:
            awaitable = ownership.finish(awaitable)
        return await ownership.finish(asyncio.wait_for(awaitable, timeout))

    def _tier_failed(self, level: int, operation: str, exc: BaseException) -> None:
        tier = self.tiers[level]
        self._metrics[tier.name].add("errors")
        self._health[tier.name].record_failure(time.monotonic(), f"{operation}: {type(exc).__name__}: {exc}")
        logger.warning("tier %r: %s failed: %s: %s", tier.name, operation, type(exc).__name__, exc)

    async def _tier_put(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor] | None = None, *,
                        layouts: list[tuple[tuple[int, ...], torch.dtype]] | None = None,
                        write: Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]] | None = None,
                        fill_holds: list[Any] | None = None) -> int:
        """Put ``chunks`` into tier ``level`` (or, for an in-place tier, let ``write`` fill
        chunks of ``layouts`` in its memory), with timeout, metrics and health.

        ``fill_holds`` (write-through, an in-place tier): receives holds on the chunks taken
        at the moment they are committed, so no other store evicts them before their fill
        is queued (a chunk evicted then would be in no tier at all)."""
        tier = self.tiers[level]
        metrics = self._metrics[tier.name]
        started = time.perf_counter()
        if _in_place(tier) and write is None and chunks is not None:  # the tier's own copy, in place
            layouts, write = [(tuple(c.shape), c.dtype) for c in chunks], _copier(tier, keys, chunks)
        extra: dict[str, Any] = {}
        if fill_holds is not None and _in_place(tier) and self._fills_below(level):
            def on_commit() -> None:
                fill_holds.extend(tier.hold(keys, pin=False))  # type: ignore[attr-defined]
            extra["on_commit"] = on_commit
        try:
            if write is not None and layouts is not None:
                stored = await self._timed_owned(tier.put_with(keys, layouts, write, **extra))  # type: ignore[attr-defined]
                nbytes = sum(_nbytes(shape, dtype) for shape, dtype in layouts)
            else:
                assert chunks is not None  # one of the two forms is always given
                # the tier reads the chunks (a caller's tensor, held slabs) until the put stopped,
                # and a backend's worker thread may go on after its coroutine was cancelled: a
                # timeout or cancellation waits for the put's end before that memory goes back
                stored = await self._timed_owned(tier.batched_put(keys, chunks), run_to_end=True)
                nbytes = sum(c.nbytes for c in chunks)
        except TierFullError as exc:  # the tier's store is full: not admitting for a while, reads go on
            metrics.add("errors")
            if tier.name not in self._full:
                logger.warning("tier %r: full, not admitting for %.1fs: %s", tier.name, self._full_retry_s, exc)
            self._full[tier.name] = (time.monotonic(), str(exc))
            raise
        except CapacityError as exc:  # the tier is fine, the chunk just does not fit
            metrics.add("errors")
            logger.info("tier %r: %s", tier.name, exc)
            raise
        except Exception as exc:
            self._tier_failed(level, "put", exc)
            raise
        metrics.put_latency.observe(time.perf_counter() - started)
        self._health[tier.name].record_success()
        if self._full.pop(tier.name, None) is not None:
            logger.info("tier %r: admitting again (a put succeeded)", tier.name)
        metrics.add("puts", stored)
        metrics.add("bytes_in", nbytes)
        return stored

    async def _tier_get_into(self, level: int, keys: list[CacheKey], outs: list[torch.Tensor],
                             deadline: float | None = None, abandonable: bool = False) -> list[bool]:
        """``batched_get_into`` on tier ``level`` with timeout, metrics and health; errors are
        misses. At ``deadline`` the chunks not in yet are misses (counted apart: a slow tier
        is not a failing one).

        ``abandonable``: ``outs`` are staging buffers nobody else uses (kept alive by the
        tier's worker while it writes), so a timeout or cancellation may leave the read
        behind. Otherwise (a caller's memory, slabs) the read is waited for to its end."""
        tier = self.tiers[level]
        metrics = self._metrics[tier.name]
        timeout, by_deadline = self._timeout, False
        if deadline is not None:
            remaining = max(0.0, deadline - time.monotonic())
            if timeout is None or remaining < timeout:
                timeout, by_deadline = remaining, True
        if by_deadline and timeout is not None and timeout <= 0:  # past the deadline already: nothing is asked
            metrics.add("deadline_misses", len(keys))
            return [False] * len(keys)
        started = time.perf_counter()
        try:
            request = tier.batched_get_into(keys, outs)
            if abandonable:
                got = await (request if timeout is None else asyncio.wait_for(request, timeout))
            else:
                got = await self._timed_owned(request, timeout, run_to_end=True)
        except TimeoutError as exc:
            if by_deadline:
                metrics.add("deadline_misses", len(keys))
            else:
                self._tier_failed(level, "get", exc)
            return [False] * len(keys)
        except Exception as exc:
            self._tier_failed(level, "get", exc)
            return [False] * len(keys)
        metrics.get_latency.observe(time.perf_counter() - started)
        self._health[tier.name].record_success()
        self._count_read(level, len(got), [out for out, hit in zip(outs, got) if hit], started)
        return list(got)

    async def _tier_get(self, level: int, keys: list[CacheKey]) -> list[torch.Tensor | None]:
        tier = self.tiers[level]
        metrics = self._metrics[tier.name]
        started = time.perf_counter()
        try:
            got = await self._timed(tier.batched_get(keys))
        except ChunkFormatError:
            got = [await self._get_one_checked(level, key) for key in keys]
        except Exception as exc:
            self._tier_failed(level, "get", exc)
            return [None] * len(keys)
        metrics.get_latency.observe(time.perf_counter() - started)
        self._health[tier.name].record_success()
        self._count_read(level, len(got), [c for c in got if c is not None], started)
        return got

    def _count_read(self, level: int, asked: int, hits: Sequence[torch.Tensor], started: float) -> None:
        """Hits, misses and bytes of one read of tier ``level`` that began at ``started``
        (perf_counter), and a sample of the tier's speed for the cost model."""
        name = self.tiers[level].name
        nbytes = sum(chunk.nbytes for chunk in hits)
        metrics = self._metrics[name]
        metrics.add("hits", len(hits))
        metrics.add("misses", asked - len(hits))
        metrics.add("bytes_out", nbytes)
        if nbytes:
            self._speeds[name].observe(nbytes, time.perf_counter() - started)

    async def _get_one_checked(self, level: int, key: CacheKey) -> torch.Tensor | None:
        """Single get that turns an undecodable value into a miss, a delete and a count."""
        tier = self.tiers[level]
        try:
            return await tier.get(key)
        except ChunkFormatError as exc:
            self._metrics[tier.name].add("corrupt_chunks")
            logger.warning("tier %r: dropping corrupt chunk %s: %s", tier.name, key, exc)
            await tier.delete(key)
            return None

    async def _await_inflight(self, keys: Sequence[CacheKey], deadline: float | None = None) -> int:
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

    async def _get_tiered(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        results: list[torch.Tensor | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for level in range(len(self.tiers)):
            if not missing:
                break
            if not self._available(level):
                continue
            got = await self._tier_get(level, [keys[i] for i in missing])
            still: list[int] = []
            hits: list[int] = []
            for index, chunk in zip(missing, got):
                if chunk is None:
                    still.append(index)
                else:
                    results[index] = chunk
                    hits.append(index)
            if hits and level > 0:
                await self._promote_hits(level, [keys[i] for i in hits], [results[i] for i in hits])  # type: ignore[misc]
            missing = still
        for index in missing:  # acknowledged but not yet written below: serve the snapshot
            snapshot = self._fill.pending(keys[index])
            if snapshot is not None:
                results[index] = snapshot.clone()
        return results

    async def _promote_hits(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
        with copies.on_path(self._copies, "promote"):
            for target in policy.promotion_targets(level):
                if not self._promote[target] or not self._admits(target):
                    continue
                try:
                    await self._tier_put(target, keys, chunks)
                except Exception:
                    continue  # counted by _tier_put; the hit is still served
                self._metrics[self.tiers[target].name].add("promotions", len(keys))

    async def _demote(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
        """Demotion sink of tier ``level`` (write-back): the next tier that takes them holds them.

        Only dirty chunks are written: a chunk promoted from the target is still there
        (keys name content, so the copy there is the same bytes).
        """
        for target in range(level + 1, len(self.tiers)):
            if not self._admits(target):
                continue
            try:
                present = await self._timed(self.tiers[target].batched_contains(keys))
            except Exception as exc:
                self._tier_failed(target, "contains", exc)
                present = [False] * len(keys)
            dirty = [i for i, flag in enumerate(present) if not flag]
            if dirty:
                try:
                    await self._tier_put(target, [keys[i] for i in dirty], [chunks[i] for i in dirty])
                except Exception:
                    continue
            self._metrics[self.tiers[level].name].add("demotions", len(keys))  # moved below (clean ones were there)
            return
        raise TierUnavailableError(f"no tier below {self.tiers[level].name!r} could take {len(keys)} demoted chunk(s)")

    def _fills_below(self, level: int) -> bool:
        """Whether a put into tier ``level`` is copied to the tiers below it (write-through)."""
        return self.write_policy == "write_through" and level + 1 < len(self.tiers)

    async def _queue_fill(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor], owned: list[bool],
                          taken: list[Any] | None = None) -> None:
        """Write-through: queue copies of what tier ``level`` just took for the tiers below.

        From a memory tier the fill reads the tier's own copy, held since the commit
        (``taken``, from :meth:`_tier_put`'s ``fill_holds``), so it stays valid even if the
        tier evicts the chunk before the fill runs; otherwise chunks that are views of the
        caller's memory are snapshotted first, since the caller may reuse it.
        """
        if not self._fills_below(level):
            return
        below = list(range(level + 1, len(self.tiers)))
        release = None
        if _in_place(self.tiers[level]):
            if not taken:
                taken = list(self.tiers[level].hold(keys, pin=False))  # type: ignore[attr-defined]
            held = [(key, h) for key, h in zip(keys, taken) if h is not None]  # None only if the batch repeated it
            keys = [key for key, _ in held]
            holds = [h for _, h in held]
            chunks = [h.chunk for h in holds]

            def release() -> None:
                _release_all(holds)
        else:
            pairs = [(empty_host(tuple(c.shape), c.dtype), c) for c, mine in zip(chunks, owned) if not mine]
            await _copy_pairs_off_loop(pairs)
            fresh = iter(dst for dst, _ in pairs)
            chunks = [c if mine else next(fresh) for c, mine in zip(chunks, owned)]
        try:
            queued = await self._fill.put(FillJob(keys, chunks, below, release))
        except BaseException:  # cancelled while waiting for room: the job never got in
            if release is not None:
                release()
            raise
        if not queued:
            for target in below:
                self._metrics[self.tiers[target].name].add("dropped_fills", len(keys))

    async def _run_fills(self) -> None:
        while True:
            jobs = await self._fill.take(_FILL_BATCH_BYTES)
            try:
                keys = [k for job in jobs for k in job.keys]
                chunks = [c for job in jobs for c in job.chunks]
                # every level's put has stopped before the jobs' held slabs are released
                await ownership.gather(*(self._fill_level(level, keys, chunks) for level in jobs[0].levels))
            except Exception:
                logger.exception("background fill failed")
            finally:
                await self._fill.done(jobs)

    async def _fill_level(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
        if not self._admits(level):
            self._metrics[self.tiers[level].name].add("dropped_fills", len(keys))
            return
        with copies.on_path(self._copies, "fill"):
            try:
                await self._tier_put(level, keys, chunks)
            except Exception:
                self._metrics[self.tiers[level].name].add("dropped_fills", len(keys))
                return
            self._copies.add_delivered("fill", sum(c.nbytes for c in chunks))

    async def _read_held(self, level: int, keys: list[CacheKey], ranges: list[tuple[int, int]], indices: list[int],
                         sink: transfer.ChunkSink) -> list[bool]:
        """Copy chunks of an in-place tier straight from its (pinned) slabs into the sink."""
        tier = self.tiers[level]
        started = time.perf_counter()
        holds = tier.hold([keys[i] for i in indices], pin=True)  # type: ignore[attr-defined]
        try:
            hits = [h is not None and fits_destination(h.chunk, sink.chunk_shape(ranges[i][1] - ranges[i][0]),
                                                       sink.dtype) for i, h in zip(indices, holds)]
            work = [(h.chunk, ranges[i]) for i, h, hit in zip(indices, holds, hits) if hit and h is not None]
            await _off_loop(functools.partial(_read_all, sink, work),
                            sum(chunk.nbytes for chunk, _ in work))
            if level > 0 and work:
                await self._promote_hits(level, [keys[i] for i, hit in zip(indices, hits) if hit],
                                         [chunk for chunk, _ in work])
        finally:
            for hold in holds:
                if hold is not None:
                    hold.release()
        self._count_read(level, len(hits), [chunk for chunk, _ in work], started)
        return hits

    async def _read_chunks(self, keys: list[CacheKey], levels: list[int | None], ranges: list[tuple[int, int]],
                           sink: transfer.ChunkSink, caller_owned: bool, preloaded: torch.Tensor | None = None,
                           deadline: float | None = None) -> int:
        """Read each chunk into ``sink`` from the tier it was located in; the number of
        leading chunks delivered.

        First every tier reads the chunks located in it, all tiers at once; a chunk a tier
        turns out not to have is then asked of the tiers below, in order. A chunk goes
        straight into the sink's destination (one copy) unless the sink has none for it (an
        unaligned first chunk, per-layer tensors), or the tier streams before it verifies and
        the destination is the caller's, or the read may be abandoned (a deadline or a tier
        timeout): then it is read into a pooled chunk buffer and copied once it is in. Hits
        below the top tier are promoted.
        """
        done = [False] * len(keys)
        staged: dict[int, torch.Tensor] = {}
        if preloaded is not None:
            staged[0], done[0] = preloaded, True
        self._read_fill_queue([i for i in range(len(keys)) if levels[i] == -1], keys, ranges, sink, done)
        first_round: dict[int, list[int]] = {}
        for index in range(len(keys)):
            level = levels[index]
            if not done[index] and level is not None and level >= 0:
                first_round.setdefault(level, []).append(index)
        reads = [(level, asked) for level, asked in first_round.items() if self._available(level)]
        # ownership.gather, not asyncio.gather: a cancelled retrieve returns only once every
        # tier's read into the sink has stopped
        for (_, asked), got in zip(reads, await ownership.gather(
                *(self._read_level(level, asked, keys, ranges, sink, caller_owned, staged, deadline)
                  for level, asked in reads))):
            for index, hit in zip(asked, got):
                done[index] = hit
        # a chunk the top tier evicted after it was located may still wait in the fill queue
        self._read_fill_queue([i for i in range(len(keys)) if not done[i]], keys, ranges, sink, done)
        pending = [i for i in range(len(keys)) if not done[i]]
        for level in range(len(self.tiers)):  # second round: what a tier did not have, from the tiers below
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            asked = [i for i in pending if levels[i] is not None and levels[i] < level]  # type: ignore[operator]
            if not asked or not self._available(level):
                continue
            for index, hit in zip(asked, await self._read_level(level, asked, keys, ranges, sink, caller_owned,
                                                                  staged, deadline)):
                done[index] = hit
            pending = [i for i in pending if not done[i]]
        delivered = policy.first_missing(done)
        late = [(staged[i], ranges[i]) for i in sorted(staged) if i < delivered]
        if late:
            await _off_loop(functools.partial(_read_all, sink, late),
                            sum(chunk.nbytes for chunk, _ in late))
        return delivered

    def _read_fill_queue(self, indices: list[int], keys: list[CacheKey], ranges: list[tuple[int, int]],
                         sink: transfer.ChunkSink, done: list[bool]) -> None:
        """Copy the chunks ``indices`` that are acknowledged but not yet written below from the
        fill queue's copy, now (the fill may release those bytes at the next await)."""
        for index in indices:
            if done[index]:
                continue
            chunk = self._fill.pending(keys[index])
            start, end = ranges[index]
            if chunk is not None and fits_destination(chunk, sink.chunk_shape(end - start), sink.dtype):
                sink.read_from(chunk, start, end)
                done[index] = True

    async def _read_level(self, level: int, asked: list[int], keys: list[CacheKey], ranges: list[tuple[int, int]],
                          sink: transfer.ChunkSink, caller_owned: bool, staged: dict[int, torch.Tensor],
                          deadline: float | None) -> list[bool]:
        """Tier ``level`` reads chunks ``asked`` (into the sink, or into ``staged`` buffers); hits."""
        tier = self.tiers[level]
        requested = list(asked)
        hits: dict[int, bool] = {}
        if _in_place(tier):  # chunks the sink has no destination for are copied out of held slabs
            borrowed = [i for i in asked if sink.destination(*ranges[i]) is None]
            if borrowed:
                hits.update(zip(borrowed, await self._read_held(level, keys, ranges, borrowed, sink)))
                asked = [i for i in asked if i not in hits]
        if asked:
            may_abandon = (deadline is not None or self._timeout is not None) and not _in_place(tier)
            stage = may_abandon or (caller_owned and tier.streams_into_destination)
            targets = []
            for index in asked:
                start, end = ranges[index]
                target = None if stage else sink.destination(start, end)
                if target is None:
                    target = staged[index] = empty_host(sink.chunk_shape(end - start), sink.dtype)
                targets.append(target)
            got = await self._tier_get_into(level, [keys[i] for i in asked], targets, deadline, abandonable=stage)
            hits.update(zip(asked, got))
            for index, hit, target in zip(asked, got, targets):
                if not hit and staged.get(index) is target:
                    # a miss, or a read abandoned at the deadline that may still be writing: never
                    # reuse it, never copy it out (a later round reads the chunk afresh)
                    del staged[index]
            if level > 0 and any(got):
                await self._promote_hits(level, [keys[i] for i, hit in zip(asked, got) if hit],
                                         [t for t, hit in zip(targets, got) if hit])
        return [hits.get(i, False) for i in requested]


_IN_PLACE_TYPES: dict[type, bool] = {}


def _place(found: list[int | None], missing: list[int], flags: Sequence[bool], level: int) -> list[int]:
    """Record ``level`` for the ``missing`` chunks whose flag is set; the ones still missing."""
    still = []
    for index, flag in zip(missing, flags):
        if flag:
            found[index] = level
        else:
            still.append(index)
    return still


def _release_all(holds: Sequence[Any]) -> None:
    for hold in holds:
        if hold is not None:
            hold.release()


def _copier(tier: StorageBackend, keys: list[CacheKey], chunks: list[torch.Tensor]
            ) -> Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]]:
    """The writer of an in-place tier's put of ``chunks``: the tier's own copy into its slabs
    (later duplicates of a key win)."""
    latest = dict(zip(keys, chunks))

    async def write(views: dict[CacheKey, torch.Tensor]) -> None:
        await tier.copy_chunks([(view, latest[key].detach()) for key, view in views.items()])  # type: ignore[attr-defined]
    return write


def _rejection(exc: BaseException) -> str:
    """Why a tier did not take a put, for :class:`TierUnavailableError`."""
    if isinstance(exc, TierFullError):
        return f"full: {exc}"
    if isinstance(exc, CapacityError):
        return f"rejected the size: {exc}"
    return f"failed: {type(exc).__name__}: {exc}"


def _in_place(tier: StorageBackend) -> bool:
    """Whether ``tier`` keeps chunks in memory the engine may write and read in place."""
    kind = type(tier)
    if kind not in _IN_PLACE_TYPES:
        _IN_PLACE_TYPES[kind] = isinstance(tier, InPlaceTier)
    return _IN_PLACE_TYPES[kind]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * torch.empty((), dtype=dtype).element_size()


def _read_all(sink: transfer.ChunkSink, work: list[tuple[torch.Tensor, tuple[int, int]]]) -> None:
    """Copy each whole chunk into the sink at its token range."""
    for chunk, (start, end) in work:
        sink.read_from(chunk, start, end)


async def _off_loop(work: Callable[[], Any], nbytes: int) -> None:
    """Run a copy off the event loop when it is large, so other requests keep moving.

    The copy writes into memory handed to it (reserved slabs, the caller's ``out``, a paged
    cache): a cancellation is delivered only once the copy stopped (:func:`tierkv.ownership.in_thread`).
    """
    if nbytes > _OFFLOAD_COPY_BYTES:
        await ownership.in_thread(work)
    else:
        work()


async def _copy_pairs_off_loop(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    def copy_all() -> None:
        for dst, src in pairs:
            copy_into(dst, src)
    await _off_loop(copy_all, sum(dst.nbytes for dst, _ in pairs))
