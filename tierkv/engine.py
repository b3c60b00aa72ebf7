"""The engine: chunk keys in, tensors across tiers, tensors out.

``AsyncEngine`` is the asyncio core. ``Engine`` is the blocking facade with the same
methods, running one core on a private event-loop thread (the httpx Client /
AsyncClient pattern), so a serving engine without asyncio can call it directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from tierkv import copies, kvlayout, policy, registry, transfer
from tierkv.backend import InPlaceTier, StorageBackend, check_batch, fits_destination
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
from tierkv.keys import KV_FORMATS, CacheKey, ChunkHasher, TokenIds, as_token_array
from tierkv.kvlayout import KVCache
from tierkv.memory import copy_into, empty_host
from tierkv.metrics import TierMetrics
from tierkv.planner import HOST_MEMORY_SEED, PrefixPlan, RecomputeModel, TierSpeed, load_everything, plan_prefix
from tierkv.policy import TierHealth
from tierkv.pressure import HostMemoryProbe, MemoryProbe, MemoryReading, PressureMonitor, open_device_probe

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Output assembly larger than this runs off the event loop so other requests keep moving.
_OFFLOAD_COPY_BYTES = 4 << 20
# A background fill writes up to this many bytes per batch (one LMDB transaction, say).
_FILL_BATCH_BYTES = 256 << 20
# Chunk keys kept for reuse by keys_for (a few MiB at most).
_RECENT_KEYS = 1 << 15


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
        self._recent_keys: dict[str, CacheKey] = {}
        self.tiers: list[StorageBackend] = build_tiers(self.config)
        self._promote = [tier.promote for tier in self.config.tiers]
        self._metrics = {tier.name: TierMetrics() for tier in self.tiers}
        self._speeds = {tier.name: TierSpeed(type(tier).speed_seed) for tier in self.tiers}
        self._speeds["fill-queue"] = TierSpeed(HOST_MEMORY_SEED)  # acknowledged chunks still in host memory
        self._recompute = RecomputeModel(self.config.recompute.tokens_per_s, self.config.recompute.curve or None)
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
        self._copies = copies.CopyCounter()
        # (blob shape with 0 tokens, dtype) of the chunks seen last: sizes retrieve outputs, checks `out`
        self._layout: tuple[tuple[int, ...], torch.dtype] | None = None
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._last_lookup: tuple[int, int, list[int | None], PrefixPlan] | None = None
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

    def keys_for(self, tokens: TokenIds) -> list[CacheKey]:
        """The key of every chunk of ``tokens`` (the last one may cover a partial chunk)."""
        return list(self._iter_keys(as_token_array(tokens)))

    def _iter_keys(self, token_array: np.ndarray) -> Iterator[CacheKey]:
        """Keys of a validated token array, made as they are needed.

        Keys of recently seen chunks are reused: a scheduler looks a prompt up, then
        retrieves it, and each tier asks a key for its string form.
        """
        recent = self._recent_keys
        for chunk_hash in self._hasher.iter_prefix_hashes(token_array):
            key = recent.get(chunk_hash)
            if key is None:
                if len(recent) >= _RECENT_KEYS:
                    recent.clear()
                key = recent[chunk_hash] = self._make_key(chunk_hash)
            yield key

    # -- prompt-level API -------------------------------------------------------------
    async def store(
        self,
        tokens: TokenIds,
        kv: KVCache,
        mask: torch.Tensor | None = None,
        skip_existing: bool = True,
    ) -> int:
        """Store the KV of ``tokens``; returns the number of chunks written.

        With a suffix ``mask``, ``kv`` holds only the masked tokens and the number of
        unmasked (skipped) tokens must be a multiple of the chunk size. With
        ``skip_existing``, chunks already cached at the start of the prompt are not
        written again. Each byte is copied once, from ``kv`` into the first tier that
        takes it; lower tiers are filled from that copy.
        """
        self._ensure_open()
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = kvlayout.store_mask_skip(mask, num_tokens, self.chunk_size)
        source = transfer.source_for(kv, self.metadata.fmt, skip)
        if source.num_tokens != num_tokens - skip:
            dim = kvlayout.token_dim(self.metadata.fmt)
            raise ValueError(
                f"KV holds {source.num_tokens} tokens (dim {dim} of the {self.metadata.fmt} layout "
                f"{kvlayout.layout_text(self.metadata.fmt)}) but {num_tokens - skip} tokens are to be stored "
                f"({num_tokens} tokens, {skip} masked out)"
            )
        if self.config.dtype is not None and source.dtype != self.config.dtype:
            raise ValueError(f"KV dtype {source.dtype} does not match the configured dtype {self.config.dtype}")
        keys = list(self._iter_keys(token_array))[skip // self.chunk_size :]
        ranges = transfer.chunk_ranges(skip, num_tokens, self.chunk_size)
        if skip_existing and keys:
            first = policy.first_missing(await self.batched_contains(keys))
            keys, ranges = keys[first:], ranges[first:]
        if not keys:
            return 0
        return await self.store_from(keys, source, ranges)

    async def store_from(self, keys: Sequence[CacheKey], source: transfer.ChunkSource,
                         ranges: Sequence[tuple[int, int]]) -> int:
        """Store the chunks ``source`` gives for token ``ranges`` under ``keys``; chunks written.

        The first tier that admits the batch gets one copy of each byte, straight from the
        source (a memory tier lets the source write into its slabs in place); the tiers
        below are filled from that copy. Connectors call this with a paged-cache source.
        """
        self._ensure_open()
        await self._start()
        keys, ranges = list(keys), list(ranges)
        layouts = [(source.chunk_shape(end - start), source.dtype) for start, end in ranges]
        self._layout = (kvlayout.with_tokens(layouts[0][0], self.metadata.fmt, 0), source.dtype)
        with copies.on_path(self._copies, "store"):
            self._copies.add_delivered("store", sum(_nbytes(shape, dtype) for shape, dtype in layouts))
            errors: list[BaseException] = []
            for level in range(len(self.tiers)):
                if not self._admits(level):
                    continue
                chunks: list[torch.Tensor] = []
                owned: list[bool] = []
                try:
                    if _in_place(self.tiers[level]):
                        stored = await self._tier_put(level, keys, layouts=layouts, write=_writer(source, keys, ranges))
                    else:
                        views = [source.view(start, end) for start, end in ranges]
                        owned = [view is None for view in views]
                        chunks = [view if view is not None else await _gathered(source, shape, rng)
                                  for view, (shape, _), rng in zip(views, layouts, ranges)]
                        stored = await self._tier_put(level, keys, chunks)
                except Exception as exc:
                    errors.append(exc)
                    continue
                await self._queue_fill(level, keys, chunks, owned)
                return stored
        if errors:
            raise errors[0]
        raise TierUnavailableError("no tier is available to take the chunks (all unhealthy or under pressure)")

    async def retrieve(
        self,
        tokens: TokenIds,
        mask: torch.Tensor | None = None,
        return_tuple: bool = True,
        out: KVCache | None = None,
        deadline_s: float | None = None,
    ) -> tuple[Any, torch.Tensor]:
        """The cached KV of the longest cached prefix of ``tokens`` and a mask of the tokens it covers.

        With a suffix ``mask``, only the masked tokens are returned. When nothing is
        cached the KV is an empty tuple (as in the seed engine, whatever ``return_tuple``).

        ``out`` (a blob in the engine's ``kv_format`` holding the masked tokens, or per-layer
        (K, V) pairs) receives the KV straight from the tiers, and the KV returned is a view
        of it; without ``out`` the KV is allocated once and filled straight from the tiers.
        Tokens of ``out`` past the returned mask are not meant to be read: they keep their
        old bytes, except where a chunk after a damaged or vanished one was read (then they
        hold that chunk's correct KV).

        With ``cost_aware`` (see :meth:`plan`) only the part of the prefix that is faster to
        load than to recompute is read. ``deadline_s``: chunks that have not arrived after
        that many seconds are misses; the prefix that did arrive is returned (a stuck tier
        costs at most the deadline, and nothing read after it reaches ``out``).
        """
        self._ensure_open()
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = kvlayout.suffix_mask_skip(mask, num_tokens)
        fmt = self.metadata.fmt
        sink = None
        if out is not None:
            sink = transfer.sink_for(out, fmt, skip, num_tokens - skip, self._layout, self.config.dtype)
            if not return_tuple and isinstance(sink, transfer.TupleSink):
                raise ValueError("out is per-layer tensors that do not form one blob: pass return_tuple=True")
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        sink, retrieved, ret_mask = await self._retrieve_into(token_array, skip, sink, caller_owned=out is not None,
                                                              deadline=deadline)
        if not retrieved or sink is None:
            return (), ret_mask
        if isinstance(sink, transfer.TupleSink):
            return sink.narrowed(retrieved), ret_mask
        blob = sink.blob.narrow(kvlayout.token_dim(fmt), 0, retrieved)
        return (kvlayout.as_tuple(blob) if return_tuple else blob), ret_mask

    async def retrieve_to(self, tokens: TokenIds, sink: transfer.ChunkSink, mask: torch.Tensor | None = None,
                          deadline_s: float | None = None, plan: bool = True) -> torch.Tensor:
        """Retrieve the cached prefix of ``tokens`` into ``sink`` (a connector's paged cache);
        returns the mask of the tokens written. Chunks held by a memory tier are copied
        straight out of its slabs into the sink. ``plan=False``: load all of the cached prefix
        (the caller, e.g. vLLM's scheduler, already decided how much pays)."""
        self._ensure_open()
        token_array = as_token_array(tokens)
        skip = kvlayout.suffix_mask_skip(mask, len(token_array))
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        _, _, ret_mask = await self._retrieve_into(token_array, skip, sink, caller_owned=True, deadline=deadline,
                                                   plan=plan)
        return ret_mask

    async def _retrieve_into(self, token_array: np.ndarray, skip: int, sink: transfer.ChunkSink | None,
                             caller_owned: bool, deadline: float | None = None, plan: bool = True
                             ) -> tuple[Any, int, torch.Tensor]:
        """Locate the cached prefix and read it into ``sink`` (a fresh output when None);
        the sink, the number of tokens delivered and the mask of them.

        One pass over the tiers: tiers with an in-memory index say which chunks they hold,
        a tier without one is asked for the rest with gets (on S3 a miss is one GET answered
        404, never a HEAD first).
        """
        num_tokens = len(token_array)
        ret_mask = torch.zeros(num_tokens, dtype=torch.bool)
        first_chunk = skip // self.chunk_size
        keys = list(self._iter_keys(token_array))[first_chunk:]
        keys = keys[: await self._await_inflight(keys, deadline)]
        levels = self._locate_for_read(keys)
        keys = keys[: policy.first_missing([level is not None for level in levels])]
        if plan and keys and self.cost_aware:
            chunk_levels: list[int | None] = [None] * first_chunk
            chunk_levels += levels[: len(keys)]
            prefix_plan = self._plan(chunk_levels, num_tokens, assume_cached=first_chunk)
            keys = keys[: max(0, -(-prefix_plan.planned_tokens // self.chunk_size) - first_chunk)]
        ranges = transfer.chunk_ranges(skip - skip % self.chunk_size, num_tokens, self.chunk_size)[: len(keys)]
        hits = 0
        if keys:
            with copies.on_path(self._copies, "retrieve"):
                preloaded = None
                if sink is None:
                    sink, preloaded = await self._fresh_sink(keys, ranges, skip)
                if sink is not None:
                    hits = await self._read_chunks(keys, levels, ranges, sink, caller_owned, preloaded, deadline)
        retrieved = min(ranges[hits - 1][1], num_tokens) - skip if hits else 0
        self._miss_tokens += num_tokens - skip - retrieved
        if retrieved and sink is not None:
            ret_mask[skip : skip + retrieved] = True
            self._hit_tokens += retrieved
            self._copies.add_delivered("retrieve", retrieved * _nbytes(sink.chunk_shape(1), sink.dtype))
        return sink, retrieved, ret_mask

    async def lookup(self, tokens: TokenIds) -> int:
        """Length in tokens of the longest prefix of ``tokens`` cached in any tier.

        ``stats()["last_lookup"]`` says how many of those chunks each tier holds. The first
        chunk is located on its own: when no tier holds it (a new prompt), the rest of the
        prompt is neither hashed nor asked for.
        """
        self._ensure_open()
        token_array = as_token_array(tokens)
        return self._record_lookup(len(token_array), await self._locate_prefix(token_array))

    def lookup_nowait(self, tokens: TokenIds) -> int | None:
        """:meth:`lookup` answered at once from the tiers' in-memory indexes, from any thread;
        None when a tier available now needs I/O to answer (then use :meth:`lookup`)."""
        self._ensure_open()
        token_array = as_token_array(tokens)
        levels = self._locate_prefix_nowait(token_array)
        return None if levels is None else self._record_lookup(len(token_array), levels)

    async def locate_prefix(self, tokens: TokenIds) -> list[str]:
        """The tier holding each chunk of the cached prefix of ``tokens`` (what :meth:`lookup`
        counts), highest first; ``"fill-queue"`` for a chunk only waiting to be written."""
        self._ensure_open()
        return self._tier_names(await self._locate_prefix(as_token_array(tokens)))

    def locate_prefix_nowait(self, tokens: TokenIds) -> list[str] | None:
        """:meth:`locate_prefix` from in-memory indexes, from any thread; None when that needs I/O."""
        self._ensure_open()
        levels = self._locate_prefix_nowait(as_token_array(tokens))
        return None if levels is None else self._tier_names(levels)

    def _tier_names(self, levels: list[int | None]) -> list[str]:
        prefix = levels[: policy.first_missing([level is not None for level in levels])]
        return ["fill-queue" if level == -1 else self.tiers[level].name for level in prefix]  # type: ignore[index]

    async def _locate_prefix(self, token_array: np.ndarray) -> list[int | None]:
        keys = self._iter_keys(token_array)
        levels = await self.locate_keys(list(itertools.islice(keys, 1)))
        if levels and levels[0] is not None:
            levels += await self.locate_keys(list(keys))
        return levels

    def _locate_prefix_nowait(self, token_array: np.ndarray) -> list[int | None] | None:
        keys = self._iter_keys(token_array)
        levels = self._locate_nowait(list(itertools.islice(keys, 1)))
        if levels and levels[0] is not None:
            rest = self._locate_nowait(list(keys))
            levels = None if rest is None else levels + rest
        return levels

    def _record_lookup(self, num_tokens: int, levels: list[int | None]) -> int:
        """The length a scheduler should count as cached: the planned prefix (see :meth:`plan`)."""
        hit_chunks = policy.first_missing([level is not None for level in levels])
        cached = min(hit_chunks * self.chunk_size, num_tokens)
        prefix_plan = self._plan(levels[:hit_chunks], num_tokens)
        self._last_lookup = (num_tokens, cached, levels[:hit_chunks], prefix_plan)
        return prefix_plan.planned_tokens

    def _last_lookup_summary(self) -> dict[str, Any] | None:
        if self._last_lookup is None:
            return None
        num_tokens, cached, levels, prefix_plan = self._last_lookup
        per_tier = {tier.name: 0 for tier in self.tiers}
        for level in levels:
            if level is not None and level >= 0:
                per_tier[self.tiers[level].name] += 1
        return {"tokens": num_tokens, "cached_tokens": cached, "chunks_per_tier": per_tier,
                "plan": prefix_plan.summary()}

    # -- cost-aware loading -----------------------------------------------------------------------
    @property
    def cost_aware(self) -> bool:
        """Whether a cached prefix is loaded only as far as that beats recomputing it
        (``cost_aware`` in the config; by default, once a recompute speed is known)."""
        if self.config.cost_aware is not None:
            return self.config.cost_aware
        return self._recompute.known

    def observe_recompute(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """The serving model computed ``new_tokens`` after ``context_tokens`` cached ones in
        ``seconds``: refines the recompute speed the cost model uses (integrations call this
        around every prefill they run)."""
        self._recompute.observe(new_tokens, context_tokens, seconds)

    def plan_nowait(self, tokens: TokenIds) -> PrefixPlan | None:
        """How much of the cached prefix of ``tokens`` is worth loading, from in-memory indexes
        (any thread); None when a tier needs I/O to answer (then use :meth:`plan`)."""
        self._ensure_open()
        token_array = as_token_array(tokens)
        levels = self._locate_prefix_nowait(token_array)
        if levels is None:
            return None
        self._record_lookup(len(token_array), levels)
        return self._last_lookup[3]  # type: ignore[index]

    async def plan(self, tokens: TokenIds) -> PrefixPlan:
        """How much of the cached prefix of ``tokens`` is worth loading: for each prefix length,
        the expected fetch time (the tiers holding its chunks, at their measured speeds, read in
        parallel) against the recompute time it saves; the best length wins. Without a known
        recompute speed (or with ``cost_aware: false``) the plan is the whole cached prefix."""
        self._ensure_open()
        token_array = as_token_array(tokens)
        self._record_lookup(len(token_array), await self._locate_prefix(token_array))
        return self._last_lookup[3]  # type: ignore[index]

    def _plan(self, levels: Sequence[int | None], num_tokens: int, assume_cached: int = 0) -> PrefixPlan:
        """The plan for cached chunks at ``levels`` (a prefix, from the prompt's first chunk);
        the first ``assume_cached`` chunks are the caller's already (not loaded, not counted)."""
        base = min(assume_cached * self.chunk_size, num_tokens)
        names = [("fill-queue" if level == -1 else self.tiers[level].name)  # type: ignore[index]
                 for level in levels[assume_cached:]]
        sizes = [min(self.chunk_size, num_tokens - (assume_cached + i) * self.chunk_size) for i in range(len(names))]
        if not self.cost_aware:
            return load_everything(names, sizes, "cost_aware is off" if self.config.cost_aware is False else
                                   "no recompute speed known (recompute: in the config, or measured prefills)", base)
        bytes_per_token = self._bytes_per_token()
        if bytes_per_token is None:
            return load_everything(names, sizes, "chunk size in bytes not known yet (nothing stored or read)", base)
        return plan_prefix(names, sizes, bytes_per_token, self._speeds, self._recompute, base)

    def _bytes_per_token(self) -> float | None:
        if self._layout is None:
            return None
        shape, dtype = self._layout
        return float(_nbytes(kvlayout.with_tokens(shape, self.metadata.fmt, 1), dtype))

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

    async def locate(self, tokens: TokenIds) -> list[str | None]:
        """For each chunk of ``tokens``, the name of the highest tier holding it (None if none)."""
        levels = await self.locate_keys(self.keys_for(as_token_array(tokens)))
        return [None if level is None else ("fill-queue" if level < 0 else self.tiers[level].name) for level in levels]

    async def prefetch(self, tokens: TokenIds) -> None:
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
        with copies.on_path(self._copies, "store"):
            self._copies.add_delivered("store", sum(c.numel() * c.element_size() for c in chunks))
            errors: list[BaseException] = []
            for level in range(len(self.tiers)):
                if not self._admits(level):
                    continue
                try:
                    stored = await self._tier_put(level, keys, chunks)
                except Exception as exc:
                    errors.append(exc)
                    continue
                await self._queue_fill(level, keys, chunks, [False] * len(chunks))
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
            entry["speed"] = self._speeds[tier.name].snapshot()
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
            "last_lookup": self._last_lookup_summary(),
            "cost_aware": self.cost_aware,
            "recompute": self._recompute.snapshot(),
            "copies": self._copies.snapshot(),
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

    async def _tier_put(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor] | None = None, *,
                        layouts: list[tuple[tuple[int, ...], torch.dtype]] | None = None,
                        write: Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]] | None = None) -> int:
        """Put ``chunks`` into tier ``level`` (or, for an in-place tier, let ``write`` fill
        chunks of ``layouts`` in its memory), with timeout, metrics and health."""
        tier = self.tiers[level]
        metrics = self._metrics[tier.name]
        started = time.perf_counter()
        try:
            if write is not None and layouts is not None:
                stored = await self._timed(tier.put_with(keys, layouts, write))  # type: ignore[attr-defined]
                nbytes = sum(_nbytes(shape, dtype) for shape, dtype in layouts)
            else:
                assert chunks is not None  # one of the two forms is always given
                stored = await self._timed(tier.batched_put(keys, chunks))
                nbytes = sum(c.numel() * c.element_size() for c in chunks)
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
        metrics.add("bytes_in", nbytes)
        return stored

    async def _tier_get_into(self, level: int, keys: list[CacheKey], outs: list[torch.Tensor],
                             deadline: float | None = None) -> list[bool]:
        """``batched_get_into`` on tier ``level`` with timeout, metrics and health; errors are
        misses. At ``deadline`` the chunks not in yet are misses (counted apart: a slow tier
        is not a failing one)."""
        tier = self.tiers[level]
        metrics = self._metrics[tier.name]
        timeout, by_deadline = self._timeout, False
        if deadline is not None:
            remaining = max(0.0, deadline - time.monotonic())
            if timeout is None or remaining < timeout:
                timeout, by_deadline = remaining, True
        started = time.perf_counter()
        try:
            request = tier.batched_get_into(keys, outs)
            got = await (request if timeout is None else asyncio.wait_for(request, timeout))
        except TimeoutError as exc:
            if by_deadline:
                metrics.add("deadline_misses", len(keys))
            else:
                self._tier_failed(level, "get", exc)
            return [False] * len(keys)
        except Exception as exc:
            self._tier_failed(level, "get", exc)
            return [False] * len(keys)
        seconds = time.perf_counter() - started
        metrics.get_latency.observe(seconds)
        self._health[tier.name].record_success()
        hits = sum(got)
        nbytes = sum(out.numel() * out.element_size() for out, hit in zip(outs, got) if hit)
        metrics.add("hits", hits)
        metrics.add("misses", len(got) - hits)
        metrics.add("bytes_out", nbytes)
        if hits:
            self._speeds[tier.name].observe(nbytes, seconds)
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
        seconds = time.perf_counter() - started
        metrics.get_latency.observe(seconds)
        self._health[tier.name].record_success()
        hits = [c for c in got if c is not None]
        nbytes = sum(c.numel() * c.element_size() for c in hits)
        metrics.add("hits", len(hits))
        metrics.add("misses", len(got) - len(hits))
        metrics.add("bytes_out", nbytes)
        if nbytes:
            self._speeds[tier.name].observe(nbytes, seconds)
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
            if not dirty:
                return
            try:
                await self._tier_put(target, [keys[i] for i in dirty], [chunks[i] for i in dirty])
            except Exception:
                continue
            return
        raise TierUnavailableError(f"no tier below {self.tiers[level].name!r} could take {len(keys)} demoted chunk(s)")

    # -- background fills ---------------------------------------------------------------------
    async def _queue_fill(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor], owned: list[bool]) -> None:
        """Write-through: queue copies of what tier ``level`` just took for the tiers below.

        From a memory tier the fill reads the tier's own copy (held, so it stays valid even
        if the tier evicts the chunk before the fill runs); otherwise chunks that are views
        of the caller's memory are snapshotted first, since the caller may reuse it.
        """
        below = list(range(level + 1, len(self.tiers)))
        if self.write_policy != "write_through" or not below:
            return
        release = None
        if _in_place(self.tiers[level]):
            held = [(key, h) for key, h in zip(keys, self.tiers[level].hold(keys, pin=False))  # type: ignore[attr-defined]
                    if h is not None]  # a key can only be missing if the batch repeated it
            keys = [key for key, _ in held]
            holds = [h for _, h in held]
            chunks = [h.chunk for h in holds]

            def release() -> None:
                for hold in holds:
                    hold.release()
        else:
            pairs = [(empty_host(tuple(c.shape), c.dtype), c) for c, mine in zip(chunks, owned) if not mine]
            await _copy_pairs_off_loop(pairs)
            fresh = iter(dst for dst, _ in pairs)
            chunks = [c if mine else next(fresh) for c, mine in zip(chunks, owned)]
        if not await self._fill.put(FillJob(keys, chunks, below, release)):
            for target in below:
                self._metrics[self.tiers[target].name].add("dropped_fills", len(keys))

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
        with copies.on_path(self._copies, "fill"):
            try:
                await self._tier_put(level, keys, chunks)
            except Exception:
                self._metrics[self.tiers[level].name].add("dropped_fills", len(keys))
                return
            self._copies.add_delivered("fill", sum(c.numel() * c.element_size() for c in chunks))

    # -- reading a prompt's chunks into a sink --------------------------------------------
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
                            sum(chunk.numel() * chunk.element_size() for chunk, _ in work))
            if level > 0 and work:
                await self._promote_hits(level, [keys[i] for i, hit in zip(indices, hits) if hit],
                                         [chunk for chunk, _ in work])
        finally:
            for hold in holds:
                if hold is not None:
                    hold.release()
        metrics = self._metrics[tier.name]
        nbytes = sum(chunk.numel() * chunk.element_size() for chunk, _ in work)
        metrics.add("hits", sum(hits))
        metrics.add("misses", len(hits) - sum(hits))
        metrics.add("bytes_out", nbytes)
        if nbytes:
            self._speeds[tier.name].observe(nbytes, time.perf_counter() - started)
        return hits

    async def _fresh_sink(self, keys: list[CacheKey], ranges: list[tuple[int, int]], skip: int
                          ) -> tuple[transfer.BlobSink | None, torch.Tensor | None]:
        """The output of a retrieve without ``out``: allocated once, for the cached tokens.

        Its layout is that of the chunks seen last; when none was seen yet (a fresh process
        over a persistent tier) the first chunk is read on its own to learn it.
        """
        preloaded = None
        if self._layout is None:
            preloaded = (await self._get_tiered(keys[:1]))[0]
            if preloaded is None:
                return None, None
            self._layout = (kvlayout.with_tokens(tuple(preloaded.shape), self.metadata.fmt, 0), preloaded.dtype)
        shape = kvlayout.with_tokens(self._layout[0], self.metadata.fmt, ranges[-1][1] - skip)
        return transfer.BlobSink(empty_host(shape, self._layout[1]), self.metadata.fmt, skip), preloaded

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
        for index in range(len(keys)):
            if levels[index] == -1 and not done[index]:  # acknowledged, not yet written below
                chunk = self._fill.pending(keys[index])
                start, end = ranges[index]
                if chunk is not None and fits_destination(chunk, sink.chunk_shape(end - start), sink.dtype):
                    sink.read_from(chunk, start, end)  # now: the fill may release those bytes at the next await
                    done[index] = True
        first_round: dict[int, list[int]] = {}
        for index in range(len(keys)):
            level = levels[index]
            if not done[index] and level is not None and level >= 0:
                first_round.setdefault(level, []).append(index)
        reads = [(level, asked) for level, asked in first_round.items() if self._available(level)]
        for (_, asked), got in zip(reads, await asyncio.gather(
                *(self._read_level(level, asked, keys, ranges, sink, caller_owned, staged, deadline)
                  for level, asked in reads))):
            for index, hit in zip(asked, got):
                done[index] = hit
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
                            sum(chunk.numel() * chunk.element_size() for chunk, _ in late))
        return delivered

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
                    target = staged.get(index)
                    if target is None:
                        target = staged[index] = empty_host(sink.chunk_shape(end - start), sink.dtype)
                targets.append(target)
            got = await self._tier_get_into(level, [keys[i] for i in asked], targets, deadline)
            hits.update(zip(asked, got))
            if level > 0 and any(got):
                await self._promote_hits(level, [keys[i] for i, hit in zip(asked, got) if hit],
                                         [t for t, hit in zip(targets, got) if hit])
        return [hits.get(i, False) for i in requested]


_IN_PLACE_TYPES: dict[type, bool] = {}


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
    """Run a copy off the event loop when it is large, so other requests keep moving."""
    if nbytes > _OFFLOAD_COPY_BYTES:
        await asyncio.to_thread(work)
    else:
        work()


async def _copy_pairs_off_loop(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    def copy_all() -> None:
        for dst, src in pairs:
            copy_into(dst, src)
    await _off_loop(copy_all, sum(dst.numel() * dst.element_size() for dst, _ in pairs))


def _writer(source: transfer.ChunkSource, keys: list[CacheKey], ranges: list[tuple[int, int]]
            ) -> Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]]:
    """Fills a memory tier's reserved chunks from ``source`` (one copy each)."""
    where = dict(zip(keys, ranges))

    async def write(views: dict[CacheKey, torch.Tensor]) -> None:
        def write_all() -> None:
            for key, view in views.items():
                source.write_into(view, *where[key])
        await _off_loop(write_all, sum(view.numel() * view.element_size() for view in views.values()))
    return write


