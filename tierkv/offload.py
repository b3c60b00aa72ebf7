"""Copies that may run off the event loop: one helper and one threshold for the engine and
the memory tiers.

A copy larger than :data:`OFFLOAD_COPY_BYTES` runs on a worker thread so other requests keep
moving; a smaller one runs inline (a thread hop costs more than it saves). The copy writes
into memory handed to it (reserved slabs, the caller's ``out``, a paged cache), so a
cancellation is delivered only once it stopped (:func:`tierkv.ownership.in_thread`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierkv import ownership
from tierkv.memory import copy_into

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
