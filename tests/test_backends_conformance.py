"""Every built-in backend against the shipped conformance suite, on real storage."""

from __future__ import annotations

from pathlib import Path

from tierkv.backend import StorageBackend
from tierkv.keys import CacheKey
from tierkv.testing import BackendTests
from tierkv_backends.cpu import CPUBackend
from tierkv_backends.fs import FSBackend
from tierkv_backends.lmdb import LMDBBackend, encode_key


class TestCPUBackend(BackendTests):
    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return CPUBackend(name="host", capacity=capacity or 64 << 20)


class TestCPUBackendLazy(BackendTests):
    """The same contract with ``preallocate: false`` (slabs allocated on first use)."""

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return CPUBackend(name="host", capacity=capacity or 64 << 20, preallocate=False)


class TestLMDBBackend(BackendTests):
    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return LMDBBackend(name="disk", capacity=capacity or 64 << 20, path=str(tmp_path / "lmdb"))

    def corrupt_stored(self, backend: StorageBackend, key: CacheKey) -> None:
        assert isinstance(backend, LMDBBackend)
        with backend._env.begin(write=True, db=backend._data) as txn:
            value = bytearray(txn.get(encode_key(key)))
            value[-1] ^= 0xFF
            txn.put(encode_key(key), bytes(value))


class TestFSBackend(BackendTests):
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
