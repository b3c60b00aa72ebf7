"""Where chunks are: the level of the highest tier holding each key.

Three questions, one answer format (a level per key; -1 for a chunk acknowledged but still
in the fill queue; None for nowhere): :func:`locate` asks every available tier (I/O where a
tier needs it), :func:`locate_nowait` answers from in-memory indexes only (None when a tier
available now would need I/O), :func:`locate_for_read` plans a read without I/O (chunks no
indexed tier holds go to the first tier without an index, asked with gets).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tierkv.fill import FillQueue
from tierkv.keys import CacheKey
from tierkv.tier import Tier

Levels = list[int | None]


async def locate(tiers: Sequence[Tier], fill: FillQueue, keys: Sequence[CacheKey]) -> Levels:
    """Index of the highest tier holding each key; -1 for the fill queue; None if nowhere."""
    found: Levels = [None] * len(keys)
    missing = list(range(len(keys)))
    for tier in tiers:
        if not missing:
            break
        if not tier.available():
            continue
        flags = await tier.contains([keys[i] for i in missing])
        if flags is None:
            continue
        missing = _place(found, missing, flags, tier.level)
    return _or_fill_queue(fill, found, missing, keys)


def locate_nowait(tiers: Sequence[Tier], fill: FillQueue, keys: Sequence[CacheKey]) -> Levels | None:
    """:func:`locate` from in-memory indexes only (reads shared state, changes nothing)."""
    now = time.monotonic()
    top: list[bool] | None = None
    if keys and tiers[0].breaker.available(now):
        top = tiers[0].contains_nowait(keys)
        if top is None:
            return None
        if all(top):  # the common answer to a hit: every chunk in the top tier
            return [0] * len(keys)
    found: Levels = [None] * len(keys)
    missing = list(range(len(keys)))
    for tier in tiers:
        if not missing:
            break
        if tier.level == 0:
            flags = top
        elif tier.breaker.available(now):
            flags = tier.contains_nowait([keys[i] for i in missing])
            if flags is None:
                return None
        else:
            flags = None
        if flags is None:
            continue
        missing = _place(found, missing, flags, tier.level)
    return _or_fill_queue(fill, found, missing, keys)


def locate_for_read(tiers: Sequence[Tier], fill: FillQueue, keys: Sequence[CacheKey]) -> Levels:
    """Where to read each chunk from, without I/O: the highest tier whose in-memory index
    holds it; chunks no indexed tier holds go to the first available tier without an
    index (read directly: a miss there is a get that finds nothing), else the fill queue."""
    found: Levels = [None] * len(keys)
    missing = list(range(len(keys)))
    now = time.monotonic()
    for tier in tiers:
        if not missing:
            break
        if not tier.breaker.available(now):
            continue
        flags = tier.contains_nowait([keys[i] for i in missing])
        if flags is None:
            for index in missing:
                found[index] = -1 if fill.pending(keys[index]) is not None else tier.level
            return found
        missing = _place(found, missing, flags, tier.level)
    return _or_fill_queue(fill, found, missing, keys)


def _or_fill_queue(fill: FillQueue, found: Levels, missing: list[int], keys: Sequence[CacheKey]) -> Levels:
    """Mark the chunks no tier holds that are still waiting in the fill queue (level -1)."""
    for index in missing:
        if fill.pending(keys[index]) is not None:
            found[index] = -1
    return found


def _place(found: Levels, missing: list[int], flags: Sequence[bool], level: int) -> list[int]:
    """Record ``level`` for the ``missing`` chunks whose flag is set; the ones still missing."""
    still = []
    for index, flag in zip(missing, flags):
        if flag:
            found[index] = level
        else:
            still.append(index)
    return still
