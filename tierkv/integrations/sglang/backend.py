"""``TierKVStorage``: SGLang's HiCache L3 storage backend, backed by a tierkv engine.

Switched on with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv",
        "module_path": "tierkv.integrations.sglang.backend", "class_name": "TierKVStorage",
        "interface_v1": 1, "config": "/etc/tierkv.yaml"}'

SGLang creates one per rank (``cls(storage_config, kwargs)``) and hands it its host KV pool
(``register_mem_pool_host``); the tierkv engine is built then, with one chunk per SGLang page.

* ``batch_set_v1`` / ``batch_get_v1`` (``interface_v1: 1``): pages go from SGLang's host pool
  straight into the first tier and come back straight into the pool (one copy per byte);
  pages already stored are not written again.
* ``batch_exists``: the length of the stored prefix, from the tiers' in-memory indexes (no
  I/O); with a cost-aware engine, only the part worth loading.
* ``get`` / ``set`` / ``batch_get`` / ``batch_set`` / ``exists``: SGLang's generic page path
  (flat pages in the pool's order), same storage.

Nothing here raises into SGLang: a failing, slow or corrupt tier is a miss (SGLang recomputes)
or a failed store (a future miss), logged and counted in ``TierKVStorage.counters``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from tierkv.chunks.keys import CacheKey
from tierkv.chunks.revisions import directory_revision
from tierkv.engine.blocking import Engine, EngineMetadata
from tierkv.integrations.sglang.config import BackendSettings, settings_from
from tierkv.integrations.sglang.keys import PageKeySpace
from tierkv.integrations.sglang.layout import PageLayout
from tierkv.integrations.sglang.pages import PageIO, ViewSink, ViewSource

logger = logging.getLogger(__name__)

_STORED_KEYS_KEPT = 1 << 20  # keys remembered for clear(), per process


class TierKVStorage(HiCacheStorage):
    """A ``HiCacheStorage`` whose pages live in tierkv's tiers."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings: BackendSettings = settings_from(storage_config.extra_config, storage_config.model_name or "")
        self.model_name = storage_config.model_name or self.settings.config.model
        # MLA KV is the same on every TP rank: one copy for all, written by one rank
        replicated = bool(storage_config.is_mla_model)
        self.world_size = 1 if replicated else int(storage_config.tp_size)
        self.rank = 0 if replicated else int(storage_config.tp_rank)
        self.writer = bool(storage_config.is_storage_writer)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stored: dict[CacheKey, None] = {}
        self.engine: Engine | None = None
        self.layout: PageLayout | None = None
        self.keyspace: PageKeySpace | None = None
        self.io: PageIO | None = None

    # -- set-up ------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind SGLang's host pool and build the engine (one chunk per page). A pool tierkv
        cannot store (another layout, mixed K/V widths) is a ValueError: SGLang's attach fails."""
        super().register_mem_pool_host(mem_pool_host)
        layout = PageLayout(mem_pool_host)
        config = self.storage_config
        geometry = layout.geometry() + f":pp={config.pp_rank}/{config.pp_size}"
        if getattr(config, "attn_cp_size", 1) > 1:
            geometry += f":cp={config.attn_cp_rank}/{config.attn_cp_size}"
        keyspace = PageKeySpace(self.model_name, self.world_size, self.rank, geometry, self._revision())
        engine = Engine(self.settings.for_pages(layout.page_size, self.model_name),
                        EngineMetadata(self.model_name, self.world_size, self.rank, "vllm"))
        if self.engine is not None:
            self.engine.close()
        self.layout, self.keyspace, self.engine = layout, keyspace, engine
        self.io = PageIO(engine, layout.page_size)
        logger.info("tierkv: SGLang %s pages (%s layout, %s) of %r rank %d/%d in tiers %s", layout.kind,
                    layout.layout, layout.geometry(), self.model_name, self.rank, self.world_size,
                    [tier.name for tier in engine.tiers])

    def _revision(self) -> str:
        """The model revision in every page key: the tierkv config's ``model_revision``, else a
        digest of the model directory (config and weights), else the model's name."""
        configured = self.settings.config.model_revision
        if configured:
            return configured
        if os.path.isdir(self.model_name):
            return directory_revision(self.model_name)
        return f"name:{self.model_name}"

    def _ready(self) -> tuple[PageIO, PageLayout, PageKeySpace]:
        if self.io is None or self.layout is None or self.keyspace is None:
            raise RuntimeError("tierkv: no host pool registered yet (register_mem_pool_host)")
        return self.io, self.layout, self.keyspace

    def _count(self, **amounts: int) -> None:
        with self._lock:
            self.counters.update(amounts)
        self._write_stats()

    def _failed(self, operation: str, exc: BaseException) -> None:
        self._count(**{f"{operation}_errors": 1})
        logger.warning("tierkv: %s failed (SGLang treats it as a miss): %s: %s", operation, type(exc).__name__, exc)

    # -- the zero-copy page path (interface_v1) ----------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages stored (and worth loading, when the engine is cost-aware); no I/O
        where every tier keeps an in-memory index."""
        try:
            io, _, keyspace = self._ready()
            tiers = io.where(keyspace.keys(list(keys)))
            held = io.held_prefix(tiers)
            first_page = len(extra_info.prefix_keys or []) if extra_info is not None else 0
            worth = io.worth_loading(tiers[:held], first_page) if held else 0
        except Exception as exc:
            self._failed("exists", exc)
            return 0
        self._count(exists_queries=1, exists_pages_asked=len(keys), exists_pages_held=held,
                    exists_pages_declined=held - worth)
        return worth

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages straight into SGLang's host pool at ``host_indices`` (``page_size`` per key)."""
        if not keys:
            return []
        try:
            io, layout, keyspace = self._ready()
            layout.check_indices(host_indices, len(keys))
            started = time.perf_counter()
            views = [layout.view(layout.page_index(host_indices, page)) for page in range(len(keys))]
            loaded = io.read(keyspace.keys(list(keys)), ViewSink(views, layout.page_size),
                             self.settings.load_deadline_s)
        except Exception as exc:
            self._failed("load", exc)
            return [False] * len(keys)
        self._count(pages_loaded=loaded, pages_missed=len(keys) - loaded,
                    bytes_loaded=loaded * layout.page_nbytes, load_us=_micros_since(started))
        return [page < loaded for page in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store pages straight out of SGLang's host pool at ``host_indices``; pages already
        stored are not written again."""
        if not keys:
            return []
        if not self.writer:  # a replicated (MLA) page is written by one rank
            return [True] * len(keys)
        try:
            io, layout, keyspace = self._ready()
            layout.check_indices(host_indices, len(keys))
            return self._store(io, keyspace.keys(list(keys)),
                               [layout.view(layout.page_index(host_indices, page)) for page in range(len(keys))])
        except Exception as exc:
            self._failed("store", exc)
            return [False] * len(keys)

    def _store(self, io: PageIO, keys: list[CacheKey], views: list[torch.Tensor]) -> list[bool]:
        started = time.perf_counter()
        new = [index for index, tier in enumerate(io.where(keys)) if tier is None]
        if new:
            io.write([keys[i] for i in new], ViewSource([views[i] for i in new], io.page_size))
            with self._lock:
                if len(self._stored) > _STORED_KEYS_KEPT:
                    self._stored.clear()
                self._stored.update(dict.fromkeys(keys[i] for i in new))
        self._count(pages_stored=len(new), pages_already_stored=len(keys) - len(new),
                    bytes_stored=len(new) * views[0].nbytes, store_us=_micros_since(started))
        return [True] * len(keys)

    # -- SGLang's generic page path (flat pages in the pool's own order) ---------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page into its flat target (a fresh page when none is given); None for a miss
        (and for every page after one: SGLang loads prefixes)."""
        if not keys:
            return []
        try:
            io, layout, keyspace = self._ready()
            targets = list(target_locations) if target_locations is not None else [None] * len(keys)
            if len(targets) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
            started = time.perf_counter()
            flats = [t if t is not None else torch.empty(layout.page_nbytes // layout.dtype.itemsize,
                                                         dtype=layout.dtype) for t in targets]
            views = [layout.from_flat(flat) for flat in flats]
            loaded = io.read(keyspace.keys(list(keys)), ViewSink(views, layout.page_size),
                             self.settings.load_deadline_s)
        except Exception as exc:
            self._failed("load", exc)
            return [None] * len(keys)
        self._count(pages_loaded=loaded, pages_missed=len(keys) - loaded, bytes_loaded=loaded * layout.page_nbytes,
                    load_us=_micros_since(started))
        return [flat if page < loaded else None for page, flat in enumerate(flats)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages (``host_pool.get_data_page(index)``); whether all were stored."""
        if not keys:
            return True
        if not self.writer:
            return True
        try:
            io, layout, keyspace = self._ready()
            pages: Sequence[Any] = list(values) if values is not None else []
            if len(pages) != len(keys) or any(not isinstance(p, torch.Tensor) for p in pages):
                raise ValueError(f"{len(keys)} keys need {len(keys)} page tensors, got {values!r:.80}")
            return all(self._store(io, keyspace.keys(list(keys)), [layout.from_flat(p) for p in pages]))
        except Exception as exc:
            self._failed("store", exc)
            return False

    def exists(self, key: str) -> bool:
        try:
            io, _, keyspace = self._ready()
            return io.where([keyspace.key(key)])[0] is not None
        except Exception as exc:
            self._failed("exists", exc)
            return False

    # -- housekeeping ------------------------------------------------------------------------------
    def clear(self) -> bool:
        """Remove the pages this process stored (other processes' pages are theirs to clear)."""
        if self.engine is None:
            return True
        with self._lock:
            keys, self._stored = list(self._stored), {}
        try:
            self.engine.batched_delete(keys)
        except Exception as exc:
            self._failed("clear", exc)
            return False
        return True

    def stats(self) -> dict[str, Any]:
        """The backend's counters and the engine's (hits, tiers, copies per byte)."""
        with self._lock:
            counters = dict(self.counters)
        engine = None
        if self.engine is not None:
            try:
                engine = self.engine.stats()
            except Exception as exc:  # a closed engine has no stats; the counters still count
                engine = {"error": f"{type(exc).__name__}: {exc}"}
        return {"model": self.model_name, "rank": self.rank, "world_size": self.world_size,
                "counters": counters, "engine": engine}

    def _write_stats(self) -> None:
        path = self.settings.stats_file
        if not path:
            return
        path = path.replace("{rank}", str(self.rank))
        try:
            with self._lock:
                document = {"model": self.model_name, "rank": self.rank, "counters": dict(self.counters)}
            temporary = f"{path}.{os.getpid()}.tmp"
            with open(temporary, "w") as handle:
                json.dump(document, handle)
            os.replace(temporary, path)
        except OSError as exc:
            logger.debug("tierkv: cannot write stats file %s: %s", path, exc)

    def close(self) -> None:
        """Let stores in flight land, close the tiers."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


def _micros_since(started: float) -> int:
    """Microseconds since ``started`` (``time.perf_counter``): the counters' time unit, so
    SGLang's wait for its L3 can be split into tierkv's share and the rest."""
    return int((time.perf_counter() - started) * 1e6)
