"""``shm`` tier: one host cache per node, in a pool file every serving process maps.

One module of about 450 lines, by choice: the tier's calls share one attached pool, its lock
deadline and its counters; the pool, its file, lock, processes and journal already stand apart.

Data-parallel replicas, one vLLM per NUMA socket, an SGLang beside a vLLM, a restarted engine
beside a live one: every process whose config names the same ``path`` shares one pool of
``capacity`` bytes, with no daemon. A prefix one process stored is a hit in the others at
memory speed, host memory holds it once, and one LRU over the whole pool decides what stays.
Keys bind model, revision, adapter and tenant, so processes serving different models share a
pool safely; ``stats()`` and ``occupancy()`` count what each scope holds.

The data path is the ``cpu`` tier's: a put reserves room in the pool and the source writes
each chunk there once (in place, ``tierkv.backend.InPlaceTier``), a read copies once out
of the pool into the caller's memory (``out=``, a connector's pages), and holds lend the
pool's memory to connectors and fills. What the pool guarantees when processes die at any
instant is ``tierkv_backends.shm.pool``'s; where CUDA is present the data area is
registered as pinned memory in every process (pieces of at most 64 GiB), so device copies go
straight to and from it.

Survives: a process crash (whatever it committed stays, what it was writing never shows, and
what it held is given back), a restart of every process (the file stays). Not a reboot: the
pool lives in memory (``/dev/shm``, or a hugetlbfs mount).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from tierkv.backend import StorageBackend, check_batch, check_destinations, fits_destination
from tierkv.backend.options import Option, format_size
from tierkv.chunks import serde
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.kvlayout import nbytes_of
from tierkv.chunks.memory import cuda_available, empty_host
from tierkv.policy.planner import HOST_MEMORY_SEED, SpeedSeed
from tierkv.routing import offload
from tierkv_backends.shm.file import MEMORY_FILE_SYSTEMS, file_system_type
from tierkv_backends.shm.layout import (
    HEADER_BYTES,
    MIN_JOURNAL_BYTES,
    SHAPE_DIMS,
    Geometry,
    Layout,
    default_holds_per_process,
    default_max_chunks,
)
from tierkv_backends.shm.lock import PoolBusyError
from tierkv_backends.shm.operations import PoolOperations, default_path
from tierkv_backends.shm.pool import Held, PoolBrokenError, SharedPool, digest

logger = logging.getLogger("tierkv_backends.shm")

_PIN_PIECE = 64 << 30  # cudaHostRegister takes at most this much at once on some drivers
_DIGESTS_KEPT = 1 << 16


def _geometry(capacity: int, max_chunks: int | None, max_processes: int, holds_per_process: int | None,
              journal_bytes: int | None) -> Geometry:
    """A pool's geometry, every size not given derived from the capacity (so every process
    configured alike derives the same one): the index, hold rows and journal grow with it."""
    chunks = max_chunks or default_max_chunks(capacity)
    return Geometry(capacity, chunks, max_processes, holds_per_process or default_holds_per_process(chunks),
                    _journal_size(journal_bytes))


class _FileMode:
    """The ``mode`` option: a file mode given as an int (0o600) or an octal string ("0600",
    "660"), one its owner can read and write; the configuration reference shows it in octal."""

    __name__ = "file mode (octal)"

    def __call__(self, value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError(f"expected a file mode such as 0600, got {value!r}")
        if isinstance(value, int):
            mode = value
        elif isinstance(value, str):
            try:
                mode = int(value, 8)
            except ValueError as exc:
                raise ValueError(f"expected an octal file mode such as 0600, got {value!r}") from exc
        else:
            raise ValueError(f"expected a file mode such as 0600, got {value!r}")
        if not 0 <= mode <= 0o777 or not mode & 0o600 == 0o600:
            raise ValueError(f"expected a file mode its owner can read and write, 0600 to 0777, got {oct(mode)}")
        return mode

    @staticmethod
    def show(value: int) -> str:
        return f"0{value:o}"


_mode = _FileMode()


def _scope_id(scope: str) -> int:
    """The 64-bit number a key's scope is counted under (its 16 hex digits)."""
    try:
        return int(scope, 16) & 0xFFFFFFFFFFFFFFFF if scope else 0
    except ValueError:
        return digest(scope.encode())[0]


