"""Host memory: pooled buffers and fast byte copies.

Large fresh allocations are expensive (every page faults on first touch, and pinned
allocation goes through the driver), so chunks that tierkv hands out live in recycled
slabs, and large unpinned buffers ask for transparent huge pages. A handed-out tensor returns its slab to the pool by itself when the last
reference to it (or any view of it) is dropped.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
import threading
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from tierkv.chunks import copies

logger = logging.getLogger("tierkv.memory")

@functools.cache
def cuda_available() -> bool:
    """Whether a usable CUDA device exists (the CPU build of torch says no)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install must not crash a CPU-only user
        return False


def can_pin_memory() -> bool:
    """Pinned host memory needs CUDA; the CPU build of torch raises on ``pin_memory``."""
    return cuda_available()


_GRANULE = 64 << 10


def size_class(nbytes: int) -> int:
    """Round a request up so slabs of near-equal sizes are shared: powers of two below
    64 KiB, whole 64 KiB granules above (at most 6% waste for a 1 MiB chunk)."""
    if nbytes <= 0:
        return 0
    if nbytes < _GRANULE:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // _GRANULE) * _GRANULE


_PAGE = mmap.PAGESIZE
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, where there is one (Linux); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """Ask the kernel to back a large, fresh host tensor with transparent huge pages.

    First touch of fresh memory costs one page fault per 4 KiB page, which makes writing a
    new 512 MiB buffer several times slower than copying into touched memory; with 2 MiB
    pages the faults all but vanish. Advisory: where THP is off or madvise is missing the
    tensor is returned as it is. Pinned memory is left alone (the driver owns it).
    """
    nbytes = tensor.numel() * tensor.element_size()
    madvise = _madvise()
    if madvise is None or nbytes < _HUGE_PAGE or tensor.device.type != "cpu" or tensor.is_pinned():
        return tensor
    start = tensor.data_ptr()
    aligned = (start + _PAGE - 1) & ~(_PAGE - 1)
    length = (start + nbytes - aligned) & ~(_PAGE - 1)
    if length > 0 and madvise(aligned, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return tensor


def allocate_bytes(nbytes: int, pinned: bool) -> torch.Tensor:
    """A fresh uint8 host tensor, pinned when asked and possible (else on huge pages)."""
    return huge_pages(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and can_pin_memory()))


class _Lease:
    """Returns a slab to its pool when the last tensor using it is garbage."""

    __slots__ = ("pool", "slab")

    def __init__(self, pool: HostBufferPool, slab: torch.Tensor) -> None:
        self.pool = pool
        self.slab = slab

    def __del__(self) -> None:
        self.pool._release(self.slab)


class _LeasedArray(np.ndarray):
    """An ndarray that keeps its lease alive; torch.from_numpy holds a reference to it."""


class HostBufferPool:
    """Recycles host slabs (pinned when CUDA is present) for tensors handed to callers.

    Idle slabs are kept up to ``max_idle_bytes``; beyond that they are freed. Safe to use
    from several threads.
    """

    def __init__(self, pinned: bool = False, max_idle_bytes: int = 1 << 30) -> None:
        self.pinned = pinned and can_pin_memory()
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape``/``dtype`` backed by a pooled slab."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        slab = self._acquire(size_class(nbytes))
        array = slab.numpy()[:nbytes].view(_LeasedArray)
        array._lease = _Lease(self, slab)  # type: ignore[attr-defined]
        return torch.from_numpy(array).view(dtype).view(shape)

    def _acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            idle = self._idle.get(nbytes)
            if idle:
                self._idle_bytes -= nbytes
                self.reuses += 1
                return idle.pop()
            self.allocations += 1
        return allocate_bytes(nbytes, self.pinned)

    def _release(self, slab: torch.Tensor) -> None:
        nbytes = slab.numel()
        with self._lock:
            if self._idle_bytes + nbytes > self.max_idle_bytes:
                return  # let it be freed
            self._idle[nbytes].append(slab)
            self._idle_bytes += nbytes

    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            return {
                "pinned": self.pinned,
                "idle_bytes": self._idle_bytes,
                "allocations": self.allocations,
                "reuses": self.reuses,
            }


_default_pool: HostBufferPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> HostBufferPool:
    """The process-wide pool used for chunks handed back to callers."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = HostBufferPool(pinned=can_pin_memory())
        return _default_pool


def empty_host(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A pooled, uninitialised host tensor owned by the caller."""
    return default_pool().empty(shape, dtype)


