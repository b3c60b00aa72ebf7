"""``fs`` tier: one file per chunk in a sharded directory (local or shared filesystem).

A chunk is written to a temporary name in its final directory and renamed into place,
so a crash or a concurrent reader never sees a half-written chunk. With a capacity,
least-recently-used files (by this process's accesses; by modification time after a
restart) are deleted to make room.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from pathlib import Path
from typing import ClassVar

import aiofiles
import aiofiles.os

from tierkv.backend import BlobBackend
from tierkv.errors import CapacityError, ConfigError
from tierkv.options import Option, format_size
from tierkv.policy import LRUIndex
from tierkv_backends.lmdb import ensure_writable_dir

_SUFFIX = ".tkv"


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

    async def get_bytes(self, key: str) -> bytes | None:
        digest = self._digest(key)
        try:
            async with aiofiles.open(self._file(digest), "rb") as handle:
                data = await handle.read()
        except FileNotFoundError:
            return None
        self._index.touch(digest)
        return data

    async def put_bytes(self, key: str, data: bytes) -> None:
        digest = self._digest(key)
        self._check_fits(len(data))
        async with self._write_lock():
            if self.capacity is not None:
                replaced = self._index.size_of(digest) or 0
                victims = self._index.victims(len(data) - replaced, self.capacity, protect=[digest])
                if victims is None:
                    raise CapacityError(f"tier {self.name!r}: no room for {format_size(len(data))}")
                for victim in victims:
                    await self._unlink(victim)
                    self._count_eviction(self._index.remove(victim))
            final = self._file(digest)
            await aiofiles.os.makedirs(final.parent, exist_ok=True)
            temporary = final.parent / f".{digest}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            try:
                async with aiofiles.open(temporary, "wb") as handle:
                    await handle.write(data)
                    if self.fsync:
                        await handle.flush()
                        await asyncio.to_thread(os.fsync, handle.fileno())
                await aiofiles.os.replace(temporary, final)
            except BaseException:
                await self._remove_quietly(temporary)
                raise
            self._index.add(digest, len(data))

    async def _remove_quietly(self, path: Path) -> None:
        try:
            await aiofiles.os.remove(path)
        except OSError:
            pass

    async def _unlink(self, digest: str) -> bool:
        try:
            await aiofiles.os.remove(self._file(digest))
        except FileNotFoundError:
            return False
        return True

    async def delete_bytes(self, key: str) -> bool:
        digest = self._digest(key)
        existed = await self._unlink(digest)
        self._index.remove(digest)
        return existed

    async def exists(self, key: str) -> bool:
        return await aiofiles.os.path.exists(self._file(self._digest(key)))

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "chunks": len(self._index), "path": str(self.root)}
