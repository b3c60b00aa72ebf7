"""The prompt API: tokens in, KV out, across the tiers of the :class:`~tierkv.router.TierRouter` it holds.

``AsyncEngine`` cuts prompts into chunk keys (prefix-chained hashes), stores a prompt's KV
(each byte copied once, into the first tier that admits it), retrieves the cached prefix of
a prompt (into memory the caller owns, a fresh output, or a connector's paged cache), answers
lookups from in-memory indexes, and asks the cost model how much of a cached prefix is worth
loading. ``Engine`` (:mod:`tierkv.engine`) is its blocking facade.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tierkv import copies, kvlayout, policy, transfer
from tierkv.backend import StorageBackend
from tierkv.config import EngineConfig, load_config
from tierkv.errors import ConfigError
from tierkv.keys import KV_FORMATS, CacheKey, ChunkHasher, TokenIds, as_token_array
from tierkv.kvlayout import KVCache
from tierkv.memory import empty_host
from tierkv.metadata import EngineMetadata, KVShape
from tierkv.planner import PrefixPlan, RecomputeModel, load_everything, plan_prefix
from tierkv.pressure import MemoryProbe
from tierkv.router import TierRouter
from tierkv.tier import nbytes_of

__all__ = ["AsyncEngine", "EngineMetadata", "KVShape"]  # EngineMetadata lives in tierkv.metadata

logger = logging.getLogger("tierkv.engine")

_RECENT_KEYS = 1 << 15


class AsyncEngine:
    """Stores and retrieves KV caches of token prefixes across a stack of tiers (held by
    :attr:`router`, used through its public methods only).

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
        self._hasher = ChunkHasher(self.chunk_size)
        self._recent_keys: dict[str, CacheKey] = {}
        self.router = TierRouter(self.config, probes)
        self._recompute = RecomputeModel(self.config.recompute.tokens_per_s, self.config.recompute.curve or None)
        # (blob shape with 0 tokens, dtype) of the chunks seen last (or given as metadata.kv_shape):
        # sizes retrieve outputs, checks `out`, prices reads in the plan
        self._layout: tuple[tuple[int, ...], torch.dtype] | None = self.metadata.blob_layout()
        self._learning_layout = False
        try:  # the loop the engine runs on, for learning the layout from any thread
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._last_lookup: tuple[int, int, list[int | None], PrefixPlan] | None = None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], metadata: EngineMetadata | None = None) -> AsyncEngine:
        return cls(load_config(path), metadata)

    def _make_key(self, chunk_hash: str) -> CacheKey:
        meta = self.metadata
        return CacheKey(meta.fmt, meta.model_name, meta.world_size, meta.worker_id, chunk_hash)

    # -- the router's surface, for callers of the engine ---------------------------------------
    @property
    def tiers(self) -> list[StorageBackend]:
        """The tiers' backends, top (fastest) first."""
        return self.router.tiers

    @property
    def write_policy(self) -> str:
        return self.router.write_policy

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Store chunks under their keys (see :meth:`TierRouter.batched_put`); chunks acknowledged."""
        return await self.router.batched_put(keys, chunks)

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Chunks for ``keys`` in order, None for misses (see :meth:`TierRouter.batched_get`)."""
        return await self.router.batched_get(keys)

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by any tier (or waits in the fill queue)."""
        return await self.router.batched_contains(keys)

    async def batched_delete(self, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys`` from every tier; how many (key, tier) copies were removed."""
        return await self.router.batched_delete(keys)

    async def locate_keys(self, keys: Sequence[CacheKey]) -> list[int | None]:
        """Index of the highest tier holding each key; -1 for the fill queue; None if nowhere."""
        return await self.router.locate(keys)

    async def flush(self) -> None:
        """Wait until every background operation (fills, prefetches, demotions) has landed."""
        await self.router.flush()

    async def close(self) -> None:
        """Flush, then close every tier. Idempotent."""
        await self.router.close()

    # Names the SGLang page store (tierkv/integrations/sglang/pages.py) was written against
    # while the engine was a router subclass; they delegate to the router's public methods.
    def _ensure_open(self) -> None:
        self.router.ensure_open()

    async def _start(self) -> None:
        await self.router.start()

    async def _await_inflight(self, keys: Sequence[CacheKey], deadline: float | None = None) -> int:
        return await self.router.wait_inflight(keys, deadline)

    def _locate_nowait(self, keys: Sequence[CacheKey]) -> list[int | None] | None:
        return self.router.locate_nowait(keys)

    def _locate_for_read(self, keys: Sequence[CacheKey]) -> list[int | None]:
        return self.router.locate_for_read(keys)

    @property
    def _copies(self) -> copies.CopyCounter:
        return self.router.copies

    async def _read_chunks(self, keys: list[CacheKey], levels: Sequence[int | None], ranges: list[tuple[int, int]],
                           sink: transfer.ChunkSink, caller_owned: bool, preloaded: torch.Tensor | None = None,
                           deadline: float | None = None) -> int:
        return await self.router.read_into(keys, levels, ranges, sink, caller_owned=caller_owned,
                                           preloaded=preloaded, deadline=deadline)

    # -- prompts ------------------------------------------------------------------------------
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
        keys, ranges = await self.chunks_to_store(token_array, skip, skip_existing)
        if not keys:
            return 0
        return await self.store_from(keys, source, ranges)

    async def chunks_to_store(self, token_array: np.ndarray, skip: int, skip_existing: bool = True
                              ) -> tuple[list[CacheKey], list[tuple[int, int]]]:
        """Keys and token ranges of the chunks of a validated token array (:func:`as_token_array`)
        to store, from token ``skip`` (chunk-aligned) on; with ``skip_existing``, without the
        chunks already cached at the start."""
        keys = list(self._iter_keys(token_array))[skip // self.chunk_size :]
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
            self._layout = (kvlayout.with_tokens(source.chunk_shape(end - start), self.metadata.fmt, 0), source.dtype)
        return await self.router.put(keys, source, ranges)

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
        self.router.ensure_open()
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
        self.router.ensure_open()
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
        keys = keys[: await self.router.wait_inflight(keys, deadline)]
        levels = self.router.locate_for_read(keys)
        keys = keys[: policy.first_missing([level is not None for level in levels])]
        if plan and keys and self.cost_aware:
            prefix_plan = self._plan(levels[: len(keys)], num_tokens, first_chunk)
            keys = keys[: max(0, -(-prefix_plan.planned_tokens // self.chunk_size) - first_chunk)]
        ranges = transfer.chunk_ranges(skip - skip % self.chunk_size, num_tokens, self.chunk_size)[: len(keys)]
        hits = 0
        if keys:
            with copies.on_path(self.router.copies, "retrieve"):
                preloaded = None
                if sink is None:
                    sink, preloaded = await self._fresh_sink(keys, ranges, skip, deadline)
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

    async def lookup(self, tokens: TokenIds) -> int:
        """Length in tokens of the longest prefix of ``tokens`` cached in any tier.

        ``stats()["last_lookup"]`` says how many of those chunks each tier holds. The first
        chunk is located on its own: when no tier holds it (a new prompt), the rest of the
        prompt is neither hashed nor asked for.
        """
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        return self._record_lookup(token_array, await self._locate_prefix(token_array)).planned_tokens

    def lookup_nowait(self, tokens: TokenIds) -> int | None:
        """:meth:`lookup` answered at once from the tiers' in-memory indexes, from any thread;
        None when a tier available now needs I/O to answer (then use :meth:`lookup`)."""
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        levels = self._locate_prefix_nowait(token_array)
        return None if levels is None else self._record_lookup(token_array, levels).planned_tokens

    async def locate_prefix(self, tokens: TokenIds) -> list[str]:
        """The tier holding each chunk of the cached prefix of ``tokens`` (what :meth:`lookup`
        counts), highest first; ``"fill-queue"`` for a chunk only waiting to be written."""
        self.router.ensure_open()
        return self._tier_names(await self._locate_prefix(as_token_array(tokens)))

    def locate_prefix_nowait(self, tokens: TokenIds) -> list[str] | None:
        """:meth:`locate_prefix` from in-memory indexes, from any thread; None when that needs I/O."""
        self.router.ensure_open()
        levels = self._locate_prefix_nowait(as_token_array(tokens))
        return None if levels is None else self._tier_names(levels)

    def _tier_names(self, levels: list[int | None]) -> list[str]:
        prefix = levels[: policy.first_missing([level is not None for level in levels])]
        return [self._level_name(level) for level in prefix if level is not None]

    def _level_name(self, level: int) -> str:
        return self.router.level_name(level)

    async def _locate_prefix(self, token_array: np.ndarray) -> list[int | None]:
        keys = self._iter_keys(token_array)
        levels = await self.router.locate(list(itertools.islice(keys, 1)))
        if levels and levels[0] is not None:
            levels += await self.router.locate(list(keys))
        return levels

    def _locate_prefix_nowait(self, token_array: np.ndarray) -> list[int | None] | None:
        keys = self._iter_keys(token_array)
        levels = self.router.locate_nowait(list(itertools.islice(keys, 1)))
        if levels and levels[0] is not None:
            rest = self.router.locate_nowait(list(keys))
            levels = None if rest is None else levels + rest
        return levels

    def _record_lookup(self, token_array: np.ndarray, levels: list[int | None]) -> PrefixPlan:
        """The length a scheduler should count as cached: the planned prefix (see :meth:`plan`)."""
        num_tokens = len(token_array)
        if self._layout is None and levels and levels[0] is not None and levels[0] >= 0:
            self._learn_layout_soon(next(self._iter_keys(token_array)), levels[0])
        hit_chunks = policy.first_missing([level is not None for level in levels])
        cached = min(hit_chunks * self.chunk_size, num_tokens)
        prefix_plan = self._plan(levels[:hit_chunks], num_tokens)
        self._last_lookup = (num_tokens, cached, levels[:hit_chunks], prefix_plan)
        return prefix_plan

    def _last_lookup_summary(self) -> dict[str, Any] | None:
        if self._last_lookup is None:
            return None
        num_tokens, cached, levels, prefix_plan = self._last_lookup
        per_tier = {tier.name: 0 for tier in self.tiers}
        for level in levels:
            if level is not None and level >= 0:
                per_tier[self.router.level_name(level)] += 1
        return {"tokens": num_tokens, "cached_tokens": cached, "chunks_per_tier": per_tier,
                "plan": prefix_plan.summary()}

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
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        levels = self._locate_prefix_nowait(token_array)
        if levels is None:
            return None
        return self._record_lookup(token_array, levels)

    async def plan(self, tokens: TokenIds) -> PrefixPlan:
        """How much of the cached prefix of ``tokens`` is worth loading: for each prefix length,
        the expected fetch time (the tiers holding its chunks, at their measured speeds, read in
        parallel) against the recompute time it saves; the best length wins. Without a known
        recompute speed (or with ``cost_aware: false``) the plan is the whole cached prefix."""
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        return self._record_lookup(token_array, await self._locate_prefix(token_array))

    def _plan(self, levels: Sequence[int | None], num_tokens: int, first_chunk: int = 0) -> PrefixPlan:
        """The plan for the cached chunks at ``levels``, which start at chunk ``first_chunk`` of
        the prompt (the chunks before it are the caller's already: not loaded, not counted)."""
        base = min(first_chunk * self.chunk_size, num_tokens)
        names = [self._level_name(level) for level in levels if level is not None]
        sizes = [min(self.chunk_size, num_tokens - (first_chunk + i) * self.chunk_size) for i in range(len(names))]
        if not self.cost_aware:
            return load_everything(names, sizes, "cost_aware is off" if self.config.cost_aware is False else
                                   "no recompute speed known (recompute: in the config, or measured prefills)", base)
        bytes_per_token = self._bytes_per_token()
        speeds = self.router.speeds()
        if bytes_per_token is None:
            # the bytes are not known yet, but each read's fixed cost is: if even reads of a
            # byte per token lose to recomputing, so do the real ones
            floor = plan_prefix(names, sizes, 1.0, speeds, self._recompute, base)
            if floor.planned_tokens == base:
                return floor
            return load_everything(names, sizes, "chunk size in bytes not known yet (nothing stored or read; "
                                   "give EngineMetadata.kv_shape to plan from the start)", base)
        return plan_prefix(names, sizes, bytes_per_token, speeds, self._recompute, base)

    def _bytes_per_token(self) -> float | None:
        if self._layout is None:
            return None
        shape, dtype = self._layout
        return float(nbytes_of(kvlayout.with_tokens(shape, self.metadata.fmt, 1), dtype))

    async def locate(self, tokens: TokenIds) -> list[str | None]:
        """For each chunk of ``tokens``, the name of the highest tier holding it (None if none)."""
        levels = await self.router.locate(self.keys_for(as_token_array(tokens)))
        return [None if level is None else self._level_name(level) for level in levels]

    async def prefetch(self, tokens: TokenIds) -> None:
        """Start moving the cached prefix of ``tokens`` up to the top tier; returns at once.

        A later retrieve of the same tokens waits only for the chunks still in flight.
        """
        self.router.ensure_open()
        keys = self.keys_for(as_token_array(tokens))
        levels = await self.router.locate(keys)
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
            "last_lookup": self._last_lookup_summary(),
            "cost_aware": self.cost_aware,
            "recompute": self._recompute.snapshot(),
            "copies": router["copies"],
            "tiers": router["tiers"],
        }

    async def _fresh_sink(self, keys: list[CacheKey], ranges: list[tuple[int, int]], skip: int,
                          deadline: float | None = None) -> tuple[transfer.BlobSink | None, torch.Tensor | None]:
        """The output of a retrieve without ``out``: allocated once, for the cached tokens.

        Its layout is that of the chunks seen last (or ``EngineMetadata.kv_shape``); when none
        is known yet (a fresh process over a persistent tier) the first chunk is read on its
        own to learn it, within ``deadline`` (past it, nothing is retrieved).
        """
        preloaded = None
        layout = self._layout
        if layout is None:
            first = self.router.get(keys[:1])
            try:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                # a fresh output of the tier's, not memory anyone lent it: safe to abandon
                preloaded = (await (first if remaining is None else asyncio.wait_for(first, remaining)))[0]
            except TimeoutError:
                return None, None
            if preloaded is None:
                return None, None
            layout = self._set_layout(preloaded)
        shape = kvlayout.with_tokens(layout[0], self.metadata.fmt, ranges[-1][1] - skip)
        return transfer.BlobSink(empty_host(shape, layout[1]), self.metadata.fmt, skip), preloaded


    def _set_layout(self, chunk: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        """Learn the layout from a chunk read; the layout."""
        self._layout = (kvlayout.with_tokens(tuple(chunk.shape), self.metadata.fmt, 0), chunk.dtype)
        return self._layout

    def _learn_layout_soon(self, key: CacheKey, level: int) -> None:
        """Read the chunk ``key`` of tier ``level`` in the background (once) to learn the layout;
        callable from any thread, never waits for the read."""
        try:
            self._loop = asyncio.get_running_loop()  # called on the loop: that is the engine's
        except RuntimeError:
            pass
        if self._learning_layout or self._loop is None or self._loop.is_closed():
            return
        self._learning_layout = True
        try:
            self._loop.call_soon_threadsafe(self.router.spawn, self._learn_layout(key, level))
        except RuntimeError:  # the loop stopped meanwhile
            self._learning_layout = False

    async def _learn_layout(self, key: CacheKey, level: int) -> None:
        try:
            chunk = (await self.router.get_from(level, [key]))[0]  # within the health timeout, if one is set
            if chunk is not None and self._layout is None:
                self._set_layout(chunk)
        finally:
            self._learning_layout = False
