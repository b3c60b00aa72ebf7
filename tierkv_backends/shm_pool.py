"""A pool of chunk memory in one file that every process on the node maps: the shared index,
the allocator, holds, eviction, and recovery from processes that die at any instant.

The contract (docs/design.md, "One host cache per node"):

- **One lock, released by the kernel.** Every change to the index happens under an ``flock``
  on the pool file (plus a thread lock inside the process). A process killed while holding it
  loses it at once; the header word :attr:`Word.HOLDER` it set on entry is still set, so the
  next holder knows the index may be half changed and rebuilds everything derived (tables,
  free extents, reader counts) from the entries, which change one state word at a time.
- **Visible only when whole.** A put reserves an entry (WRITING, invisible, owned by its process
  slot) and an extent, fills the extent outside the lock, and commits (one store of the state
  word, then one store into the hash table). A writer that dies leaves a WRITING entry of a dead
  owner: reaped, its extent freed.
- **No byte changes under a reader.** A read holds the entry (its reader count, and the entry id
  in the process's hold row in the pool) while it copies; an entry with readers is never
  evicted and a replaced or deleted one is RETIRED until its last reader lets go. A dead
  process's holds are given back when it is reaped; a process reaped while alive (its heartbeat
  stopped for ``lease_s`` in another pid namespace) finds its token changed when it releases
  and reports the read as a miss.
- **No space leaked.** Dead processes (pid gone or reused, or a stale heartbeat across pid
  namespaces) are reaped whenever room runs out and when a process attaches.
- **Bounded.** Extents are carved from ``capacity`` bytes by first fit with coalescing; room is
  made by evicting committed entries without readers, least recently used first (``tick`` is
  CLOCK_MONOTONIC, one clock for every process on the node).

Lookups read the live hash table without the lock (an answer may be stale by the time it is
used; a read then misses, never returns another chunk's bytes).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tierkv import serde
from tierkv.errors import CapacityError, ConfigError, TierKVError
from tierkv.memory import huge_pages
from tierkv_backends.shm_layout import (
    DELETED,
    EMPTY,
    ENTRY_FIELDS,
    HEADER_BYTES,
    MAGIC,
    PROCESS_FIELDS,
    SHAPE_DIMS,
    VERSION,
    Geometry,
    Layout,
    State,
    Word,
    header_problem,
)

logger = logging.getLogger(__name__)

_REHASH_FRACTION = 4  # rebuild the table once a quarter of its slots are deleted markers
MEMORY_FILE_SYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")


def digest(key: bytes) -> tuple[int, int]:
    """128 bits of BLAKE2b of a key's bytes: keys are told apart by it (collision-resistant, so
    no tenant can make its prompt's digest equal another's)."""
    raw = hashlib.blake2b(key, digest_size=16).digest()
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


def alloc_size(nbytes: int) -> int:
    """Bytes an extent of a chunk takes: 64-byte aligned, 4 KiB aligned from 64 KiB (whole pages
    copy faster)."""
    align = 4096 if nbytes >= 64 << 10 else 64
    return max(align, -(-nbytes // align) * align)


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: one clock for every process on the node (last use, heartbeats)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _process_start(pid: int) -> int:
    """A process's start time in clock ticks since boot (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return 0


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def file_system_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/self/mountinfo; "" if unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                left, _, right = line.partition(" - ")
                mount_point = left.split()[4].replace("\\040", " ")
                if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best):
                    best, kind = mount_point, right.split()[0]
    except OSError:
        return ""
    return kind


@dataclass
class Held:
    """One hold on an entry: its id and the position of the hold in this process's row."""

    entry: int
    position: int
    token: int


