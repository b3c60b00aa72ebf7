"""Which chunks a tier takes: reuse-aware admission.

Most KV is never asked for again (serving traces: a few percent of blocks give most reuses),
so a slow or wearing tier that takes every chunk spends its writes, requests and capacity on
one-hit chunks and evicts the ones that would hit. A tier's ``admission`` says which chunks
may be *copied* into it (write-through fills, write-back demotions and flushes, promotions):

* ``all``: every chunk (the default);
* ``reused`` / ``reused(n)``: a chunk seen at least ``n`` times (default 2), where a store of
  it and a read that found it count once each. Under write-through a chunk that reaches ``n``
  later, on a hit in a memory tier above, is filled down then (once);
* ``tinylfu``: a chunk only if it has been seen more often than the chunk the tier would evict
  to make room for it (any chunk while the tier has room). Needs a tier that can name its next
  victim (``tierkv.backend.NamesVictims``: cpu, gpu, lmdb, fs).

A store itself always lands in the first tier that takes it: admission filters copies, never
the one copy a store makes. What is not admitted is counted (``admitted`` / ``rejected`` per
tier in ``stats()``), never an error.

Counts live in a ``FrequencySketch``: a count-min sketch of 4-bit counters whose size is
fixed (independent of how many keys were ever seen) and which halves every counter after a
sample of increments, so old popularity fades (TinyLFU's reset). Each process keeps its own:
processes sharing a tier each decide from what they have seen.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.errors import ConfigError

_MAX_COUNT = 15  # 4-bit counters: enough to order popularity, small enough to age fast
_ROWS = 4
_BATCH = 240  # keys counted at once (240 + 15 fits a uint8 cell)
_REUSED = re.compile(r"reused(?:\((\d+)\))?")


class FrequencySketch:
    """Approximate counts of keys in ``width`` x 4 saturating counters (count-min), aged by
    halving every counter after ``sample`` increments. It can over-count (a collision), never
    under-count a key since the last halving."""

    def __init__(self, width: int = 1 << 16, sample: int | None = None) -> None:
        if width < 16 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two >= 16, got {width}")
        self.width = width
        self.sample = sample if sample is not None else 10 * width
        self._counts = np.zeros((_ROWS, width), dtype=np.uint8)
        self._rows = np.arange(_ROWS)[:, None]
        self._added = 0
        self.resets = 0

    def _slots(self, keys: Sequence[Hashable]) -> np.ndarray:
        """Column of each key in each row (double hashing of the key's hash): [rows, keys]."""
        hashes = np.array([hash(key) & 0xFFFFFFFFFFFFFFFF for key in keys], dtype=np.uint64)
        low, high = hashes & np.uint64(0xFFFFFFFF), (hashes >> np.uint64(32)) | np.uint64(1)
        steps = np.arange(_ROWS, dtype=np.uint64)[:, None]
        return ((low[None, :] + steps * high[None, :]) & np.uint64(self.width - 1)).astype(np.int64)

    def add(self, keys: Sequence[Hashable]) -> None:
        """Count one sighting of each key (a key twice in ``keys`` counts twice)."""
        for start in range(0, len(keys), _BATCH):  # a cell gains at most _BATCH: no uint8 overflow
            slots = self._slots(keys[start : start + _BATCH])
            rows = np.broadcast_to(self._rows, slots.shape)
            np.add.at(self._counts, (rows, slots), 1)  # repeats in a batch add up
            self._counts[rows, slots] = np.minimum(self._counts[rows, slots], _MAX_COUNT)
        self._added += len(keys)
        if self._added >= self.sample:
            self._counts >>= 1
            self._added //= 2
            self.resets += 1

    def estimate(self, keys: Sequence[Hashable]) -> list[int]:
        """The count of each key (the least of its counters)."""
        if not keys:
            return []
        return self._counts[self._rows, self._slots(keys)].min(axis=0).tolist()

    @property
    def nbytes(self) -> int:
        """Memory the counters take (fixed at construction)."""
        return int(self._counts.nbytes)


@dataclass(frozen=True)
class Admission:
    """A tier's admission rule (see the module docstring): ``policy`` is ``all``, ``reused``
    or ``tinylfu``; ``times`` is ``reused``'s threshold."""

    policy: str = "all"
    times: int = 2

    @property
    def filters(self) -> bool:
        """Whether some chunks may be turned away (anything but ``all``)."""
        return self.policy != "all"

    def admits(self, counts: Sequence[int], victim_counts: Sequence[int] | None = None) -> list[bool]:
        """Per chunk seen ``counts[i]`` times, whether it may be copied in. ``victim_counts``
        (tinylfu): how often the chunk it would displace was seen; None when it displaces none."""
        if self.policy == "all":
            return [True] * len(counts)
        if self.policy == "reused":
            return [count >= self.times for count in counts]
        if victim_counts is None:
            return [True] * len(counts)
        return [count > victim for count, victim in zip(counts, victim_counts)]

    def just_reached(self, counts: Sequence[int]) -> list[bool]:
        """``reused``: whether each chunk's count has just reached the threshold (a late fill
        is due once, at that sighting)."""
        return [self.policy == "reused" and count == self.times for count in counts]

    def describe(self) -> str:
        return f"reused({self.times})" if self.policy == "reused" else self.policy


def parse_admission(raw: object, path: str) -> Admission:
    """``all``, ``reused``, ``reused(n)`` or ``tinylfu`` (``path``: where in the YAML, for errors)."""
    expected = "expected all, reused, reused(n) with n >= 1, or tinylfu"
    if not isinstance(raw, str):
        raise ConfigError(f"{path}: {expected}, got {raw!r}")
    text = raw.strip().lower().replace(" ", "")
    if text in ("all", "tinylfu"):
        return Admission(text)
    match = _REUSED.fullmatch(text)
    if match is None:
        raise ConfigError(f"{path}: {expected}, got {raw!r}")
    times = int(match.group(1) or 2)
    if times < 1:
        raise ConfigError(f"{path}: {expected}, got {raw!r}")
    return Admission("reused", times)
