"""The engine: chunk keys in, tensors across tiers, tensors out.

``AsyncEngine`` is the asyncio core. ``Engine`` is the blocking facade with the same
methods, running one core on a private event-loop thread (the httpx Client /
AsyncClient pattern), so a serving engine without asyncio can call it directly.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from tierkv import kvlayout, policy, registry
from tierkv.backend import StorageBackend, check_batch
from tierkv.config import EngineConfig, load_config
from tierkv.errors import (
    BackendClosedError,
    CapacityError,
    ChunkFormatError,
    ConfigError,
    TierKVError,
    TierUnavailableError,
)
from tierkv.fill import FillJob, FillQueue
from tierkv.keys import KV_FORMATS, CacheKey, ChunkHasher, as_token_array
from tierkv.kvlayout import KVCache
from tierkv.memory import copy_into, empty_host
from tierkv.metrics import TierMetrics
from tierkv.policy import TierHealth
from tierkv.pressure import HostMemoryProbe, MemoryProbe, MemoryReading, PressureMonitor, open_device_probe

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Output assembly larger than this runs off the event loop so other requests keep moving.
_OFFLOAD_COPY_BYTES = 4 << 20
# A background fill writes up to this many bytes per batch (one LMDB transaction, say).
_FILL_BATCH_BYTES = 256 << 20


@dataclass(frozen=True)
class EngineMetadata:
    """Who is caching: the parts of every key that keep models and shards apart."""

    model_name: str
    world_size: int = 1
    worker_id: int = 0
    fmt: str = "vllm"

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineMetadata:
        return cls(config.model, config.world_size, config.worker_id, config.kv_format)


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


class AsyncEngine:
    """Stores and retrieves KV caches of token prefixes across a stack of tiers.

    Tiers are tried top (fastest) first. ``write_through``: a put is acknowledged when the
    first tier that admits it holds it, and the tiers below are filled in the background
    from a bounded queue. ``write_back``: a put goes to that tier only, and a chunk moves
    down when it is evicted (demoted). Either way a hit in a lower tier is copied up into
    the tiers above that have ``promote: true``. A tier that keeps failing is skipped for
    a while and retried; memory tiers shrink and stop admitting under memory pressure.
    """

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        metadata: EngineMetadata | None = None,
        probes: Mapping[str, MemoryProbe] | None = None,
    ) -> None:
        self.config = load_config(config)
        self.metadata = metadata or EngineMetadata.from_config(self.config)
        if self.metadata.fmt not in KV_FORMATS:
            raise ConfigError(f"kv_format: expected one of {list(KV_FORMATS)}, got {self.metadata.fmt!r}")
        self.chunk_size = self.config.chunk_size
        self.write_policy = self.config.write_policy
        self._hasher = ChunkHasher(self.chunk_size)
        self.tiers: list[StorageBackend] = build_tiers(self.config)
        self._promote = [tier.promote for tier in self.config.tiers]
        self._metrics = {tier.name: TierMetrics() for tier in self.tiers}
        health = self.config.health
        self._health = {tier.name: TierHealth(health.failure_threshold, health.retry_after_s) for tier in self.tiers}
        self._timeout = health.timeout_s
        self._fill = FillQueue(self.config.background.queue_bytes, self.config.background.when_full)
        self._inflight: dict[CacheKey, asyncio.Future[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._fill_worker: asyncio.Task[None] | None = None
        self._probes = dict(probes or {})
        self._pressure: dict[str, TierPressure] = {}
        self._nvml_state = nvml_status()
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._last_lookup: dict[str, Any] | None = None
        self._started = False
        self._closed = False
        if self.write_policy == "write_back":
            for level, tier in enumerate(self.tiers[:-1]):
                if hasattr(tier, "demote_sink"):
                    tier.demote_sink = functools.partial(self._demote, level)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], metadata: EngineMetadata | None = None) -> AsyncEngine:
        return cls(load_config(path), metadata)

    # -- keys ----------------------------------------------------------------------------
    def _make_key(self, chunk_hash: str) -> CacheKey:
        meta = self.metadata
        return CacheKey(meta.fmt, meta.model_name, meta.world_size, meta.worker_id, chunk_hash)

    def keys_for(self, tokens: torch.Tensor | Sequence[int] | np.ndarray) -> list[CacheKey]:
        """The key of every chunk of ``tokens`` (the last one may cover a partial chunk)."""
        return [self._make_key(h) for h in self._hasher.prefix_hashes(tokens)]

    # -- prompt-level API -------------------------------------------------------------
    async def store(
        self,
        tokens: torch.Tensor | Sequence[int],
        kv: KVCache,
        mask: torch.Tensor | None = None,
        skip_existing: bool = True,
    ) -> int:
        """Store the KV of ``tokens``; returns the number of chunks written.

        With a suffix ``mask``, ``kv`` holds only the masked tokens and the number of
        unmasked (skipped) tokens must be a multiple of the chunk size. With
        ``skip_existing``, chunks already cached at the start of the prompt are not
        written again.
        """
        self._ensure_open()
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = kvlayout.store_mask_skip(mask, num_tokens, self.chunk_size)
        blob = kvlayout.as_blob(kv, self.metadata.fmt)
        dim = kvlayout.token_dim(self.metadata.fmt)
        if blob.shape[dim] != num_tokens - skip:
            raise ValueError(
                f"KV holds {blob.shape[dim]} tokens (dim {dim} of {self.metadata.fmt} shape {tuple(blob.shape)}) but "
                f"{num_tokens - skip} tokens are to be stored ({num_tokens} tokens, {skip} masked out)"
            )
        if self.config.dtype is not None and blob.dtype != self.config.dtype:
            raise ValueError(f"KV dtype {blob.dtype} does not match the configured dtype {self.config.dtype}")
        keys = self.keys_for(token_array)[skip // self.chunk_size :]
        chunks = [blob.narrow(dim, start, min(self.chunk_size, blob.shape[dim] - start))
                  for start in range(0, blob.shape[dim], self.chunk_size)]
        if skip_existing and keys:
            first = policy.first_missing(await self.batched_contains(keys))
            keys, chunks = keys[first:], chunks[first:]
        if not keys:
            return 0
        return await self.batched_put(keys, chunks)

    async def retrieve(
        self,
        tokens: torch.Tensor | Sequence[int],
        mask: torch.Tensor | None = None,
        return_tuple: bool = True,
    ) -> tuple[Any, torch.Tensor]:
        """The cached KV of the longest cached prefix of ``tokens`` and a mask of the tokens it covers.

        With a suffix ``mask``, only the masked tokens are returned. When nothing is
        cached the KV is an empty tuple (as in the seed engine, whatever ``return_tuple``).
        """
        self._ensure_open()
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = kvlayout.suffix_mask_skip(mask, num_tokens)
        ret_mask = torch.zeros(num_tokens, dtype=torch.bool)
        keys = self.keys_for(token_array)[skip // self.chunk_size :]
        await self._await_inflight(keys)
        present = await self.batched_contains(keys)
        keys = keys[: policy.first_missing(present)]
        chunks = await self._get_tiered(keys) if keys else []
        found = [c for c in chunks[: policy.first_missing([c is not None for c in chunks])] if c is not None]
        usable = self._consistent_prefix(found)
        if not usable:
            self._miss_tokens += num_tokens - skip
            return (), ret_mask
        blob = await self._assemble(usable, skip % self.chunk_size)
        retrieved = blob.shape[kvlayout.token_dim(self.metadata.fmt)]
        ret_mask[skip : skip + retrieved] = True
        self._hit_tokens += retrieved
        self._miss_tokens += num_tokens - skip - retrieved
        return (kvlayout.as_tuple(blob) if return_tuple else blob), ret_mask

    async def lookup(self, tokens: torch.Tensor | Sequence[int]) -> int:
        """Length in tokens of the longest prefix of ``tokens`` cached in any tier.

        ``stats()["last_lookup"]`` says how many of those chunks each tier holds.
        """
        self._ensure_open()
        token_array = as_token_array(tokens)
        levels = await self.locate_keys(self.keys_for(token_array))
        hit_chunks = policy.first_missing([level is not None for level in levels])
        cached = min(hit_chunks * self.chunk_size, len(token_array))
        per_tier = {tier.name: 0 for tier in self.tiers}
        for level in levels[:hit_chunks]:
            if level is not None and level >= 0:
                per_tier[self.tiers[level].name] += 1
        self._last_lookup = {"tokens": len(token_array), "cached_tokens": cached, "chunks_per_tier": per_tier}
        return cached

    async def locate(self, tokens: torch.Tensor | Sequence[int]) -> list[str | None]:
        """For each chunk of ``tokens``, the name of the highest tier holding it (None if none)."""
        levels = await self.locate_keys(self.keys_for(as_token_array(tokens)))
        return [None if level is None else ("fill-queue" if level < 0 else self.tiers[level].name) for level in levels]

    async def prefetch(self, tokens: torch.Tensor | Sequence[int]) -> None:
        """Start moving the cached prefix of ``tokens`` up to the top tier; returns at once.

        A later retrieve of the same tokens waits only for the chunks still in flight.
        """
        self._ensure_open()
        await self._start()
        keys = self.keys_for(as_token_array(tokens))
        levels = await self.locate_keys(keys)
        prefix = keys[: policy.first_missing([level is not None for level in levels])]
        moving = [key for key, level in zip(prefix, levels) if level and key not in self._inflight]
        if not moving:
            return
        loop = asyncio.get_running_loop()
        for key in moving:
            self._inflight[key] = loop.create_future()
        self._spawn(self._prefetch(moving))

    async def _prefetch(self, keys: list[CacheKey]) -> None:
        try:
            await self._get_tiered(keys)
        finally:
            for key in keys:
                future = self._inflight.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(None)

    # -- key-level API --------------------------------------------------------------------
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
        errors: list[BaseException] = []
        for level in range(len(self.tiers)):
            if not self._admits(level):
                continue
            try:
                stored = await self._tier_put(level, keys, chunks)
            except Exception as exc:
                errors.append(exc)
                continue
            below = list(range(level + 1, len(self.tiers)))
            if self.write_policy == "write_through" and below:
                await self._queue_fill(keys, chunks, below)
            return stored
        if errors:
            raise errors[0]
        raise TierUnavailableError("no tier is available to take the chunks (all unhealthy or under pressure)")

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
            self._health[tier.name].record_success()
            still = []
            for index, flag in zip(missing, flags):
                if flag:
                    found[index] = level
                else:
                    still.append(index)
            missing = still
        for index in missing:
            if self._fill.pending(keys[index]) is not None:
                found[index] = -1
        return found

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

    def stats(self) -> dict[str, Any]:
        """Hit rate, the fill queue, memory pressure, and per-tier counters and occupancy."""
        total = self._hit_tokens + self._miss_tokens
        tiers = {}
        for level, tier in enumerate(self.tiers):
            entry = {**tier.stats(), **self._metrics[tier.name].snapshot()}
            entry["corrupt_chunks"] = tier.counters.get("corrupt_chunks", 0) + self._metrics[tier.name].counters[
                "corrupt_chunks"]
            entry["demotions"] = tier.counters.get("demotions", 0)
            entry["health"] = self._health[tier.name].state()
            entry["promote"] = self._promote[level]
            if tier.name in self._pressure:
                entry["pressure"] = self._pressure[tier.name].describe()
            tiers[tier.name] = entry
        return {
            "model": self.metadata.model_name,
            "chunk_size": self.chunk_size,
            "write_policy": self.write_policy,
            "hit_tokens": self._hit_tokens,
            "miss_tokens": self._miss_tokens,
            "hit_rate": self._hit_tokens / total if total else 0.0,
            "fill_queue": self._fill.stats(),
            "background_tasks": len(self._background),
            "inflight_prefetch_chunks": len(self._inflight),
            "pressure": {"nvml": self._nvml_state,
                         **{name: p.describe() for name, p in self._pressure.items()}},
            "last_lookup": self._last_lookup,
            "tiers": tiers,
        }

    # -- lifecycle ------------------------------------------------------------------------
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

    # -- tier access ------------------------------------------------------------------------
    def _available(self, level: int) -> bool:
        tier = self.tiers[level]
        if self._health[tier.name].available(time.monotonic()):
            return True
        self._metrics[tier.name].add("skipped_unhealthy")
        return False

    def _admits(self, level: int) -> bool:
        """Whether new chunks may be written to this tier now (healthy, not under pressure)."""
        pressure = self._pressure.get(self.tiers[level].name)
        if pressure is not None and not pressure.admitting:
            self._metrics[self.tiers[level].name].add("skipped_pressure")
            return False
        return self._available(level)

    async def _timed(self, awaitable: Awaitable[T]) -> T:
        if self._timeout is None:
            return await awaitable
        return await asyncio.wait_for(awaitable, self._timeout)

    def _tier_failed(self, level: int, operation: str, exc: BaseException) -> None:
        tier = self.tiers[level]
        self._metrics[tier.name].add("errors")
        self._health[tier.name].record_failure(time.monotonic(), f"{operation}: {type(exc).__name__}: {exc}")
        logger.warning("tier %r: %s failed: %s: %s", tier.name, operation, type(exc).__name__, exc)

    async def _tier_put(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> int:
        tier = self.tiers[level]
        metrics = self._metrics[tier.name]
        started = time.perf_counter()
        try:
            stored = await self._timed(tier.batched_put(keys, chunks))
        except CapacityError as exc:  # the tier is fine, the chunk just does not fit
            metrics.add("errors")
            logger.info("tier %r: %s", tier.name, exc)
            raise
        except Exception as exc:
            self._tier_failed(level, "put", exc)
            raise
        metrics.put_latency.observe(time.perf_counter() - started)
        self._health[tier.name].record_success()
        metrics.add("puts", stored)
        metrics.add("bytes_in", sum(c.numel() * c.element_size() for c in chunks))
        return stored

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
        hits = [c for c in got if c is not None]
        metrics.add("hits", len(hits))
        metrics.add("misses", len(got) - len(hits))
        metrics.add("bytes_out", sum(c.numel() * c.element_size() for c in hits))
        return got

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

    async def _await_inflight(self, keys: Sequence[CacheKey]) -> None:
        waiting = {id(f): f for f in (self._inflight.get(key) for key in keys) if f is not None}
        if waiting:
            await asyncio.gather(*waiting.values(), return_exceptions=True)

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
            if not dirty:
                return
            try:
                await self._tier_put(target, [keys[i] for i in dirty], [chunks[i] for i in dirty])
            except Exception:
                continue
            return
        raise TierUnavailableError(f"no tier below {self.tiers[level].name!r} could take {len(keys)} demoted chunk(s)")

    # -- background fills ---------------------------------------------------------------------
    async def _queue_fill(self, keys: list[CacheKey], chunks: list[torch.Tensor], levels: list[int]) -> None:
        snapshot = [empty_host(tuple(c.shape), c.dtype) for c in chunks]
        pairs = list(zip(snapshot, chunks))
        if sum(c.numel() * c.element_size() for c in chunks) > _OFFLOAD_COPY_BYTES:
            await asyncio.to_thread(_copy_pairs, pairs)
        else:
            _copy_pairs(pairs)
        if not await self._fill.put(FillJob(keys, snapshot, levels)):
            for level in levels:
                self._metrics[self.tiers[level].name].add("dropped_fills", len(keys))

    async def _run_fills(self) -> None:
        while True:
            jobs = await self._fill.take(_FILL_BATCH_BYTES)
            try:
                keys = [k for job in jobs for k in job.keys]
                chunks = [c for job in jobs for c in job.chunks]
                await asyncio.gather(*(self._fill_level(level, keys, chunks) for level in jobs[0].levels))
            except Exception:
                logger.exception("background fill failed")
            finally:
                await self._fill.done(jobs)

    async def _fill_level(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
        if not self._admits(level):
            self._metrics[self.tiers[level].name].add("dropped_fills", len(keys))
            return
        try:
            await self._tier_put(level, keys, chunks)
        except Exception:
            self._metrics[self.tiers[level].name].add("dropped_fills", len(keys))

    # -- output assembly ------------------------------------------------------------------
    def _consistent_prefix(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Chunks up to the first one whose layout disagrees with the first (a foreign value)."""
        if not chunks:
            return chunks
        dim = kvlayout.token_dim(self.metadata.fmt)
        ref = chunks[0]
        for index, chunk in enumerate(chunks):
            same = chunk.dim() == 5 and chunk.dtype == ref.dtype and all(
                chunk.shape[d] == ref.shape[d] for d in range(5) if d != dim
            )
            if not same or chunk.shape[dim] > self.chunk_size:
                logger.warning("chunk %d has layout %s %s, expected %s %s; stopping the prefix there",
                               index, tuple(chunk.shape), chunk.dtype, tuple(ref.shape), ref.dtype)
                return chunks[:index]
        return chunks

    async def _assemble(self, chunks: list[torch.Tensor], drop_first: int) -> torch.Tensor:
        dim = kvlayout.token_dim(self.metadata.fmt)
        pieces = [chunks[0].narrow(dim, drop_first, chunks[0].shape[dim] - drop_first), *chunks[1:]]
        shape = list(chunks[0].shape)
        shape[dim] = sum(p.shape[dim] for p in pieces)
        out = empty_host(tuple(shape), chunks[0].dtype)
        pairs = []
        offset = 0
        for piece in pieces:
            pairs.append((out.narrow(dim, offset, piece.shape[dim]), piece))
            offset += piece.shape[dim]
        if out.numel() * out.element_size() > _OFFLOAD_COPY_BYTES:
            await asyncio.to_thread(_copy_pairs, pairs)
        else:
            _copy_pairs(pairs)
        return out


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        copy_into(dst, src)


