"""The conformance kit over the ``shm`` tier: a pool file in /dev/shm per test, every capability
it declares (in-place puts and holds, a capacity bound, persistence across processes)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.backend import StorageBackend
from tierkv.testing import BackendTests
from tierkv_backends.shm import SharedMemoryBackend

SHM = Path("/dev/shm")


@pytest.fixture
def pool_path(tmp_path: Path) -> Iterator[Path]:
    """A pool file on /dev/shm (a memory file system), removed after the test."""
    base = SHM if SHM.is_dir() and SHM.stat().st_dev != tmp_path.stat().st_dev else tmp_path
    path = base / f"tierkv-test-{uuid.uuid4().hex[:12]}.pool"
    yield path
    path.unlink(missing_ok=True)


class TestSharedMemoryBackend(BackendTests):
    @pytest.fixture(autouse=True)
    def _pool(self, pool_path: Path) -> None:
        self.pool_path = pool_path

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return SharedMemoryBackend(name="node", capacity=capacity or (64 << 20), path=str(self.pool_path),
                                   max_chunks=256)