def _journal_size(size: int | None) -> int:
    """The journal's bytes as the pool's geometry takes them (0: its default), a multiple of 8."""
    if size is None:
        return 0
    if size < MIN_JOURNAL_BYTES:
        raise ValueError(f"journal_bytes: expected at least {format_size(MIN_JOURNAL_BYTES)}, got {size} bytes")
    return size // 8 * 8


class PoolHold:
    """The bytes of one chunk in the pool, kept from eviction until ``release``."""

    __slots__ = ("_backend", "_held", "chunk")

    def __init__(self, backend: SharedMemoryBackend, held: Held, chunk: torch.Tensor) -> None:
        self._backend: SharedMemoryBackend | None = backend
        self._held = held
        self.chunk = chunk

    def release(self) -> bool:
        """Let go (idempotent); False when this process had been reaped as dead meanwhile and the
        bytes read under the hold may not be the chunk's."""
        backend, self._backend = self._backend, None
        return backend._release([self._held])[0] if backend is not None else True


class SharedMemoryBackend(PoolOperations, StorageBackend):
    """A tier whose chunks live in a pool file shared by every process on the node."""

    speed_seed: ClassVar[SpeedSeed] = HOST_MEMORY_SEED
    persistent: ClassVar[bool] = True  # across processes and their crashes; not across a reboot
    requires_capacity: ClassVar[bool] = True
    options: ClassVar[dict[str, Option]] = {
        "path": Option("path", None, doc="the pool file, on a memory file system (default "
                                         "/dev/shm/tierkv-<uid>.pool); every process naming it shares the pool"),
        "mode": Option(_mode, 0o600, doc="permissions of a pool this process creates (it holds every tenant's "
                                         "KV: owner only unless a group of service users shares it)"),
        "max_chunks": Option("int", None, minimum=16, doc="chunks the pool can index (default: one per 256 KiB "
                                                          "of capacity, at most 1M; under 1 GiB one per 8 KiB "
                                                          "up to 4096)"),
        "max_processes": Option("int", 64, minimum=1, doc="processes attached at once"),
        "holds_per_process": Option("int", None, minimum=16, doc="chunks one process may hold at once "
                                                                 "(reads in flight, fills waiting; default: "
                                                                 "4 per max_chunks, 256 to 16384)"),
        "lease_s": Option("float", 30.0, minimum=0.1, doc="a live process whose heartbeat stopped for this long "
                                                          "(stopped, frozen) has its holds taken back, so the pool "
                                                          "can evict what it was reading; a process is dead only when "
                                                          "the kernel says so"),
        "lock_timeout_s": Option("float", 1.0, minimum=0.001, doc="how long a call waits for the pool's lock "
                                                                  "before it gives up (a store goes to the next "
                                                                  "tier, a read misses) and, until the lock is free "
                                                                  "again, stops waiting for it"),
        "journal_bytes": Option("size", None, doc="the pool's journal (what every process stored and what "
                                                  "left: how engines announce each other's chunks as KV events); "
                                                  "default 2 KiB per indexed chunk and at least an eighth "
                                                  "of the capacity up to 16 MiB, at most 256 MiB"),
        "retain_share": Option("float", 0.5, minimum=0.0,
                               doc="the share of the pool's capacity that retained chunks (hints that keep a "
                                   "prefix through evictions: Engine.retain, a request's retain_s) may take, "
                                   "every process's together, 0 to 1; give every process the same"),
        "pinned": Option("bool", None, doc="register the pool as pinned memory for CUDA copies (default: when "
                                           "CUDA is available)"),
    }

    def __init__(self, name: str, capacity: int | None = None, path: str | None = None, mode: int | str = 0o600,
                 max_chunks: int | None = None, max_processes: int = 64, holds_per_process: int | None = None,
                 lease_s: float = 30.0, lock_timeout_s: float = 1.0, journal_bytes: int | None = None,
                 retain_share: float = 0.5, pinned: bool | None = None) -> None:
        super().__init__(name, capacity)
        assert self.capacity is not None  # requires_capacity guarantees it
        self.path = path or default_path()
        kind = file_system_type(self.path)
        if kind and kind not in MEMORY_FILE_SYSTEMS:
            logger.warning("tier %r: %s is on a %s file system, not in memory (tmpfs such as /dev/shm, or "
                           "hugetlbfs): the kernel writes the pool's pages back to disk, and a half-written pool "
                           "may survive a reboot", name, self.path, kind)
        geometry = _geometry(self.capacity, max_chunks, max_processes, holds_per_process, journal_bytes)
        self.pool = SharedPool(self.path, geometry, _mode(mode), lease_s, where=f"tier {name!r}",
                               lock_timeout_s=lock_timeout_s)
        if not 0.0 <= retain_share <= 1.0:
            raise ValueError(f"retain_share: expected a share of the capacity from 0 to 1, got {retain_share!r}")
        self.retain_share = float(retain_share)
        self._digests: dict[CacheKey, tuple[int, int]] = {}
        self._named: dict[int, int] = {}  # scope id -> the journal's head when this process last named it
        self._pinned: list[int] = []
        if pinned if pinned is not None else cuda_available():
            self._pin()
        self.device = torch.device("cpu")
        self.counters.update({"stale_reads": 0, "skipped_stores": 0, "busy_misses": 0, "journal_busy": 0,
                              "busy_hints": 0})

    @classmethod
    def file_size(cls, capacity: int, path: str | None = None, max_chunks: int | None = None,
                  max_processes: int = 64, holds_per_process: int | None = None,
                  journal_bytes: int | None = None) -> dict[str, Any]:
        """What a pool of ``capacity`` costs in its file system (``tierkv pool-size``): the file's
        bytes, where they go, and the room the file system at ``path`` has for it."""
        geometry = _geometry(capacity, max_chunks, max_processes, holds_per_process, journal_bytes)
        holds_per_process = geometry.holds_per_process
        layout = Layout.of(geometry)
        holds = 4 * max_processes * holds_per_process
        path = path or default_path()
        directory = os.path.dirname(os.path.abspath(path)) or "."
        try:
            stats = os.statvfs(directory)
            free: int | None = stats.f_bavail * stats.f_frsize
        except OSError:
            free = None
        return {"path": path, "capacity": capacity, "file_bytes": layout.file_bytes,
                "index_bytes": layout.holds - HEADER_BYTES, "hold_rows_bytes": holds,
                "journal_bytes": geometry.journal_bytes,
                "header_and_alignment_bytes": HEADER_BYTES + layout.data - layout.holds - holds - geometry.journal_bytes,
                "max_chunks": geometry.max_chunks, "max_processes": max_processes,
                "holds_per_process": holds_per_process, "file_system": file_system_type(directory) or None,
                "free_bytes": free, "fits": None if free is None else free >= layout.file_bytes}

    # -- keys ----------------------------------------------------------------------------------
    def _digest(self, key: CacheKey) -> tuple[int, int]:
        found = self._digests.get(key)
        if found is None:
            if len(self._digests) >= _DIGESTS_KEPT:
                self._digests.clear()
            found = self._digests[key] = digest(key.to_bytes())
        return found

    def _digest_rows(self, keys: Sequence[CacheKey]) -> np.ndarray:
        return np.array([self._digest(key) for key in keys], dtype=np.uint64).reshape(-1, 2)

    # -- CUDA ----------------------------------------------------------------------------------
    def _pin(self) -> None:
        """Register the data area with CUDA (page-locked for DMA), piece by piece."""
        try:
            cudart = torch.cuda.cudart()
            base, size = self.pool.data.data_ptr(), self.pool.data.numel()
            for start in range(0, size, _PIN_PIECE):
                length = min(_PIN_PIECE, size - start)
                error = cudart.cudaHostRegister(base + start, length, 0)
                if int(error) != 0:
                    raise RuntimeError(f"cudaHostRegister returned {error}")
                self._pinned.append(base + start)
        except Exception as exc:  # pageable memory still works, more slowly
            logger.warning("tier %r: could not register the pool as pinned memory (%s); CUDA copies stage", self.name,
                           exc)
            self._unpin()

    def _unpin(self) -> None:
        if not self._pinned:
            return
        cudart = torch.cuda.cudart()
        for pointer in self._pinned:
            cudart.cudaHostUnregister(pointer)
        self._pinned.clear()

    @property
    def pinned(self) -> bool:
        return bool(self._pinned)

    # -- copies (as a memory tier's) ---------------------------------------------------------------
    async def copy_chunks(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (dst, src) pair, off the event loop when large; waited for to its end."""
        await offload.copy_pairs(pairs)

    def empty_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return empty_host(shape, dtype)

    # -- writes in place -------------------------------------------------------------------------
    async def put_with(self, keys: Sequence[CacheKey], layouts: Sequence[tuple[tuple[int, ...], torch.dtype]],
                       write: Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]],
                       on_commit: Callable[[], None] | None = None) -> int:
        """Reserve room in the pool, let ``write`` fill it (key -> view of the pool), then commit:
        the chunks become visible to every process at once, whole. ``write`` must not return
        while a copy into the views still runs."""
        self._ensure_open()
        if len(keys) != len(layouts):
            raise ValueError(f"put_with got {len(keys)} keys but {len(layouts)} layouts")
        latest = dict(zip(keys, layouts))  # later duplicates win
        for shape, dtype in latest.values():  # checked before the pool's lock is taken
            if len(shape) > SHAPE_DIMS:
                raise ValueError(f"tier {self.name!r}: a chunk has at most {SHAPE_DIMS} dimensions, got {tuple(shape)}")
            serde.dtype_code(dtype)
            self._check_fits(nbytes_of(shape, dtype))
        batch = list(latest)
        try:
            async with self.pool.alock():
                entries = self.pool.reserve([self._digest(key) for key in batch],
                                            [_scope_id(key.scope) for key in batch], [latest[key] for key in batch])
                self._count_evictions()
                self._name_scopes(batch)
        except (PoolBusyError, PoolBrokenError):
            self.counters["skipped_stores"] += len(batch)
            raise
        try:
            await write({key: self.pool.view(entry) for key, entry in zip(batch, entries)})
        except BaseException:
            with contextlib.suppress(PoolBusyError, PoolBrokenError):  # given back later; the first error stands
                await self._finish(entries, commit=False)
            raise
        await self._finish(entries, commit=True)
        if on_commit is not None:
            on_commit()
        return len(keys)

    async def _finish(self, entries: list[int], commit: bool) -> None:
        """Commit (or give back) reserved entries; when the lock stays busy (or the file shrank)
        they are given back at this process's next holding of the lock, never left behind."""
        try:
            async with self.pool.alock():
                if commit:
                    self.pool.commit(entries)
                else:
                    self.pool.abort(entries)
        except (PoolBusyError, PoolBrokenError):
            self.pool.abort_later(entries)
            self.counters["skipped_stores"] += len(entries)
            raise

    def _count_evictions(self) -> None:
        made, self.pool.evicted = self.pool.evicted, 0
        freed, self.pool.evicted_bytes = self.pool.evicted_bytes, 0
        self.counters["evictions"] += made
        self.counters["evicted_bytes"] += freed

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        self._ensure_open()
        check_batch(keys, chunks)
        latest = dict(zip(keys, chunks))

        async def write(views: dict[CacheKey, torch.Tensor]) -> None:
            await self.copy_chunks([(view, latest[key].detach()) for key, view in views.items()])
        await self.put_with(list(latest), [(tuple(c.shape), c.dtype) for c in latest.values()], write)
        return len(keys)

    # -- reads -------------------------------------------------------------------------------------
    def hold(self, keys: Sequence[CacheKey], pin: bool = True) -> list[PoolHold | None]:
        """The bytes of each committed chunk (None for misses), kept until released: a held
        chunk is never evicted or overwritten, by any process (``pin`` makes no difference here:
        a chunk being read is never evicted)."""
        self._ensure_open()
        if not keys:
            return []
        try:
            with self.pool.lock():
                held = self.pool.hold(self._digest_rows(keys))
                views = [None if h is None else self.pool.view(h.entry) for h in held]
        except (PoolBusyError, PoolBrokenError):  # the lock is stuck, or the file shrank: misses
            self.counters["busy_misses"] += len(keys)
            return [None] * len(keys)
        return [None if h is None or view is None else PoolHold(self, h, view) for h, view in zip(held, views)]

    def _release(self, held: Sequence[Held]) -> list[bool]:
        if self.pool.slot < 0:  # closed: the pool took its holds back
            return [False] * len(held)
        try:
            with self.pool.lock():
                valid = [self.pool.release(h) for h in held]
        except PoolBusyError:  # released at the next holding of the lock
            valid = [self.pool.release_later(h) for h in held]
        except PoolBrokenError:  # nothing read from a shrunk file counts
            valid = [False] * len(held)
        stale = len(valid) - sum(valid)
        if stale:
            self.counters["stale_reads"] += stale
        return valid

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        holds = self.hold(keys)
        outs = [None if h is None else self.empty_output(tuple(h.chunk.shape), h.chunk.dtype) for h in holds]
        valid: list[bool] = []
        try:
            await self.copy_chunks([(out, h.chunk) for out, h in zip(outs, holds) if out is not None and h])
        finally:
            valid = [h.release() if h is not None else False for h in holds]
        return [out if ok else None for out, ok in zip(outs, valid)]

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """One copy per chunk, pool -> destination, while the chunk is held."""
        check_destinations(keys, outs)
        holds = self.hold(keys)
        hits = [h is not None and fits_destination(out, h.chunk.shape, h.chunk.dtype) for h, out in zip(holds, outs)]
        valid: list[bool] = []
        try:
            await self.copy_chunks([(out, h.chunk) for out, h, hit in zip(outs, holds, hits) if hit and h])
        finally:
            valid = [h.release() if h is not None else False for h in holds]
        return [hit and ok for hit, ok in zip(hits, valid)]

    async def contains(self, key: CacheKey) -> bool:
        return (await self.batched_contains([key]))[0]

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        self._ensure_open()
        return self._found(keys)

    def batched_contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        """From the pool's index, without its lock (every process's chunks)."""
        if self._closed:
            return None
        return self._found(keys)

    def _found(self, keys: Sequence[CacheKey]) -> list[bool]:
        if not keys:
            return []
        try:
            self.pool.check_intact()
        except PoolBrokenError:
            return [False] * len(keys)
        if len(keys) <= 256:  # a prompt's chunks: plain Python beats numpy's per-call cost
            return self.pool.contains([self._digest(key) for key in keys])
        return (self.pool.find(self._digest_rows(keys)) >= 0).tolist()

    async def delete(self, key: CacheKey) -> bool:
        self._ensure_open()
        d0, d1 = self._digest(key)
        async with self.pool.alock():
            return self.pool.delete(d0, d1)

    def _name_scopes(self, keys: Sequence[CacheKey]) -> None:
        """Journal the model name of each scope this process stores into: the first time, and
        again once half the ring was written since (so the ring always holds it while this process
        stores there). Under the lock."""
        journal = self.pool.journal
        for key in keys:
            scope = _scope_id(key.scope)
            named_at = self._named.get(scope)
            if named_at is None or journal.newest() - named_at > journal.size // 2:
                journal.named(scope, key.model_name)
                self._named[scope] = journal.newest()

    # -- reporting ---------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes the pool holds, every process's."""
        return self.pool.used_bytes if not self._closed and self.pool.broken is None else 0

    def scope_usage(self) -> dict[str, dict[str, int]]:
        if self.pool.broken is not None:
            return {}
        usage = self.pool.scope_usage()
        return {f"{scope:016x}": {"chunks": chunks, "bytes": nbytes} for scope, (chunks, nbytes) in usage.items()}

    async def drop_scope(self, model_name: str, scope: str) -> int:
        """Every process's chunks of ``scope`` leave the pool (entries carry the scope, not the
        model: a scope's digest already binds the model's revision); how many."""
        self._ensure_open()
        if len(scope) != 16 or any(c not in "0123456789abcdefABCDEF" for c in scope):
            return 0  # not a scope the pool indexes (keys made by hand): none of its entries
        return (await asyncio.to_thread(self.drop_scopes, [scope]))[0]

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), **self.pool.counters(), "path": self.path, "pinned": self.pinned,
                "process_slot": self.pool.slot}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._close_pool)

    def _close_pool(self) -> None:
        try:
            self._unpin()
        finally:
            self.pool.close()

    def __repr__(self) -> str:
        return f"SharedMemoryBackend(name={self.name!r}, capacity={format_size(self.capacity or 0)}, path={self.path!r})"

