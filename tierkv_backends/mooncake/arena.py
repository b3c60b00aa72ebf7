"""The mooncake tier's staging arena: one block of host memory registered with the transfer engine.

Mooncake's zero-copy calls (``batch_get_into``, ``batch_upsert_from``) move bytes between
the store and memory the transfer engine knows (``register_buffer``; required for RDMA).
Registering costs a metadata update, so the tier registers one arena at start-up and
carves regions out of it per batch: a put encodes header + payload into its region (the
one copy of the put) and hands the region to the store; a get lands in its region, is
verified there, and is copied once into the caller's destination.

Regions are owned by the worker thread that reserved them and freed by it when the store
call returned, never by the caller that stopped waiting: a region a timed-out transfer may
still write into is never handed to anyone else (the ownership rule, see
``tierkv.chunks.ownership``).
"""

from __future__ import annotations

import bisect
import threading
import time

import numpy as np
import torch

from tierkv.chunks.memory import huge_pages

#: regions start on this boundary (cache lines; the payload after a header stays 8-byte aligned)
_ALIGN = 64


def _round_up(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class Region:
    """``nbytes`` of the arena at ``offset``; release it once, when no transfer uses it any more."""

    __slots__ = ("_arena", "offset", "nbytes", "ptr", "array")

    def __init__(self, arena: StagingArena, offset: int, nbytes: int) -> None:
        self._arena = arena
        self.offset = offset
        self.nbytes = nbytes
        self.ptr = arena.ptr + offset
        self.array: np.ndarray = arena.array[offset : offset + nbytes]

    def release(self) -> None:
        self._arena._free(self.offset, self.nbytes)


class StagingArena:
    """A first-fit allocator over one contiguous, registered host buffer (thread-safe)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < _ALIGN:
            raise ValueError(f"a staging arena needs at least {_ALIGN} bytes, got {nbytes}")
        self.nbytes = nbytes // _ALIGN * _ALIGN
        self.tensor = huge_pages(torch.empty(self.nbytes, dtype=torch.uint8))
        self.tensor.zero_()  # touched at start-up: a node's first reads do not pay the page faults
        self.array: np.ndarray = self.tensor.numpy()
        self.ptr: int = self.tensor.data_ptr()
        self._starts: list[int] = [0]  # free intervals, sorted by start
        self._sizes: dict[int, int] = {0: self.nbytes}
        self._cond = threading.Condition()

    @staticmethod
    def footprint(nbytes: int) -> int:
        """Arena bytes a region of ``nbytes`` takes (rounded up to the alignment)."""
        return _round_up(max(nbytes, 1))

    def reserve(self, nbytes: int, deadline: float) -> Region:
        """A region of ``nbytes``; waits for one to be freed until ``deadline`` (TimeoutError)."""
        size = self.footprint(nbytes)
        if size > self.nbytes:
            raise ValueError(f"{nbytes} bytes cannot fit in a staging arena of {self.nbytes} bytes")
        with self._cond:
            while True:
                for start in self._starts:
                    free = self._sizes[start]
                    if free >= size:
                        self._take(start, free, size)
                        return Region(self, start, size)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {size} bytes free in the staging arena before the deadline")
                self._cond.wait(remaining)

    def _take(self, start: int, free: int, size: int) -> None:
        index = bisect.bisect_left(self._starts, start)
        del self._starts[index]
        del self._sizes[start]
        if free > size:
            self._starts.insert(index, start + size)
            self._sizes[start + size] = free - size

    def _free(self, offset: int, size: int) -> None:
        with self._cond:
            index = bisect.bisect_left(self._starts, offset)
            end = offset + size
            if index < len(self._starts) and self._starts[index] == end:  # merge with the next free interval
                size += self._sizes.pop(end)
                del self._starts[index]
            if index > 0:  # merge with the previous one
                before = self._starts[index - 1]
                if before + self._sizes[before] == offset:
                    self._sizes[before] += size
                    self._cond.notify_all()
                    return
            self._starts.insert(index, offset)
            self._sizes[offset] = size
            self._cond.notify_all()

    def free_bytes(self) -> int:
        with self._cond:
            return sum(self._sizes.values())
