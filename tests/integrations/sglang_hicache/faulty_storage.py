"""Test-only: a TierKVStorage whose tiers all fail (tierkv.testing.faults.FaultyBackend), loaded
by a real SGLang through ``--hicache-storage-backend dynamic`` (``module_path: faulty_storage``),
to show that a failing tier costs SGLang only its hits, never a request."""

from __future__ import annotations

from typing import Any

from tierkv.integrations.sglang.backend import TierKVStorage
from tierkv.testing.faults import FaultyBackend


class FailingTiersStorage(TierKVStorage):
    """Every tier raises on every call, from the moment the host pool is registered."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        assert self.engine is not None
        for backend in self.engine.tiers:
            faulty = self.engine.wrap_tier(backend.name, FaultyBackend)
            faulty.failing = True