def _wide_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """The same bytes as int32 elements when the layout allows it, else None.

    Strided copies of 1- and 2-byte dtypes run several times slower than of 4-byte ones,
    so byte copies are done through 4-byte views wherever the innermost dimension is
    contiguous and a whole number of 4-byte words.
    """
    esize = tensor.element_size()
    if esize >= 4 or tensor.dim() == 0:
        return None
    if tensor.stride(-1) != 1 or (tensor.shape[-1] * esize) % 4:
        return None
    if any((s * esize) % 4 for s in tensor.stride()[:-1]) or (tensor.storage_offset() * esize) % 4:
        return None
    try:
        return tensor.view(torch.int32)
    except RuntimeError:
        return None


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors of equal shape and dtype, at memcpy speed where possible.

    Counted as one copy of ``dst``'s bytes on the current copy path (``tierkv.chunks.copies``).
    """
    copies.count(dst.numel() * dst.element_size())
    if dst.dtype == src.dtype and dst.shape == src.shape and src.dim() > 0:
        wide_dst, wide_src = _wide_view(dst), _wide_view(src)
        if wide_dst is not None and wide_src is not None:
            wide_dst.copy_(wide_src)
            return
    dst.copy_(src)


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor's bytes."""
    if not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def byte_runs(tensor: torch.Tensor) -> list[memoryview]:
    """The bytes of a CPU tensor as memoryviews of its contiguous runs, in element order.

    A token slice of a KV blob is not contiguous, but each (layer, K/V) piece of it is:
    file reads and writes, checksums and copies can then work on those pieces directly
    (``preadv`` / ``writev`` into / out of the caller's memory) instead of gathering them
    into a temporary first. Raises ValueError for a tensor whose innermost dimension is
    strided (no runs to speak of).
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"byte_runs needs a CPU tensor, got one on {tensor.device}")
    if tensor.numel() == 0:
        return []
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.stride(-1) != 1 and tensor.shape[-1] != 1:
        raise ValueError(f"byte_runs needs a unit innermost stride, got strides {tuple(tensor.stride())}")
    array = tensor.detach().view(torch.uint8).numpy()
    dense_from = array.ndim
    expected = array.itemsize
    while dense_from > 0 and (array.shape[dense_from - 1] == 1 or array.strides[dense_from - 1] == expected):
        expected *= array.shape[dense_from - 1]
        dense_from -= 1
    if dense_from == 0:
        return [array.data.cast("B")]
    return [array[index].data.cast("B") for index in np.ndindex(*array.shape[:dense_from])]


def scatter_bytes(source: memoryview, runs: list[memoryview], last_first: bool = False) -> None:
    """Copy contiguous ``source`` bytes, in order, into ``runs`` (of equal total size); counted.

    ``last_first`` copies the last run first: right after ``source`` was read through (a
    checksum), its end is the part still in the CPU cache.
    """
    total = sum(run.nbytes for run in runs)
    if total != source.nbytes:
        raise ValueError(f"scatter_bytes: {source.nbytes} source bytes for {total} destination bytes")
    copies.count(total)
    offsets = []
    offset = 0
    for run in runs:
        offsets.append(offset)
        offset += run.nbytes
    order = range(len(runs) - 1, -1, -1) if last_first else range(len(runs))
    for index in order:
        run = runs[index]
        copy_bytes(run, source[offsets[index] : offsets[index] + run.nbytes])


def gather_bytes(runs: list[memoryview], target: memoryview) -> None:
    """Copy ``runs`` one after another into the contiguous ``target`` (of equal total size); counted."""
    total = sum(run.nbytes for run in runs)
    if total != target.nbytes:
        raise ValueError(f"gather_bytes: {total} source bytes for {target.nbytes} destination bytes")
    copies.count(total)
    offset = 0
    for run in runs:
        copy_bytes(target[offset : offset + run.nbytes], run)
        offset += run.nbytes


_NUMPY_COPY_FROM = 64 << 10
"""Pieces of at least this many bytes are copied by numpy, which releases the GIL (a
memoryview assignment holds it, so two reader threads copied one after the other)."""


class _SourceBuffer:
    """Read-only bytes as an array torch accepts: torch has no read-only tensors (and warns
    on each one it is given), and a tensor over this array is only ever a copy's source."""

    def __init__(self, array: np.ndarray) -> None:
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface
        self._array = array  # the memory stays alive as long as the tensor over it


def copy_from_bytes(out: torch.Tensor, source: memoryview) -> None:
    """Copy the contiguous bytes ``source`` (``out``'s elements in order) into the host tensor
    ``out``; counted. One torch copy, through 4-byte views where the layout allows: torch
    splits it over its intra-op threads without the GIL, which read an LMDB map into token
    slices ~15% faster than numpy copies of each contiguous run."""
    nbytes = out.numel() * out.element_size()
    if source.nbytes != nbytes:
        raise ValueError(f"copy_from_bytes: {source.nbytes} source bytes for {nbytes} destination bytes")
    array = np.asarray(_SourceBuffer(np.frombuffer(source, dtype=np.uint8)))
    copy_into(out, torch.from_numpy(array).view(out.dtype).view(out.shape))


def copy_bytes(target: memoryview, source: memoryview) -> None:
    """Copy ``source`` into ``target`` (byte buffers of one size), other threads running meanwhile
    when the piece is large."""
    if target.nbytes >= _NUMPY_COPY_FROM:
        np.copyto(np.frombuffer(target, dtype=np.uint8), np.frombuffer(source, dtype=np.uint8))
    else:
        target[:] = source


def direct_target(out: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Where a byte-level reader should put a chunk meant for ``out``: ``out`` itself when it
    is host memory whose bytes come in contiguous runs, else a pooled host temporary (the
    second value is True; copy it into ``out`` once the chunk has been verified)."""
    if out.device.type == "cpu" and (out.dim() == 0 or out.stride(-1) == 1 or out.shape[-1] == 1):
        return out, False
    return empty_host(tuple(out.shape), out.dtype), True


def contiguous_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if it is a contiguous CPU tensor, else a pooled contiguous copy."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor
    out = empty_host(tuple(tensor.shape), tensor.dtype)
    copy_into(out, tensor.to("cpu") if tensor.device.type != "cpu" else tensor)
    return out