async def _gathered(source: transfer.ChunkSource, shape: tuple[int, ...], rng: tuple[int, int]) -> torch.Tensor:
    """A pooled chunk buffer filled from ``source`` (for sources with no zero-copy view)."""
    chunk = empty_host(shape, source.dtype)
    await _off_loop(lambda: source.write_into(chunk, *rng), chunk.numel() * chunk.element_size())
    return chunk


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
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine of :attr:`core` on the engine's loop; returns at once with a future
        (an integration that overlaps tierkv work with its own, e.g. a save during the next
        forward pass)."""
        if not self._thread.is_alive():
            coro.close()
            raise BackendClosedError("engine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of :attr:`core` on the engine's loop and wait for its result."""
        return self._run(coro)

    @property
    def core(self) -> AsyncEngine:
        """The asyncio engine this facade drives (its coroutines go to :meth:`submit` / :meth:`run`)."""
        return self._core

    @property
    def config(self) -> EngineConfig:
        return self._core.config

    @property
    def metadata(self) -> EngineMetadata:
        return self._core.metadata

    @property
    def tiers(self) -> list[StorageBackend]:
        return self._core.tiers

    def keys_for(self, tokens: TokenIds) -> list[CacheKey]:
        return self._core.keys_for(tokens)

    def store(self, tokens: TokenIds, kv: KVCache, mask: torch.Tensor | None = None,
              skip_existing: bool = True) -> int:
        return self._run(self._core.store(tokens, kv, mask, skip_existing))

    def retrieve(self, tokens: TokenIds, mask: torch.Tensor | None = None, return_tuple: bool = True,
                 out: KVCache | None = None, deadline_s: float | None = None) -> tuple[Any, torch.Tensor]:
        return self._run(self._core.retrieve(tokens, mask, return_tuple, out, deadline_s))

    def lookup(self, tokens: TokenIds) -> int:
        """Answered on the calling thread from the tiers' in-memory indexes when they all have
        one (no hop to the engine's loop: a scheduler asks this for every request)."""
        cached = self._core.lookup_nowait(tokens)
        return cached if cached is not None else self._run(self._core.lookup(tokens))

    def plan(self, tokens: TokenIds) -> PrefixPlan:
        """Answered on the calling thread when every tier has an in-memory index (see lookup)."""
        planned = self._core.plan_nowait(tokens)
        return planned if planned is not None else self._run(self._core.plan(tokens))

    def observe_recompute(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        self._core.observe_recompute(new_tokens, context_tokens, seconds)

    @property
    def cost_aware(self) -> bool:
        return self._core.cost_aware

    def locate_prefix(self, tokens: TokenIds) -> list[str]:
        """Answered on the calling thread when every tier has an in-memory index (see lookup)."""
        names = self._core.locate_prefix_nowait(tokens)
        return names if names is not None else self._run(self._core.locate_prefix(tokens))

    def prefetch(self, tokens: TokenIds) -> None:
        self._run(self._core.prefetch(tokens))

    def locate(self, tokens: TokenIds) -> list[str | None]:
        return self._run(self._core.locate(tokens))

    def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        return self._run(self._core.batched_put(keys, chunks))

    def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        return self._run(self._core.batched_get(keys))

    def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        return self._run(self._core.batched_contains(keys))

    def batched_delete(self, keys: Sequence[CacheKey]) -> int:
        return self._run(self._core.batched_delete(keys))

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
