"""``cpu`` tier: chunks in host memory (pinned when CUDA is present), bounded, with LRU
(or S3-FIFO) eviction.

Chunks are copied into slabs of a pool allocated and touched once at start-up
(``preallocate: true``, the default): allocating large host buffers, pinned ones
especially, costs far more than the copy itself, so no put or get allocates.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tierkv.backend.options import Option
from tierkv_backends.memory.tier import (
    EVICTION_OPTION,
    PREALLOCATE_OPTION,
    RETAIN_SHARE_OPTION,
    MemoryTier,
    pinned_default,
)


class CPUBackend(MemoryTier):
    """Host-memory tier."""

    options: ClassVar[dict[str, Option]] = {
        "pinned": Option("bool", None, doc="pin host memory (default: when CUDA is available)"),
        "eviction": EVICTION_OPTION,
        "preallocate": PREALLOCATE_OPTION,
        "retain_share": RETAIN_SHARE_OPTION,
    }

    def __init__(self, name: str, capacity: int | None = None, pinned: bool | None = None,
                 eviction: str = "lru", preallocate: bool = True, retain_share: float = 0.5) -> None:
        super().__init__(name, capacity, torch.device("cpu"), pinned_default(pinned, name), eviction, preallocate,
                         retain_share)
