"""The prompt API: tokens in, KV out, across the tiers of the ``tierkv.routing.router.TierRouter`` it holds.

One module of about 520 lines, by choice: it is the whole public prompt API, one class whose
methods each carry their contract in their docstring, plus the router's surface re-exposed for
callers of the engine; the logic behind them lives in the modules beside it (chunk_layout,
prefix_plans, metadata) and below.

``AsyncEngine`` cuts prompts into chunk keys (prefix-chained hashes), stores a prompt's KV
(each byte copied once, into the first tier that admits it), retrieves the cached prefix of
a prompt (into memory the caller owns, a fresh output, or a connector's paged cache), answers
lookups from in-memory indexes, and asks the cost model how much of a cached prefix is worth
loading. ``Engine`` (``tierkv.engine.blocking``) is its blocking facade.

What it builds on, each in its own module: keys (``tierkv.chunks.keys.KeyMaker``), the chunk
layout (``tierkv.engine.chunk_layout``), the plan (``tierkv.engine.prefix_plans``), and the router
(``tierkv.routing.router``), used through its public methods only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tierkv.backend.contract import StorageBackend
from tierkv.chunks import copies, kvlayout, transfer
from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.chunks.keys import KV_FORMATS, CacheKey, KeyMaker, TokenIds, as_token_array
from tierkv.chunks.kvlayout import KVCache, nbytes_of
from tierkv.config.loader import EngineConfig, load_config
from tierkv.engine.chunk_layout import ChunkLayout
from tierkv.engine.metadata import EngineMetadata, KVShape, check_capacities
from tierkv.engine.prefix_plans import PrefixPlans
from tierkv.errors import ConfigError
from tierkv.policy import residency as policy
from tierkv.policy.planner import PrefixPlan
from tierkv.policy.pressure import MemoryProbe
from tierkv.routing.locate import Levels
from tierkv.routing.router import TierRouter
from tierkv.tiers.tier import B

__all__ = ["AsyncEngine", "EngineMetadata", "KVShape"]  # EngineMetadata lives in tierkv.engine.metadata

logger = logging.getLogger("tierkv.engine")

def apply_log_level() -> None:
    """``TIERKV_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR, CRITICAL), when set: the level of
    tierkv's loggers (``tierkv.*`` and the built-in backends' ``tierkv_backends.*``)."""
    value = os.environ.get("TIERKV_LOG_LEVEL", "").strip()
    if not value:
        return
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ConfigError(f"TIERKV_LOG_LEVEL: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got {value!r}")
    for name in ("tierkv", "tierkv_backends"):
        logging.getLogger(name).setLevel(level)


class AsyncEngine:
    """Stores and retrieves KV caches of token prefixes across a stack of tiers (held by
    ``router``, used through its public methods only).

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
        apply_log_level()
        self.metadata = metadata or EngineMetadata.from_config(self.config)
        if self.metadata.fmt not in KV_FORMATS:
            raise ConfigError(f"kv_format: expected one of {list(KV_FORMATS)}, got {self.metadata.fmt!r}")
        self.chunk_size = self.config.chunk_size
        check_capacities(self.config, self.metadata)
        meta = self.metadata
        self.key_maker = KeyMaker(meta.fmt, meta.model_name, meta.world_size, meta.worker_id, self.chunk_size,
                                  engine_parts=meta.identity_parts())
        self.router = TierRouter(self.config, probes)
        # the chunks' (blob shape with 0 tokens, dtype): sizes outputs, checks `out`, prices reads
        self.layout = ChunkLayout(self.router, self.metadata.fmt, self.metadata.blob_layout())
        self.plans = PrefixPlans(self.router, self.layout, self.config)
        self._hit_tokens = 0
        self._miss_tokens = 0
        self.unidentified_requests = 0  # requests an integration neither stored nor loaded (see note_unidentified)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], metadata: EngineMetadata | None = None) -> AsyncEngine:
        return cls(load_config(path), metadata)

    # -- the router's surface, for callers of the engine ---------------------------------------
    @property
    def tiers(self) -> tuple[StorageBackend, ...]:
        """The tiers' backends, top (fastest) first (read-only; ``wrap_tier`` replaces one)."""
        return self.router.backends

    def wrap_tier(self, name: str, wrapper: Callable[[StorageBackend], B]) -> B:
        """Route every later call into tier ``name`` through ``wrapper(backend)`` (a fault
        injector, a throttle, a tracer) and return it; the wrapper keeps the tier's name."""
        return self.router.wrap_tier(name, wrapper)

    @property
    def write_policy(self) -> str:
        return self.router.write_policy

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Store chunks under their keys (see ``TierRouter.batched_put``); chunks acknowledged."""
        return await self.router.batched_put(keys, chunks)

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Chunks for ``keys`` in order, None for misses (see ``TierRouter.batched_get``)."""
        return await self.router.batched_get(keys)

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by any tier (or waits in the fill queue)."""
        return await self.router.batched_contains(keys)

    async def batched_delete(self, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys`` from every tier; how many (key, tier) copies were removed."""
        return await self.router.batched_delete(keys)

    async def locate_keys(self, keys: Sequence[CacheKey]) -> list[str | None]:
        """The name of the highest tier holding each key (``tierkv.routing.locate.FILL_QUEUE``
        for a chunk acknowledged and not yet written); None if nowhere."""
        return self.router.names(await self.router.levels(keys))

    def locate_keys_nowait(self, keys: Sequence[CacheKey]) -> list[str | None] | None:
        """``locate_keys`` from in-memory indexes, from any thread; None when a tier
        available now needs I/O to answer."""
        levels = self.router.levels_nowait(keys)
        return None if levels is None else self.router.names(levels)

    async def flush(self) -> None:
        """Wait until every background operation (fills, prefetches, demotions) has landed;
        under write-back, also write every chunk a memory tier holds alone to the tier below
        (returns once they have landed: a persistent tier there keeps them across a crash)."""
        await self.router.flush()

    async def close(self, flush: bool = True) -> None:
        """Flush, then close every tier. Idempotent. ``flush=False``: close without writing
        write-back's dirty chunks down (what only memory tiers hold is then lost)."""
        await self.router.close(flush)

    # -- prompts ------------------------------------------------------------------------------
    def keys_for(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[CacheKey]:
        """The key of every chunk of ``tokens`` (the last one may cover a partial chunk) of a
        request of ``identity`` (its LoRA adapter, tenant salt and media: ``tierkv.chunks.identity``)."""
        return list(self._iter_keys(as_token_array(tokens), identity))

    def _iter_keys(self, token_array: np.ndarray, identity: RequestIdentity = PLAIN) -> Iterator[CacheKey]:
        return self.key_maker.iter_keys(token_array, identity)

    def note_unidentified(self) -> None:
        """An integration saw a request whose KV it cannot identify (e.g. a prompt given as
        embeddings): it neither stores nor loads it, and ``stats()["identity"]`` counts it."""
        self.unidentified_requests += 1

    async def store(
        self,
        tokens: TokenIds,
        kv: KVCache,
        mask: torch.Tensor | None = None,
        skip_existing: bool = True,
        identity: RequestIdentity = PLAIN,
    ) -> int:
        """Store the KV of ``tokens``; returns the number of chunks written.

        ``identity`` (every prompt call takes it): what else the KV depends on, the request's
        LoRA adapter, tenant salt and media (``tierkv.chunks.identity.RequestIdentity``); a
        chunk is only ever found again by a request of the same identity.

        With a suffix ``mask``, ``kv`` holds only the masked tokens and the number of
        unmasked (skipped) tokens must be a multiple of the chunk size. With
        ``skip_existing``, chunks already cached at the start of the prompt are not
        written again. Each byte is copied once, from ``kv`` into the first tier that
        takes it; lower tiers are filled from that copy.
        """
        self.router.ensure_open()
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
        keys, ranges = await self.chunks_to_store(token_array, skip, skip_existing, identity)
        if not keys:
            return 0
        return await self.store_from(keys, source, ranges)

    async def chunks_to_store(self, token_array: np.ndarray, skip: int, skip_existing: bool = True,
                              identity: RequestIdentity = PLAIN) -> tuple[list[CacheKey], list[tuple[int, int]]]:
        """Keys and token ranges of the chunks of a validated token array (``as_token_array``)
        to store, from token ``skip`` (chunk-aligned) on; with ``skip_existing``, without the
        chunks already cached at the start."""
        keys = list(self._iter_keys(token_array, identity))[skip // self.chunk_size :]
        ranges = transfer.chunk_ranges(skip, len(token_array), self.chunk_size)
        if skip_existing and keys:
            first = policy.first_missing(await self.router.batched_contains(keys))
            keys, ranges = keys[first:], ranges[first:]
        return keys, ranges

    async def store_from(self, keys: Sequence[CacheKey], source: transfer.ChunkSource,
                         ranges: Sequence[tuple[int, int]]) -> int:
        """Store the chunks ``source`` gives for token ``ranges`` under ``keys``; chunks written.

        The first tier that admits the batch gets one copy of each byte, straight from the
        source (a memory tier lets the source write into its slabs in place); the tiers
        below are filled from that copy. Connectors call this with a paged-cache source.
        """
        self.router.ensure_open()
        if ranges:
            start, end = ranges[0]
            self.layout.from_chunk(source.chunk_shape(end - start), source.dtype)
        return await self.router.put(keys, source, ranges)

    async def retrieve(
        self,
        tokens: TokenIds,
        mask: torch.Tensor | None = None,
        return_tuple: bool = True,
        out: KVCache | None = None,
        deadline_s: float | None = None,
        identity: RequestIdentity = PLAIN,
    ) -> tuple[Any, torch.Tensor]:
        """The cached KV of the longest cached prefix of ``tokens`` and a mask of the tokens it covers.

        With a suffix ``mask``, only the masked tokens are returned. When nothing is
        cached the KV is an empty tuple (whatever ``return_tuple``: what callers of the first version expect).

        ``out`` (a blob in the engine's ``kv_format`` holding the masked tokens, or per-layer
        (K, V) pairs) receives the KV straight from the tiers, and the KV returned is a view
        of it; without ``out`` the KV is allocated once and filled straight from the tiers.
        Tokens of ``out`` past the returned mask are not meant to be read: they keep their
        old bytes, except where a chunk after a damaged or vanished one was read (then they
        hold that chunk's correct KV).

        With ``cost_aware`` (see ``plan``) only the part of the prefix that is faster to
        load than to recompute is read. ``deadline_s``: chunks that have not arrived after
        that many seconds are misses; the prefix that did arrive is returned (a stuck tier
        costs at most the deadline, and nothing read after it reaches ``out``).
        """
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = kvlayout.suffix_mask_skip(mask, num_tokens)
        fmt = self.metadata.fmt
        sink = None
        if out is not None:
            sink = transfer.sink_for(out, fmt, skip, num_tokens - skip, self.layout.value, self.config.dtype)
            if not return_tuple and isinstance(sink, transfer.TupleSink):
                raise ValueError("out is per-layer tensors that do not form one blob: pass return_tuple=True")
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        sink, retrieved, ret_mask = await self._retrieve_into(token_array, skip, sink, caller_owned=out is not None,
                                                              deadline=deadline, identity=identity)
        if not retrieved or sink is None:
            return (), ret_mask
        if isinstance(sink, transfer.TupleSink):
            return sink.narrowed(retrieved), ret_mask
        blob = sink.blob.narrow(kvlayout.token_dim(fmt), 0, retrieved)
        return (kvlayout.as_tuple(blob) if return_tuple else blob), ret_mask

    async def retrieve_to(self, tokens: TokenIds, sink: transfer.ChunkSink, mask: torch.Tensor | None = None,
                          deadline_s: float | None = None, plan: bool = True,
                          identity: RequestIdentity = PLAIN) -> torch.Tensor:
        """Retrieve the cached prefix of ``tokens`` into ``sink`` (a connector's paged cache);
        returns the mask of the tokens written. Chunks held by a memory tier are copied
        straight out of its slabs into the sink. ``plan=False``: load all of the cached prefix
        (the caller, e.g. vLLM's scheduler, already decided how much pays)."""
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        skip = kvlayout.suffix_mask_skip(mask, len(token_array))
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        _, _, ret_mask = await self._retrieve_into(token_array, skip, sink, caller_owned=True, deadline=deadline,
                                                   plan=plan, identity=identity)
        return ret_mask

    async def _held_prefix(self, keys: list[CacheKey], deadline: float | None
                           ) -> tuple[list[CacheKey], Levels]:
        """The leading ``keys`` some tier holds (after the stores in flight for them landed, or
        the deadline passed) and the level each of them was located in."""
        keys = keys[: await self.router.wait_inflight(keys, deadline)]
        levels = self.router.read_levels(keys)
        return keys[: policy.first_missing([level is not None for level in levels])], levels

    async def retrieve_keys_into(self, keys: Sequence[CacheKey], ranges: Sequence[tuple[int, int]],
                                 sink: transfer.ChunkSink, deadline_s: float | None = None) -> int:
        """Read the leading ``keys`` some tier holds into ``sink`` at token ``ranges``; how
        many leading chunks arrived (a damaged or late chunk is a miss and ends the prefix).

        The key-level read for callers that name chunks themselves (SGLang's pages): the
        same tiers, deadline and hit/miss accounting as ``retrieve``, without hashing
        tokens. Chunks after the delivered prefix may hold junk in ``sink``: the count is the
        contract (the caller's memory is not released while a tier still writes into it).
        """
        self.router.ensure_open()
        await self.router.start()
        keys = list(keys)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        held, levels = await self._held_prefix(keys, deadline)
        delivered = 0
        if held:
            with copies.on_path(self.router.copies, "retrieve"):
                # caller_owned=False: a tier that verifies after streaming may write straight into
                # a chunk whose check then fails; that chunk is reported missing
                delivered = await self.router.read_into(held, levels[: len(held)], list(ranges[: len(held)]), sink,
                                                        caller_owned=False, deadline=deadline)
        tokens = [end - start for start, end in ranges[: len(keys)]]
        hit = sum(tokens[:delivered])
        self._hit_tokens += hit
        self._miss_tokens += sum(tokens) - hit
        if hit:
            self.router.copies.add_delivered("retrieve", sum(nbytes_of(sink.chunk_shape(end - start), sink.dtype)
                                                             for start, end in ranges[:delivered]))
        return delivered

    async def _retrieve_into(self, token_array: np.ndarray, skip: int, sink: transfer.ChunkSink | None,
                             caller_owned: bool, deadline: float | None = None, plan: bool = True,
                             identity: RequestIdentity = PLAIN) -> tuple[Any, int, torch.Tensor]:
        """Locate the cached prefix and read it into ``sink`` (a fresh output when None);
        the sink, the number of tokens delivered and the mask of them.

        One pass over the tiers: tiers with an in-memory index say which chunks they hold,
        a tier without one is asked for the rest with gets (on S3 a miss is one GET answered
        404, never a HEAD first).
        """
        num_tokens = len(token_array)
        ret_mask = torch.zeros(num_tokens, dtype=torch.bool)
        first_chunk = skip // self.chunk_size
        keys, levels = await self._held_prefix(list(self._iter_keys(token_array, identity))[first_chunk:], deadline)
        if plan and keys and self.cost_aware:
            prefix_plan = self.plans.plan(self.router.names(levels[: len(keys)]), num_tokens, first_chunk)
            keys = keys[: max(0, -(-prefix_plan.planned_tokens // self.chunk_size) - first_chunk)]
        ranges = transfer.chunk_ranges(skip - skip % self.chunk_size, num_tokens, self.chunk_size)[: len(keys)]
        hits = 0
        if keys:
            with copies.on_path(self.router.copies, "retrieve"):
                preloaded = None
                if sink is None:
                    sink, preloaded = await self.layout.fresh_sink(keys, ranges, skip, deadline)
                if sink is not None:
                    hits = await self.router.read_into(keys, levels, ranges, sink, caller_owned=caller_owned,
                                                        preloaded=preloaded, deadline=deadline)
        retrieved = min(ranges[hits - 1][1], num_tokens) - skip if hits else 0
        self._miss_tokens += num_tokens - skip - retrieved
        if retrieved and sink is not None:
            ret_mask[skip : skip + retrieved] = True
            self._hit_tokens += retrieved
            self.router.copies.add_delivered("retrieve", retrieved * nbytes_of(sink.chunk_shape(1), sink.dtype))
        return sink, retrieved, ret_mask

    async def lookup(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> int:
        """Length in tokens of the longest prefix of ``tokens`` cached in any tier.

        ``stats()["last_lookup"]`` says how many of those chunks each tier holds. The first
        chunk is located on its own: when no tier holds it (a new prompt), the rest of the
        prompt is neither hashed nor asked for.
        """
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        return self._record_lookup(token_array, await self._prefix_levels(token_array, identity),
                                   identity).planned_tokens

    def lookup_nowait(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> int | None:
        """``lookup`` answered at once from the tiers' in-memory indexes, from any thread;
        None when a tier available now needs I/O to answer (then use ``lookup``)."""
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        levels = self._prefix_levels_nowait(token_array, identity)
        return None if levels is None else self._record_lookup(token_array, levels, identity).planned_tokens

    async def locate_prefix(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str]:
        """The tier holding each chunk of the cached prefix of ``tokens`` (what ``lookup``
        counts), highest first; ``"fill-queue"`` for a chunk only waiting to be written."""
        self.router.ensure_open()
        return self._tier_names(await self._prefix_levels(as_token_array(tokens), identity))

    def locate_prefix_nowait(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str] | None:
        """``locate_prefix`` from in-memory indexes, from any thread; None when that needs I/O."""
        self.router.ensure_open()
        levels = self._prefix_levels_nowait(as_token_array(tokens), identity)
        return None if levels is None else self._tier_names(levels)

    def _tier_names(self, levels: Levels) -> list[str]:
        prefix = levels[: policy.first_missing([level is not None for level in levels])]
        return [name for name in self.router.names(prefix) if name is not None]

    async def _prefix_levels(self, token_array: np.ndarray, identity: RequestIdentity) -> Levels:
        return await self.plans.prefix_levels(self._iter_keys(token_array, identity))

    def _prefix_levels_nowait(self, token_array: np.ndarray, identity: RequestIdentity) -> Levels | None:
        return self.plans.prefix_levels_nowait(self._iter_keys(token_array, identity))

    def _record_lookup(self, token_array: np.ndarray, levels: Levels,
                       identity: RequestIdentity) -> PrefixPlan:
        """The length a scheduler should count as cached: the planned prefix (see ``plan``)."""
        return self.plans.record(len(token_array), levels, lambda: next(self._iter_keys(token_array, identity)))

    @property
    def cost_aware(self) -> bool:
        """Whether a cached prefix is loaded only as far as that beats recomputing it
        (``cost_aware`` in the config, or as last set; by default, once a recompute speed is known)."""
        return self.plans.cost_aware

    @cost_aware.setter
    def cost_aware(self, value: bool | None) -> None:
        """Switch the policy at runtime (None: the default), keeping every measured speed."""
        self.plans.set_cost_aware(value)

    def observe_recompute(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """The serving model computed ``new_tokens`` after ``context_tokens`` cached ones in
        ``seconds``: refines the recompute speed the cost model uses (integrations call this
        around every prefill they run)."""
        self.plans.recompute.observe(new_tokens, context_tokens, seconds)

    def plan_nowait(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> PrefixPlan | None:
        """How much of the cached prefix of ``tokens`` is worth loading, from in-memory indexes
        (any thread); None when a tier needs I/O to answer (then use ``plan``)."""
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        levels = self._prefix_levels_nowait(token_array, identity)
        if levels is None:
            return None
        return self._record_lookup(token_array, levels, identity)

    async def plan(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> PrefixPlan:
        """How much of the cached prefix of ``tokens`` is worth loading: for each prefix length,
        the expected fetch time (the tiers holding its chunks, at their measured speeds, read in
        parallel) against the recompute time it saves; the best length wins. Without a known
        recompute speed (or with ``cost_aware: false``) the plan is the whole cached prefix."""
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        return self._record_lookup(token_array, await self._prefix_levels(token_array, identity), identity)

    def plan_located(self, tier_names: Sequence[str | None], num_tokens: int, first_chunk: int = 0) -> PrefixPlan:
        """The plan (see ``plan``) for cached chunks already located: ``tier_names`` holds
        the tier of each (as ``locate_keys`` answers), starting at chunk ``first_chunk``
        of a prompt of ``num_tokens`` tokens whose earlier chunks the caller already has (an
        integration that located a page range itself)."""
        return self.plans.plan(tier_names, num_tokens, first_chunk)

    async def locate(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str | None]:
        """For each chunk of ``tokens``, the name of the highest tier holding it (None if none)."""
        return await self.locate_keys(self.keys_for(as_token_array(tokens), identity))

    async def prefetch(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> None:
        """Start moving the cached prefix of ``tokens`` up to the top tier; returns at once.

        A later retrieve of the same tokens waits only for the chunks still in flight.
        """
        self.router.ensure_open()
        keys = self.keys_for(as_token_array(tokens), identity)
        levels = await self.router.levels(keys)
        held = policy.first_missing([level is not None for level in levels])
        await self.router.prefetch(keys[:held], levels[:held])

    def stats(self) -> dict[str, Any]:
        """Hit rate, the fill queue, memory pressure, and per-tier counters and occupancy."""
        total = self._hit_tokens + self._miss_tokens
        router = self.router.stats()
        return {
            "model": self.metadata.model_name,
            "chunk_size": self.chunk_size,
            "write_policy": self.write_policy,
            "hit_tokens": self._hit_tokens,
            "miss_tokens": self._miss_tokens,
            "hit_rate": self._hit_tokens / total if total else 0.0,
            "fill_queue": router["fill_queue"],
            "background_tasks": router["background_tasks"],
            "inflight_prefetch_chunks": router["inflight_prefetch_chunks"],
            "pressure": router["pressure"],
            "last_lookup": self.plans.last_lookup(),
            "cost_aware": self.cost_aware,
            "recompute": self.plans.recompute.snapshot(),
            "copies": router["copies"],
            "tiers": router["tiers"],
            "identity": self.identity_stats(),
        }

    def occupancy(self) -> dict[str, Any]:
        """What each tier holds per key scope (a model revision x adapter x tenant salt), as
        ``{"tiers": {tier: {scope: {"chunks", "bytes"}} or None}, "scopes": {scope: what it
        binds}}``, naming no key and no salt. A tier that cannot list its keys cheaply (s3,
        mooncake, fs) shows None; scopes this process never made keys in show no description
        (another process's tenants, or ``""``: keys of an older tierkv, never read now)."""
        tiers = {backend.name: backend.scope_usage() for backend in self.tiers}
        labels = self.key_maker.scope_labels
        seen = {scope for usage in tiers.values() if usage for scope in usage}
        return {"tiers": tiers, "scopes": {scope: labels.get(scope, {}) for scope in sorted(seen)}}

    def identity_stats(self) -> dict[str, Any]:
        """The scopes this engine made keys in (short digest -> what it binds, never a salt)
        and the requests integrations could not identify."""
        return {"engine": dict(self.metadata.identity_parts()), "scopes": dict(self.key_maker.scope_labels),
                "unidentified_requests": self.unidentified_requests}
