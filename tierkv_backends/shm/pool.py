"""A pool of chunk memory in one file that every process on the node maps: the shared index,
the allocator, holds, eviction, and recovery from processes that die at any instant.

One module of about 560 lines, by choice (why: below, "Over 400 lines").

The contract (docs/design.md, "One host cache per node"):

- **One lock, released by the kernel, never waited on without bound.** Every change to the
  index happens under an ``flock`` on the pool file (plus a thread lock inside the process),
  taken with a deadline (``tierkv_backends.shm.lock``: a holder that is stopped costs the
  others one wait of ``lock_timeout_s``, then misses). A process killed while holding it loses
  it at once; the header word ``Word.HOLDER`` it set on entry is still set, so the next
  holder knows the index may be half changed and rebuilds everything derived (tables, free
  extents, reader counts) from the entries, which change one state word at a time.
- **Visible only when whole.** A put reserves an entry (WRITING, invisible, owned by its process
  slot) and an extent, fills the extent outside the lock, and commits (one store of the state
  word, then one store into the hash table). A writer that dies leaves a WRITING entry of a dead
  owner: reaped, its extent freed.
- **No byte changes under a reader.** A read holds the entry (its reader count, and the entry id
  in the process's hold row in the pool) while it copies; an entry with readers is never
  evicted and a replaced or deleted one is RETIRED until its last reader lets go.
- **Dead is what the kernel says.** A process is dead when the kernel dropped its slot's
  liveness lock (``tierkv_backends.shm.liveness``; any pid namespace): then its holds, its
  unfinished writes and its slot are given back. A live process whose heartbeat stopped for
  ``lease_s`` (stopped, frozen) has only its holds taken back and its token voided: when it runs
  again it finds the token changed, forgets those holds without touching any count, reports
  their reads as misses (``stale_reads``) and goes on in its own slot under a new token; what it
  was writing stayed its own, so its write completes into memory nobody else was given.
  Reader counts therefore never outlive their process, and no process writes into room it
  does not own.
- **No space leaked.** Dead processes are reaped whenever room runs out and when a process
  attaches.
- **Bounded.** Extents are carved from ``capacity`` bytes by first fit with coalescing; room is
  made by evicting committed entries without readers, least recently used first (``tick`` is
  CLOCK_MONOTONIC, one clock for every process on the node).
- **A shrunk file is an error, not a signal.** Before each batch and at each heartbeat the
  process compares the file's size with its mapping; a file someone truncated makes the pool
  unusable to this process (``PoolBrokenError``, one log line), never a SIGBUS, save for a
  truncation in the instant between that check and a copy.

Lookups read the live hash table without the lock (an answer may be stale by the time it is
used; a read then misses, never returns another chunk's bytes).

The file and its mapping are ``tierkv_backends.shm.file``'s, the hash table and the free
extents ``tierkv_backends.shm.index``'s, the lock's deadline ``tierkv_backends.shm.lock``'s, the attached processes
``tierkv_backends.shm.processes``'. Over 400 lines (about 560) by choice: the lock, the
entries' states, holds, reaping and recovery are one state machine over one index (recovery
rebuilds what every other method keeps; reaping undoes holds and writes), and splitting it
would spread the invariants above across modules that each keep only part of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.chunks import serde
from tierkv.errors import CapacityError, RetentionRefusedError, TierKVError, TierUnavailableError
from tierkv_backends.shm import liveness
from tierkv_backends.shm.file import now_ns
from tierkv_backends.shm.index import REHASH_FRACTION
from tierkv_backends.shm.layout import SHAPE_DIMS, Geometry, State, Word
from tierkv_backends.shm.lock import PoolLock
from tierkv_backends.shm.processes import PoolBrokenError, PoolProcesses

logger = logging.getLogger("tierkv_backends.shm_pool")

__all__ = ["Held", "PoolBrokenError", "SharedPool", "alloc_size", "digest"]


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


@dataclass
class Held:
    """One hold on an entry: its id and the position of the hold in this process's row."""

    entry: int
    position: int
    token: int


_ATTACH_WAIT_S = 10.0
_RETAINED_LAST = 1 << 62  # added to a retained entry's last use when victims are ordered (ns ticks are far below)  # the lock at attach: longer than a call's wait, still bounded


