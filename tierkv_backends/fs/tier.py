r"""``fs`` tier: one file per chunk in a sharded directory (local or shared filesystem).

One module of about 560 lines, by choice: one tier over one shared state -- the in-memory index,
the rescans that refresh it for other processes' writes, the writers that rename into it and the
LRU that deletes from it -- with every method a few lines; the byte-level I/O helpers live in
``tierkv_backends.fs.files``.

A chunk is written to a temporary name in its final directory and renamed into place,
so a crash or a concurrent reader never sees a half-written chunk. With a capacity,
least-recently-used files (by this process's accesses; by modification time after a
restart) are deleted to make room.

Bytes move once: a put ``pwritev``\ s the chunk's contiguous pieces straight from the
caller's tensor (a token slice of a KV blob is not gathered first), checksumming each step
of about 1 MiB just before the kernel copies it (so each byte is read from RAM once, as by a
bare ``writev``), then writes the header, which holds that checksum, at the file's start.
A payload of 64 KiB or more starts at the file's first page boundary after the header (a hole
in between), so the kernel copies whole pages; files written before that, with the payload
right after the header, are read as well;
``batched_get_into`` ``preadv``\ s straight into the destination's pieces and verifies the
checksum there, in place: one copy per byte, also into memory the caller owns (the tier
does not ask the engine to stage, ``streams_into_destination`` is False). A damaged file
is a miss whose destination may hold some of its bytes: the hit mask is the contract,
never the contents of a slice reported missing. Which chunks exist is answered from an in-memory index
filled by a scan at start-up and by this process's writes (and, with
``rescan_interval_s``, refreshed from the directory for writers in other processes), so
a lookup never touches the filesystem. Every read path -- lookups from any thread
included -- only checks the clock; when the interval has passed the tier's event loop
starts a rescan in the background.

Ownership: the threads that ``writev`` from the caller's chunks or ``preadv`` into its
destinations are always waited for (``tierkv.chunks.ownership.finish``): a call returns,
raises or is cancelled only once none of them touches the caller's memory any more.

A full disk (ENOSPC, EDQUOT, EIO on write) is a ``tierkv.errors.TierFullError``
naming the tier and the file; the failed file is removed, what was written stays
readable, and the next put tries again (after space was freed, it succeeds).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import aiofiles.os
import torch

from tierkv.backend import BlobBackend, check_batch, check_destinations, full_disk_error
from tierkv.backend.options import Option, format_size
from tierkv.chunks import copies, ownership, serde
from tierkv.chunks.keys import KV_FORMATS, CacheKey
from tierkv.chunks.memory import as_bytes, byte_runs, copy_into, direct_target, empty_host
from tierkv.errors import CapacityError, ChunkFormatError, ConfigError
from tierkv.policy.planner import SpeedSeed
from tierkv.policy.residency import LRUIndex
from tierkv_backends._paths import ensure_writable_dir
from tierkv_backends.fs.files import payload_offset, payload_offset_in, pwrite_all, read_all, write_payload

logger = logging.getLogger("tierkv_backends.fs")

_SUFFIX = ".tkv"
_IO_THREADS = 4  # files are independent: a few threads overlap syscalls and page-cache copies
_DIGEST_CACHE = 1 << 16
MakeHeader = Callable[[int], bytes]
"""How to make a chunk file's header from its payload's checksum (known once the payload is written)."""


class FileParts(NamedTuple):
    """What one file is made of."""

    header: MakeHeader | bytes | bytearray
    """The header, or how to make it; plain bytes are written as they are, without a checksum."""
    runs: list[memoryview]
    """The payload's pieces, written back to back from ``payload_at`` on."""
    header_len: int
    payload_at: int
    """Where the payload starts (plain bytes: their length, no payload follows)."""

    @property
    def size(self) -> int:
        """The file's size once written."""
        return self.payload_at + sum(run.nbytes for run in self.runs)


