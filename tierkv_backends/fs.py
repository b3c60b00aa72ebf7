"""``fs`` tier: one file per chunk in a sharded directory (local or shared filesystem).

A chunk is written to a temporary name in its final directory and renamed into place,
so a crash or a concurrent reader never sees a half-written chunk. With a capacity,
least-recently-used files (by this process's accesses; by modification time after a
restart) are deleted to make room.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from tierkv import serde
from tierkv.backend import BlobBackend, check_batch
from tierkv.errors import CapacityError, ChunkFormatError, ConfigError
from tierkv.keys import CacheKey
from tierkv.memory import as_bytes, contiguous_host, empty_host
from tierkv.options import Option, format_size
from tierkv.policy import LRUIndex
from tierkv_backends.lmdb import ensure_writable_dir

logger = logging.getLogger(__name__)

_SUFFIX = ".tkv"
_IO_THREADS = 4  # files are independent: a few threads overlap syscalls and page-cache copies


def _encode_parts(key: CacheKey, chunk: torch.Tensor) -> tuple[bytes, np.ndarray]:
    """Header bytes and a zero-copy view of the payload, written with one writev."""
    payload = as_bytes(contiguous_host(chunk.detach()))
    return serde.encode_header(chunk, key.fmt if key.fmt in ("vllm", "huggingface") else None, payload), payload


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    pending = [b.cast("B") for b in buffers if b.nbytes]
    while pending:
        written = os.writev(fd, pending)
        while pending and written >= pending[0].nbytes:
            written -= pending[0].nbytes
            pending.pop(0)
        if pending and written:
            pending[0] = pending[0][written:]


def _read_all(fd: int, into: memoryview, offset: int) -> int:
    """Read until ``into`` is full or the file ends; the number of bytes read."""
    got = 0
    while got < into.nbytes:
        n = os.preadv(fd, [into[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class FSBackend(BlobBackend):
    """Directory tier: ``<path>/ab/cd/<sha256 of key>.tkv``."""

    persistent: ClassVar[bool] = True
    bounded: ClassVar[bool] = True
    options: ClassVar[dict[str, Option]] = {
        "path": Option("path", required=True, doc="root directory of the chunk files"),
        "fsync": Option("bool", False, doc="fsync each file before renaming it into place"),
    }

    def __init__(self, name: str, capacity: int | None = None, path: str = "", fsync: bool = False) -> None:
        super().__init__(name, capacity)
        ensure_writable_dir(path, f"tier {name!r} path")
        self.root = Path(path)
        self.fsync = fsync
        probe = self.root / f".probe-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"tier {name!r} path: cannot write into {path!r}: {exc.strerror}") from exc
        self._index: LRUIndex[str] = LRUIndex()
        self._lock: asyncio.Lock | None = None
        self._scan()

    def _scan(self) -> None:
        found = []
        for dirpath, _, files in os.walk(self.root):
            for file in files:
                if file.endswith(_SUFFIX):
                    stat = os.stat(os.path.join(dirpath, file))
                    found.append((stat.st_mtime, file[: -len(_SUFFIX)], stat.st_size))
        for _, digest, size in sorted(found):
            self._index.add(digest, size)

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @staticmethod
    def _digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    def _file(self, digest: str) -> Path:
        return self.root / digest[:2] / digest[2:4] / f"{digest}{_SUFFIX}"

    def _write_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # -- batched paths: one worker-thread hop per batch, one copy per chunk -------------------
    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        self._ensure_open()
        check_batch(keys, chunks)
        latest = {self._digest(key.to_string()): (key, chunk) for key, chunk in zip(keys, chunks)}
        # encode on the loop thread: bad dtypes fail before anything is written or evicted
        encoded = {digest: _encode_parts(key, chunk) for digest, (key, chunk) in latest.items()}
        for header, payload in encoded.values():
            self._check_fits(len(header) + payload.nbytes)
        async with self._write_lock():
            await self._make_room({d: len(h) + p.nbytes for d, (h, p) in encoded.items()})
            await self._in_threads(list(encoded.items()), self._write_files)
            for digest, (header, payload) in encoded.items():
                self._index.add(digest, len(header) + payload.nbytes)
        return len(keys)

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        self._ensure_open()
        names = [key.to_string() for key in keys]
        digests = [self._digest(name) for name in names]
        results = await self._in_threads(digests, self._read_files)
        out: list[torch.Tensor | None] = []
        for name, digest, result in zip(names, digests, results):
            if isinstance(result, ChunkFormatError):
                await self._drop_corrupt(name, result)
                result = None
            elif result is not None:
                self._index.touch(digest)
            out.append(result)
        return out

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        self._ensure_open()
        paths = [self._file(self._digest(key.to_string())) for key in keys]
        return await asyncio.to_thread(lambda: [path.exists() for path in paths])

    async def _in_threads(self, items: list[Any], work: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """Run ``work`` over ``items`` in worker threads: one slice per thread, in order."""
        if not items:
            return []
        slices = min(_IO_THREADS, len(items))
        size = -(-len(items) // slices)
        parts = [items[i : i + size] for i in range(0, len(items), size)]
        done = await asyncio.gather(*(asyncio.to_thread(work, part) for part in parts))
        return [result for part in done for result in part]

    def _write_files(self, items: list[tuple[str, tuple[bytes, np.ndarray]]]) -> list[None]:
        for digest, (header, payload) in items:
            final = self._file(digest)
            final.parent.mkdir(parents=True, exist_ok=True)
            temporary = final.parent / f".{digest}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            try:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    _write_all(fd, [memoryview(header), memoryview(payload)])
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temporary, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(temporary)
                raise
        return [None] * len(items)

    def _read_files(self, digests: list[str]) -> list[torch.Tensor | ChunkFormatError | None]:
        return [self._read_file(digest) for digest in digests]

    def _read_file(self, digest: str) -> torch.Tensor | ChunkFormatError | None:
        """The chunk read straight into a pooled tensor (one copy), or why it is unusable."""
        try:
            fd = os.open(self._file(digest), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            head = os.pread(fd, serde.MAX_HEADER_BYTES, 0)
            try:
                header = serde.decode_header(head)
            except ChunkFormatError as exc:
                return exc
            out = empty_host(header.shape, header.dtype)
            payload = as_bytes(out)
            got = _read_all(fd, memoryview(payload), header.header_len)
            try:
                serde.verify_payload(header, payload[:got])
                if os.fstat(fd).st_size != header.header_len + header.payload_len:
                    raise ChunkFormatError("chunk file is longer than its header says")
            except ChunkFormatError as exc:
                return exc
            return out
        finally:
            os.close(fd)

    async def _make_room(self, sizes: dict[str, int]) -> None:
        if self.capacity is None:
            return
        need = sum(sizes.values()) - sum(self._index.size_of(d) or 0 for d in sizes)
        victims = self._index.victims(need, self.capacity, protect=list(sizes))
        if victims is None:
            raise CapacityError(f"tier {self.name!r}: no room for {format_size(need)}")
        if victims:
            await asyncio.to_thread(lambda: [self._unlink_sync(v) for v in victims])
            for victim in victims:
                self._count_eviction(self._index.remove(victim))

    # -- single-key byte interface (BlobBackend) -----------------------------------------------
    async def get_bytes(self, key: str) -> bytes | None:
        digest = self._digest(key)
        try:
            data = await asyncio.to_thread(self._file(digest).read_bytes)
        except FileNotFoundError:
            return None
        self._index.touch(digest)
        return data

    async def put_bytes(self, key: str, data: bytes) -> None:
        digest = self._digest(key)
        self._check_fits(len(data))
        async with self._write_lock():
            await self._make_room({digest: len(data)})
            await asyncio.to_thread(self._write_files, [(digest, (data, np.empty(0, dtype=np.uint8)))])
            self._index.add(digest, len(data))

    def _unlink_sync(self, digest: str) -> bool:
        try:
            os.remove(self._file(digest))
        except FileNotFoundError:
            return False
        return True

    async def delete_bytes(self, key: str) -> bool:
        digest = self._digest(key)
        existed = await asyncio.to_thread(self._unlink_sync, digest)
        self._index.remove(digest)
        return existed

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self._file(self._digest(key)).exists)

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "chunks": len(self._index), "path": str(self.root)}
