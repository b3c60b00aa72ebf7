"""The layout of a node-shared pool file (the ``shm`` tier): where each part lives, and the
check that a file some process created is one this tierkv can read.

One file on a memory file system, mapped by every process that names it::

    [header 4 KiB][table A][table B][entries][free extents][processes][holds][journal][... data, 2 MiB aligned]

- header: int64 words (``Word``): magic, layout version, geometry, the lock holder, counters;
- tables A and B: the open-addressing hash table, int32 entry ids (-1 empty, -2 deleted); the
  header says which is live, so a rebuild writes the other one whole and then flips one word;
- entries: struct-of-arrays, one slot per chunk (``ENTRY_FIELDS``): digest, state, owner,
  readers, extent, layout, last use, retention, scope;
- free extents: (start, length) pairs of the data area, sorted by start, coalesced;
- processes: a slot per attached process (pid, start time, pid namespace, heartbeat, token); the
  process also holds a kernel lock on one byte per slot (``LIVENESS_BASE``, far past the
  file's end), so whether a slot's process lives is a question the kernel answers;
- holds: per process slot, the entry ids it holds (-1 free), so a dead process's holds can be
  given back;
- journal: a ring of records of what entered and left the pool, written under the lock and
  read by every attached process without it (``tierkv_backends.shm.journal``): how engines
  announce each other's chunks (vLLM KV events) and how a late reader learns the contents;
- data: ``capacity`` bytes of chunk payloads.

Everything but the entries, the journal and the data is derived: after a crash inside the lock the next holder
rebuilds tables, free extents and reader counts from the entries and the live processes' holds
(``tierkv_backends.shm.pool``).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = int.from_bytes(b"TKVSHM\x00\x01", "little")
VERSION = 3  # 2: liveness by a kernel lock per process slot (pool.py), leases revoke holds only; 3: the journal
HEADER_BYTES = 4096
DATA_ALIGN = 2 << 20
SHAPE_DIMS = 8

LIVENESS_BASE = 1 << 60
"""Byte offset of slot 0's liveness lock (an open-file-description lock, never data)."""

EMPTY, DELETED = -1, -2
"""Hash-table slots: no entry, or an entry removed (probing goes on past it)."""


class State(enum.IntEnum):
    """An entry's state: only COMMITTED entries are found by readers."""

    FREE = 0
    WRITING = 1  # reserved by its owner, being filled; invisible
    COMMITTED = 2  # whole, in the table
    RETIRED = 3  # replaced or deleted while readers held it: freed by the last release


class Word(enum.IntEnum):
    """Index of each int64 word of the header."""

    MAGIC = 0
    VERSION = 1
    CAPACITY = 2
    TABLE_SIZE = 3
    MAX_CHUNKS = 4
    MAX_PROCESSES = 5
    HOLDS_PER_PROCESS = 6
    DATA_OFFSET = 7
    GEOMETRY_DIGEST = 8
    HOLDER = 9  # process slot + 1 of the lock holder, 0 when free: left set, the holder died inside
    LIVE_TABLE = 10  # 0 or 1: which hash table is in use
    FREE_COUNT = 11
    USED_BYTES = 12
    COMMITTED_CHUNKS = 13
    DELETED_SLOTS = 14
    EVICTIONS = 15
    RECOVERIES = 16
    REAPED_PROCESSES = 17
    CREATED_NS = 18
    NEXT_ENTRY = 19  # where the search for a free entry starts
    EVICTED_BYTES = 20
    EXPIRED_LEASES = 21  # holds taken back from live processes whose heartbeat stopped (stopped, frozen)
    JOURNAL_BYTES = 22  # the journal ring's size
    JOURNAL_HEAD = 23  # bytes ever written to the journal: its next record starts at HEAD % JOURNAL_BYTES
    JOURNAL_TAIL = 24  # where its oldest whole record starts (<= HEAD; moved before a record is overwritten)
    JOURNAL_SEQ = 25  # records ever written
    READS = 26  # chunks held for a read, every process's (hits)
    DROPS = 27  # chunks dropped on request (``drop_scopes``: tierkv pool drop)
    RETAINED_EVICTIONS = 28  # retained chunks evicted because nothing else was left to evict