class SharedPool(PoolProcesses):
    """One process's view of a pool file (see the module docstring)."""

    def __init__(self, path: str, geometry: Geometry, mode: int = 0o600, lease_s: float = 30.0,
                 where: str = "shm tier", lock_timeout_s: float = 1.0) -> None:
        super().__init__(path, geometry, mode, where)
        self._init_processes(lease_s)
        self.evicted = 0  # evictions this process made (taken by the tier's counters)
        self.evicted_bytes = 0
        self._lock = PoolLock(self._fd, lock_timeout_s, self._holder, where, path)
        try:
            with self.lock(_ATTACH_WAIT_S):
                self.reap()
                self._claim_slot()
        except BaseException:
            self._close_files()
            raise
        self._start_heartbeat()

    # -- the lock ------------------------------------------------------------------------------
    @property
    def lock_timeouts(self) -> int:
        """Waits for the lock that gave up (``tierkv_backends.shm.lock.PoolBusyError``)."""
        return self._lock.timeouts

    @contextlib.contextmanager
    def lock(self, wait_s: float | None = None) -> Iterator[None]:
        """The pool's one lock, within ``wait_s`` (default ``lock_timeout_s``), else
        ``PoolBusyError`` (see ``tierkv_backends.shm.lock``). A holder that died inside
        leaves ``Word.HOLDER`` set; the next holder rebuilds first. A change that failed with
        a tierkv error left the index whole (every such path gives back what it took); any other
        exception leaves the word set, so the next holder rebuilds too."""
        self.check_intact()
        self._lock.acquire(wait_s)
        try:
            with self._inside():
                yield
        finally:
            self._lock.release()

    @contextlib.asynccontextmanager
    async def alock(self, wait_s: float | None = None) -> AsyncIterator[None]:
        """``lock``, waiting on the event loop; the body must not await."""
        self.check_intact()
        await self._lock.acquire_async(wait_s)
        try:
            with self._inside():
                yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        if not self._lock.outermost:  # nested in this thread: the outer holding did the checks
            yield
            return
        self.check_intact()
        if int(self.words[Word.HOLDER]) != 0:
            self.recover()
        self.words[Word.HOLDER] = self.slot + 1 if self.slot >= 0 else self.geometry.max_processes + 1
        if self.slot >= 0:
            self._rejoin_if_revoked()
            self._release_pending()
        try:
            yield
        except TierKVError:
            self.words[Word.HOLDER] = 0
            raise
        self.words[Word.HOLDER] = 0

    def reap(self) -> int:
        """Give back what dead processes held (their holds, their unfinished writes, their slot),
        and take back the holds of live processes whose heartbeat stopped for ``lease_s`` (their
        unfinished writes stay theirs: a stopped writer resumes into them); how many processes
        were reaped. Under the lock."""
        reaped = expired = 0
        for slot in (int(s) for s in np.flatnonzero(self.procs["pid"] != 0)):
            if slot == self.slot:
                continue
            if self.alive(slot):
                if int(self.procs["token"][slot]) != 0 and self._lease_expired(slot):
                    self._take_holds_back(slot)
                    self.procs["token"][slot] = 0  # its holds are void: it rejoins when it runs again
                    expired += 1
                continue
            self._take_holds_back(slot)
            for entry in np.flatnonzero((self.entries["state"] == State.WRITING) & (self.entries["owner"] == slot)):
                self._free_entry(int(entry))
            self.procs["token"][slot] = 0
            self.procs["pid"][slot] = 0
            reaped += 1
        if reaped:
            self.words[Word.REAPED_PROCESSES] += reaped
            logger.info("%s: gave back what %d dead process(es) held in the pool at %s", self.where, reaped, self.path)
        if expired:
            self.words[Word.EXPIRED_LEASES] += expired
            logger.warning("%s: took back the holds of %d process(es) in the pool at %s that did not run for lease_s="
                           "%gs (stopped or frozen)", self.where, expired, self.path, self.lease_s)
        return reaped + expired

    def _take_holds_back(self, slot: int) -> None:
        row = self.holds[slot]
        for entry in row[row >= 0]:
            self._unhold(int(entry))
        row[:] = -1
        self.procs["holds"][slot] = 0

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

    def _drop(self, entry: int, replaced: bool = False) -> None:
        """A committed entry leaves: unpublished, then freed, or RETIRED while readers hold it;
        the journal says so unless a newer copy of the same chunk ``replaced`` it."""
        if not replaced:
            d0, d1 = (int(x) for x in self.entries["digest"][entry])
            self.journal.dropped([(d0, d1)])
        self._unpublish(entry)
        self.words[Word.COMMITTED_CHUNKS] -= 1
        if int(self.entries["readers"][entry]) > 0:
            self.entries["state"][entry] = State.RETIRED
        else:
            self._free_entry(entry)
        if int(self.words[Word.DELETED_SLOTS]) * REHASH_FRACTION > self.geometry.table_size:
            self._rehash()

    def reserve(self, digests: Sequence[tuple[int, int]], scopes: Sequence[int],
                layouts: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[int]:
        """WRITING entries (owned by this process) with extents for chunks of ``layouts``,
        evicting least-recently-used committed entries without readers as needed (the batch's
        own entries are WRITING, so a batch never evicts itself). Under the lock; all or
        nothing."""
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
                        victims = self._victims()
                    victim = next(victims, None)
                    if victim is None:
                        if self.reap():
                            victims = None
                            start = self._take(size)
                            continue
                        raise CapacityError(f"{self.where}: no room for {size} bytes in the pool: the rest of its "
                                            f"{self.geometry.capacity} bytes is being read or written")
                    if int(self.entries["state"][victim]) == State.COMMITTED and not self.entries["readers"][victim]:
                        freed = int(self.entries["alloc"][victim])
                        if int(self.entries["retain"][victim]) > now_ns():
                            self.words[Word.RETAINED_EVICTIONS] += 1
                        self._drop(victim)
                        self.words[Word.EVICTIONS] += 1
                        self.words[Word.EVICTED_BYTES] += freed
                        self.evicted += 1
                        self.evicted_bytes += freed
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
                fields["retain"][entry] = 0
                fields["state"][entry] = State.WRITING  # last: the entry is now this process's
                self.words[Word.USED_BYTES] += size
                taken.append(entry)
        except BaseException:
            for entry in taken:
                self._free_entry(entry)
            raise
        return taken

    def _victims(self) -> Iterator[int]:
        """Committed entries without readers, least recently used first (batches of the oldest),
        retained ones after every other: retention is a bias, never a deadlock."""
        fields = self.entries
        candidates = np.flatnonzero((fields["state"] == State.COMMITTED) & (fields["readers"] == 0))
        ticks = fields["tick"][candidates]
        ticks = np.where(fields["retain"][candidates] > now_ns(), ticks + _RETAINED_LAST, ticks)
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
                continue  # not this process's to commit (given back meanwhile): nothing to do
            self.entries["tick"][entry] = now_ns()
            self.entries["state"][entry] = State.COMMITTED
            replaced = self._publish(entry)
            self.words[Word.COMMITTED_CHUNKS] += 1
            if replaced >= 0:  # a newer copy keeps the old one's retention
                self.entries["retain"][entry] = max(int(self.entries["retain"][entry]),
                                                    int(self.entries["retain"][replaced]))
                self._drop(replaced, replaced=True)

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
        self.words[Word.READS] += len(held) - held.count(None)
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

    def release_later(self, held: Held) -> bool:
        """A release that could not take the lock (it is stuck): done at this process's next
        holding of it. Whether the read under the hold was valid, from this process's token
        without the lock: holds are taken back only under the lock, by changing the token first,
        so a token unchanged after the copy means nobody could have evicted the chunk during it."""
        if self.slot < 0 or held.token != self.token or int(self.procs["token"][self.slot]) != held.token:
            return False
        self._pending.append(held)
        return True

    def abort_later(self, entries: Sequence[int]) -> None:
        """Reserved entries whose commit or abort could not take the lock: given back at this
        process's next holding of it (they stay this live process's WRITING room until then)."""
        self._pending_aborts.extend(entries)

    def _release_pending(self) -> None:
        pending, self._pending = self._pending, []
        for held in pending:
            self.release(held)
        aborts, self._pending_aborts = self._pending_aborts, []
        self.abort(aborts)

    def _unhold(self, entry: int) -> None:
        readers = int(self.entries["readers"][entry]) - 1
        self.entries["readers"][entry] = max(0, readers)
        if readers <= 0 and int(self.entries["state"][entry]) == State.RETIRED:
            self._free_entry(entry)

    def describe(self, descriptions: Sequence[tuple[tuple[int, int], bytes]]) -> int:
        """Journal a description of each committed chunk (digest, payload) still in the pool; how
        many were written (one larger than the journal allows is left out). Under the lock."""
        digests = np.array([digest for digest, _ in descriptions], dtype=np.uint64).reshape(-1, 2)
        written = 0
        for (chunk, payload), entry in zip(descriptions, self.find(digests)):
            if entry >= 0:
                written += self.journal.described(chunk, payload)
        return written

    def retained_bytes(self) -> int:
        """Bytes of committed entries retained now. Under the lock (or a snapshot without it)."""
        fields = self.entries
        live = (fields["state"] == State.COMMITTED) & (fields["retain"] > now_ns())
        return int(fields["alloc"][live].sum())

    def retain(self, digests: np.ndarray, until_ns: int, cap_bytes: int) -> list[bool]:
        """Retain the committed entry of each digest until ``until_ns`` (CLOCK_MONOTONIC; a
        retention already longer is kept; 0 releases them); whether each was found. Refused
        whole (``RetentionRefusedError``) when the retained bytes would pass ``cap_bytes``.
        Under the lock."""
        found = self.find(digests)
        entries = np.unique(found[found >= 0])
        fields = self.entries
        if until_ns:
            now = now_ns()
            adding = int(fields["alloc"][entries[fields["retain"][entries] <= now]].sum())
            retained = self.retained_bytes()
            if retained + adding > cap_bytes:
                raise RetentionRefusedError(
                    f"{self.where}: retaining {adding} more bytes would retain {retained + adding} of the pool's "
                    f"{self.geometry.capacity}, past its cap of {cap_bytes} (retain_share): nothing was retained")
            fields["retain"][entries] = np.maximum(fields["retain"][entries], until_ns)
        else:
            fields["retain"][entries] = 0
        return (found >= 0).tolist()

    def drop_scopes(self, scopes: set[int] | None) -> tuple[int, int]:
        """Drop every committed chunk of ``scopes`` (None: every chunk); (chunks, bytes). A chunk
        being read stays RETIRED until its last reader lets go, as any replaced chunk does.
        Under the lock."""
        state, scope_of = self.entries["state"], self.entries["scope"]
        committed = np.flatnonzero(state == State.COMMITTED)
        if scopes is not None:
            committed = committed[np.isin(scope_of[committed], np.array(sorted(scopes), dtype=np.uint64))]
        freed = int(self.entries["alloc"][committed].sum()) if len(committed) else 0
        for entry in committed:
            self._drop(int(entry))
        self.words[Word.DROPS] += len(committed)
        return len(committed), freed

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
        mine = {"lock_timeouts": self.lock_timeouts, "holds_taken_back": self.rejoins, "broken": self.broken is not None}
        if self.broken is not None:  # the mapping must not be touched
            return mine
        words = self.words
        return {"pool_chunks": int(words[Word.COMMITTED_CHUNKS]), "pool_evictions": int(words[Word.EVICTIONS]),
                "pool_reads": int(words[Word.READS]), "pool_drops": int(words[Word.DROPS]),
                "pool_retained_bytes": self.retained_bytes(),
                "pool_retained_evictions": int(words[Word.RETAINED_EVICTIONS]),
                "pool_evicted_bytes": int(words[Word.EVICTED_BYTES]), "recoveries": int(words[Word.RECOVERIES]),
                "reaped_processes": int(words[Word.REAPED_PROCESSES]), "expired_leases": int(words[Word.EXPIRED_LEASES]),
                "processes": int((self.procs["pid"] != 0).sum()), "free_extents": int(words[Word.FREE_COUNT]), **mine}

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
        """Give back this process's holds and unfinished writes and its slot; unmap. Bounded: a
        lock that stays busy (or a shrunk file) leaves them to the others, who reap this process
        once it is gone."""
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
                    liveness.give_up(self._fd, self.slot)
            except (OSError, TierUnavailableError) as exc:  # gone, shrunk or stuck: the others reap this one
                logger.warning("%s: closing the pool at %s: %s", self.where, self.path, exc)
        self.slot = -1
        self._close_files()
