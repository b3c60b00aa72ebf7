"""The engine: chunk keys in, tensors across tiers, tensors out.

One module of about 770 lines, by choice: ``Engine`` mirrors the prompt and key-level methods
of ``AsyncEngine``, and each carries its whole contract (arguments, result, errors) in its
docstring, which the API reference renders; the logic behind them lives in
``tierkv.engine.async_engine`` and below.

``AsyncEngine`` (``tierkv.engine.async_engine``) is the asyncio core: the prompt API over the
tier router (``tierkv.routing.router``), with the cost model (``tierkv.policy.planner``). ``Engine``
here is the blocking facade with the same methods, running one core on a private
event-loop thread (the httpx Client / AsyncClient pattern), so a serving engine without
asyncio can call it directly; ``EngineBuilder`` keeps one engine per worker. The names
that used to live here (``AsyncEngine``, ``EngineMetadata``, ``build_tiers``,
``nvml_status``, ``TierPressure``) are still importable from this module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from tierkv.backend.contract import StorageBackend
from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.chunks.keys import CacheKey, TokenIds
from tierkv.chunks.kvlayout import KVCache
from tierkv.config.loader import EngineConfig, load_config
from tierkv.engine.async_engine import AsyncEngine, EngineMetadata
from tierkv.errors import BackendClosedError
from tierkv.policy.planner import PrefixPlan
from tierkv.policy.pressure import MemoryProbe
from tierkv.routing.router import build_tiers
from tierkv.tiers.tier import B
from tierkv.tiers.tier_pressure import TierPressure, nvml_status

logger = logging.getLogger("tierkv.engine")

T = TypeVar("T")

__all__ = ["AsyncEngine", "Engine", "EngineBuilder", "EngineMetadata", "TierPressure", "build_tiers", "nvml_status"]


class Engine:
    """Blocking facade over ``AsyncEngine``, running it on a private event-loop thread.

    The prompt and key-level methods of [AsyncEngine][tierkv.AsyncEngine] are here with the
    same arguments, each blocking until its answer; the others (a connector's reads and
    writes of its paged cache) run on ``core`` through ``submit`` or ``run``. Use it as a
    context manager, or call ``close`` when done.

    Safe to share between threads, ``close`` included: a call that races ``close()``
    either completes or raises ``BackendClosedError``; no caller waits on a loop that is
    gone. Calls already running when ``close()`` starts run to their end against open tiers
    (the router closes no tier under a running call: ``tierkv.routing.calls``, up to its
    ``close_grace_s``; a tier closed under a call still running then ends it with
    ``BackendClosedError``); any still running ``close_grace_s`` after that are cancelled on
    the loop, and their callers get ``BackendClosedError`` only once the cancelled work has
    ended (a copy into the caller's memory finishes before the call returns, as for any
    cancellation: ``tierkv.chunks.ownership``).

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

    close_grace_s: ClassVar[float] = 10.0

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        metadata: EngineMetadata | None = None,
        probes: Mapping[str, MemoryProbe] | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierkv-engine", daemon=True)
        self._lock = threading.Lock()  # guards _closing and _calls: no call is scheduled once close starts
        self._closing = False
        self._closed = threading.Event()
        self._calls: set[concurrent.futures.Future[Any]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()  # the calls' tasks, touched on the loop only
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
        """An engine from a YAML config file (the format of ``tierkv.config``).

        Args:
            path: The YAML file.
            metadata: What the cached KV belongs to; None: derived from the config.

        Returns:
            A running engine (``close`` it when done).

        Raises:
            ConfigError: if the file cannot be read, is not YAML or not a valid configuration,
                or a tier fails to open.
            BackendLoadError: if a tier's backend is found but cannot be imported.
        """
        return cls(load_config(path), metadata)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = self.submit(coro)
        try:
            return future.result()
        except concurrent.futures.CancelledError as exc:
            if self._closing:
                raise BackendClosedError("engine closed while the call was running") from exc
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine of ``core`` on the engine's loop without waiting for it.

        For an integration that overlaps tierkv work with its own, e.g. a save during the next
        forward pass: ``engine.submit(engine.core.store(tokens, kv))``.

        Args:
            coro: The coroutine, usually a call of a method of ``core`` (the engine's
                ``AsyncEngine``). It is closed without running when the engine is closed.

        Returns:
            A ``concurrent.futures.Future`` of the coroutine's result. Its ``result()`` raises what
                the coroutine raised, or ``concurrent.futures.CancelledError`` for a call that
                ``close`` had to cancel.

        Raises:
            BackendClosedError: if ``close`` has started.
        """
        with self._lock:
            if self._closing or not self._thread.is_alive():
                coro.close()
                raise BackendClosedError("engine is closed")
            future = asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)
            self._calls.add(future)
        future.add_done_callback(self._call_done)
        return future

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``, its task known to ``close`` (which may have to cancel it)."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    def _call_done(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._calls.discard(future)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of ``core`` on the engine's loop and wait for its result.

        What the coroutine raises is raised here.

        Args:
            coro: The coroutine, usually a call of a method of ``core``.

        Returns:
            What the coroutine returned.

        Raises:
            BackendClosedError: if ``close`` has started, or cancelled the call while it ran.
        """
        return self._run(coro)

    @property
    def core(self) -> AsyncEngine:
        """The asyncio engine this facade drives (its coroutines go to ``submit`` / ``run``)."""
        return self._core

    @property
    def config(self) -> EngineConfig:
        """The validated configuration the engine was built from."""
        return self._core.config

    @property
    def metadata(self) -> EngineMetadata:
        """What the cached KV belongs to: model, revision, KV format, dtype, rank (part of every key)."""
        return self._core.metadata

    @property
    def tiers(self) -> tuple[StorageBackend, ...]:
        """The tiers' backends, fastest first (read-only; ``wrap_tier`` replaces one)."""
        return self._core.tiers

    def wrap_tier(self, name: str, wrapper: Callable[[StorageBackend], B]) -> B:
        """Route every later call into tier ``name`` through ``wrapper(backend)``.

        For a fault injector, a throttle or a tracer (see ``AsyncEngine.wrap_tier``). On a tier
        with a ``codec`` the wrapper goes under the codec: it sees the frames that are stored.

        Args:
            name: The tier's name in the configuration.
            wrapper: Called once with the tier's backend; returns the backend to use in its
                place, under the same ``name``.

        Returns:
            The backend ``wrapper`` returned, now in the tier's place.

        Raises:
            KeyError: if no tier is called ``name``.
            TypeError: if ``wrapper`` returns something that is not a ``StorageBackend``.
            ValueError: if the backend ``wrapper`` returns has another ``name``.
        """
        return self._core.wrap_tier(name, wrapper)

    def keys_for(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[CacheKey]:
        """The key of every chunk of ``tokens`` for a request of ``identity`` (no tier is asked).

        Args:
            tokens: The token ids: a 1-D tensor, sequence or numpy array of integers.
            identity: What else the request's KV depends on (LoRA adapter, tenant salt, media);
                the default is a plain text request.

        Returns:
            One [CacheKey][tierkv.CacheKey] per chunk of ``chunk_size`` tokens, in order (the
                last one may cover a partial chunk); for ``batched_put`` and the other key-level
                calls.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids in ``[0, 2**31 - 1]``.
        """
        return self._core.keys_for(tokens, identity)

    def tail_keys(self, tokens: TokenIds, start_chunk: int, lengths: Sequence[int],
                  identity: RequestIdentity = PLAIN) -> list[CacheKey]:
        """The keys chunk ``start_chunk`` of ``tokens`` would have if the prompt ended ``lengths``
        tokens into it: what a save of that shorter prompt stored there (``AsyncEngine.tail_keys``).

        Args:
            tokens: The longer prompt's token ids.
            start_chunk: Which chunk the shorter prompt ended in.
            lengths: Where in that chunk it may have ended, in tokens (1 to ``chunk_size``).
            identity: The identity both prompts were stored and looked up under.

        Returns:
            One key per length, in the order given.

        Raises:
            ValueError: for malformed tokens, or a length outside the chunk or past the tokens.
        """
        return self._core.tail_keys(tokens, start_chunk, lengths, identity)

    def note_unidentified(self) -> None:
        """Count a request whose KV an integration can neither store nor load.

        E.g. a prompt given as embeddings; ``stats()["identity"]`` reports the count (see
        ``AsyncEngine.note_unidentified``).
        """
        self._core.note_unidentified()

    def store(self, tokens: TokenIds, kv: KVCache, mask: torch.Tensor | None = None,
              skip_existing: bool = True, identity: RequestIdentity = PLAIN) -> int:
        """Store the KV of ``tokens``; returns once the first tier that admits it holds it.

        Lower tiers are filled in the background from that copy. See ``AsyncEngine.store``.

        Args:
            tokens: The prompt's token ids (a 1-D tensor, sequence or numpy array).
            kv: The KV of those tokens: one blob in the engine's ``kv_format``, or per-layer
                ``(K, V)`` pairs. With ``mask``, only the KV of the masked tokens.
            mask: A suffix mask over ``tokens`` (False for a prefix, True for the rest): only
                the True tokens are stored, and the False prefix must be a whole number of
                chunks. None: every token.
            skip_existing: Leave out the chunks already cached at the start of the prompt.
            identity: What else the KV depends on (adapter, tenant salt, media); a chunk is
                found again only by a request of the same identity.

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
        return self._run(self._core.store(tokens, kv, mask, skip_existing, identity))

    def retrieve(self, tokens: TokenIds, mask: torch.Tensor | None = None, return_tuple: bool = True,
                 out: KVCache | None = None, deadline_s: float | None = None,
                 identity: RequestIdentity = PLAIN) -> tuple[Any, torch.Tensor]:
        """The KV of the longest cached prefix of ``tokens`` and the mask of the tokens it covers.

        Bit-exact, or a miss. See ``AsyncEngine.retrieve`` for ``out`` and the cost-aware plan.

        Args:
            tokens: The prompt's token ids.
            mask: A suffix mask over ``tokens``: only the True tokens are retrieved. None:
                every token.
            return_tuple: Return the KV as per-layer ``(K, V)`` pairs; False: as one blob in
                the engine's ``kv_format``.
            out: Memory to retrieve into (a blob in the engine's ``kv_format`` for the masked
                tokens, or per-layer ``(K, V)`` pairs); the KV returned is then a view of it.
                None: a new tensor is allocated.
            deadline_s: Seconds to wait for chunks: one that has not arrived by then is a miss
                and ends the prefix. None: no limit.
            identity: The request's identity, as given to ``store``.

        Returns:
            A pair ``(kv, mask)``: the KV of the tokens retrieved (an empty tuple when none
                was) and a boolean tensor over ``tokens``, True for each token retrieved.

        Raises:
            ValueError: if ``tokens``, ``mask`` or ``out`` is malformed, or ``out`` is
                per-layer tensors that do not form one blob while ``return_tuple`` is False.
            BackendClosedError: if the engine is closed.
        """
        return self._run(self._core.retrieve(tokens, mask, return_tuple, out, deadline_s, identity))

    def lookup(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> int:
        """How many leading tokens of ``tokens`` to count as cached.

        The longest cached prefix, or with ``cost_aware`` the part of it worth loading (see
        ``plan``); ``stats()["last_lookup"]`` says where its chunks are. Answered on the
        calling thread from the tiers' in-memory indexes when they all have one (no hop to the
        engine's loop: a scheduler asks this for every request), on the loop otherwise.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            A number of tokens, from 0 to ``len(tokens)``.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        cached = self._core.lookup_nowait(tokens, identity)
        return cached if cached is not None else self._run(self._core.lookup(tokens, identity))

    def plan(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> PrefixPlan:
        """How much of the cached prefix of ``tokens`` is worth loading, and why.

        Answered on the calling thread when every tier has an in-memory index (as ``lookup``
        is); see ``AsyncEngine.plan`` for the cost model.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            The plan: cached and planned tokens, the expected fetch time against the recompute
                time it saves, chunks per tier and the reason.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        planned = self._core.plan_nowait(tokens, identity)
        return planned if planned is not None else self._run(self._core.plan(tokens, identity))

    def observe_recompute(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """Tell the cost model how long the serving model took to prefill.

        Integrations call this around every prefill they run; values that are not positive
        (``context_tokens``: negative) or not finite are ignored.

        Args:
            new_tokens: How many tokens the model computed.
            context_tokens: How many cached tokens it attended to before them.
            seconds: How long that took.
        """
        self._core.observe_recompute(new_tokens, context_tokens, seconds)

    @property
    def cost_aware(self) -> bool:
        """Whether a cached prefix is loaded only as far as that beats recomputing it.

        Set it to switch the policy at runtime: True, False, or None (on once a recompute speed
        is known); anything else raises ``TypeError``. The speeds measured so far are kept,
        e.g. to compare the two policies on one engine.
        """
        return self._core.cost_aware

    @cost_aware.setter
    def cost_aware(self, value: bool | None) -> None:
        """Switch the policy at runtime (None: on once a recompute speed is known); the tier
        and recompute speeds measured so far are kept, e.g. to compare the two policies on
        one engine."""
        self._core.cost_aware = value

    def locate_prefix(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str]:
        """The tier holding each chunk of the longest cached prefix of ``tokens``.

        Answered on the calling thread when every tier has an in-memory index (as ``lookup``
        is).

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            Per chunk of the prefix, in order, the name of the highest tier holding it
                (``"fill-queue"`` for a chunk acknowledged and not yet written); empty when the
                first chunk is cached nowhere.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        names = self._core.locate_prefix_nowait(tokens, identity)
        return names if names is not None else self._run(self._core.locate_prefix(tokens, identity))

    def prefetch(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> int:
        """Start moving the cached prefix of ``tokens`` up to the first tier.

        Returns once the moves have started; a later ``retrieve`` of the same tokens waits only
        for the chunks still in flight.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            The tokens of the cached prefix (already in the first tier, or moving there).

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        return int(self._run(self._core.prefetch(tokens, identity)))

    def retain(self, tokens: TokenIds, seconds: float, identity: RequestIdentity = PLAIN,
               cut_at: int | None = None) -> int:
        """Keep the cached prefix of ``tokens`` through evictions for ``seconds`` (0 releases it).

        A lease in every tier that keeps leases (the node pool ``shm``, the memory tiers ``cpu``
        and ``gpu``): retained chunks are
        evicted after every other, so under pressure a lease is a bias, never a deadlock; each
        such tier caps the share of its capacity retained chunks take (``retain_share``).

        Args:
            tokens: The prompt's token ids.
            seconds: How long from now; a longer lease a chunk already has is kept; 0 releases.
            identity: The request's identity, as given to ``store``.
            cut_at: Where a save also stored the prompt cut inside its last chunk (a
                continuation tail, ``tail_keys``): that partial chunk is leased too.

        Returns:
            The tokens of the leading chunks retained.

        Raises:
            RetentionRefusedError: if the lease would pass a tier's cap (nothing was retained).
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids, ``seconds`` is
                negative, or ``cut_at`` is not inside the prompt's last chunk.
            BackendClosedError: if the engine is closed.
        """
        return int(self._run(self._core.retain(tokens, seconds, identity, cut_at)))

    def drop(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> int:
        """Remove the cached chunks of ``tokens`` from every tier (a session that ended).

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            The tokens of the chunks some tier held.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        return int(self._run(self._core.drop(tokens, identity)))

    def drop_identity(self, identity: RequestIdentity) -> int:
        """Remove every chunk of ``identity``'s requests (a tenant, an adapter: one key scope)
        from the tiers that can find their chunks by scope: the node pool, the memory tiers,
        ``lmdb`` and ``s3`` (``fs`` keeps them until evicted).

        Args:
            identity: The requests' identity, as given to ``store``.

        Returns:
            The chunks dropped.

        Raises:
            BackendClosedError: if the engine is closed.
            TierUnavailableError: naming each tier whose drop failed (every other tier
                dropped its chunks first).
        """
        return int(self._run(self._core.drop_identity(identity)))

    def locate(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str | None]:
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
        return self._run(self._core.locate(tokens, identity))

    def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Store chunks under keys you made (with ``keys_for``), as the write policy says.

        Args:
            keys: One key per chunk.
            chunks: The chunks, each a KV blob of one chunk's tokens; the caller may reuse them
                once the call returns.

        Returns:
            How many chunks were acknowledged.

        Raises:
            ValueError: if ``keys`` and ``chunks`` differ in length.
            TierUnavailableError: if no tier took the chunks and some are cached nowhere.
            BackendClosedError: if the engine is closed, or closed under the call.
        """
        return self._run(self._core.batched_put(keys, chunks))

    def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The chunk of each key, each from the highest tier holding it.

        Hits below the first tier are copied up into the tiers above that promote.

        Args:
            keys: The keys to read.

        Returns:
            The chunks in the order of ``keys``; None for a miss.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return self._run(self._core.batched_get(keys))

    def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether any tier holds each key (or it waits to be written to one).

        Args:
            keys: The keys to look for.

        Returns:
            One flag per key, in order.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return self._run(self._core.batched_contains(keys))

    def batched_delete(self, keys: Sequence[CacheKey]) -> int:
        """Remove the keys from every tier.

        The background fills already queued land first, so none writes a key back; a tier that
        fails is counted and skipped.

        Args:
            keys: The keys to remove.

        Returns:
            How many (key, tier) copies were removed.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return self._run(self._core.batched_delete(keys))

    def flush(self) -> None:
        """Wait until background work (fills, prefetches, demotions) has landed.

        Under write-back, also write what only a memory tier holds to the tier below, and
        return once it has landed there.

        Raises:
            TierUnavailableError: under write-back, if no tier below took some dirty chunks
                (they stay in memory; a later flush tries again), or some left their tier
                before a tier below took them.
            BackendClosedError: if the engine is closed.
        """
        self._run(self._core.flush())

    def stats(self) -> dict[str, Any]:
        """Plain data about the engine, safe to print or serve as JSON.

        Hit rate, the fill queue, memory pressure, per-tier counters and occupancy, the last
        lookup's plan, the cost model and the identities seen (see ``AsyncEngine.stats``).

        Returns:
            A dict of plain values.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return self._run(self._stats())

    async def _stats(self) -> dict[str, Any]:
        return self._core.stats()

    def occupancy(self) -> dict[str, Any]:
        """What each tier holds per key scope (see ``AsyncEngine.occupancy``).

        Returns:
            ``{"tiers": {tier: {scope: {"chunks": n, "bytes": b}} or None}, "scopes": {scope:
                what it binds}}``, naming no key and no salt.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return self._run(self._occupancy())

    async def _occupancy(self) -> dict[str, Any]:
        return self._core.occupancy()

    def close(self, flush: bool = True) -> None:
        """Flush background work, close every tier and stop the loop thread.

        Idempotent and safe from any thread: a second caller waits for the first's close to
        end. A flush that cannot write everything down is logged, and the tiers close anyway.

        Args:
            flush: Under write-back, write the chunks only a memory tier holds to the tier
                below first; False: close without (those chunks are lost).
        """
        with self._lock:
            closing, self._closing = self._closing, True
            if not closing:
                if not self._thread.is_alive():
                    self._closed.set()
                    return
                closed = asyncio.run_coroutine_threadsafe(self._core.close(flush), self._loop)
        if closing:
            self._closed.wait()
            return
        try:
            closed.result()
        finally:
            try:
                self._end_calls()
            finally:
                self._stop_loop()
                self._closed.set()

    def _end_calls(self) -> None:
        """Let the calls still running end (closed tiers end them), then cancel the rest on
        the loop and wait until their tasks have ended (their callers are answered then)."""
        with self._lock:
            running = list(self._calls)
        _, stuck = concurrent.futures.wait(running, timeout=self.close_grace_s)
        if not stuck:
            return
        logger.warning("tierkv: cancelling %d call(s) still running %.0f s after close()", len(stuck),
                       self.close_grace_s)
        try:
            asyncio.run_coroutine_threadsafe(self._cancel_tasks(), self._loop).result(timeout=self.close_grace_s)
        except concurrent.futures.TimeoutError:
            logger.warning("tierkv: cancelled calls still unwinding after %.0f s; stopping the loop",
                           self.close_grace_s)

    async def _cancel_tasks(self) -> None:
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

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

        Args:
            instance_id: The engine's name in this process (e.g. one per worker).
            config: Its configuration (an ``EngineConfig``, a mapping or a YAML path); loaded
                and compared with the existing engine's on every call.
            metadata: What the cached KV belongs to; None: derived from the config.

        Returns:
            The engine of that name: the existing one, or a new one.

        Raises:
            ConfigError: if ``config`` is invalid, or a new engine's tier fails to open.
            BackendLoadError: if a new engine's backend cannot be imported.
            ValueError: if an engine of that name exists with a different configuration or
                metadata.
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
        """The engine named ``instance_id``, if one was created (and not destroyed).

        Args:
            instance_id: The engine's name, as given to ``get_or_create``.

        Returns:
            The engine, or None.
        """
        with cls._lock:
            return cls._instances.get(instance_id)

    @classmethod
    def destroy(cls, instance_id: str) -> None:
        """Close and forget the engine named ``instance_id`` (no-op when absent).

        Args:
            instance_id: The engine's name, as given to ``get_or_create``.
        """
        with cls._lock:
            engine = cls._instances.pop(instance_id, None)
            cls._configs.pop(instance_id, None)
        if engine is not None:
            engine.close()