ENTRY_FIELDS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("digest", "u8", (2,)),  # 128-bit BLAKE2b of the key
    ("scope", "u8", ()),  # the key's scope (16 hex digits), for per-scope occupancy
    ("offset", "i8", ()),  # into the data area
    ("alloc", "i8", ()),  # bytes reserved
    ("nbytes", "i8", ()),  # bytes of the chunk
    ("tick", "i8", ()),  # last use, CLOCK_MONOTONIC ns (one clock for every process)
    ("retain", "i8", ()),  # retained until (CLOCK_MONOTONIC ns; 0: not retained): evicted after the rest
    ("shape", "i8", (SHAPE_DIMS,)),
    ("state", "i4", ()),
    ("owner", "i4", ()),  # process slot of a WRITING entry's writer
    ("readers", "i4", ()),  # holds on it, every process together
    ("dtype", "i2", ()),
    ("ndim", "i2", ()),
)
PROCESS_FIELDS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("pid", "i8", ()),  # 0: free slot
    ("start", "i8", ()),  # the process's start time (clock ticks since boot): pid reuse is told apart
    ("pidns", "i8", ()),  # inode of its pid namespace: a pid means something only inside it
    ("heartbeat", "i8", ()),  # CLOCK_MONOTONIC ns, refreshed while it lives
    ("token", "i8", ()),  # random per attach: a hold is valid only under the token that took it
    ("holds", "i8", ()),  # holds in use
)


@dataclass(frozen=True)
class Geometry:
    """The sizes a pool is created with; every process attaching must agree on them."""

    capacity: int
    max_chunks: int
    max_processes: int
    holds_per_process: int
    journal_bytes: int = 0  # 0: default_journal_bytes(max_chunks, capacity)

    def __post_init__(self) -> None:
        if not self.journal_bytes:
            object.__setattr__(self, "journal_bytes", default_journal_bytes(self.max_chunks, self.capacity))
        if self.journal_bytes % 8 or self.journal_bytes < MIN_JOURNAL_BYTES:
            raise ValueError(f"journal_bytes: expected a multiple of 8 of at least {MIN_JOURNAL_BYTES}, got "
                             f"{self.journal_bytes}")

    @property
    def table_size(self) -> int:
        """Hash-table slots: a power of two, at least twice the entries (load <= 1/2)."""
        return 1 << max(4, (2 * self.max_chunks - 1).bit_length())

    def digest(self) -> int:
        """One number for the geometry and the layout version, stored in the header."""
        packed = struct.pack("<7q", VERSION, self.capacity, self.max_chunks, self.max_processes,
                             self.holds_per_process, SHAPE_DIMS, self.journal_bytes)
        return int.from_bytes(hashlib.blake2b(packed, digest_size=7).digest(), "little")


