"""Where chunks are: the level of the highest tier holding each key.

Inside the engine a place is a ``Level`` (an index into the tiers, fastest first;
``FILL_QUEUE_LEVEL`` for a chunk acknowledged but still waiting in the fill queue; None
for nowhere). Callers of the engine see tier names instead (``names``; the fill queue is
``FILL_QUEUE``): every ``locate*`` method of the engine answers with names, and nothing
inside it does.

Three questions, one answer format: ``levels`` asks every available tier (I/O where a
tier needs it), ``levels_nowait`` answers from in-memory indexes only (None when a tier
available now would need I/O), ``read_levels`` plans a read without I/O (chunks no
indexed tier holds go to the first tier without an index, asked with gets).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tierkv.chunks.keys import CacheKey
from tierkv.routing.fill import FillQueue
from tierkv.tiers.tier import Tier

Level = int
"""An index into the tiers, fastest first, or ``FILL_QUEUE_LEVEL``."""
Levels = list[Level | None]
FILL_QUEUE_LEVEL: Level = -1
"""The level of a chunk acknowledged but not yet written to any tier (still in the fill queue)."""
FILL_QUEUE = "fill-queue"
"""What callers of the engine see for ``FILL_QUEUE_LEVEL``."""


def names(tiers: Sequence[Tier], found: Sequence[Level | None]) -> list[str | None]:
    """The name callers see for each level: the tier's, or ``FILL_QUEUE`` (None stays None)."""
    return [None if level is None else FILL_QUEUE if level == FILL_QUEUE_LEVEL else tiers[level].name
            for level in found]


async def levels(tiers: Sequence[Tier], fill: FillQueue, keys: Sequence[CacheKey]) -> Levels:
    """The level of the highest tier holding each key (or the fill queue); None if nowhere."""
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


def levels_nowait(tiers: Sequence[Tier], fill: FillQueue, keys: Sequence[CacheKey]) -> Levels | None:
    """``levels`` from in-memory indexes only (reads shared state, changes nothing)."""
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


def read_levels(tiers: Sequence[Tier], fill: FillQueue, keys: Sequence[CacheKey]) -> Levels:
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
                found[index] = FILL_QUEUE_LEVEL if fill.pending(keys[index]) is not None else tier.level
            return found
        missing = _place(found, missing, flags, tier.level)
    return _or_fill_queue(fill, found, missing, keys)


def held_anywhere(tiers: Sequence[Tier], fill: FillQueue, keys: Sequence[CacheKey]) -> list[bool]:
    """Whether some tier's in-memory index holds each key (unhealthy tiers included: what a tier
    holds does not change because its calls fail), or it waits in the fill queue; no I/O, so a
    tier without an index counts as not holding it."""
    held = [fill.pending(key) is not None for key in keys]
    for tier in tiers:
        missing = [index for index, flag in enumerate(held) if not flag]
        if not missing:
            break
        flags = tier.contains_nowait([keys[index] for index in missing])
        for index, flag in zip(missing, flags or ()):
            held[index] = bool(flag)
    return held


def _or_fill_queue(fill: FillQueue, found: Levels, missing: list[int], keys: Sequence[CacheKey]) -> Levels:
    """Mark the chunks no tier holds that are still waiting in the fill queue (``FILL_QUEUE_LEVEL``)."""
    for index in missing:
        if fill.pending(keys[index]) is not None:
            found[index] = FILL_QUEUE_LEVEL
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
