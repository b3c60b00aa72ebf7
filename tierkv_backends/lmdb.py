"""``lmdb`` tier: one LMDB environment on local disk, persistent, bounded, LRU.

Each chunk is two records written in one transaction: its chunk-format header in the
``meta`` database and its raw bytes in ``data``. Keeping the payload a record of its own
lets LMDB copy the tensor's bytes straight from the caller's buffer, and lets a read
copy them once, from the map into the output tensor, checksumming each step of 256 KiB as
it lands (from the CPU cache: each byte is read from memory once). A damaged chunk is a
miss whose destination may hold its bytes: the hit mask is the contract, as for ``fs``.

A ``batched_put`` is one write transaction. When the map fills (LMDB needs contiguous
free pages for a large value) least-recently-used chunks are evicted in a committed
transaction of their own and the batch is retried, instead of failing with MapFullError.
That is the tier's own capacity; the disk under it filling up is another matter: LMDB
fails the commit (it reports the short write as EIO), nothing of the batch is stored, and
the put raises ``tierkv.errors.TierFullError`` naming the tier and the map file.
What was committed before stays readable, and a later put succeeds once space returns.

Ownership: every transaction that reads the caller's chunks or writes into its
destinations runs in a worker thread that is waited for (``tierkv.chunks.ownership.finish``),
cancellation included, so a call never returns while LMDB still touches caller memory;
a commit that completed under a cancelled call is still indexed.

Over 400 lines (about 420) by choice: the write transaction, its map-full eviction and the
two-thread verified read share one environment and one lock; splitting them would spread
that locking across modules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hashlib
import logging
import os
import struct
from collections.abc import Sequence
from typing import Any, ClassVar

import lmdb
import torch

from tierkv.backend import FULL_DISK_ERRNOS, StorageBackend, check_batch, check_destinations, full_disk_error
from tierkv.backend.options import Option, format_size
from tierkv.chunks import copies, ownership, serde
from tierkv.chunks.keys import KV_FORMATS, CacheKey, count_by_scope, in_scope
from tierkv.chunks.memory import copy_into, direct_target
from tierkv.errors import CapacityError, ChunkFormatError, ConfigError, TierUnavailableError
from tierkv.policy.planner import SpeedSeed
from tierkv.policy.residency import LRUIndex
from tierkv_backends._paths import ensure_writable_dir

logger = logging.getLogger(__name__)

_SEQ = struct.Struct("<Q")  # write sequence number in front of each header: LRU order survives restarts
_MAX_KEY_BYTES = 500  # LMDB's default key limit is 511 bytes
_MAP_HEADROOM = 64 << 20
_checksum_executor: concurrent.futures.ThreadPoolExecutor | None = None
_read_executor: concurrent.futures.ThreadPoolExecutor | None = None
_PARALLEL_READ_BYTES = 8 << 20  # below this a second thread costs more than it saves
_PARALLEL_CHECKSUM_BYTES = 64 << 20


def _accounted(payload_nbytes: int, ndim: int = 8) -> int:
    """Bytes a chunk counts against the capacity: its payload and header (at ``ndim``
    dimensions; the largest a header holds when the chunk's own is not known yet)."""
    return payload_nbytes + 64 + 8 * ndim


def _checksum_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One thread that checksums payloads while the writing thread copies them into LMDB."""
    global _checksum_executor
    if _checksum_executor is None:
        _checksum_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierkv-lmdb-checksum")
    return _checksum_executor


def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One more thread for reads: large batches are read by two threads at once."""
    global _read_executor
    if _read_executor is None:
        _read_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierkv-lmdb-read")
    return _read_executor


def encode_key(key: CacheKey) -> bytes:
    """LMDB key for a chunk: its string form, or a digest of it when too long for LMDB."""
    raw = key.to_bytes()
    return raw if len(raw) <= _MAX_KEY_BYTES else b"#" + hashlib.sha256(raw).digest()


class LMDBBackend(StorageBackend):
    """Local-disk tier in one LMDB environment; survives process restarts."""

    speed_seed: ClassVar[SpeedSeed] = SpeedSeed(fixed_s=150e-6, bytes_per_s=2e9)  # page cache or local SSD
    persistent: ClassVar[bool] = True
    requires_capacity: ClassVar[bool] = True
    options: ClassVar[dict[str, Option]] = {
        "path": Option("path", required=True, doc="directory of the LMDB environment"),
        "sync": Option("bool", False, doc="fsync every commit: survive power loss, not just a crash"),
        "readahead": Option("bool", True, doc="OS readahead on the map (keep on for reads from disk)"),
        "max_readers": Option("int", 126, minimum=1, doc="LMDB reader slots: threads and processes reading at once"),
        "writemap": Option("bool", False, doc="write values straight into the map (one copy: about twice as fast "
                                              "while the environment fits in RAM, slower beyond it; every process "
                                              "sharing the environment must use the same setting)"),
        "verify": Option("bool", True, doc="check each chunk's checksum when it is read (LMDB cannot tear a "
                                           "committed write; off trusts the disk and reads at copy speed)"),
    }

    def __init__(self, name: str, capacity: int | None = None, path: str = "", sync: bool = False,
                 readahead: bool = True, max_readers: int = 126, verify: bool = True, writemap: bool = False) -> None:
        super().__init__(name, capacity)
        self.verify = verify
        assert self.capacity is not None  # requires_capacity guarantees it
        ensure_writable_dir(path, f"tier {name!r} path")
        self.path = path
        map_size = self.capacity + self.capacity // 8 + _MAP_HEADROOM
        try:
            self._env = lmdb.open(path, map_size=map_size, max_dbs=2, subdir=True, sync=sync, metasync=sync,
                                  readahead=readahead, max_readers=max_readers, lock=True, writemap=writemap)
        except lmdb.Error as exc:
            raise ConfigError(f"tier {name!r}: cannot open LMDB environment at {path!r}: {exc}") from exc
        self._meta = self._env.open_db(b"meta")
        self._data = self._env.open_db(b"data")
        self._index: LRUIndex[bytes] = LRUIndex()
        self._seq = 0
        self._write_lock: asyncio.Lock | None = None
        self._inflight: set[asyncio.Future[Any]] = set()
        self._load_index()
        if self._index.used_bytes > self.capacity:
            self._evict_now(self._index.victims(0, self.capacity) or self._index.keys())

    def _load_index(self) -> None:
        entries: list[tuple[int, bytes, int]] = []
        with self._env.begin(db=self._meta, buffers=True) as txn:
            for key, value in txn.cursor():
                try:
                    seq = _SEQ.unpack_from(value)[0]
                    header = serde.decode_header(bytes(value[_SEQ.size:]))
                except (ChunkFormatError, struct.error):
                    seq, size = 0, 0
                else:
                    size = header.header_len + header.payload_len
                entries.append((seq, bytes(key), size))
        for seq, key, size in sorted(entries):
            self._index.add(key, size)
            self._seq = max(self._seq, seq)

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    # -- helpers ----------------------------------------------------------------------------
    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` in a worker thread and return (or raise, or deliver a cancellation) only
        once it has stopped: it may read the caller's chunks or write into its destinations
        (``tierkv.chunks.ownership.finish``). LMDB errors become tierkv errors naming the path."""
        future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._inflight.add(future)
        try:
            return await ownership.finish(future)
        except lmdb.Error as exc:
            raise self._tier_error(exc) from exc
        finally:
            self._inflight.discard(future)

    def _tier_error(self, exc: lmdb.Error) -> Exception:
        """The tierkv error for an LMDB failure: TierFullError for a full disk, else TierUnavailableError."""
        full = self._full_disk(exc)
        return full if full is not None else TierUnavailableError(
            f"tier {self.name!r}: LMDB error at {self.path!r}: {exc}")

    def _full_disk(self, exc: lmdb.Error) -> Exception | None:
        """A TierFullError when LMDB failed because the disk is full. LMDB reports a short
        write while flushing pages as EIO ("Input/output error"), ENOSPC where it sees it."""
        text = str(exc)
        for code in sorted(FULL_DISK_ERRNOS):
            if os.strerror(code) in text:
                return full_disk_error(self.name, os.path.join(self.path, "data.mdb"), code)
        return None

    def _lock(self) -> asyncio.Lock:
        if self._write_lock is None:
            self._write_lock = asyncio.Lock()
        return self._write_lock

    def _evict_now(self, victims: Sequence[bytes]) -> None:
        with self._env.begin(write=True) as txn:
            for victim in victims:
                txn.delete(victim, db=self._meta)
                txn.delete(victim, db=self._data)
        for victim in victims:
            self._count_eviction(self._index.remove(victim))

    # -- writes -------------------------------------------------------------------------------
    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        self._ensure_open()
        check_batch(keys, chunks)
        latest = {encode_key(key): (key, chunk) for key, chunk in zip(keys, chunks)}
        sizes = {}
        for kb, (_, chunk) in latest.items():
            nbytes = chunk.numel() * chunk.element_size()
            sizes[kb] = _accounted(nbytes, chunk.dim())
            self._check_fits(sizes[kb])
        async with self._lock():
            self._ensure_open()
            need = sum(sizes.values()) - sum(self._index.size_of(kb) or 0 for kb in latest)
            victims = self._index.victims(need, self.capacity or 0, protect=latest)
            if victims is None:
                raise CapacityError(f"tier {self.name!r}: a batch of {format_size(need)} does not fit in "
                                    f"{format_size(self.capacity or 0)}")
            records = [(kb, key.fmt, chunk) for kb, (key, chunk) in latest.items()]
            first_seq = self._seq + 1
            self._seq += len(records)
            committed: list[tuple[list[bytes], list[tuple[bytes, int]]]] = []
            try:
                while True:
                    try:
                        await self._in_thread(self._write, victims, records, first_seq, committed)
                        break
                    except TierUnavailableError as exc:
                        if not isinstance(exc.__cause__, lmdb.MapFullError):
                            raise
                        victims = self._more_victims(victims, latest, need)
            finally:  # a commit counts even when the call was cancelled while it ran
                for evicted, written in committed:
                    for victim in evicted:
                        self._count_eviction(self._index.remove(victim))
                    for kb, size in written:
                        self._index.add(kb, size)
        return len(keys)

    def next_victims(self, chunk_nbytes: Sequence[int]) -> list[CacheKey] | None:
        """The chunks an eviction for chunks of ``chunk_nbytes`` bytes would take, in order
        (see ``tierkv.backend.NamesVictims``; each counted as a put accounts it, its header
        at the largest number of dimensions); a key stored as a digest (too long for LMDB)
        cannot be named and is left out."""
        if self.capacity is None:
            return []
        victims = self._index.victims(sum(_accounted(nbytes) for nbytes in chunk_nbytes), self.capacity)
        if victims is None:
            return None
        return [CacheKey.from_string(kb.decode()) for kb in victims if not kb.startswith(b"#")]

    def _more_victims(self, victims: list[bytes], protect: dict[bytes, Any], need: int) -> list[bytes]:
        """After MapFullError (free pages too fragmented for a large value): commit the planned
        evictions plus a quarter of the remaining evictable chunks, then retry with none."""
        candidates = [k for k in self._index.keys()
                      if k not in protect and k not in victims and not self._index.is_pinned(k)]
        if not candidates and not victims:
            raise CapacityError(f"tier {self.name!r}: LMDB map at {self.path!r} is full and nothing is left to "
                                f"evict for a batch of {format_size(need)}")
        try:
            self._evict_now(victims + candidates[: max(1, len(candidates) // 4)] if candidates else victims)
        except lmdb.Error as exc:
            raise self._tier_error(exc) from exc
        return []

    def _write(self, victims: list[bytes], records: list[tuple[bytes, str, torch.Tensor]], first_seq: int,
               committed: list[tuple[list[bytes], list[tuple[bytes, int]]]]) -> None:
        """One write transaction: delete ``victims``, put ``records``; once it committed,
        ``committed`` gets (victims, [(key, size)]). An aborted transaction changes nothing."""
        formats = [fmt if fmt in KV_FORMATS else None for _, fmt, _ in records]
        for (_, _, chunk), fmt in zip(records, formats):
            serde.check_encodable(chunk, fmt)
        payloads = [serde.contiguous_payload(chunk) for _, _, chunk in records]  # LMDB takes one buffer per value
        # checksums of a large batch overlap the data puts (LMDB copies with the GIL released);
        # a small one is checksummed here: waking a second thread costs more than it saves
        if sum(p.nbytes for p in payloads) >= _PARALLEL_CHECKSUM_BYTES:
            digests = _checksum_pool().submit(lambda: [serde.checksum(p) for p in payloads])
        else:
            digests = concurrent.futures.Future()
            digests.set_result([serde.checksum(p) for p in payloads])
        written: list[tuple[bytes, int]] = []
        try:
            with self._env.begin(write=True) as txn:
                for victim in victims:
                    txn.delete(victim, db=self._meta)
                    txn.delete(victim, db=self._data)
                for (kb, _, _), payload in zip(records, payloads):
                    txn.put(kb, payload, db=self._data)
                    copies.count(payload.nbytes)
                for offset, ((kb, _, chunk), fmt, payload, digest) in enumerate(
                        zip(records, formats, payloads, digests.result())):
                    header = serde.encode_header(chunk, fmt, payload, digest)
                    txn.put(kb, _SEQ.pack(first_seq + offset) + header, db=self._meta)
                    written.append((kb, len(header) + payload.nbytes))
        finally:  # the checksum thread reads the caller's chunks: never leave it running
            concurrent.futures.wait([digests])
        committed.append((victims, written))

    async def delete(self, key: CacheKey) -> bool:
        self._ensure_open()
        kb = encode_key(key)
        async with self._lock():
            existed = await self._in_thread(self._delete, [kb])
            self._index.remove(kb)
        return bool(existed)

    def _delete(self, kbs: list[bytes]) -> int:
        removed = 0
        with self._env.begin(write=True) as txn:
            for kb in kbs:
                removed += bool(txn.delete(kb, db=self._meta))
                txn.delete(kb, db=self._data)
        return removed

    async def drop_scope(self, model_name: str, scope: str) -> int:
        """Every chunk of ``scope`` in the environment leaves it, whichever process wrote it (the
        keys are read from the file, not this process's index); a reader's open transaction
        keeps its bytes."""
        self._ensure_open()
        async with self._lock():
            dropped = await self._in_thread(self._delete_in_scope, model_name, scope)
            for kb in dropped:
                self._index.remove(kb)
        return len(dropped)

    def _delete_in_scope(self, model_name: str, scope: str) -> list[bytes]:
        with self._env.begin(write=True) as txn:
            matching = [key for key in txn.cursor(db=self._meta).iternext(keys=True, values=False)
                        if in_scope(key, model_name, scope)]
            for kb in matching:
                txn.delete(kb, db=self._meta)
                txn.delete(kb, db=self._data)
        return matching

    # -- reads ---------------------------------------------------------------------------------
    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        self._ensure_open()
        kbs = [encode_key(key) for key in keys]
        results, corrupt = await self._in_thread(self._read, kbs)
        await self._after_read(kbs, [chunk is not None for chunk in results], corrupt)
        return results

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Copied once from the map into each destination and verified there as it lands (a
        damaged chunk is a miss whose destination may hold its bytes: the mask is the contract)."""
        self._ensure_open()
        check_destinations(keys, outs)
        kbs = [encode_key(key) for key in keys]
        hits, corrupt = await self._in_thread(self._read_into, kbs, list(outs))
        await self._after_read(kbs, hits, corrupt)
        return hits

    async def _after_read(self, kbs: list[bytes], hits: list[bool], corrupt: list[bytes]) -> None:
        for kb, hit in zip(kbs, hits):
            if hit:
                self._index.touch(kb)
        if corrupt:
            self.count_corrupt([(kb.hex(), "failed its checksum or header check") for kb in corrupt])
            async with self._lock():
                await self._in_thread(self._delete, corrupt)
                for kb in corrupt:
                    self._index.remove(kb)

    def _read_into(self, kbs: list[bytes], outs: list[torch.Tensor]) -> tuple[list[bool], list[bytes]]:
        """Read a batch into its destinations; a large batch is split over two threads, each
        in a read transaction of its own (one verifies a chunk while the other copies one)."""
        nbytes = sum(out.numel() * out.element_size() for out in outs)
        if len(kbs) < 2 or nbytes < _PARALLEL_READ_BYTES:
            return self._read_part(kbs, outs)
        context = contextvars.copy_context()  # the copy counter's path follows into the helper thread
        other = _read_pool().submit(context.run, self._read_part, kbs[1::2], outs[1::2])
        try:
            even_hits, even_corrupt = self._read_part(kbs[0::2], outs[0::2])
        finally:  # the helper writes into the caller's destinations too: never return before it stopped
            concurrent.futures.wait([other])
        odd_hits, odd_corrupt = other.result()
        hits = [False] * len(kbs)
        hits[0::2], hits[1::2] = even_hits, odd_hits
        return hits, even_corrupt + odd_corrupt

    def _read_part(self, kbs: list[bytes], outs: list[torch.Tensor]) -> tuple[list[bool], list[bytes]]:
        hits: list[bool] = []
        corrupt: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            for kb, out in zip(kbs, outs):
                meta = txn.get(kb, db=self._meta)
                payload = txn.get(kb, db=self._data)
                if meta is None or payload is None:
                    hits.append(False)
                    continue
                target, staged = direct_target(out)
                try:
                    header = serde.decode_header(meta[_SEQ.size:])
                    hit = serde.copy_payload_into(header, payload, target, verify=self.verify, in_destination=True)
                except ChunkFormatError:
                    corrupt.append(kb)
                    hit = False
                if hit and staged:
                    copy_into(out, target)
                hits.append(hit)
        return hits, corrupt

    def _read(self, kbs: list[bytes]) -> tuple[list[torch.Tensor | None], list[bytes]]:
        results: list[torch.Tensor | None] = []
        corrupt: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            for kb in kbs:
                meta = txn.get(kb, db=self._meta)
                payload = txn.get(kb, db=self._data)
                if meta is None or payload is None:
                    results.append(None)
                    continue
                try:
                    header = serde.decode_header(meta[_SEQ.size:])
                    results.append(serde.decode_payload(header, payload, verify=self.verify))
                except ChunkFormatError:
                    corrupt.append(kb)
                    results.append(None)
        return results, corrupt

    async def contains(self, key: CacheKey) -> bool:
        return (await self.batched_contains([key]))[0]

    def batched_contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        """This process's index first; keys it does not know are looked up in a read
        transaction (another process sharing the environment may have written them)."""
        if self._closed:
            return None
        kbs = [encode_key(key) for key in keys]
        found = [kb in self._index for kb in kbs]
        if all(found):
            return found
        try:
            with self._env.begin(db=self._meta, buffers=True) as txn:
                return [hit or txn.get(kb) is not None for kb, hit in zip(kbs, found)]
        except lmdb.Error:
            return None

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        self._ensure_open()
        try:
            with self._env.begin(db=self._meta, buffers=True) as txn:
                return [txn.get(encode_key(key)) is not None for key in keys]
        except lmdb.Error as exc:
            raise TierUnavailableError(f"tier {self.name!r}: LMDB error at {self.path!r}: {exc}") from exc

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._lock():
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)
            self._env.close()

    def scope_usage(self) -> dict[str, dict[str, int]]:
        return count_by_scope(self._index.sized_items())

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "chunks": len(self._index), "path": self.path}