def default_max_chunks(capacity: int) -> int:
    """Chunks a pool indexes unless told: one per 256 KiB of capacity, at most 1M; a small pool
    (under 1 GiB) one per 8 KiB up to 4,096, so its index stays a few percent of it (a pool's
    chunks are rarely under 8 KiB: 256 tokens of a 2-layer model with one KV head of 64)."""
    return max(64, min(1 << 20, max(capacity // (256 << 10), min(4096, capacity // (8 << 10)))))


def default_holds_per_process(max_chunks: int) -> int:
    """Holds one process may have at once unless told (a read or a waiting fill takes one on a
    chunk): four per chunk the pool indexes, 256 to 16,384."""
    return max(256, min(16384, 4 * max_chunks))


MIN_JOURNAL_BYTES = 64 << 10


def default_journal_bytes(max_chunks: int, capacity: int = 1 << 40) -> int:
    """The journal's ring unless told: 2 KiB per indexed chunk (a 256-token chunk's description,
    its tokens and vLLM block hashes, takes about 1.6 KiB), and at least an eighth of the capacity
    up to 16 MiB, at most 256 MiB."""
    floor = max(MIN_JOURNAL_BYTES, min(16 << 20, capacity // 8 // 8 * 8))
    return max(floor, min(256 << 20, max_chunks * 2048))


def _aligned(offset: int, align: int = 64) -> int:
    return -(-offset // align) * align


@dataclass(frozen=True)
class Layout:
    """Byte offsets of every part of a pool file of ``geometry``."""

    geometry: Geometry
    tables: tuple[int, int]
    entries: dict[str, int]
    free: int
    processes: dict[str, int]
    holds: int
    journal: int
    data: int

    @property
    def file_bytes(self) -> int:
        return self.data + self.geometry.capacity

    @classmethod
    def of(cls, geometry: Geometry) -> Layout:
        offset = HEADER_BYTES
        tables = []
        for _ in range(2):
            tables.append(offset)
            offset = _aligned(offset + 4 * geometry.table_size)
        entries = {}
        for name, kind, shape in ENTRY_FIELDS:
            entries[name] = offset
            offset = _aligned(offset + np.dtype(kind).itemsize * int(np.prod(shape, dtype=np.int64)) * geometry.max_chunks)
        free = offset
        offset = _aligned(offset + 16 * (geometry.max_chunks + 1))
        processes = {}
        for name, kind, _ in PROCESS_FIELDS:
            processes[name] = offset
            offset = _aligned(offset + np.dtype(kind).itemsize * geometry.max_processes)
        holds = offset
        offset = _aligned(offset + 4 * geometry.max_processes * geometry.holds_per_process)
        journal = offset
        offset = _aligned(offset + geometry.journal_bytes)
        return cls(geometry, (tables[0], tables[1]), entries, free, processes, holds, journal,
                   _aligned(offset, DATA_ALIGN))


def header_problem(words: np.ndarray, geometry: Geometry) -> str | None:
    """Why a pool file whose header is ``words`` cannot be used with ``geometry`` (None: it can)."""
    if int(words[Word.MAGIC]) != MAGIC:
        return "it is not a tierkv pool (or an older tierkv's, whose format this one cannot read)"
    if int(words[Word.VERSION]) != VERSION:
        return f"it is a pool of layout version {int(words[Word.VERSION])}; this tierkv reads version {VERSION}"
    try:
        theirs = geometry_of(words)
    except ValueError:
        return "its header does not match its geometry (a damaged or foreign file)"
    if theirs.capacity != geometry.capacity:
        return (f"its capacity is {theirs.capacity} bytes and this config asks for {geometry.capacity}: every "
                "process sharing a pool gives it the same capacity")
    if theirs != geometry:
        return (f"it was created with max_chunks={theirs.max_chunks}, max_processes={theirs.max_processes}, "
                f"holds_per_process={theirs.holds_per_process}, journal_bytes={theirs.journal_bytes}; this config "
                f"asks for max_chunks={geometry.max_chunks}, max_processes={geometry.max_processes}, "
                f"holds_per_process={geometry.holds_per_process}, journal_bytes={geometry.journal_bytes}")
    if int(words[Word.GEOMETRY_DIGEST]) != geometry.digest():
        return "its header does not match its geometry (a damaged or foreign file)"
    return None


def geometry_of(words: np.ndarray) -> Geometry:
    """The geometry a pool's header (of this layout version) records."""
    return Geometry(int(words[Word.CAPACITY]), int(words[Word.MAX_CHUNKS]), int(words[Word.MAX_PROCESSES]),
                    int(words[Word.HOLDS_PER_PROCESS]), int(words[Word.JOURNAL_BYTES]))
