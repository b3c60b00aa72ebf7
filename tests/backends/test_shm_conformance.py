"""The conformance kit over the ``shm`` tier: a pool file in /dev/shm per test, every capability
it declares (in-place puts and holds, a capacity bound, persistence across processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.backend import StorageBackend
from tierkv.testing import BackendTests
from tierkv_backends.shm import SharedMemoryBackend


class TestSharedMemoryBackend(BackendTests):
    @pytest.fixture(autouse=True)
    def _pool(self, pool_path: Path) -> None:
        self.pool_path = pool_path

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return SharedMemoryBackend(name="node", capacity=capacity or (64 << 20), path=str(self.pool_path),
                                   max_chunks=256)
