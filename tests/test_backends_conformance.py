"""Every built-in backend against the shipped conformance suite, on real storage."""

from __future__ import annotations

from pathlib import Path

from tierkv.backend import StorageBackend
from tierkv.testing import BackendTests
from tierkv_backends.cpu import CPUBackend
from tierkv_backends.fs import FSBackend
from tierkv_backends.lmdb import LMDBBackend


class TestCPUBackend(BackendTests):
    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return CPUBackend(name="host", capacity=capacity or 64 << 20)


class TestLMDBBackend(BackendTests):
    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return LMDBBackend(name="disk", capacity=capacity or 64 << 20, path=str(tmp_path / "lmdb"))


class TestFSBackend(BackendTests):
    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        return FSBackend(name="files", capacity=capacity, path=str(tmp_path / "fs"))
