"""Where memory tiers keep their chunks: slabs handed out by one of two allocators.

- ``SlabArena`` (``preallocate: true``): the tier's whole capacity is allocated and
  touched (pinned, with CUDA) once, at start-up, in a few large segments; slabs are ranges
  carved out of them. A steady-state put or get allocates nothing and takes no page
  faults. Under memory pressure, segments left empty are given back.
- ``LazySlabs`` (``preallocate: false``): a slab is allocated on first use and kept
  for reuse by size class; idle slabs of other sizes are freed when a new size would not
  fit otherwise.

Both never hold more than ``limit`` bytes and hand out uint8 tensors of
``tierkv.chunks.memory.size_class`` bytes.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import defaultdict

import torch

from tierkv.chunks.memory import huge_pages, size_class

logger = logging.getLogger("tierkv_backends.slabs")

_MIN_SEGMENT = 64 << 20
_SEGMENTS = 8


def new_buffer(nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
    """A fresh uint8 buffer on ``device`` (pinned host memory when asked)."""
    return huge_pages(torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pinned and device.type == "cpu"))


class LazySlabs:
    """Slabs allocated on first use, recycled by size class (see module docstring)."""

    preallocated = False

    def __init__(self, limit: int, device: torch.device, pinned: bool) -> None:
        self.limit = limit
        self.device = device
        self.pinned = pinned
        self.allocated = 0
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        size = size_class(nbytes)
        idle = self._idle.get(size)
        if idle:
            return idle.pop()
        for other in list(self._idle):
            while self._idle[other] and self.allocated + size > self.limit:
                self.allocated -= self._idle[other].pop().numel()
        if self.allocated + size > self.limit:
            return None
        self.allocated += size
        return new_buffer(size, self.device, self.pinned)

    def release(self, slab: torch.Tensor) -> None:
        self._idle[slab.numel()].append(slab)

    def trim(self, down_to: int = 0) -> int:
        """Free every idle slab (give memory back now, e.g. under pressure); bytes freed."""
        freed = sum(s.numel() for slabs in self._idle.values() for s in slabs)
        self.allocated -= freed
        self._idle.clear()
        return freed

    def segment_of(self, slab: torch.Tensor) -> int | None:
        return None

    def segments_to_empty(self, down_to: int) -> set[int]:
        return set()

    def clear(self) -> None:
        self._idle.clear()
        self.allocated = 0


class _Segment:
    """One large buffer and its free ranges (offset -> size, coalesced)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.size = buffer.numel()
        self.starts: list[int] = [0]
        self.free: dict[int, int] = {0: self.size}
        self.live_bytes = 0

    def take(self, size: int) -> int | None:
        for start in self.starts:
            length = self.free[start]
            if length >= size:
                del self.free[start]
                self.starts.remove(start)
                if length > size:
                    self._insert(start + size, length - size)
                self.live_bytes += size
                return start
        return None

    def give(self, start: int, size: int) -> None:
        self.live_bytes -= size
        index = bisect.bisect_left(self.starts, start)
        if index < len(self.starts) and start + size == self.starts[index]:  # merge with the next range
            size += self.free.pop(self.starts.pop(index))
        if index > 0:
            before = self.starts[index - 1]
            if before + self.free[before] == start:  # merge with the previous range
                self.free[before] += size
                return
        self._insert(start, size)

    def _insert(self, start: int, size: int) -> None:
        bisect.insort(self.starts, start)
        self.free[start] = size

    @property
    def empty(self) -> bool:
        return self.live_bytes == 0


class SlabArena:
    """Capacity allocated once in segments, slabs carved from them (see module docstring)."""

    preallocated = True

    def __init__(self, limit: int, device: torch.device, pinned: bool, touch: bool = True) -> None:
        self.limit = limit
        self.device = device
        self.pinned = pinned
        self.segment_bytes = max(min(limit, max(_MIN_SEGMENT, limit // _SEGMENTS)), 1)
        self._segments: dict[int, _Segment] = {}  # storage address -> segment
        self._oversize: dict[int, torch.Tensor] = {}  # slabs larger than a segment, by storage address
        self.allocated = 0
        self.startup_s = 0.0
        started = time.perf_counter()
        while self.allocated < limit:
            self._add_segment(touch)
        self.startup_s = time.perf_counter() - started

    def _add_segment(self, touch: bool) -> _Segment:
        """A new segment: a full one, or what is left of the limit."""
        buffer = new_buffer(min(self.segment_bytes, self.limit - self.allocated), self.device, self.pinned)
        if touch and self.device.type == "cpu" and not self.pinned:
            buffer.zero_()  # take the first-touch page faults now, not on the first put
        segment = _Segment(buffer)
        self._segments[buffer.untyped_storage().data_ptr()] = segment
        self.allocated += segment.size
        return segment

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        size = size_class(nbytes)
        if size > self.segment_bytes:
            if self.allocated + size > self.limit:
                return None
            slab = new_buffer(size, self.device, self.pinned)
            self._oversize[slab.untyped_storage().data_ptr()] = slab
            self.allocated += size
            return slab
        for segment in self._segments.values():
            start = segment.take(size)
            if start is not None:
                return segment.buffer[start : start + size]
        if self.allocated + min(size, self.segment_bytes) > self.limit:
            return None
        segment = self._add_segment(touch=False)  # regrowing after pressure gave memory back
        start = segment.take(size)
        return None if start is None else segment.buffer[start : start + size]

    def release(self, slab: torch.Tensor) -> None:
        address = slab.untyped_storage().data_ptr()
        if self._oversize.pop(address, None) is not None:
            self.allocated -= slab.numel()
            return
        self._segments[address].give(slab.storage_offset(), slab.numel())

    def segment_of(self, slab: torch.Tensor) -> int | None:
        """Which segment holds ``slab`` (None for an oversize slab)."""
        address = slab.untyped_storage().data_ptr()
        return address if address in self._segments else None

    def segments_to_empty(self, down_to: int) -> set[int]:
        """The least-occupied segments whose release would bring ``allocated`` down to ``down_to``."""
        excess = self.allocated - down_to
        chosen: set[int] = set()
        for address, segment in sorted(self._segments.items(), key=lambda item: item[1].live_bytes):
            if excess <= 0:
                break
            chosen.add(address)
            excess -= segment.size
        return chosen

    def trim(self, down_to: int = 0) -> int:
        """Give back empty segments while more than ``down_to`` bytes are allocated; bytes freed."""
        freed = 0
        for address, segment in list(self._segments.items()):
            if self.allocated <= down_to:
                break
            if segment.empty:
                del self._segments[address]
                self.allocated -= segment.size
                freed += segment.size
        return freed

    def clear(self) -> None:
        self._segments.clear()
        self._oversize.clear()
        self.allocated = 0