class SharedPool:
    """One process's view of a pool file (see the module docstring)."""

    def __init__(self, path: str, geometry: Geometry, mode: int = 0o600, lease_s: float = 30.0,
                 where: str = "shm tier") -> None:
        self.path = path
        self.geometry = geometry
        self.layout = Layout.of(geometry)
        self.lease_s = lease_s
        self.where = where
        self.mode = mode
        self.evicted = 0  # evictions this process made
        self._thread_lock = threading.RLock()
        self._fd = self._open(mode)
        self._map: mmap.mmap | None = None
        try:
            self._create_or_check()
            self._map = mmap.mmap(self._fd, self.layout.file_bytes, flags=mmap.MAP_SHARED | _populate(),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._views()
            self._pidns = _pid_namespace()
            self.slot = -1
            self.token = 0
            self._free_positions: list[int] = []
            with self.lock():
                self.reap()
                self._claim_slot()
        except BaseException:
            self._close_files()
            raise
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="tierkv-shm-heartbeat", daemon=True)
        self._heartbeat.start()

    # -- opening -----------------------------------------------------------------------------
    def _open(self, mode: int) -> int:
        directory = os.path.dirname(os.path.abspath(self.path)) or "."
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        except PermissionError as exc:
            raise ConfigError(f"{self.where}: no permission to open the pool at {self.path!r} ({exc.strerror}): it "
                              "belongs to another user, or its mode keeps this one out; run as its owner, or give "
                              "this process a path of its own") from exc
        except OSError as exc:
            raise ConfigError(f"{self.where}: cannot open the pool at {self.path!r}: {exc.strerror}") from exc
        return fd

    def _create_or_check(self) -> None:
        """Under the lock: create the pool if the file is new (or a creator died before it was
        whole), else check that it is a pool of this layout and geometry."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(self._fd).st_size
            words = np.frombuffer(os.pread(self._fd, HEADER_BYTES, 0).ljust(HEADER_BYTES, b"\0"), dtype=np.int64)
            if size == 0 or not words.any():  # new, or its creator died before writing the magic word
                self._create()
                return
            problem = header_problem(words, self.geometry)
            if problem is not None:
                raise ConfigError(f"{self.where}: the file at {self.path!r} is not a pool this process can use: "
                                  f"{problem}. Remove it (once no process uses it) to create a new pool, or name "
                                  "another path")
            if size < self.layout.file_bytes:
                raise ConfigError(f"{self.where}: the pool at {self.path!r} is {size} bytes, shorter than its "
                                  f"geometry needs ({self.layout.file_bytes}): a damaged file; remove it")
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _create(self) -> None:
        need = self.layout.file_bytes
        directory = os.path.dirname(os.path.abspath(self.path)) or "."
        stats = os.statvfs(directory)
        if stats.f_bavail * stats.f_frsize < need:
            raise ConfigError(f"{self.where}: the pool needs {need} bytes at {self.path!r}, and its file system has "
                              f"{stats.f_bavail * stats.f_frsize} free: give a smaller capacity, or grow it (e.g. "
                              "mount -o remount,size=... /dev/shm)")
        os.ftruncate(self._fd, 0)
        os.fchmod(self._fd, self.mode)  # exactly the mode asked for, whatever the umask
        try:
            os.posix_fallocate(self._fd, 0, need)  # every page now, not a SIGBUS on a full tmpfs later
        except OSError as exc:
            os.ftruncate(self._fd, 0)
            raise ConfigError(f"{self.where}: cannot allocate {need} bytes for the pool at {self.path!r}: "
                              f"{exc.strerror}") from exc
        mapping = mmap.mmap(self._fd, self.layout.data, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self._map = mapping
            self._views(data=False)
            self._initialize()
        finally:
            self._drop_views()
            self._map = None
            mapping.close()
        logger.info("%s: created a pool of %d bytes at %s", self.where, self.geometry.capacity, self.path)

    def _initialize(self) -> None:
        """Write an empty index and the header of a new pool; the magic word last."""
        geometry, words = self.geometry, self.words
        self.tables[0][:] = EMPTY
        self.tables[1][:] = EMPTY
        self.entries["state"][:] = State.FREE
        self.holds[:] = -1
        self.procs["pid"][:] = 0
        self.free[0] = (0, geometry.capacity)
        words[Word.FREE_COUNT] = 1
        words[Word.VERSION] = VERSION
        words[Word.CAPACITY] = geometry.capacity
        words[Word.TABLE_SIZE] = geometry.table_size
        words[Word.MAX_CHUNKS] = geometry.max_chunks
        words[Word.MAX_PROCESSES] = geometry.max_processes
        words[Word.HOLDS_PER_PROCESS] = geometry.holds_per_process
        words[Word.DATA_OFFSET] = self.layout.data
        words[Word.GEOMETRY_DIGEST] = geometry.digest()
        words[Word.CREATED_NS] = time.time_ns()
        words[Word.MAGIC] = MAGIC  # last: the pool exists once this word does

    def _views(self, data: bool = True) -> None:
        """numpy views of every part of the mapping (and a torch view of the data area)."""
        assert self._map is not None
        layout, geometry, buffer = self.layout, self.geometry, self._map
        self.words = np.frombuffer(buffer, dtype=np.int64, count=HEADER_BYTES // 8, offset=0)
        self.tables = [np.frombuffer(buffer, dtype=np.int32, count=geometry.table_size, offset=offset)
                       for offset in layout.tables]
        self.entries: dict[str, np.ndarray] = {}
        for name, kind, shape in ENTRY_FIELDS:
            count = geometry.max_chunks * int(np.prod(shape, dtype=np.int64))
            array = np.frombuffer(buffer, dtype=kind, count=count, offset=layout.entries[name])
            self.entries[name] = array.reshape((geometry.max_chunks, *shape)) if shape else array
        self.free = np.frombuffer(buffer, dtype=np.int64, count=2 * (geometry.max_chunks + 1),
                                  offset=layout.free).reshape(-1, 2)
        self.procs = {name: np.frombuffer(buffer, dtype=kind, count=geometry.max_processes, offset=layout.processes[name])
                      for name, kind, _ in PROCESS_FIELDS}
        self.holds = np.frombuffer(buffer, dtype=np.int32, count=geometry.max_processes * geometry.holds_per_process,
                                   offset=layout.holds).reshape(geometry.max_processes, geometry.holds_per_process)
        if data:
            self.data = torch.frombuffer(buffer, dtype=torch.uint8, count=geometry.capacity, offset=layout.data)
            # plain memoryviews for the lookup path: indexing one gives a Python int in tens of ns,
            # where a numpy element or a small vectorised probe costs microseconds
            whole = memoryview(buffer)
            words_view = whole[: 8 * len(Word)].cast("q")
            table_views = [whole[offset : offset + 4 * geometry.table_size].cast("i") for offset in layout.tables]
            digest_view = whole[layout.entries["digest"] : layout.entries["digest"] + 16 * geometry.max_chunks].cast("Q")
            state_view = whole[layout.entries["state"] : layout.entries["state"] + 4 * geometry.max_chunks].cast("i")
            self._lookup_views = (whole, words_view, table_views, digest_view, state_view)
            huge_pages(self.data)  # 2 MiB pages where the mount allows them (tmpfs huge=advise / within_size)

    def _drop_views(self) -> None:
        for view in self.__dict__.pop("_lookup_views", ())[::-1]:
            if isinstance(view, list):
                for part in view:
                    part.release()
            else:
                view.release()
        for name in ("words", "tables", "entries", "free", "procs", "holds", "data"):
            self.__dict__.pop(name, None)

    # -- the lock ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """The pool's one lock: the process's thread lock, then the file's flock. A holder that
        died inside leaves :attr:`Word.HOLDER` set; the next holder rebuilds first. A change
        that failed with a tierkv error left the index whole (every such path gives back what
        it took); any other exception leaves the word set, so the next holder rebuilds too."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if int(self.words[Word.HOLDER]) != 0:
                    self.recover()
                self.words[Word.HOLDER] = self.slot + 1 if self.slot >= 0 else self.geometry.max_processes + 1
                try:
                    yield
                except TierKVError:
                    self.words[Word.HOLDER] = 0
                    raise
                self.words[Word.HOLDER] = 0
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- processes -----------------------------------------------------------------------------
    def _claim_slot(self) -> None:
        pids = self.procs["pid"]
        free = np.flatnonzero(pids == 0)
        if not len(free):
            raise ConfigError(f"{self.where}: the pool at {self.path!r} has all its {self.geometry.max_processes} "
                              "process slots taken by live processes (max_processes)")
        slot = int(free[0])
        self.token = secrets.randbits(62) + 1
        self.holds[slot][:] = -1
        self.procs["start"][slot] = _process_start(os.getpid())
        self.procs["pidns"][slot] = self._pidns
        self.procs["heartbeat"][slot] = now_ns()
        self.procs["token"][slot] = self.token
        self.procs["holds"][slot] = 0
        self.procs["pid"][slot] = os.getpid()
        self.slot = slot
        self._free_positions = list(range(self.geometry.holds_per_process - 1, -1, -1))

    def _beat(self) -> None:
        while not self._stop.wait(max(0.05, self.lease_s / 4)):
            try:
                if self.slot >= 0 and int(self.procs["token"][self.slot]) == self.token:
                    self.procs["heartbeat"][self.slot] = now_ns()
            except (AttributeError, ValueError):  # closing: the mapping is gone
                return

    def alive(self, slot: int) -> bool:
        """Whether the process in ``slot`` still runs (by pid and start time in this pid namespace,
        by its heartbeat in another)."""
        pid = int(self.procs["pid"][slot])
        if pid == 0:
            return False
        if slot == self.slot and pid == os.getpid():
            return True
        if int(self.procs["pidns"][slot]) == self._pidns:
            return _process_start(pid) == int(self.procs["start"][slot])
        return now_ns() - int(self.procs["heartbeat"][slot]) < self.lease_s * 1e9

    def reap(self) -> int:
        """Give back what dead processes held (their holds, their unfinished writes, their slot);
        how many were reaped. Under the lock."""
        reaped = 0
        for slot in np.flatnonzero(self.procs["pid"] != 0):
            slot = int(slot)
            if slot == self.slot or self.alive(slot):
                continue
            row = self.holds[slot]
            for entry in row[row >= 0]:
                self._unhold(int(entry))
            row[:] = -1
            for entry in np.flatnonzero((self.entries["state"] == State.WRITING) & (self.entries["owner"] == slot)):
                self._free_entry(int(entry))
            self.procs["token"][slot] = 0
            self.procs["holds"][slot] = 0
            self.procs["pid"][slot] = 0
            reaped += 1
        if reaped:
            self.words[Word.REAPED_PROCESSES] += reaped
            logger.info("%s: gave back what %d dead process(es) held in the pool at %s", self.where, reaped, self.path)
        return reaped

    # -- recovery ------------------------------------------------------------------------------
    def recover(self) -> None:
        """Rebuild everything derived from the entries, after a holder died inside the lock: the
        hash table, free extents, reader counts, usage; unfinished writes of dead processes go."""
        entries, state = self.entries, self.entries["state"]
        live_slots = [int(slot) for slot in np.flatnonzero(self.procs["pid"] != 0) if self.alive(int(slot))]
        for slot in (int(slot) for slot in np.flatnonzero(self.procs["pid"] != 0)):
            if slot not in live_slots:
                self.holds[slot][:] = -1
                self.procs["token"][slot] = 0
                self.procs["pid"][slot] = 0
        readers = np.zeros(self.geometry.max_chunks, dtype=np.int64)
        for slot in live_slots:
            row = self.holds[slot]
            held = row[(row >= 0) & (row < self.geometry.max_chunks)]
            np.add.at(readers, held, 1)
            self.procs["holds"][slot] = len(held)
        entries["readers"][:] = readers
        writing = state == State.WRITING
        orphans = writing & ~np.isin(entries["owner"], np.array(live_slots, dtype=np.int64))
        state[orphans] = State.FREE
        state[(state == State.RETIRED) & (readers == 0)] = State.FREE
        # one committed entry per digest: the newest
        committed = np.flatnonzero(state == State.COMMITTED)
        order = committed[np.lexsort((-entries["tick"][committed], entries["digest"][committed, 1],
                                      entries["digest"][committed, 0]))]
        digests = entries["digest"][order]
        repeat = np.zeros(len(order), dtype=bool)
        repeat[1:] = (digests[1:] == digests[:-1]).all(axis=1)
        for entry in order[repeat]:
            state[entry] = State.RETIRED if readers[entry] else State.FREE
        # extents of what is left, overlaps dropped (a torn entry would show as one)
        live = np.flatnonzero(state != State.FREE)
        live = live[np.argsort(entries["offset"][live], kind="stable")]
        kept, end = [], 0
        for entry in live:
            start, alloc = int(entries["offset"][entry]), int(entries["alloc"][entry])
            if start < end or alloc <= 0 or start + alloc > self.geometry.capacity:
                state[entry] = State.FREE
                continue
            kept.append(entry)
            end = start + alloc
        self._rebuild_free(kept)
        self.words[Word.USED_BYTES] = int(entries["alloc"][kept].sum()) if kept else 0
        self.words[Word.COMMITTED_CHUNKS] = int((state == State.COMMITTED).sum())
        self._rehash()
        self.words[Word.RECOVERIES] += 1
        logger.warning("%s: a process died while changing the pool at %s; rebuilt its index (%d chunks kept)",
                       self.where, self.path, int(self.words[Word.COMMITTED_CHUNKS]))

    def _rebuild_free(self, kept: Sequence[int]) -> None:
        extents, cursor = [], 0
        for entry in kept:
            start = int(self.entries["offset"][entry])
            if start > cursor:
                extents.append((cursor, start - cursor))
            cursor = start + int(self.entries["alloc"][entry])
        if cursor < self.geometry.capacity:
            extents.append((cursor, self.geometry.capacity - cursor))
        if extents:
            self.free[: len(extents)] = extents
        self.words[Word.FREE_COUNT] = len(extents)

    # -- the hash table ------------------------------------------------------------------------
    def _table(self) -> np.ndarray:
        return self.tables[int(self.words[Word.LIVE_TABLE]) & 1]

    def contains(self, digests: Sequence[tuple[int, int]]) -> list[bool]:
        """Whether a committed entry of each digest is in the pool: :meth:`find` for the few
        digests of a lookup, in plain Python over memoryviews (no lock, no numpy call)."""
        _, words, tables, digest_of, state_of = self._lookup_views
        table = tables[words[10] & 1]  # Word.LIVE_TABLE
        mask = len(table) - 1
        found = []
        append = found.append
        for d0, d1 in digests:
            slot = d0 & mask
            probes = mask
            while probes >= 0:
                entry = table[slot]
                if entry >= 0:
                    if digest_of[2 * entry] == d0 and digest_of[2 * entry + 1] == d1 and state_of[entry] == 2:
                        append(True)  # State.COMMITTED
                        break
                elif entry == EMPTY:
                    append(False)
                    break
                slot = (slot + 1) & mask
                probes -= 1
            else:  # a full probe path (only while another process rebuilds the table)
                append(False)
        return found

    def find(self, digests: np.ndarray) -> np.ndarray:
        """The committed entry of each digest (rows of [d0, d1]), -1 where none; no lock needed
        (a concurrent change makes an answer stale, never another chunk's)."""
        table = self._table()
        mask = table.shape[0] - 1
        entries, state = self.entries["digest"], self.entries["state"]
        found = np.full(len(digests), -1, dtype=np.int64)
        pending = np.arange(len(digests))
        slots = (digests[:, 0] & np.uint64(mask)).astype(np.int64)
        for _ in range(table.shape[0]):
            if not len(pending):
                break
            ids = table[slots].astype(np.int64)
            empty = ids == EMPTY
            valid = ids >= 0
            hit = np.zeros(len(pending), dtype=bool)
            safe = np.where(valid, ids, 0)
            hit[valid] = ((entries[safe[valid]] == digests[pending[valid]]).all(axis=1)
                          & (state[safe[valid]] == State.COMMITTED))
            found[pending[hit]] = ids[hit]
            going = ~(hit | empty)
            pending, slots = pending[going], (slots[going] + 1) & mask
        return found

    def _slot_of(self, entry: int) -> int:
        """The table slot holding ``entry`` (-1 if none)."""
        table = self._table()
        mask = table.shape[0] - 1
        slot = int(self.entries["digest"][entry, 0]) & mask
        for _ in range(table.shape[0]):
            current = int(table[slot])
            if current == entry:
                return slot
            if current == EMPTY:
                return -1
            slot = (slot + 1) & mask
        return -1

    def _publish(self, entry: int) -> int:
        """Put committed ``entry`` in the table, in place of a committed entry of the same digest
        if there is one (returned), else in the first free slot on its probe path."""
        table = self._table()
        mask = table.shape[0] - 1
        d0, d1 = (int(x) for x in self.entries["digest"][entry])
        slot, first_free = d0 & mask, -1
        for _ in range(table.shape[0]):
            current = int(table[slot])
            if current == EMPTY:
                break
            if current == DELETED:
                if first_free < 0:
                    first_free = slot
            elif (int(self.entries["digest"][current, 0]) == d0 and int(self.entries["digest"][current, 1]) == d1
                  and int(self.entries["state"][current]) == State.COMMITTED):
                table[slot] = entry
                return current
            slot = (slot + 1) & mask
        if first_free >= 0:
            table[first_free] = entry
            self.words[Word.DELETED_SLOTS] -= 1
        else:
            table[slot] = entry
        return -1

    def _unpublish(self, entry: int) -> None:
        slot = self._slot_of(entry)
        if slot >= 0:
            self._table()[slot] = DELETED
            self.words[Word.DELETED_SLOTS] += 1

    def _rehash(self) -> None:
        """Write the table afresh in the other buffer (committed entries only), then flip to it:
        a crash before the flip leaves the old one in use."""
        spare = 1 - (int(self.words[Word.LIVE_TABLE]) & 1)
        table = self.tables[spare]
        table[:] = EMPTY
        mask = table.shape[0] - 1
        for entry in np.flatnonzero(self.entries["state"] == State.COMMITTED):
            slot = int(self.entries["digest"][entry, 0]) & mask
            while table[slot] != EMPTY:
                slot = (slot + 1) & mask
            table[slot] = entry
        self.words[Word.LIVE_TABLE] = spare
        self.words[Word.DELETED_SLOTS] = 0

    # -- extents -------------------------------------------------------------------------------
    def _take(self, size: int) -> int | None:
        count = int(self.words[Word.FREE_COUNT])
        if not count:
            return None
        lengths = self.free[:count, 1]
        index = int(np.argmax(lengths >= size))
        if lengths[index] < size:
            return None
        start, length = int(self.free[index, 0]), int(self.free[index, 1])
        if length == size:
            self.free[index : count - 1] = self.free[index + 1 : count].copy()
            self.words[Word.FREE_COUNT] = count - 1
        else:
            self.free[index] = (start + size, length - size)
        return start

    def _give(self, start: int, size: int) -> None:
        count = int(self.words[Word.FREE_COUNT])
        starts = self.free[:count, 0]
        index = int(np.searchsorted(starts, start))
        merge_before = index > 0 and int(self.free[index - 1, 0] + self.free[index - 1, 1]) == start
        merge_after = index < count and start + size == int(self.free[index, 0])
        if merge_before and merge_after:
            self.free[index - 1, 1] += size + self.free[index, 1]
            self.free[index : count - 1] = self.free[index + 1 : count].copy()
            self.words[Word.FREE_COUNT] = count - 1
        elif merge_before:
            self.free[index - 1, 1] += size
        elif merge_after:
            self.free[index] = (start, size + self.free[index, 1])
        else:
            self.free[index + 1 : count + 1] = self.free[index:count].copy()
            self.free[index] = (start, size)
            self.words[Word.FREE_COUNT] = count + 1

    # -- entries -------------------------------------------------------------------------------
    def _new_entry(self) -> int | None:
        """A free entry slot, searched from where the last one was found."""
        state = self.entries["state"]
        cursor = int(self.words[Word.NEXT_ENTRY]) % self.geometry.max_chunks
        free = np.flatnonzero(state[cursor:] == State.FREE)
        if len(free):
            entry = cursor + int(free[0])
        else:
            free = np.flatnonzero(state[:cursor] == State.FREE)
            if not len(free):
                return None
            entry = int(free[0])
        self.words[Word.NEXT_ENTRY] = entry + 1
        return entry

    def _free_entry(self, entry: int) -> None:
        """An entry's extent goes back and the entry is free (it is in no table)."""
        state = int(self.entries["state"][entry])
        if state == State.FREE:
            return
        self.entries["state"][entry] = State.FREE
        alloc = int(self.entries["alloc"][entry])
        self._give(int(self.entries["offset"][entry]), alloc)
        self.words[Word.USED_BYTES] -= alloc

    def _drop(self, entry: int) -> None:
        """A committed entry leaves: unpublished, then freed, or RETIRED while readers hold it."""
        self._unpublish(entry)
        self.words[Word.COMMITTED_CHUNKS] -= 1
        if int(self.entries["readers"][entry]) > 0:
            self.entries["state"][entry] = State.RETIRED
        else:
            self._free_entry(entry)
        if int(self.words[Word.DELETED_SLOTS]) * _REHASH_FRACTION > self.geometry.table_size:
            self._rehash()

    def reserve(self, digests: Sequence[tuple[int, int]], scopes: Sequence[int],
                layouts: Sequence[tuple[tuple[int, ...], torch.dtype]], protect: np.ndarray) -> list[int]:
        """WRITING entries (owned by this process) with extents for chunks of ``layouts``,
        evicting least-recently-used committed entries without readers as needed (never those
        in ``protect``). Under the lock; all or nothing."""
        taken: list[int] = []
        try:
            victims: Iterator[int] | None = None
            for (d0, d1), scope, (shape, dtype) in zip(digests, scopes, layouts):
                if len(shape) > SHAPE_DIMS:
                    raise ValueError(f"{self.where}: a chunk has at most {SHAPE_DIMS} dimensions, got shape {tuple(shape)}")
                code = serde.dtype_code(dtype)  # the chunk format's codes: stable across versions
                nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
                size = alloc_size(nbytes)
                if size > self.geometry.capacity:
                    raise CapacityError(f"{self.where}: a chunk of {nbytes} bytes does not fit in the pool's capacity "
                                        f"of {self.geometry.capacity}")
                start = self._take(size)
                while start is None:
                    if victims is None:
                        victims = self._victims(protect)
                    victim = next(victims, None)
                    if victim is None:
                        if self.reap():
                            victims = None
                            start = self._take(size)
                            continue
                        raise CapacityError(f"{self.where}: no room for {size} bytes in the pool: the rest of its "
                                            f"{self.geometry.capacity} bytes is being read or written")
                    if int(self.entries["state"][victim]) == State.COMMITTED and not self.entries["readers"][victim]:
                        self._drop(victim)
                        self.words[Word.EVICTIONS] += 1
                        self.evicted += 1
                    start = self._take(size)
                entry = self._new_entry()
                if entry is None:
                    self._give(start, size)
                    raise CapacityError(f"{self.where}: the pool's {self.geometry.max_chunks} entries are all in use "
                                        "(max_chunks)")
                fields = self.entries
                fields["digest"][entry] = (d0, d1)
                fields["scope"][entry] = scope
                fields["offset"][entry] = start
                fields["alloc"][entry] = size
                fields["nbytes"][entry] = nbytes
                fields["shape"][entry] = 0
                fields["shape"][entry, : len(shape)] = shape
                fields["ndim"][entry] = len(shape)
                fields["dtype"][entry] = code
                fields["readers"][entry] = 0
                fields["owner"][entry] = self.slot
                fields["tick"][entry] = now_ns()
                fields["state"][entry] = State.WRITING  # last: the entry is now this process's
                self.words[Word.USED_BYTES] += size
                taken.append(entry)
        except BaseException:
            for entry in taken:
                self._free_entry(entry)
            raise
        return taken

    def _victims(self, protect: np.ndarray) -> Iterator[int]:
        """Committed entries without readers, least recently used first (batches of the oldest)."""
        fields = self.entries
        candidates = np.flatnonzero((fields["state"] == State.COMMITTED) & (fields["readers"] == 0))
        if len(protect):
            candidates = candidates[~np.isin(candidates, protect)]
        ticks = fields["tick"][candidates]
        step = 64
        for begin in range(0, len(candidates), step):
            upto = min(len(candidates), begin + step)
            if upto < len(candidates):
                part = np.argpartition(ticks, upto - 1)[:upto]
            else:
                part = np.arange(len(candidates))
            ordered = part[np.argsort(ticks[part], kind="stable")][begin:upto]
            yield from (int(candidates[index]) for index in ordered)

    def commit(self, entries: Sequence[int]) -> None:
        """Make this process's WRITING entries visible (replacing committed ones of the same key).
        Under the lock."""
        for entry in entries:
            if int(self.entries["state"][entry]) != State.WRITING or int(self.entries["owner"][entry]) != self.slot:
                continue  # reaped meanwhile (this process was taken for dead): nothing to commit
            self.entries["tick"][entry] = now_ns()
            self.entries["state"][entry] = State.COMMITTED
            replaced = self._publish(entry)
            self.words[Word.COMMITTED_CHUNKS] += 1
            if replaced >= 0:
                self._drop(replaced)

    def abort(self, entries: Sequence[int]) -> None:
        """Give back this process's WRITING entries unused. Under the lock."""
        for entry in entries:
            if int(self.entries["state"][entry]) == State.WRITING and int(self.entries["owner"][entry]) == self.slot:
                self._free_entry(entry)

    def view(self, entry: int) -> torch.Tensor:
        """The chunk of ``entry`` as a tensor over the pool's memory."""
        fields = self.entries
        start, nbytes, ndim = int(fields["offset"][entry]), int(fields["nbytes"][entry]), int(fields["ndim"][entry])
        shape = tuple(int(x) for x in fields["shape"][entry, :ndim])
        dtype = serde.code_dtype(int(fields["dtype"][entry]))
        assert dtype is not None, "only this tierkv's dtype codes are ever written"
        return self.data[start : start + nbytes].view(dtype).view(shape)

    # -- holds ---------------------------------------------------------------------------------
    def hold(self, digests: np.ndarray, touch: bool = True) -> list[Held | None]:
        """Hold the committed entry of each digest (None for misses, or when this process's hold
        row is full). Under the lock."""
        found = self.find(digests)
        held: list[Held | None] = []
        stamp = now_ns()
        for entry in found:
            entry = int(entry)
            if entry < 0 or not self._free_positions:
                held.append(None)
                continue
            position = self._free_positions.pop()
            self.holds[self.slot, position] = entry
            self.procs["holds"][self.slot] += 1
            self.entries["readers"][entry] += 1
            if touch:
                self.entries["tick"][entry] = stamp
            held.append(Held(entry, position, self.token))
        return held

    def release(self, held: Held) -> bool:
        """Let go of a hold; whether it was still valid (False: this process was reaped as dead
        meanwhile, and the bytes read under it may have changed). Under the lock."""
        if int(self.procs["token"][self.slot]) != held.token or self.token != held.token:
            return False
        if int(self.holds[self.slot, held.position]) != held.entry:
            return False
        self.holds[self.slot, held.position] = -1
        self.procs["holds"][self.slot] -= 1
        self._free_positions.append(held.position)
        self._unhold(held.entry)
        return True

    def _unhold(self, entry: int) -> None:
        readers = int(self.entries["readers"][entry]) - 1
        self.entries["readers"][entry] = max(0, readers)
        if readers <= 0 and int(self.entries["state"][entry]) == State.RETIRED:
            self._free_entry(entry)

    def delete(self, d0: int, d1: int) -> bool:
        """Remove the committed entry of a digest. Under the lock."""
        entry = int(self.find(np.array([[d0, d1]], dtype=np.uint64))[0])
        if entry < 0:
            return False
        self._drop(entry)
        return True

    # -- reporting -----------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return int(self.words[Word.USED_BYTES])

    def counters(self) -> dict[str, int]:
        words = self.words
        return {"pool_chunks": int(words[Word.COMMITTED_CHUNKS]), "pool_evictions": int(words[Word.EVICTIONS]),
                "recoveries": int(words[Word.RECOVERIES]), "reaped_processes": int(words[Word.REAPED_PROCESSES]),
                "processes": int((self.procs["pid"] != 0).sum()), "free_extents": int(words[Word.FREE_COUNT])}

    def scope_usage(self) -> dict[int, tuple[int, int]]:
        """Per scope id: (chunks, bytes) of committed entries, every process's."""
        fields = self.entries
        committed = np.flatnonzero(fields["state"] == State.COMMITTED)
        usage: dict[int, tuple[int, int]] = {}
        if not len(committed):
            return usage
        scopes, inverse = np.unique(fields["scope"][committed], return_inverse=True)
        counts = np.bincount(inverse)
        sizes = np.bincount(inverse, weights=fields["alloc"][committed].astype(np.float64))
        for scope, count, size in zip(scopes, counts, sizes):
            usage[int(scope)] = (int(count), int(size))
        return usage

    # -- closing -------------------------------------------------------------------------------
    def close(self) -> None:
        """Give back this process's holds and unfinished writes and its slot; unmap."""
        self._stop.set()
        if self._map is not None and self.slot >= 0:
            try:
                with self.lock():
                    if int(self.procs["token"][self.slot]) == self.token:
                        row = self.holds[self.slot]
                        for entry in row[row >= 0]:
                            self._unhold(int(entry))
                        row[:] = -1
                        mine = np.flatnonzero((self.entries["state"] == State.WRITING)
                                              & (self.entries["owner"] == self.slot))
                        for entry in mine:
                            self._free_entry(int(entry))
                        self.procs["token"][self.slot] = 0
                        self.procs["holds"][self.slot] = 0
                        self.procs["pid"][self.slot] = 0
            except OSError as exc:  # the file went away under us: nothing left to give back
                logger.warning("%s: closing the pool at %s: %s", self.where, self.path, exc)
        self.slot = -1
        self._close_files()

    def _close_files(self) -> None:
        self._drop_views()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still lent out: the mapping goes with it
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _populate() -> int:
    """MAP_POPULATE where Linux has it: the mapping's page tables are filled at attach, not by
    faults on the first copies."""
    return getattr(mmap, "MAP_POPULATE", 0)

