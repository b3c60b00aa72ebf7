"""The prompt API: tokens in, KV out, across the tiers of the ``tierkv.routing.router.TierRouter`` it holds.

One module of about 680 lines, by choice: the prompt API (store, retrieve, lookup, locate,
stats), one class whose methods each carry their contract in their docstring; its key-level
calls (``key_calls``), its cost-model calls (``cost_calls``) and its hints (``hints``) are
mixins beside it, and the logic behind them lives in the modules beside it (chunk_layout,
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
from tierkv.engine.cost_calls import CostModelCalls
from tierkv.engine.hints import HintCalls, HintCounts
from tierkv.engine.key_calls import KeyLevelCalls
from tierkv.engine.metadata import EngineMetadata, KVShape, check_capacities
from tierkv.engine.prefix_plans import PrefixPlans
from tierkv.errors import ConfigError
from tierkv.policy import residency as policy
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


class AsyncEngine(KeyLevelCalls, CostModelCalls, HintCalls):
    """Stores and retrieves KV caches of token prefixes across a stack of tiers.

    The tiers are held by ``router`` (a ``tierkv.routing.router.TierRouter``), used through its
    public methods only. [Engine][tierkv.Engine] is the blocking facade over this class.

    Tiers are tried top (fastest) first. ``write_through``: a put is acknowledged when the
    first tier that admits it holds it, and the tiers below are filled in the background
    from a bounded queue. ``write_back``: a put goes to that tier only, and a chunk moves
    down when it is evicted (demoted). Either way a hit in a lower tier is copied up into
    the tiers above that have ``promote: true``. A tier that keeps failing is skipped for
    a while and retried; memory tiers shrink and stop admitting under memory pressure.

    Args:
        config: The configuration: an ``EngineConfig``, a mapping in the shape of the YAML
            file, or the path of a YAML file (read by [load_config][tierkv.load_config]).
        metadata: What the cached KV belongs to (model, revision, rank, KV format, KV shape);
            None: ``EngineMetadata.from_config(config)``.
        probes: Per tier name, the probe that reads the memory that tier lives in (memory
            pressure); a memory tier without one gets NVML on its CUDA device, or the
            host-memory probe.

    Raises:
        ConfigError: if the configuration is invalid, ``metadata`` names an unknown KV
            format, a tier's capacity cannot hold one chunk of ``metadata.kv_shape``, a
            tier fails to open, or ``TIERKV_LOG_LEVEL`` is not a level name.
        BackendNotFoundError: if a tier names a backend no installed distribution provides
            (a ``ConfigError``).
        BackendLoadError: if a tier's backend is found but cannot be imported.
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
        self.hint_counts = HintCounts()  # what retain / drop / prefetch did (tierkv.engine.hints)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], metadata: EngineMetadata | None = None) -> AsyncEngine:
        """An engine from a YAML config file (the format of ``tierkv.config``).

        Args:
            path: The YAML file.
            metadata: What the cached KV belongs to; None: derived from the config.

        Returns:
            The engine (``close`` it when done).

        Raises:
            ConfigError: if the file cannot be read, is not YAML or not a valid configuration,
                or a tier fails to open.
            BackendLoadError: if a tier's backend is found but cannot be imported.
        """
        return cls(load_config(path), metadata)

    # -- the router's surface, for callers of the engine ---------------------------------------
    @property
    def tiers(self) -> tuple[StorageBackend, ...]:
        """The tiers' backends, top (fastest) first (read-only; ``wrap_tier`` replaces one)."""
        return self.router.backends

    def wrap_tier(self, name: str, wrapper: Callable[[StorageBackend], B]) -> B:
        """Route every later call into tier ``name`` through ``wrapper(backend)``.

        For a fault injector, a throttle or a tracer. On a tier with a ``codec`` the wrapper
        goes under the codec: it sees the frames that are stored and moved, as the medium does.

        Args:
            name: The tier's name in the configuration.
            wrapper: Called once with the tier's backend; returns the backend to use in its
                place, which keeps the tier's ``name``.

        Returns:
            The backend ``wrapper`` returned, now in the tier's place.

        Raises:
            KeyError: if no tier is called ``name``.
            TypeError: if ``wrapper`` returns something that is not a ``StorageBackend``.
            ValueError: if the backend ``wrapper`` returns has another ``name``.
        """
        return self.router.wrap_tier(name, wrapper)

    @property
    def write_policy(self) -> str:
        """``"write_through"`` or ``"write_back"``, as configured."""
        return self.router.write_policy

    async def flush(self) -> None:
        """Wait until every background operation (fills, prefetches, demotions) has landed.

        Under write-back, also write every chunk a memory tier holds alone to the tier below,
        and return once they have landed (a persistent tier there keeps them across a crash).

        Raises:
            TierUnavailableError: under write-back, if no tier below took some dirty chunks
                (they stay in memory; a later flush tries again), or some left their tier
                before a tier below took them.
        """
        await self.router.flush()

    async def close(self, flush: bool = True) -> None:
        """Flush, then close every tier. Idempotent.

        Refuses new calls at once (they raise ``BackendClosedError``) and lets the running ones
        end first, up to the router's ``close_grace_s``. A flush that cannot write everything
        down is logged, and the tiers close anyway.

        Args:
            flush: Under write-back, write the chunks only a memory tier holds to the tier
                below first; False: close without (what only memory tiers hold is then lost).
        """
        await self.router.close(flush)

    # -- prompts ------------------------------------------------------------------------------
    def keys_for(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[CacheKey]:
        """The key of every chunk of ``tokens`` for a request of ``identity`` (no tier is asked).

        Args:
            tokens: The token ids: a 1-D tensor, sequence or numpy array of integers.
            identity: What else the request's KV depends on: its LoRA adapter, tenant salt and
                media (``tierkv.chunks.identity``); the default is a plain text request.

        Returns:
            One [CacheKey][tierkv.CacheKey] per chunk of ``chunk_size`` tokens, in order (the
                last one may cover a partial chunk).

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids in ``[0, 2**31 - 1]``.
        """
        return list(self._iter_keys(as_token_array(tokens), identity))

    def tail_keys(self, tokens: TokenIds, start_chunk: int, lengths: Sequence[int],
                  identity: RequestIdentity = PLAIN) -> list[CacheKey]:
        """The keys a partial chunk of ``tokens`` would have, cut at each of ``lengths`` tokens.

        Where an earlier, shorter prompt ended inside chunk ``start_chunk`` (a chat's previous
        turn), its last chunk was stored under a key over just its tokens; this names the keys
        of the candidate cuts without hashing the chunks before them again.

        Args:
            tokens: The prompt's token ids.
            start_chunk: The index of the partial chunk.
            lengths: Its candidate lengths in tokens, each in ``[1, chunk_size]``.
            identity: The request's identity, as given to ``store``.

        Returns:
            Per length, in order, the key ``keys_for(tokens[:start_chunk * chunk_size + length])``
                ends with.

        Raises:
            ValueError: if ``tokens`` is malformed or a length is out of range.
        """
        return self.key_maker.tail_keys(as_token_array(tokens), start_chunk, lengths, identity)

    def cut_key(self, tokens: TokenIds, end: int, identity: RequestIdentity = PLAIN) -> CacheKey:
        """The key of the partial chunk ``tokens[:end]`` ends with, ``end`` inside a chunk: where a
        save stored its prompt cut (a continuation tail), named alike by its lease, its drop and
        its KV event.

        Args:
            tokens: The prompt's token ids.
            end: Where the cut ends, inside a chunk.
            identity: The request's identity, as given to ``store``.

        Returns:
            The key ``keys_for(tokens[:end])`` ends with.

        Raises:
            ValueError: if ``tokens`` is malformed, or ``end`` lies on a chunk boundary or past them.
        """
        return self.key_maker.cut_key(as_token_array(tokens), end, identity)

    def _iter_keys(self, token_array: np.ndarray, identity: RequestIdentity = PLAIN) -> Iterator[CacheKey]:
        return self.key_maker.iter_keys(token_array, identity)

    def note_unidentified(self) -> None:
        """Count a request whose KV an integration cannot identify.

        E.g. a prompt given as embeddings: the integration neither stores nor loads its KV, and
        ``stats()["identity"]`` counts it.
        """
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

        Each byte is copied once, from ``kv`` into the first tier that takes it; lower tiers
        are filled from that copy in the background.

        Args:
            tokens: The prompt's token ids (a 1-D tensor, sequence or numpy array).
            kv: The KV of those tokens: one blob in the engine's ``kv_format``, or per-layer
                ``(K, V)`` pairs. With ``mask``, only the KV of the masked tokens.
            mask: A suffix mask over ``tokens`` (False for a prefix, True for the rest): only
                the True tokens are stored, and the number of False (skipped) tokens must be a
                multiple of the chunk size. None: every token.
            skip_existing: Leave out the chunks already cached at the start of the prompt.
            identity: What else the KV depends on (every prompt call takes it): the request's
                LoRA adapter, tenant salt and media (``RequestIdentity``); a chunk is only ever
                found again by a request of the same identity.

        Returns:
            The number of chunks written (0 when there was nothing to write).

        Raises:
            ValueError: if ``tokens``, ``mask`` or ``kv`` is malformed, ``kv`` holds another
                number of tokens than are to be stored, or its dtype is not the configured
                ``dtype``.
            TierUnavailableError: if no tier took the chunks (each full, failing or skipped as
                unhealthy) and some are cached nowhere.
            BackendClosedError: if the engine is closed, or closed under the call.
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
        """The keys and token ranges of the chunks of a prompt to store.

        Args:
            token_array: The prompt's token ids, already validated (``as_token_array``).
            skip: The first token to store (chunk-aligned): the chunks before it are left out.
            skip_existing: Also leave out the chunks already cached at the start of the prompt.
            identity: The request's identity.

        Returns:
            The keys and the ``[start, end)`` token range of each chunk to store.

        Raises:
            BackendClosedError: if the engine is closed (asked only with ``skip_existing``).
        """
        keys = list(self._iter_keys(token_array, identity))[skip // self.chunk_size :]
        ranges = transfer.chunk_ranges(skip, len(token_array), self.chunk_size)
        if skip_existing and keys:
            first = policy.first_missing(await self.router.batched_contains(keys))
            keys, ranges = keys[first:], ranges[first:]
        return keys, ranges

    async def store_from(self, keys: Sequence[CacheKey], source: transfer.ChunkSource,
                         ranges: Sequence[tuple[int, int]]) -> int:
        """Store the chunks ``source`` gives for token ``ranges`` under ``keys``.

        The first tier that admits the batch gets one copy of each byte, straight from the
        source (a memory tier lets the source write into its slabs in place); the tiers
        below are filled from that copy. Connectors call this with a paged-cache source.

        Args:
            keys: One key per chunk.
            source: Where the chunks' KV is read from (a ``tierkv.chunks.transfer.ChunkSource``,
                e.g. over a connector's paged cache).
            ranges: The ``[start, end)`` token range of each chunk in ``source``.

        Returns:
            The number of chunks written.

        Raises:
            TierUnavailableError: if no tier took the chunks and some are cached nowhere.
            BackendClosedError: if the engine is closed, or closed under the call.
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

        ``out`` receives the KV straight from the tiers, and the KV returned is a view of it;
        without ``out`` the KV is allocated once and filled straight from the tiers. Tokens of
        ``out`` past the returned mask are not meant to be read: they keep their old bytes,
        except where a chunk after a damaged or vanished one was read (then they hold that
        chunk's correct KV).

        With ``cost_aware`` (see ``plan``) only the part of the prefix that is faster to load
        than to recompute is read.

        Args:
            tokens: The prompt's token ids.
            mask: A suffix mask over ``tokens``: only the True tokens are returned. None: every
                token.
            return_tuple: Return the KV as per-layer ``(K, V)`` pairs; False: as one blob in
                the engine's ``kv_format``.
            out: Memory to retrieve into: a blob in the engine's ``kv_format`` holding the
                masked tokens, or per-layer ``(K, V)`` pairs. None: a new tensor is allocated.
            deadline_s: Seconds to wait: chunks that have not arrived by then are misses and the
                prefix that did arrive is returned (a stuck tier costs at most the deadline, and
                nothing read after it reaches ``out``). None: no limit.
            identity: The request's identity, as given to ``store``.

        Returns:
            A pair ``(kv, mask)``: the KV of the tokens retrieved and a boolean tensor over
                ``tokens``, True for each token retrieved. When nothing is retrieved the KV is an
                empty tuple, whatever ``return_tuple`` (what callers of the first version expect).

        Raises:
            ValueError: if ``tokens``, ``mask`` or ``out`` is malformed, or ``out`` is
                per-layer tensors that do not form one blob while ``return_tuple`` is False.
            BackendClosedError: if the engine is closed.
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
        """Retrieve the cached prefix of ``tokens`` into ``sink`` (a connector's paged cache).

        Chunks held by a memory tier are copied straight out of its slabs into the sink.

        Args:
            tokens: The prompt's token ids.
            sink: Where the chunks are written (a ``tierkv.chunks.transfer.ChunkSink``).
            mask: A suffix mask over ``tokens``: only the True tokens are retrieved. None:
                every token.
            deadline_s: Seconds to wait for chunks: one that has not arrived by then is a miss
                and ends the prefix. None: no limit.
            plan: Load only as much as the cost model says pays (with ``cost_aware``); False:
                all of the cached prefix (the caller, e.g. vLLM's scheduler, already decided).
            identity: The request's identity, as given to ``store``.

        Returns:
            A boolean tensor over ``tokens``, True for each token written into ``sink``.

        Raises:
            ValueError: if ``tokens`` or ``mask`` is malformed.
            BackendClosedError: if the engine is closed.
        """
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
        """Read the leading ``keys`` some tier holds into ``sink`` at token ``ranges``.

        The key-level read for callers that name chunks themselves (SGLang's pages): the same
        tiers, deadline and hit/miss accounting as ``retrieve``, without hashing tokens.
        Chunks after the delivered prefix may hold junk in ``sink``: the count is the contract
        (the caller's memory is not released while a tier still writes into it).

        Args:
            keys: The chunks' keys, in prompt order.
            ranges: The ``[start, end)`` token range of each chunk in ``sink``.
            sink: Where the chunks are written (a ``tierkv.chunks.transfer.ChunkSink``).
            deadline_s: Seconds to wait for chunks: one that has not arrived by then is a miss.
                None: no limit.

        Returns:
            How many leading chunks arrived (a damaged or late chunk is a miss and ends the
                prefix).

        Raises:
            BackendClosedError: if the engine is closed.
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
        """How many leading tokens of ``tokens`` to count as cached.

        The longest prefix cached in any tier, or with ``cost_aware`` the part of it worth
        loading (see ``plan``). ``stats()["last_lookup"]`` says how many of those chunks each
        tier holds. The first chunk is located on its own: when no tier holds it (a new
        prompt), the rest of the prompt is neither hashed nor asked for.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            A number of tokens, from 0 to ``len(tokens)``.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        return self._record_lookup(token_array, await self._prefix_levels(token_array, identity),
                                   identity).planned_tokens

    def lookup_nowait(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> int | None:
        """``lookup`` answered at once from the tiers' in-memory indexes, from any thread.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            What ``lookup`` returns, or None when a tier available now needs I/O to answer
                (then await ``lookup``).

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        levels = self._prefix_levels_nowait(token_array, identity)
        return None if levels is None else self._record_lookup(token_array, levels, identity).planned_tokens

    async def locate_prefix(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str]:
        """The tier holding each chunk of the longest cached prefix of ``tokens``.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            Per chunk of the prefix, in order, the name of the highest tier holding it
                (``"fill-queue"`` for a chunk only waiting to be written); empty when the first
                chunk is cached nowhere.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        self.router.ensure_open()
        return self._tier_names(await self._prefix_levels(as_token_array(tokens), identity))

    def locate_prefix_nowait(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str] | None:
        """``locate_prefix`` from in-memory indexes, from any thread.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            What ``locate_prefix`` returns, or None when that needs I/O.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        self.router.ensure_open()
        levels = self._prefix_levels_nowait(as_token_array(tokens), identity)
        return None if levels is None else self._tier_names(levels)

    def _tier_names(self, levels: Levels) -> list[str]:
        prefix = levels[: policy.first_missing([level is not None for level in levels])]
        return [name for name in self.router.names(prefix) if name is not None]

    async def locate(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str | None]:
        """Where each chunk of ``tokens`` is cached.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            Per chunk of ``tokens``, the name of the highest tier holding it (``"fill-queue"``
                for a chunk acknowledged and not yet written), or None where no tier does.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        return await self.locate_keys(self.keys_for(as_token_array(tokens), identity))

    def stats(self) -> dict[str, Any]:
        """Hit rate, the fill queue, memory pressure, and per-tier counters and occupancy.

        Also the last lookup's plan, the cost model's state, copy counts and the identities
        seen (``identity_stats``).

        Returns:
            A dict of plain values, safe to print or serve as JSON.
        """
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
            "hints": self.hint_counts.as_dict(),
        }

    def occupancy(self) -> dict[str, Any]:
        """What each tier holds per key scope (a model revision x adapter x tenant salt).

        A tier that cannot list its keys cheaply (s3, mooncake, fs) shows None; scopes this
        process never made keys in show no description (another process's tenants, or ``""``:
        keys of an older tierkv, never read now).

        Returns:
            ``{"tiers": {tier: {scope: {"chunks": n, "bytes": b}} or None}, "scopes": {scope:
                what it binds}}``, naming no key and no salt.
        """
        tiers = {backend.name: backend.scope_usage() for backend in self.tiers}
        labels = self.key_maker.scope_labels
        seen = {scope for usage in tiers.values() if usage for scope in usage}
        return {"tiers": tiers, "scopes": {scope: labels.get(scope, {}) for scope in sorted(seen)}}

    def identity_stats(self) -> dict[str, Any]:
        """The scopes this engine made keys in and the requests integrations could not identify.

        Returns:
            ``{"engine": ..., "scopes": ..., "unidentified_requests": n}``: the engine's identity
                parts, each scope's short digest and what it binds (never a salt), and the count
                ``note_unidentified`` keeps.
        """
        return {"engine": dict(self.metadata.identity_parts()), "scopes": dict(self.key_maker.scope_labels),
                "unidentified_requests": self.unidentified_requests}
