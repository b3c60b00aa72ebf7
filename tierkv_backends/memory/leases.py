"""Retention leases of a memory tier (``cpu``, ``gpu``): a hint that keeps a prefix through
evictions for a while (``Engine.retain``, a vLLM request's ``retain_s``).

A lease is a bias, never a deadlock: the tier evicts every chunk without a live lease before
any chunk with one, and evicts those too when nothing else makes room (memory pressure, a
pool of nothing but retained chunks). What may be retained at once is capped at
``retain_share`` of the tier's capacity; a lease past the cap is refused whole. A lease ends
at its deadline, when it is released (0 seconds) or when its chunk leaves the tier.

Pure bookkeeping (no I/O, no allocation), as the node pool's retention is in
``tierkv_backends.shm.pool``; the tier asks it which keys to spare.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, KeysView, Sequence, Set
from typing import Generic, TypeVar

from tierkv.backend.options import format_size
from tierkv.errors import RetentionRefusedError

K = TypeVar("K")


class Leases(Generic[K]):
    """Deadlines (``time.monotonic``) of retained keys, capped at ``share`` of a capacity."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"retain_share: expected a share of the capacity from 0 to 1, got {share!r}")
        self.share = float(share)
        self._clock = clock
        self._until: dict[K, float] = {}
        self._first_end = math.inf  # no lease ends before this: until then nothing is scanned

    def live(self) -> KeysView[K]:
        """Keys whose lease has not ended, as a view (ended ones are forgotten here; the leases
        are scanned only once the earliest of them may have ended: a store asks on every
        eviction)."""
        if self._until and self._clock() >= self._first_end:
            now = self._clock()
            for key in [key for key, until in self._until.items() if until <= now]:
                del self._until[key]
            self._first_end = min(self._until.values(), default=math.inf)
        return self._until.keys()

    def retained_bytes(self, size_of: Callable[[K], int | None]) -> int:
        """Bytes of the live leases' chunks (``size_of``: a resident chunk's bytes, None if gone)."""
        return sum(size_of(key) or 0 for key in self.live())

    def retain(self, keys: Sequence[K], seconds: float, size_of: Callable[[K], int | None], capacity: int,
               where: str) -> list[bool]:
        """Lease each resident key of ``keys`` for ``seconds`` from now (a longer lease it has is
        kept; 0 releases it); whether each is resident.

        Raises:
            RetentionRefusedError: if the leases would pass ``share`` of ``capacity`` (nothing
                was retained).
            ValueError: if ``seconds`` is negative or not finite.
        """
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"retain: expected a number of seconds >= 0, got {seconds!r}")
        resident = [size_of(key) is not None for key in keys]
        held = [key for key, here in zip(keys, resident) if here]
        if not seconds:
            for key in held:
                self._until.pop(key, None)
            return resident
        live = self.live()
        adding = sum(size_of(key) or 0 for key in set(held) - live)
        retained = self.retained_bytes(size_of)
        cap = int(self.share * capacity)
        if adding and retained + adding > cap:
            raise RetentionRefusedError(
                f"{where}: retaining {format_size(adding)} more would retain {format_size(retained + adding)} "
                f"of its {format_size(capacity)}, past its cap of {format_size(cap)} (retain_share {self.share:g}): "
                "nothing was retained")
        until = self._clock() + seconds
        for key in held:
            self._until[key] = max(self._until.get(key, 0.0), until)
        self._first_end = min(self._first_end, until)
        return resident

    def forget(self, key: K) -> None:
        """The key's chunk left the tier: its lease ends."""
        self._until.pop(key, None)

    def clear(self) -> None:
        self._until.clear()
        self._first_end = math.inf


def spare_leased_last(order: Iterable[K], leased: Set[K]) -> list[K]:
    """``order`` (the eviction policy's) with every leased key moved after every other."""
    ordered = list(order)
    return [key for key in ordered if key not in leased] + [key for key in ordered if key in leased]
