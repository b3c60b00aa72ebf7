"""GPU connectors: move KV between a serving engine's cache layout and tierkv's chunk blobs.

The interface follows LMCache's GPU connector (``from_gpu`` / ``to_gpu`` / ``get_shape``),
reimplemented. A connector reads a token range ``[start, end)`` of the *whole* token sequence
out of the serving engine's KV (``from_gpu``, for a store) or writes one back (``to_gpu``, for a
retrieve). See ``tierkv.connectors`` for the layouts each class handles.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tierkv import ops
from tierkv.chunks import copies
from tierkv.chunks.keys import KV_FORMATS


def _tensor_of(memory_obj: Any) -> torch.Tensor:
    """The blob tensor of a memory object (a tensor, or anything with a ``.tensor``)."""
    tensor = memory_obj if isinstance(memory_obj, torch.Tensor) else getattr(memory_obj, "tensor", None)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"memory_obj must be a KV blob tensor or have one in .tensor, got {type(memory_obj).__name__}"
        )
    return tensor


def _require(kwargs: dict[str, Any], name: str) -> Any:
    if kwargs.get(name) is None:
        raise ValueError(f"'{name}' must be provided in kwargs")
    return kwargs[name]


def _copy_between_devices(dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
    """``dst.copy_(src)``; asynchronous across host and device when the host side is pinned.

    Returns an event marking completion when the copy may still be in flight, else None.
    """
    host = dst if dst.device.type == "cpu" else src
    asynchronous = dst.device != src.device and host.is_pinned()
    copies.count(dst.numel() * dst.element_size())
    dst.copy_(src, non_blocking=asynchronous)
    if not asynchronous:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _zero_unless_all_valid(chunk: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero ``chunk`` when some slot may be -1 (its rows are left as they were). On a GPU it
    is zeroed unconditionally: a memset on the stream costs less than reading the slots back,
    which would stall the host until every queued kernel ran."""
    if slots.device.type != "cpu" or bool((slots < 0).any()):
        chunk.zero_()


def _finish(event: torch.cuda.Event | None, sync: bool) -> torch.cuda.Event | None:
    if event is not None and sync:
        event.synchronize()
        return None
    return event


class GPUConnector(abc.ABC):
    """Moves a token range between the serving engine's KV and a chunk blob.

    ``from_gpu`` / ``to_gpu`` take the memory object, the token range ``[start, end)`` in the
    whole sequence, and connector-specific kwargs (``kvcaches``, ``slot_mapping``). With
    ``sync=False`` they may return a ``torch.cuda.Event`` that completes when the host side of
    the copy may be touched (None when nothing is in flight); by default they return once
    the data is in place.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, fmt: str = "vllm") -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if fmt not in KV_FORMATS:
            raise ValueError(f"fmt must be one of {KV_FORMATS}, got {fmt!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.fmt = fmt

    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of the blob holding ``num_tokens`` tokens."""
        if self.fmt == "vllm":
            return torch.Size((self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_size))
        return torch.Size((self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_size))

    def _blob(self, memory_obj: Any, start: int, end: int) -> torch.Tensor:
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise ValueError(f"need 0 <= start <= end, got start={start!r} end={end!r}")
        tensor = _tensor_of(memory_obj)
        shape = self.get_shape(end - start)
        if tensor.shape != shape:
            raise ValueError(
                f"memory_obj tensor must be {self.fmt} {tuple(shape)} for tokens "
                f"[{start}, {end}), got {tuple(tensor.shape)}"
            )
        return tensor

    @abc.abstractmethod
    def dtype_of(self, **kwargs: Any) -> torch.dtype:
        """The dtype of the serving engine's KV given this call's kwargs."""

    @abc.abstractmethod
    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> torch.cuda.Event | None:
        """Copy tokens ``[start, end)`` of the serving engine's KV into ``memory_obj``."""

    @abc.abstractmethod
    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> torch.cuda.Event | None:
        """Copy ``memory_obj`` into tokens ``[start, end)`` of the serving engine's KV."""


class NestedTupleConnector(GPUConnector):
    """KV as a tuple of per-layer ``(K, V)`` covering the whole token sequence."""

    def _layers(self, kwargs: dict[str, Any]) -> Sequence[Sequence[torch.Tensor]]:
        kvcaches = _require(kwargs, "kvcaches")
        if not isinstance(kvcaches, Sequence) or len(kvcaches) != self.num_layers:
            raise ValueError(f"kvcaches must be a tuple of {self.num_layers} per-layer (K, V) pairs")
        return kvcaches

    def dtype_of(self, **kwargs: Any) -> torch.dtype:
        return self._layers(kwargs)[0][0].dtype

    def _token_views(self, kwargs: dict[str, Any], start: int, end: int) -> list[tuple[int, int, torch.Tensor]]:
        dim = 0 if self.fmt == "vllm" else 1
        views = []
        for layer, pair in enumerate(self._layers(kwargs)):
            if len(pair) != 2:
                raise ValueError(f"kvcaches layer {layer}: expected a (K, V) pair")
            for kv, tensor in enumerate(pair):
                if tensor.dim() != 3 or tensor.shape[dim] < end:
                    raise ValueError(
                        f"kvcaches layer {layer} {'KV'[kv]}: expected {self.fmt} 3-D KV with at least {end} tokens "
                        f"in dim {dim}, got {tuple(tensor.shape)}"
                    )
                views.append((layer, kv, tensor.narrow(dim, start, end - start)))
        return views

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> torch.cuda.Event | None:
        blob = self._blob(memory_obj, start, end)
        sync = kwargs.get("sync", True)
        views = self._token_views(kwargs, start, end)
        device = views[0][2].device
        if device == blob.device:
            for layer, kv, view in views:
                blob[layer, kv].copy_(view)
            return None
        staging = torch.stack([view for _, _, view in views]).view(blob.shape)  # one gather on the device
        return _finish(_copy_between_devices(blob, staging), sync)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> torch.cuda.Event | None:
        blob = self._blob(memory_obj, start, end)
        sync = kwargs.get("sync", True)
        views = self._token_views(kwargs, start, end)
        device = views[0][2].device
        source = blob
        event = None
        if device != blob.device:
            source = torch.empty(blob.shape, dtype=blob.dtype, device=device)
            event = _copy_between_devices(source, blob)
        for layer, kv, view in views:
            view.copy_(source[layer, kv])
        return _finish(event, sync)