def _encode_parts(key: CacheKey, chunk: torch.Tensor) -> FileParts:
    """How to make the header, zero-copy views of the payload's pieces, and where they go.
    Checked here (a bad dtype fails before anything is written); the checksum is left to the
    writer thread, which takes it piece by piece as it writes (see
    ``tierkv_backends.fs.files.write_payload``)."""
    fmt = key.fmt if key.fmt in KV_FORMATS else None
    runs = serde.payload_runs(chunk)
    length = len(serde.encode_header(chunk, fmt, runs, digest=0))  # the digest has a fixed size
    return FileParts(lambda digest: serde.encode_header(chunk, fmt, runs, digest=digest), runs, length,
                     payload_offset(length, sum(run.nbytes for run in runs)))


class FSBackend(BlobBackend):
    """Directory tier: ``<path>/ab/cd/<sha256 of key>.tkv``."""

    speed_seed: ClassVar[SpeedSeed] = SpeedSeed(fixed_s=300e-6, bytes_per_s=1.5e9)  # local SSD
    persistent: ClassVar[bool] = True
    bounded: ClassVar[bool] = True
    # reads land in the destination before they are verified, but a failed chunk is reported
    # missing and its slice is never used (the mask is the contract): no staging, one copy
    streams_into_destination: ClassVar[bool] = False
    options: ClassVar[dict[str, Option]] = {
        "path": Option("path", required=True, doc="root directory of the chunk files"),
        "fsync": Option("bool", False, doc="fsync each file before renaming it into place"),
        "rescan_interval_s": Option("float", None, minimum=0.0,
                                    doc="refresh the index from the directory this often (other writers "
                                        "sharing the directory); default: only at start-up"),
    }

    def __init__(self, name: str, capacity: int | None = None, path: str = "", fsync: bool = False,
                 rescan_interval_s: float | None = None) -> None:
        super().__init__(name, capacity)
        ensure_writable_dir(path, f"tier {name!r} path")
        self.root = Path(path)
        self.fsync = fsync
        self.rescan_interval_s = rescan_interval_s
        self._scanned_at = time.monotonic()
        self._rescan: asyncio.Task[None] | None = None
        self._rescan_kicked = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._note_loop()
        probe = self.root / f".probe-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"tier {name!r} path: cannot write into {path!r}: {exc.strerror}") from exc
        self._index: LRUIndex[str] = LRUIndex()
        self._digests: dict[str, str] = {}
        self._named: dict[str, CacheKey] = {}  # digest -> key, for the chunks this process wrote
        self._lock: asyncio.Lock | None = None
        self._scan()

    def _scan(self) -> None:
        for _, digest, size in sorted(self._list_files(known=set())):
            self._index.add(digest, size)

    def _list_files(self, known: set[str]) -> list[tuple[float, str, int]]:
        """(mtime, digest, size) of every chunk file; ``known`` digests are listed without a stat."""
        found = []
        for dirpath, _, files in os.walk(self.root):
            for file in files:
                if not file.endswith(_SUFFIX):
                    continue
                digest = file[: -len(_SUFFIX)]
                if digest in known:
                    found.append((0.0, digest, -1))
                    continue
                try:
                    stat = os.stat(os.path.join(dirpath, file))
                except FileNotFoundError:  # deleted by another process meanwhile
                    continue
                found.append((stat.st_mtime, digest, stat.st_size))
        return found

    def _note_loop(self) -> None:
        """Remember the event loop this tier runs on: lookups on other threads kick rescans there."""
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()

    def _rescan_due(self) -> bool:
        return (self.rescan_interval_s is not None and not self._closed
                and time.monotonic() - self._scanned_at >= self.rescan_interval_s)

    def _kick_rescan(self) -> None:
        """From any thread, at the cost of a clock read: when ``rescan_interval_s`` has passed,
        have the tier's loop start a background rescan. The caller never scans a directory."""
        if not self._rescan_due():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None:
            self._loop = self._loop or running
            self._maybe_rescan()
            return
        loop = self._loop
        if loop is None or loop.is_closed() or self._rescan_kicked:
            return
        self._rescan_kicked = True
        try:
            loop.call_soon_threadsafe(self._maybe_rescan)
        except RuntimeError:  # the loop closed meanwhile
            self._rescan_kicked = False

    def _maybe_rescan(self) -> None:
        """Refresh the index in the background when ``rescan_interval_s`` has passed (loop thread)."""
        self._rescan_kicked = False
        if not self._rescan_due() or (self._rescan is not None and not self._rescan.done()):
            return
        self._scanned_at = time.monotonic()
        self._rescan = asyncio.get_running_loop().create_task(self._refresh_index(),
                                                              name=f"tierkv-fs-rescan-{self.name}")

    async def _refresh_index(self) -> None:
        """Pick up chunks other processes wrote, forget the ones they deleted. One worker-thread
        walk of the tree; the index changes on the loop thread."""
        known = set(self._index.keys())
        try:
            listed = await asyncio.to_thread(self._list_files, known)
        except OSError as exc:
            logger.warning("tier %r: rescanning %s failed: %s", self.name, self.root, exc)
            return
        present = {digest for _, digest, _ in listed}
        for digest in [d for d in known if d not in present and d in self._index and not self._index.is_pinned(d)]:
            self._forget(digest)  # deleted by another process
        for _, digest, size in sorted(listed):
            if size >= 0 and digest not in self._index:
                self._index.add(digest, size)

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def _digest(self, key: str) -> str:
        """File name of a key string (SHA-256, so any model name makes a safe name), memoized:
        a lookup asks for it per chunk."""
        digest = self._digests.get(key)
        if digest is None:
            if len(self._digests) >= _DIGEST_CACHE:
                self._digests.clear()
            digest = self._digests[key] = hashlib.sha256(key.encode()).hexdigest()
        return digest

    def _file(self, digest: str) -> Path:
        return self.root / digest[:2] / digest[2:4] / f"{digest}{_SUFFIX}"

    def _write_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # -- batched paths: one worker-thread hop per batch, one copy per chunk -------------------
    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Write each chunk to a temporary file and rename it into place, straight from the
        caller's memory (``pwritev``, checksummed on the way). Returns only when no thread reads that memory any more,
        cancellation included; what was renamed into place is indexed whatever happens, a
        file that failed or never started is not there (no partial file is ever visible)."""
        self._ensure_open()
        check_batch(keys, chunks)
        self._note_loop()
        latest = {self._digest(key.to_string()): (key, chunk) for key, chunk in zip(keys, chunks)}
        # encode on the loop thread: bad dtypes fail before anything is written or evicted
        parts = {digest: _encode_parts(key, chunk) for digest, (key, chunk) in latest.items()}
        sizes = {digest: file.size for digest, file in parts.items()}
        for size in sizes.values():
            self._check_fits(size)
        async with self._write_lock():
            await self._make_room(sizes)
            await self._write_indexed(list(parts.items()), sizes, {digest: key for digest, (key, _) in latest.items()})
        return len(keys)

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        """Read through ``batched_get``: a chunk file is not one encoded chunk when its
        payload starts on a page boundary (see ``tierkv_backends.fs.files.payload_offset``)."""
        return (await self.batched_get([key]))[0]

    async def _write_indexed(self, items: list[tuple[str, FileParts]], sizes: dict[str, int],
                             named: Mapping[str, CacheKey] | None = None) -> None:
        """Write files in worker threads; index every file renamed into place, even when
        another failed or the call was cancelled (the threads are waited for either way).
        ``named``: the key of each digest, kept for the files written (``next_victims``)."""
        written: list[str] = []
        try:
            await self._in_threads(items, lambda part: self._write_files(part, written))
        finally:
            for digest in written:
                self._index.add(digest, sizes[digest])
                if named is not None:
                    self._named[digest] = named[digest]

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        self._ensure_open()
        self._kick_rescan()
        names = [key.to_string() for key in keys]
        digests = [self._digest(name) for name in names]
        results = await self._in_threads(digests, self._read_files)
        return await self._settle(names, digests, results)

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """``preadv`` straight into each destination's pieces, checksum verified after."""
        self._ensure_open()
        check_destinations(keys, outs)
        self._kick_rescan()
        names = [key.to_string() for key in keys]
        digests = [self._digest(name) for name in names]
        results = await self._in_threads(list(zip(digests, outs)), self._read_files_into)
        settled = await self._settle(names, digests, results)
        return [hit is True for hit in settled]

    async def _settle(self, names: list[str], digests: list[str], results: list[Any]) -> list[Any]:
        """Corrupt files become misses (deleted, counted); hits are marked as recently used."""
        settled = []
        for name, digest, result in zip(names, digests, results):
            if isinstance(result, ChunkFormatError):
                self._forget(digest)
                await self._drop_corrupt(name, result)
                result = None
            elif result is not None and result is not False:
                self._index.touch(digest)
            settled.append(result)
        return settled

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        self._ensure_open()
        self._kick_rescan()
        return [self._digest(key.to_string()) in self._index for key in keys]

    def batched_contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        if self._closed:
            return None
        self._kick_rescan()  # a clock read; the rescan itself runs on the tier's loop
        index, digest = self._index, self._digest
        return [digest(key.to_string()) in index for key in keys]

    async def _in_threads(self, items: list[Any], work: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """Run ``work`` over ``items`` in worker threads: one slice per thread, in order.

        The threads read or write memory the caller owns (its chunks, its destinations), so
        this returns, raises or delivers a cancellation only once every thread has stopped
        (``tierkv.chunks.ownership.finish``); the first error is raised after all of them ended.
        """
        if not items:
            return []
        slices = min(_IO_THREADS, len(items))
        size = -(-len(items) // slices)
        parts = [items[i : i + size] for i in range(0, len(items), size)]
        done = await ownership.finish(asyncio.gather(*(asyncio.to_thread(work, part) for part in parts),
                                                     return_exceptions=True))
        results: list[Any] = []
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome
            results.extend(outcome)
        return results

    def _write_files(self, items: list[tuple[str, FileParts]], written: list[str] | None = None) -> list[None]:
        """Write each file under a temporary name and rename it into place; ``written`` gets
        each digest renamed into place. A full disk is a TierFullError; the temporary file of
        a failed write is removed, so no partial file is ever visible."""
        for digest, parts in items:
            final = self._file(digest)
            temporary = final.parent / f".{digest}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            try:
                fd = self._create(temporary)
                try:
                    self._write_file(fd, parts)
                finally:
                    os.close(fd)
                os.replace(temporary, final)
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.remove(temporary)
                full = full_disk_error(self.name, final, exc.errno) if isinstance(exc, OSError) else None
                if full is not None:
                    raise full from exc
                raise
            if written is not None:
                written.append(digest)
        return [None] * len(items)

    @staticmethod
    def _create(temporary: Path) -> int:
        """Open a new temporary file; its shard directory is made only when missing (one
        failed open the first time, instead of a mkdir per file)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            return os.open(temporary, flags, 0o644)
        except FileNotFoundError:
            temporary.parent.mkdir(parents=True, exist_ok=True)
            return os.open(temporary, flags, 0o644)

    def _write_file(self, fd: int, parts: FileParts) -> None:
        """The payload after the header's place, checksummed as it goes, then the header
        (which holds that checksum) at the start: the file is whole only once both are in,
        and it is renamed into place only then."""
        header = parts.header
        head: bytes | bytearray
        if callable(header):
            head = header(write_payload(fd, parts.runs, parts.payload_at))
            if len(head) != parts.header_len:
                raise RuntimeError(f"chunk header is {len(head)} bytes, {parts.header_len} were reserved")
            copies.count(sum(run.nbytes for run in parts.runs))
        else:
            head = header
        pwrite_all(fd, [memoryview(head)], 0)
        if self.fsync:
            os.fsync(fd)

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
            problem = self._read_payload(fd, header, [memoryview(as_bytes(out))])
            return out if problem is None else problem
        finally:
            os.close(fd)

    def _read_files_into(self, items: list[tuple[str, torch.Tensor]]) -> list[bool | ChunkFormatError]:
        fds: list[int | None] = []
        for digest, _ in items:  # open and hint the whole slice first: the disk sees every read at once
            try:
                fd = os.open(self._file(digest), os.O_RDONLY)
            except FileNotFoundError:
                fds.append(None)
                continue
            if len(items) > 1:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            fds.append(fd)
        try:
            return [False if fd is None else self._read_file_into(fd, out) for fd, (_, out) in zip(fds, items)]
        finally:
            for opened in fds:
                if opened is not None:
                    os.close(opened)

    def _read_file_into(self, fd: int, out: torch.Tensor) -> bool | ChunkFormatError:
        """Read one chunk file into ``out`` (one copy); False when it holds another layout."""
        try:
            header = serde.decode_header(os.pread(fd, serde.MAX_HEADER_BYTES, 0))
        except ChunkFormatError as exc:
            return exc
        if not serde.fits(header, out):
            return False
        target, staged = direct_target(out)
        problem = self._read_payload(fd, header, byte_runs(target))
        if problem is not None:
            return problem
        if staged:
            copy_into(out, target)
        return True

    @staticmethod
    def _read_payload(fd: int, header: serde.ChunkHeader, runs: list[memoryview]) -> ChunkFormatError | None:
        """Read the payload into ``runs`` and verify it; the problem, if any."""
        try:
            offset = payload_offset_in(os.fstat(fd).st_size, header.header_len, header.payload_len)
            if offset is None:
                raise ChunkFormatError("chunk file size differs from what its header says (torn or appended)")
            got = read_all(fd, runs, offset)
            copies.count(got)
            if got != header.payload_len:
                raise ChunkFormatError(f"truncated chunk file: read {got} payload bytes, header says {header.payload_len}")
            serde.verify_payload(header, runs)
        except ChunkFormatError as exc:
            return exc
        return None

    async def _make_room(self, sizes: dict[str, int]) -> None:
        if self.capacity is None:
            return
        need = sum(sizes.values()) - sum(self._index.size_of(d) or 0 for d in sizes)
        victims = self._index.victims(need, self.capacity, protect=list(sizes))
        if victims is None:
            raise CapacityError(f"tier {self.name!r}: no room for {format_size(need)}")
        outcomes = await asyncio.gather(*(self._unlink(victim) for victim in victims), return_exceptions=True)
        for victim, outcome in zip(victims, outcomes):
            if isinstance(outcome, BaseException):
                logger.warning("tier %r: could not evict %s: %s", self.name, self._file(victim), outcome)
                continue
            self._count_eviction(self._forget(victim))

    def _forget(self, digest: str) -> int:
        """Drop ``digest`` from the index (and its name); the bytes it held."""
        self._named.pop(digest, None)
        return self._index.remove(digest)

    def next_victims(self, chunk_nbytes: Sequence[int]) -> list[CacheKey] | None:
        """The chunks an eviction for chunks of ``chunk_nbytes`` bytes (and their headers)
        would take, in order (see ``tierkv.backend.NamesVictims``). Files another
        process wrote have no name here and are left out (nobody here has seen them)."""
        if self.capacity is None:
            return []
        victims = self._index.victims(sum(nbytes + payload_offset(serde.MAX_HEADER_BYTES, nbytes) for nbytes in chunk_nbytes),
                                       self.capacity)
        if victims is None:
            return None
        return [self._named[digest] for digest in victims if digest in self._named]

    async def _unlink(self, digest: str) -> bool:
        """Remove a chunk file off the loop thread (aiofiles); whether it was there."""
        try:
            await aiofiles.os.remove(self._file(digest))
        except FileNotFoundError:
            return False
        return True

    # -- single-key byte interface (BlobBackend) -----------------------------------------------
    async def get_bytes(self, key: str) -> bytes | None:
        self._ensure_open()
        self._kick_rescan()
        digest = self._digest(key)
        try:
            data = await asyncio.to_thread(self._file(digest).read_bytes)
        except FileNotFoundError:
            return None
        self._index.touch(digest)
        return data

    async def put_bytes(self, key: str, data: bytes | bytearray) -> None:
        self._ensure_open()
        digest = self._digest(key)
        self._check_fits(len(data))
        async with self._write_lock():
            await self._make_room({digest: len(data)})
            await self._write_indexed([(digest, FileParts(data, [], len(data), len(data)))], {digest: len(data)})

    async def delete_bytes(self, key: str) -> bool:
        digest = self._digest(key)
        existed = await self._unlink(digest)
        self._forget(digest)
        return existed

    async def exists(self, key: str) -> bool:
        return bool(await aiofiles.os.path.exists(self._file(self._digest(key))))

    async def close(self) -> None:
        """Stop a rescan in flight (its thread finishes its walk; the index is not touched after)."""
        rescan, self._rescan = self._rescan, None
        await super().close()
        if rescan is not None and not rescan.done() and rescan.get_loop() is asyncio.get_running_loop():
            rescan.cancel()
            await asyncio.gather(rescan, return_exceptions=True)

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "chunks": len(self._index), "path": str(self.root)}
