"""Write-back's dirty chunks: what a memory tier holds that no tier below has yet.

Under ``write_policy: write_back`` a store lands in the first tier that admits it and moves
down only when that tier evicts it (demotion). What a memory tier holds alone is lost when
the process exits, so ``TierRouter.flush`` writes the
dirty chunks of every memory tier down, and ``close()`` flushes unless told not to. This
module is the bookkeeping: which keys are dirty at which level, in the order they became so.
Persistent tiers (lmdb, fs, s3, mooncake) hold what they acknowledged across a crash: their
chunks are never dirty.

The invariant the router keeps with it (docs/design.md, "Durable flush"): a key is marked
dirty at the moment its memory tier commits it, before anything can evict it, and is cleaned
only once a tier below has committed it (a demotion or a flush wrote it there) or it was
deleted. So a key that is dirty but no longer in its tier left without landing anywhere:
``DirtyChunks.lost`` records it and the next flush says so instead of returning as if
it had been written.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierkv.chunks.keys import CacheKey


class DirtyChunks:
    """Keys stored in a memory tier and not yet written to a tier below it, per level."""

    def __init__(self) -> None:
        self._levels: dict[int, dict[CacheKey, None]] = {}
        self._lost: dict[int, int] = {}

    def mark(self, level: int, keys: Iterable[CacheKey]) -> None:
        """``keys`` were just committed at ``level`` (a memory tier with tiers below it)."""
        dirty = self._levels.setdefault(level, {})
        for key in keys:
            dirty[key] = None

    def is_dirty(self, level: int, key: CacheKey) -> bool:
        """Whether ``key`` at ``level`` has no copy below yet."""
        return key in self._levels.get(level, ())

    def clean(self, level: int, keys: Iterable[CacheKey]) -> None:
        """``keys`` at ``level`` now have a copy committed below (or were deleted)."""
        dirty = self._levels.get(level)
        if dirty:
            for key in keys:
                dirty.pop(key, None)

    def lose(self, level: int, keys: Iterable[CacheKey]) -> int:
        """``keys`` left ``level`` without landing below (dropped under memory pressure after
        their demotion failed, or evicted by a tier that cannot demote): no longer dirty, and
        counted until ``take_lost``; how many of them were dirty."""
        dirty = self._levels.get(level, {})
        gone = [key for key in keys if key in dirty]
        for key in gone:
            del dirty[key]
        if gone:
            self._lost[level] = self._lost.get(level, 0) + len(gone)
        return len(gone)

    def take_lost(self) -> dict[int, int]:
        """Dirty chunks lost per level since the last call (a flush reports them once)."""
        lost, self._lost = self._lost, {}
        return lost

    def discard(self, keys: Iterable[CacheKey]) -> None:
        """``keys`` were deleted from every tier."""
        keys = list(keys)
        for level in list(self._levels):
            self.clean(level, keys)

    def levels(self) -> list[int]:
        """Levels with dirty chunks, top first."""
        return sorted(level for level, dirty in self._levels.items() if dirty)

    def pending(self, level: int) -> list[CacheKey]:
        """The dirty keys of ``level``, oldest first."""
        return list(self._levels.get(level, ()))

    def count(self) -> int:
        return sum(len(dirty) for dirty in self._levels.values())
