"""The engine: chunk keys in, tensors across tiers, tensors out.

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

    Safe to share between threads, ``close`` included: a call that races ``close()``
    either completes or raises ``BackendClosedError``; no caller waits on a loop that is
    gone. Calls already running when ``close()`` starts run to their end against open tiers
    (the router closes no tier under a running call: ``tierkv.routing.calls``, up to its
    ``close_grace_s``; a tier closed under a call still running then ends it with
    ``BackendClosedError``); any still running ``close_grace_s`` after that are cancelled on
    the loop, and their callers get ``BackendClosedError`` only once the cancelled work has
    ended (a copy into the caller's memory finishes before the call returns, as for any
    cancellation: ``tierkv.chunks.ownership``).
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
        """An engine from a YAML config file (the format of ``tierkv.config``)."""
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
        """Run a coroutine of ``core`` on the engine's loop; returns at once with a future
        (an integration that overlaps tierkv work with its own, e.g. a save during the next
        forward pass). Raises BackendClosedError once ``close`` has started; a future of a
        call that ``close`` had to cancel raises ``CancelledError``."""
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
        """Run a coroutine of ``core`` on the engine's loop and wait for its result."""
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
        """Route every later call into tier ``name`` through ``wrapper(backend)`` and return it
        (see ``AsyncEngine.wrap_tier``)."""
        return self._core.wrap_tier(name, wrapper)

    def keys_for(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[CacheKey]:
        """The key of every chunk of ``tokens`` for a request of ``identity`` (no tier is asked)."""
        return self._core.keys_for(tokens, identity)

    def note_unidentified(self) -> None:
        """Count a request whose KV an integration can neither store nor load (see
        ``AsyncEngine.note_unidentified``)."""
        self._core.note_unidentified()

    def store(self, tokens: TokenIds, kv: KVCache, mask: torch.Tensor | None = None,
              skip_existing: bool = True, identity: RequestIdentity = PLAIN) -> int:
        """Store the KV of ``tokens``; the number of chunks written once the first tier took
        them (lower tiers fill in the background). See ``AsyncEngine.store``."""
        return self._run(self._core.store(tokens, kv, mask, skip_existing, identity))

    def retrieve(self, tokens: TokenIds, mask: torch.Tensor | None = None, return_tuple: bool = True,
                 out: KVCache | None = None, deadline_s: float | None = None,
                 identity: RequestIdentity = PLAIN) -> tuple[Any, torch.Tensor]:
        """The KV of the longest cached prefix of ``tokens`` and the mask of the tokens it
        covers (bit-exact, or a miss). See ``AsyncEngine.retrieve``."""
        return self._run(self._core.retrieve(tokens, mask, return_tuple, out, deadline_s, identity))

    def lookup(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> int:
        """Answered on the calling thread from the tiers' in-memory indexes when they all have
        one (no hop to the engine's loop: a scheduler asks this for every request)."""
        cached = self._core.lookup_nowait(tokens, identity)
        return cached if cached is not None else self._run(self._core.lookup(tokens, identity))

    def plan(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> PrefixPlan:
        """Answered on the calling thread when every tier has an in-memory index (see lookup)."""
        planned = self._core.plan_nowait(tokens, identity)
        return planned if planned is not None else self._run(self._core.plan(tokens, identity))

    def observe_recompute(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """Tell the cost model how long the serving model took to compute ``new_tokens`` after
        ``context_tokens`` cached ones."""
        self._core.observe_recompute(new_tokens, context_tokens, seconds)

    @property
    def cost_aware(self) -> bool:
        """Whether a cached prefix is loaded only as far as that beats recomputing it."""
        return self._core.cost_aware

    @cost_aware.setter
    def cost_aware(self, value: bool | None) -> None:
        """Switch the policy at runtime (None: on once a recompute speed is known); the tier
        and recompute speeds measured so far are kept, e.g. to compare the two policies on
        one engine."""
        self._core.cost_aware = value

    def locate_prefix(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str]:
        """Answered on the calling thread when every tier has an in-memory index (see lookup)."""
        names = self._core.locate_prefix_nowait(tokens, identity)
        return names if names is not None else self._run(self._core.locate_prefix(tokens, identity))

    def prefetch(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> None:
        """Start moving the cached prefix of ``tokens`` up to the first tier; returns once
        started (a later retrieve waits only for the chunks still in flight)."""
        self._run(self._core.prefetch(tokens, identity))

    def locate(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> list[str | None]:
        """Per chunk of ``tokens``, the name of the highest tier holding it (None: nowhere)."""
        return self._run(self._core.locate(tokens, identity))

    def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Store chunks under keys you made (``keys_for``); how many were acknowledged."""
        return self._run(self._core.batched_put(keys, chunks))

    def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The chunk of each key, in order; None for a miss."""
        return self._run(self._core.batched_get(keys))

    def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether any tier holds each key (or it waits to be written to one)."""
        return self._run(self._core.batched_contains(keys))

    def batched_delete(self, keys: Sequence[CacheKey]) -> int:
        """Remove the keys from every tier; how many (key, tier) copies went."""
        return self._run(self._core.batched_delete(keys))

    def flush(self) -> None:
        """Wait until background work (fills, prefetches, demotions) has landed; under
        write-back, also write what only a memory tier holds to the tier below."""
        self._run(self._core.flush())

    def stats(self) -> dict[str, Any]:
        """Plain data: hit rate, the fill queue, memory pressure, per-tier counters and
        occupancy, the last lookup's plan."""
        return self._run(self._stats())

    async def _stats(self) -> dict[str, Any]:
        return self._core.stats()

    def occupancy(self) -> dict[str, Any]:
        """What each tier holds per key scope (see ``AsyncEngine.occupancy``)."""
        return self._run(self._occupancy())

    async def _occupancy(self) -> dict[str, Any]:
        return self._core.occupancy()

    def close(self, flush: bool = True) -> None:
        """Flush background work (under write-back, dirty chunks too, unless ``flush=False``),
        close every tier and stop the loop thread. Idempotent and safe from any thread: a
        second caller waits for the first's close to end."""
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
