"""Copies that may run off the event loop: one helper and one threshold for the engine and
the memory tiers.

A copy larger than ``OFFLOAD_COPY_BYTES`` runs on a worker thread so other requests keep
moving; a smaller one runs inline (a thread hop costs more than it saves). The copy writes
into memory handed to it (reserved slabs, the caller's ``out``, a paged cache), so a
cancellation is delivered only once it stopped (``tierkv.chunks.ownership.in_thread``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from tierkv.chunks import ownership, transfer
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.memory import copy_into, empty_host

OFFLOAD_COPY_BYTES = 4 << 20
"""Copies above this many bytes run on a worker thread."""


async def off_loop(work: Callable[[], Any], nbytes: int) -> None:
    """Run ``work`` (a copy of ``nbytes``) on a thread when large, else inline."""
    if nbytes > OFFLOAD_COPY_BYTES:
        await ownership.in_thread(work)
    else:
        work()


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(dst, src)`` pair."""
    for dst, src in pairs:
        copy_into(dst, src)


async def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(dst, src)`` pair, off the loop when they are large together."""
    await off_loop(lambda: copy_all(pairs), sum(dst.numel() * dst.element_size() for dst, _ in pairs))


def source_writer(source: transfer.ChunkSource, keys: list[CacheKey], ranges: list[tuple[int, int]]
                  ) -> Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]]:
    """The writer of an in-place tier's put from ``source``: fills each reserved chunk (key ->
    view of the tier's memory) with its token range, one copy, off the loop when large."""
    where = dict(zip(keys, ranges))

    async def write(views: dict[CacheKey, torch.Tensor]) -> None:
        work = [(view, *where[key]) for key, view in views.items()]
        await off_loop(lambda: transfer.write_all(source, work), sum(view.nbytes for view in views.values()))
    return write


async def gathered(source: transfer.ChunkSource, shape: tuple[int, ...], rng: tuple[int, int]) -> torch.Tensor:
    """A pooled chunk buffer filled from ``source`` (for sources with no zero-copy view)."""
    chunk = empty_host(shape, source.dtype)
    await off_loop(lambda: source.write_into(chunk, *rng), chunk.nbytes)
    return chunk