class PagedConnector(GPUConnector):
    """A paged KV cache addressed through a full ``slot_mapping`` (one slot per token, -1 = none).

    ``kvcaches``: per layer a ``(K, V)`` pair of ``[num_blocks, block_size, heads, head_size]`` or
    one fused ``[2, num_blocks, block_size, heads, head_size]`` tensor. ``slot_mapping``: int32 or
    int64 on the cache's device, at least ``end`` long. The blob may live on the host: the gather
    runs on the cache's device into a temporary, then copies.
    """

    def _paged(self, kwargs: dict[str, Any], end: int) -> tuple[Any, torch.Tensor]:
        kvcaches = _require(kwargs, "kvcaches")
        slot_mapping = _require(kwargs, "slot_mapping")
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise ValueError("slot_mapping must be a 1-D tensor with one slot per token of the whole sequence")
        if slot_mapping.numel() < end:
            raise ValueError(
                f"slot_mapping has {slot_mapping.numel()} entries but tokens up to {end} were asked for; "
                "it must be the full slot mapping of the sequence"
            )
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"kvcaches must have {self.num_layers} layers, got {len(kvcaches)}")
        return kvcaches, slot_mapping

    def dtype_of(self, **kwargs: Any) -> torch.dtype:
        keys, _ = ops.split_paged_cache(_require(kwargs, "kvcaches"))
        return keys[0].dtype

    def _staging(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def _release_staging(self, event: torch.cuda.Event | None) -> None:
        """Called when the staging buffer is handed back (V2 tracks when it is free again)."""

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> torch.cuda.Event | None:
        blob = self._blob(memory_obj, start, end)
        kvcaches, slot_mapping = self._paged(kwargs, end)
        slots = slot_mapping[start:end]
        if slots.device == blob.device:
            _zero_unless_all_valid(blob, slots)  # -1 slots leave rows untouched: keep them deterministic
            ops.paged_gather(kvcaches, slots, out=blob, order=self.fmt)
            return None
        with self._lock_staging():
            staging = self._staging(blob.shape, blob.dtype, slots.device)
            _zero_unless_all_valid(staging, slots)
            ops.paged_gather(kvcaches, slots, out=staging, order=self.fmt)
            event = _copy_between_devices(blob, staging)
            self._release_staging(event)
        return _finish(event, kwargs.get("sync", True))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> torch.cuda.Event | None:
        blob = self._blob(memory_obj, start, end)
        kvcaches, slot_mapping = self._paged(kwargs, end)
        slots = slot_mapping[start:end]
        if slots.device == blob.device:
            ops.paged_scatter(blob, kvcaches, slots, order=self.fmt)
            return None
        with self._lock_staging():
            staging = self._staging(blob.shape, blob.dtype, slots.device)
            event = _copy_between_devices(staging, blob)
            ops.paged_scatter(staging, kvcaches, slots, order=self.fmt)  # stream-ordered after the copy
            self._release_staging(event)
        return _finish(event, kwargs.get("sync", True))

    def _lock_staging(self) -> Any:
        return contextlib.nullcontext()


class PagedConnectorV2(PagedConnector):
    """``PagedConnector`` through one reusable device staging buffer.

    One kernel gathers every layer into the staging buffer, then a single copy moves it to the
    (ideally pinned) host blob, and the reverse for ``to_gpu``. The buffer grows to the largest
    range seen and is reused; calls on one connector are serialised around it, and a call waits
    for the previous copy out of it to finish before overwriting it.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, fmt: str = "vllm") -> None:
        super().__init__(num_layers, num_kv_heads, head_size, fmt)
        self._buffer: torch.Tensor | None = None
        self._busy: torch.cuda.Event | None = None
        self._lock = threading.Lock()

    def _lock_staging(self) -> Any:
        return self._lock

    def _staging(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._busy is not None:
            self._busy.synchronize()
            self._busy = None
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if self._buffer is None or self._buffer.device != device or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer[:nbytes].view(dtype).view(shape)

    def _release_staging(self, event: torch.cuda.Event | None) -> None:
        self._busy = event