class TierPressure:
    """Pressure state of one memory tier: applies each reading's decision to the tier."""

    def __init__(self, engine: AsyncEngine, level: int, high: float, low: float) -> None:
        self.engine = engine
        self.level = level
        self.high = high
        self.low = low
        self.admitting = True
        self.pressured = False
        self.monitor: PressureMonitor
        self.demoted_bytes = 0
        self.shrinks = 0
        self.pressured_since: float | None = None
        self.last_relief_s: float | None = None  # time from crossing high to getting under low
        self._shrinking: asyncio.Task[None] | None = None

    def on_reading(self, reading: MemoryReading) -> None:
        tier = self.engine.tiers[self.level]
        configured = tier.capacity or 0
        decision = policy.pressure_decision(reading.used_fraction, reading.total, tier.used_bytes, configured,
                                            self.high, self.low, self.pressured)
        if decision.pressured and not self.pressured:
            self.pressured_since = reading.at
            logger.info("tier %r: memory pressure %.1f%% >= %.1f%%: not admitting, shrinking to %d bytes",
                        tier.name, 100 * reading.used_fraction, 100 * self.high, decision.capacity)
        if not decision.pressured and self.pressured and self.pressured_since is not None:
            self.last_relief_s = reading.at - self.pressured_since
            self.pressured_since = None
        self.pressured = decision.pressured
        self.admitting = decision.admitting
        tier.set_capacity_limit(decision.capacity)  # type: ignore[attr-defined]
        if tier.used_bytes > decision.capacity and (self._shrinking is None or self._shrinking.done()):
            self._shrinking = asyncio.get_running_loop().create_task(self._shrink())
            self.engine._background.add(self._shrinking)
            self._shrinking.add_done_callback(self.engine._background_done)

    async def _shrink(self) -> None:
        tier = self.engine.tiers[self.level]
        freed = await tier.shrink_to_limit()  # type: ignore[attr-defined]
        self.demoted_bytes += freed
        self.shrinks += 1

    def describe(self) -> dict[str, Any]:
        return {**self.monitor.describe(), "pressured": self.pressured, "admitting": self.admitting,
                "high_watermark": self.high, "low_watermark": self.low,
                "effective_capacity_bytes": self.engine.tiers[self.level].capacity_bytes,
                "freed_bytes": self.demoted_bytes, "shrinks": self.shrinks, "last_relief_s": self.last_relief_s}


