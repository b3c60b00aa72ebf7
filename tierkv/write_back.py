"""Write-back's dirty chunks: what a memory tier holds that no tier below has yet.

Under ``write_policy: write_back`` a store lands in the first tier that admits it and moves
down only when that tier evicts it (demotion). What a memory tier holds alone is lost when
the process exits, so :meth:`TierRouter.flush <tierkv.router.TierRouter.flush>` writes the
dirty chunks of every memory tier down, and ``close()`` flushes unless told not to. This
module is the bookkeeping: which keys are dirty at which level, in the order they became so.
Persistent tiers (lmdb, fs, s3, mooncake) hold what they acknowledged across a crash: their
chunks are never dirty.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierkv.keys import CacheKey


class DirtyChunks:
    """Keys stored in a memory tier and not yet written to a tier below it, per level."""

    def __init__(self) -> None:
        self._levels: dict[int, dict[CacheKey, None]] = {}

    def mark(self, level: int, keys: Iterable[CacheKey]) -> None:
        """``keys`` were just stored at ``level`` (a memory tier with tiers below it)."""
        dirty = self._levels.setdefault(level, {})
        for key in keys:
            dirty[key] = None

    def clean(self, level: int, keys: Iterable[CacheKey]) -> None:
        """``keys`` at ``level`` now have a copy below (written down, or gone from the tier)."""
        dirty = self._levels.get(level)
        if dirty:
            for key in keys:
                dirty.pop(key, None)

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
