"""Pure bookkeeping for tiers: what is resident, in what order it goes, which tiers a
put or a hit touches. No I/O happens here, so every decision is unit-testable without
a backend (vLLM's kv_offload split between bookkeeping and data movement).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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

    def sized_items(self) -> list[tuple[K, int]]:
        """Every resident key with its size (in no particular order)."""
        return list(self._sizes.items())

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


class S3FIFOIndex(LRUIndex[K]):
    """S3-FIFO eviction (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and
    a ghost list of recently evicted keys.

    New keys enter the small queue; one that is hit again before it leaves moves to the
    main queue, others are evicted early (one-hit wonders, such as a prompt seen once, do
    not flush the hot set). Main-queue keys with a recent hit get another lap. A key in
    the ghost list goes straight to main when it comes back.
    """

    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        super().__init__()
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._small_bytes = 0

    def keys(self) -> list[K]:
        return [*self._small, *self._main]

    def add(self, key: K, nbytes: int) -> None:
        if key in self._sizes:
            self.remove(key)
        super().add(key, nbytes)
        self._freq[key] = 0
        if key in self._ghost:  # evicted recently and back already: it is hot
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += nbytes
        while len(self._ghost) > max(len(self._sizes), 16):
            self._ghost.popitem(last=False)

    def touch(self, key: K) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: K) -> int:
        if key in self._small:
            del self._small[key]
            self._small_bytes -= self._sizes.get(key, 0)
        self._main.pop(key, None)
        self._freq.pop(key, None)
        return super().remove(key)

    def victims(self, need_bytes: int, capacity: int, protect: Iterable[K] = ()) -> list[K] | None:
        excess = self.used_bytes + need_bytes - capacity
        if excess <= 0:
            return []
        protected = set(protect)
        chosen: list[K] = []
        chosen_set: set[K] = set()
        small_budget = self.SMALL_FRACTION * capacity
        small_bytes = self._small_bytes
        # Each key is looked at a bounded number of times: a hit only buys MAX_FREQ more laps.
        for _ in range((len(self._sizes) + 1) * (self.MAX_FREQ + 2)):
            if excess <= 0:
                return chosen
            take_small = self._small and (small_bytes > small_budget or not self._main)
            queue = self._small if take_small else self._main
            if not queue:
                break
            key = next(iter(queue))
            queue.move_to_end(key)
            if key in chosen_set:
                if all(k in chosen_set or self.is_pinned(k) or k in protected for k in queue):
                    if take_small and self._main:
                        small_bytes = 0  # small queue exhausted: look at main
                        continue
                    break
                continue
            if key in self._pins or key in protected:
                continue
            if take_small and self._freq.get(key, 0) > 0:
                del self._small[key]  # promoted to main: it was hit while on probation
                self._small_bytes -= self._sizes[key]
                small_bytes -= self._sizes[key]
                self._main[key] = None
                self._freq[key] = 0
                continue
            if not take_small and self._freq.get(key, 0) > 0:
                self._freq[key] -= 1  # another lap around main
                continue
            chosen.append(key)
            chosen_set.add(key)
            excess -= self._sizes[key]
            if take_small:
                small_bytes -= self._sizes[key]
                self._ghost[key] = None
        return chosen if excess <= 0 else None


EVICTION_POLICIES = ("lru", "s3fifo")


def make_index(policy: str = "lru") -> LRUIndex[Any]:
    """A residency index with the named eviction policy."""
    if policy == "lru":
        return LRUIndex()
    if policy == "s3fifo":
        return S3FIFOIndex()
    raise ValueError(f"unknown eviction policy {policy!r}; expected one of {list(EVICTION_POLICIES)}")


@dataclass(frozen=True)
class PressureDecision:
    """What a memory tier should do given a pressure reading."""

    admitting: bool
    capacity: int  # effective capacity now (<= configured)
    pressured: bool


def pressure_decision(
    used_fraction: float,
    total_bytes: int,
    tier_used: int,
    configured: int,
    high: float,
    low: float,
    was_pressured: bool,
) -> PressureDecision:
    """Effective capacity of a memory tier under memory pressure, with hysteresis.

    Above ``high`` (or still above ``low`` after having crossed ``high``) the tier stops
    admitting and shrinks by the excess over ``low``, so the device gets back to the low
    watermark. Below ``low`` it admits again and its capacity grows back into the free
    headroom, never past ``configured``.
    """
    pressured = used_fraction >= high or (was_pressured and used_fraction > low)
    excess = round((used_fraction - low) * total_bytes)
    if pressured:
        return PressureDecision(False, max(0, min(configured, tier_used - max(excess, 0))), True)
    headroom = max(0, -excess)
    return PressureDecision(True, min(configured, tier_used + headroom), False)


def promotion_targets(hit_tier: int) -> list[int]:
    """Tiers a hit in ``hit_tier`` is copied up to: every tier above it."""
    return list(range(hit_tier))


def first_missing(flags: Sequence[bool]) -> int:
    """Index of the first False in ``flags`` (its length when all are True)."""
    for index, present in enumerate(flags):
        if not present:
            return index
    return len(flags)
