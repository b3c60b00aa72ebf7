"""Every built-in backend against the shipped conformance suite, on real storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tierkv.backend import StorageBackend
from tierkv.chunks.keys import CacheKey
from tierkv.testing import BackendTests
from tierkv.testing.backend_tests import make_chunk, make_key, same_bytes
from tierkv_backends.cpu import CPUBackend
from tierkv_backends.fs import FSBackend
from tierkv_backends.gpu import GPUBackend
from tierkv_backends.lmdb import LMDBBackend, encode_key


class TestCPUBackend(BackendTests):
    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return CPUBackend(name="host", capacity=capacity or 64 << 20)


class TestCPUBackendLazy(BackendTests):
    """The same contract with ``preallocate: false`` (slabs allocated on first use)."""

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return CPUBackend(name="host", capacity=capacity or 64 << 20, preallocate=False)


class TestGPUBackendOnCPU(BackendTests):
    """The gpu tier's logic (device: cpu, as CI has no GPU): in place, pressure, demotion."""

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return GPUBackend(name="gpu", capacity=capacity or 64 << 20, device="cpu")


class VerifiesInDestination:
    """fs and lmdb checksum a chunk as it lands in the destination: the corrupt-chunk test
    without "the destination stays untouched" (the rest of that contract holds)."""

    with_backend: Any
    corrupt_stored: Any

    def test_corrupt_value_is_a_miss_and_is_dropped(self, tmp_path: Path) -> None:
        """Verified in the destination (one copy, no staging): a damaged chunk is a miss
        whose slice may hold its bytes -- the mask is the contract, not the slice."""
        async def body(backend: StorageBackend) -> None:
            assert not type(backend).streams_into_destination  # the engine reads it straight into out
            chunk = make_chunk(44)
            await backend.batched_put([make_key(44), make_key(45)], [chunk, make_chunk(45)])
            self.corrupt_stored(backend, make_key(44))
            out, second = torch.full_like(chunk, 5.0), torch.empty_like(chunk)
            assert await backend.batched_get_into([make_key(44), make_key(45)], [out, second]) == [False, True]
            assert same_bytes(second, make_chunk(45))
            assert await backend.get(make_key(44)) is None and not await backend.contains(make_key(44))
            assert backend.stats()["corrupt_chunks"] >= 1
        self.with_backend(tmp_path, body)


class TestLMDBBackend(VerifiesInDestination, BackendTests):
    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return LMDBBackend(name="disk", capacity=capacity or 64 << 20, path=str(tmp_path / "lmdb"))

    def corrupt_stored(self, backend: StorageBackend, key: CacheKey) -> None:
        assert isinstance(backend, LMDBBackend)
        with backend._env.begin(write=True, db=backend._data) as txn:
            value = bytearray(txn.get(encode_key(key)))
            value[-1] ^= 0xFF
            txn.put(encode_key(key), bytes(value))


class TestFSBackend(VerifiesInDestination, BackendTests):
    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return FSBackend(name="files", capacity=capacity, path=str(tmp_path / "fs"))

    def corrupt_stored(self, backend: StorageBackend, key: CacheKey) -> None:
        assert isinstance(backend, FSBackend)
        path = backend._file(backend._digest(key.to_string()))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))



class TestLMDBBackendWritemap(TestLMDBBackend):
    """The same contract with ``writemap: true`` (values written straight into the map)."""

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return LMDBBackend(name="disk", capacity=capacity or 64 << 20, path=str(tmp_path / "lmdb"), writemap=True)


class TestLMDBBackendTrusted(BackendTests):
    """``verify: false``: the contract holds, except that a flipped payload byte goes unnoticed
    (no ``corrupt_stored`` hook: that is what the option trades away)."""

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return LMDBBackend(name="disk", capacity=capacity or 64 << 20, path=str(tmp_path / "lmdb"), verify=False)
