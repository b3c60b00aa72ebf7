"""The engine: chunk keys in, tensors across tiers, tensors out.

``AsyncEngine`` is the asyncio core. ``Engine`` is the blocking facade with the same
methods, running one core on a private event-loop thread (the httpx Client /
AsyncClient pattern), so a serving engine without asyncio can call it directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from tierkv import kvlayout, policy, registry
from tierkv.backend import StorageBackend
from tierkv.config import EngineConfig, load_config
from tierkv.errors import BackendClosedError, ChunkFormatError, ConfigError, TierKVError
from tierkv.keys import KV_FORMATS, CacheKey, ChunkHasher, as_token_array
from tierkv.kvlayout import KVCache
from tierkv.memory import copy_into, empty_host

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Output assembly larger than this runs off the event loop so other requests keep moving.
_OFFLOAD_COPY_BYTES = 4 << 20
_TIER_COUNTERS = ("hits", "misses", "bytes_out", "puts", "bytes_in", "errors", "promotions", "corrupt_chunks")


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

    Tiers are tried top (fastest) first; a put goes to every tier and a hit in a lower
    tier is copied into the tiers above it.
    """

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        metadata: EngineMetadata | None = None,
    ) -> None:
        self.config = load_config(config)
        self.metadata = metadata or EngineMetadata.from_config(self.config)
        if self.metadata.fmt not in KV_FORMATS:
            raise ConfigError(f"kv_format: expected 'vllm' or 'huggingface', got {self.metadata.fmt!r}")
        self.chunk_size = self.config.chunk_size
        self._hasher = ChunkHasher(self.chunk_size)
        self.tiers: list[StorageBackend] = build_tiers(self.config)
        self._counters = {tier.name: dict.fromkeys(_TIER_COUNTERS, 0) for tier in self.tiers}
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False

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
        skip = kvlayout.suffix_mask_skip(mask, num_tokens)
        if skip % self.chunk_size:
            raise ValueError(
                f"store mask must be aligned to chunks: it skips {skip} tokens, not a multiple of chunk_size "
                f"{self.chunk_size}"
            )
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
        present = await self.batched_contains(keys)
        keys = keys[: policy.first_missing(present)]
        chunks = await self.batched_get(keys) if keys else []
        usable = chunks[: policy.first_missing([c is not None for c in chunks])]
        usable = self._consistent_prefix(usable)  # type: ignore[arg-type]
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
        """Length in tokens of the longest prefix of ``tokens`` cached in any tier."""
        self._ensure_open()
        token_array = as_token_array(tokens)
        keys = self.keys_for(token_array)
        hit_chunks = policy.first_missing(await self.batched_contains(keys)) if keys else 0
        return min(hit_chunks * self.chunk_size, len(token_array))

    async def prefetch(self, tokens: torch.Tensor | Sequence[int]) -> None:
        """Start moving the cached prefix of ``tokens`` to the top tier; returns at once."""
        self._ensure_open()
        keys = self.keys_for(as_token_array(tokens))
        self._spawn(self._prefetch(keys))

    async def _prefetch(self, keys: list[CacheKey]) -> None:
        present = await self.batched_contains(keys)
        keys = keys[: policy.first_missing(present)]
        if keys:
            await self.batched_get(keys)

    # -- key-level API --------------------------------------------------------------------
    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Write chunks to every tier; returns how many were stored.

        A tier that fails is counted and logged; the call fails only when no tier took the batch.
        """
        self._ensure_open()
        if len(keys) != len(chunks):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(chunks)} chunks")
        if not keys:
            return 0
        targets = [self.tiers[i] for i in policy.put_targets(len(self.tiers))]
        outcomes = await asyncio.gather(*(self._tier_put(tier, keys, chunks) for tier in targets), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if len(failures) == len(targets):
            raise failures[0]
        return len(keys)

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Chunks for ``keys`` in order (None for misses), each from the highest tier holding it.

        Hits below the top tier are copied into the tiers above.
        """
        self._ensure_open()
        results: list[torch.Tensor | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            wanted = [keys[i] for i in missing]
            got = await self._tier_get(tier, wanted)
            still: list[int] = []
            hits: list[int] = []
            for index, chunk in zip(missing, got):
                if chunk is None:
                    still.append(index)
                else:
                    results[index] = chunk
                    hits.append(index)
            if hits and level > 0:
                await self._promote(level, [keys[i] for i in hits], [results[i] for i in hits])  # type: ignore[misc]
            missing = still
        return results

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by any tier."""
        self._ensure_open()
        found = [False] * len(keys)
        missing = list(range(len(keys)))
        for tier in self.tiers:
            if not missing:
                break
            try:
                flags = await tier.batched_contains([keys[i] for i in missing])
            except Exception as exc:
                self._tier_failed(tier, "contains", exc)
                continue
            still = []
            for index, flag in zip(missing, flags):
                if flag:
                    found[index] = True
                else:
                    still.append(index)
            missing = still
        return found

    async def flush(self) -> None:
        """Wait until every background operation (prefetch, fills) has finished."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close(self) -> None:
        """Flush, then close every tier. Idempotent."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception:
                logger.exception("closing tier %r", tier.name)

    def stats(self) -> dict[str, Any]:
        """Hit rate and per-tier counters and occupancy."""
        total = self._hit_tokens + self._miss_tokens
        return {
            "model": self.metadata.model_name,
            "chunk_size": self.chunk_size,
            "hit_tokens": self._hit_tokens,
            "miss_tokens": self._miss_tokens,
            "hit_rate": self._hit_tokens / total if total else 0.0,
            "background_tasks": len(self._background),
            "tiers": {
                tier.name: {**tier.stats(), **{k: v for k, v in self._counters[tier.name].items()
                                               if k != "corrupt_chunks"},
                            "corrupt_chunks": tier.counters.get("corrupt_chunks", 0)
                            + self._counters[tier.name]["corrupt_chunks"]}
                for tier in self.tiers
            },
        }

    # -- internals --------------------------------------------------------------------------
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

    def _tier_failed(self, tier: StorageBackend, operation: str, exc: BaseException) -> None:
        self._counters[tier.name]["errors"] += 1
        logger.warning("tier %r: %s failed: %s: %s", tier.name, operation, type(exc).__name__, exc)

    async def _tier_put(self, tier: StorageBackend, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        try:
            stored = await tier.batched_put(keys, chunks)
        except Exception as exc:
            self._tier_failed(tier, "put", exc)
            raise
        counters = self._counters[tier.name]
        counters["puts"] += stored
        counters["bytes_in"] += sum(c.numel() * c.element_size() for c in chunks)
        return stored

    async def _tier_get(self, tier: StorageBackend, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        try:
            got = await tier.batched_get(keys)
        except ChunkFormatError:
            got = [await self._get_one_checked(tier, key) for key in keys]
        except Exception as exc:
            self._tier_failed(tier, "get", exc)
            return [None] * len(keys)
        counters = self._counters[tier.name]
        hits = [c for c in got if c is not None]
        counters["hits"] += len(hits)
        counters["misses"] += len(got) - len(hits)
        counters["bytes_out"] += sum(c.numel() * c.element_size() for c in hits)
        return got

    async def _get_one_checked(self, tier: StorageBackend, key: CacheKey) -> torch.Tensor | None:
        """Single get that turns an undecodable value into a miss, a delete and a count."""
        try:
            return await tier.get(key)
        except ChunkFormatError as exc:
            self._counters[tier.name]["corrupt_chunks"] += 1
            logger.warning("tier %r: dropping corrupt chunk %s: %s", tier.name, key, exc)
            await tier.delete(key)
            return None

    async def _promote(self, level: int, keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
        for target in policy.promotion_targets(level):
            tier = self.tiers[target]
            try:
                await tier.batched_put(keys, chunks)
            except Exception as exc:
                self._tier_failed(tier, "promote", exc)
                continue
            self._counters[tier.name]["promotions"] += len(keys)

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

        def fill() -> None:
            offset = 0
            for piece in pieces:
                copy_into(out.narrow(dim, offset, piece.shape[dim]), piece)
                offset += piece.shape[dim]

        if out.numel() * out.element_size() > _OFFLOAD_COPY_BYTES:
            await asyncio.to_thread(fill)
        else:
            fill()
        return out


class Engine:
    """Blocking facade over :class:`AsyncEngine`, running it on a private event-loop thread."""

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        metadata: EngineMetadata | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierkv-engine", daemon=True)
        self._thread.start()
        try:
            self._core: AsyncEngine = self._run(self._create(config, metadata))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _create(config: Any, metadata: EngineMetadata | None) -> AsyncEngine:
        return AsyncEngine(config, metadata)

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
