"""The index of a ``shm`` pool: its open-addressing hash table of entry ids (two buffers, one live)
and the free extents of its data area (first fit, coalesced). Methods of the pool, called under
its lock, except the lookups (``PoolIndex.contains``, ``PoolIndex.find``), which read the
live table without it. Kept apart from the pool's state machine (``tierkv_backends.shm.pool``)
because neither structure needs to know why an entry is where it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tierkv_backends.shm.file import PoolFile
from tierkv_backends.shm.layout import DELETED, EMPTY, State, Word

REHASH_FRACTION = 4  # rebuild the table once a quarter of its slots are deleted markers


class PoolIndex(PoolFile):
    """The hash table and the free extents over a mapped pool file."""

    def _table(self) -> np.ndarray:
        return self.tables[int(self.words[Word.LIVE_TABLE]) & 1]

    def contains(self, digests: Sequence[tuple[int, int]]) -> list[bool]:
        """Whether a committed entry of each digest is in the pool: ``find`` for the few
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