def nvml_status() -> str:
    """Whether NVML can be used here, and if not, why (reported once in stats)."""
    try:
        import pynvml
    except ImportError:
        return "nvml unavailable: pynvml is not installed (pip install 'tierkv[nvml]')"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        return f"nvml unavailable: {exc}"
    return f"nvml ok: {count} device(s)"


class Engine:
    """Blocking facade over :class:`AsyncEngine`, running it on a private event-loop thread."""

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        metadata: EngineMetadata | None = None,
        probes: Mapping[str, MemoryProbe] | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierkv-engine", daemon=True)
        self._thread.start()
        try:
            self._core: AsyncEngine = self._run(self._create(config, metadata, probes))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _create(config: Any, metadata: EngineMetadata | None,
                      probes: Mapping[str, MemoryProbe] | None) -> AsyncEngine:
        return AsyncEngine(config, metadata, probes)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], metadata: EngineMetadata | None = None) -> Engine:
        return cls(load_config(path), metadata)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise BackendClosedError("engine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def config(self) -> EngineConfig:
        return self._core.config

    @property
    def metadata(self) -> EngineMetadata:
        return self._core.metadata

    @property
    def tiers(self) -> list[StorageBackend]:
        return self._core.tiers

    def keys_for(self, tokens: torch.Tensor | Sequence[int] | np.ndarray) -> list[CacheKey]:
        return self._core.keys_for(tokens)

    def store(self, tokens: torch.Tensor | Sequence[int], kv: KVCache, mask: torch.Tensor | None = None,
              skip_existing: bool = True) -> int:
        return self._run(self._core.store(tokens, kv, mask, skip_existing))

    def retrieve(self, tokens: torch.Tensor | Sequence[int], mask: torch.Tensor | None = None,
                 return_tuple: bool = True) -> tuple[Any, torch.Tensor]:
        return self._run(self._core.retrieve(tokens, mask, return_tuple))

    def lookup(self, tokens: torch.Tensor | Sequence[int]) -> int:
        return self._run(self._core.lookup(tokens))

    def prefetch(self, tokens: torch.Tensor | Sequence[int]) -> None:
        self._run(self._core.prefetch(tokens))

    def locate(self, tokens: torch.Tensor | Sequence[int]) -> list[str | None]:
        return self._run(self._core.locate(tokens))

    def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        return self._run(self._core.batched_put(keys, chunks))

    def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        return self._run(self._core.batched_get(keys))

    def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        return self._run(self._core.batched_contains(keys))

    def flush(self) -> None:
        self._run(self._core.flush())

    def stats(self) -> dict[str, Any]:
        return self._run(self._stats())

    async def _stats(self) -> dict[str, Any]:
        return self._core.stats()

    def close(self) -> None:
        """Flush background work, close every tier and stop the loop thread. Idempotent."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self._core.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EngineBuilder:
    """Process-wide named engines, as serving-engine connectors expect (one per worker)."""

    _instances: ClassVar[dict[str, Engine]] = {}
    _configs: ClassVar[dict[str, tuple[EngineConfig, EngineMetadata | None]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get_or_create(
        cls,
        instance_id: str,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        metadata: EngineMetadata | None = None,
    ) -> Engine:
        """The engine named ``instance_id``, built on first use.

        Raises ValueError when the id exists with a different configuration or metadata.
        """
        loaded = load_config(config)
        with cls._lock:
            if instance_id in cls._instances:
                if cls._configs[instance_id] != (loaded, metadata):
                    raise ValueError(f"engine {instance_id!r} already exists with a different configuration or metadata")
                return cls._instances[instance_id]
            engine = Engine(loaded, metadata)
            cls._instances[instance_id] = engine
            cls._configs[instance_id] = (loaded, metadata)
            return engine

    @classmethod
    def get(cls, instance_id: str) -> Engine | None:
        with cls._lock:
            return cls._instances.get(instance_id)

    @classmethod
    def destroy(cls, instance_id: str) -> None:
        """Close and forget the engine named ``instance_id`` (no-op when absent)."""
        with cls._lock:
            engine = cls._instances.pop(instance_id, None)
            cls._configs.pop(instance_id, None)
        if engine is not None:
            engine.close()
