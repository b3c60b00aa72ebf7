"""Pure bookkeeping for tiers: what is resident, in what order it goes, which tiers a
put or a hit touches. No I/O happens here, so every decision is unit-testable without
a backend (vLLM's kv_offload split between bookkeeping and data movement).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LRUIndex(Generic[K]):
    """Sizes of resident entries in least-recently-used order, with reader pins.

    A pinned entry (one being read) is never chosen as a victim.
    """

    def __init__(self) -> None:
        self._sizes: OrderedDict[K, int] = OrderedDict()
        self._pins: dict[K, int] = {}
        self.used_bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[K]:
        """Resident keys, least recently used first."""
        return list(self._sizes)

    def size_of(self, key: K) -> int | None:
        return self._sizes.get(key)

    def add(self, key: K, nbytes: int) -> None:
        """Record ``key`` as resident and most recently used (replacing any old size)."""
        self.used_bytes += nbytes - self._sizes.pop(key, 0)
        self._sizes[key] = nbytes

    def touch(self, key: K) -> None:
        """Mark ``key`` as just used."""
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: K) -> int:
        """Forget ``key``; returns the bytes it held (0 if absent)."""
        nbytes = self._sizes.pop(key, 0)
        self.used_bytes -= nbytes
        return nbytes

    def pin(self, key: K) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: K) -> None:
        count = self._pins.get(key, 0) - 1
        if count > 0:
            self._pins[key] = count
        else:
            self._pins.pop(key, None)

    def is_pinned(self, key: K) -> bool:
        return key in self._pins

    def victims(self, need_bytes: int, capacity: int, protect: Iterable[K] = ()) -> list[K] | None:
        """Least-recently-used keys to drop so that ``need_bytes`` more fit in ``capacity``.

        Pinned and protected keys are skipped. Returns None when even dropping every
        candidate would not make room.
        """
        excess = self.used_bytes + need_bytes - capacity
        if excess <= 0:
            return []
        protected = set(protect)
        chosen: list[K] = []
        for key, nbytes in self._sizes.items():
            if key in self._pins or key in protected:
                continue
            chosen.append(key)
            excess -= nbytes
            if excess <= 0:
                return chosen
        return None


def put_targets(num_tiers: int) -> list[int]:
    """Tiers a new chunk is written to: all of them, top first (write-all for now)."""
    return list(range(num_tiers))


def promotion_targets(hit_tier: int) -> list[int]:
    """Tiers a hit in ``hit_tier`` is copied up to: every tier above it."""
    return list(range(hit_tier))


def first_missing(flags: Sequence[bool]) -> int:
    """Index of the first False in ``flags`` (its length when all are True)."""
    for index, present in enumerate(flags):
        if not present:
            return index
    return len(flags)
