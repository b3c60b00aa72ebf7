"""Where each token's K and V live in a vLLM attention backend's paged KV cache.

vLLM hands a connector one tensor per attention layer (``register_kv_caches``). How K and V
sit inside it depends on the attention backend and the vLLM version:

- ``cpu``: vLLM's CPU backend, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``:
  each (block, head) page holds the block's K *transposed* (``[head_size, block_size]``,
  as ``cpu_attn_reshape_and_cache`` writes it for the ``vec`` / ``vec16`` ISAs), then its V
  row by row (``[block_size, head_size]``); the same order for the ``vec16``, ``neon``,
  ``vsx``, ``vxe`` and ``rvv`` ISAs;
- ``cpu_amx``: the same tensor as vLLM's ``amx`` ISA packs it (tiles of token and dimension
  pairs, ``tierkv.integrations.vllm_v1.cpu_pages``): no strided view addresses it, so it
  has its own connector (``tierkv.integrations.vllm_v1.cpu_pages.MappedPageConnector``);
- ``content``: the generic per-layer view of vLLM 0.32+ CUDA backends (FlashAttention and
  others), ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` in any physical stride
  order, each token's content being its K then its V;
- ``kv_first``: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (FlashAttention
  before the generic views);
- ``blocks_first``: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (FlashInfer
  before the generic views);
- ``mla``: an MLA latent cache, ``[num_blocks, block_size, latent]`` (or with a 1 after the
  blocks, ``CPU_MLA``): each token's latent as two halves, the "K" and "V" of its chunk
  (``tierkv.integrations.vllm_v1.mla``).

Each layout gives, per layer, a K view and a V view indexed ``[block, offset_in_block]``
(shape ``[num_blocks, block_size, num_kv_heads, head_size]``, strided, no copy).
``PagedLayerConnector`` moves a token range between those views and a tierkv chunk in
``vllm`` format (``[layers, 2, tokens, heads, head_size]``): through ``tierkv.ops.paged_gather``
/ ``tierkv.ops.paged_scatter`` (one call for every layer; CUDA kernels on a GPU) when the
views are plain ``[blocks, block_size, heads, head_size]`` tensors; through
``tierkv.ops.paged_copy_strided`` (one call, transposed K moved in cache-friendly tiles)
for other views on CPU when tierkv's extension is built; else one *run* at a time:
consecutive tokens whose slots are consecutive in one block are one strided copy per layer and
K/V, so no temporary tensor is made. ``-1`` slots (tokens not to be touched) are skipped either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tierkv import ops
from tierkv.chunks.memory import copy_into
from tierkv.connectors import GPUConnector
from tierkv.integrations.vllm_v1.cpu_pages import PAGE_ORDERS, MappedPageConnector, layouts_for_isa, requested_slots
from tierkv.integrations.vllm_v1.mla import MLA_LAYOUT, split_latent

LAYOUTS = ("cpu", "cpu_amx", "cpu_bfmmla", "content", "kv_first", "blocks_first", MLA_LAYOUT)

KVViews = list[tuple[torch.Tensor, torch.Tensor]]


def _expect(layer: torch.Tensor, shape: tuple[int | None, ...], layout: str, text: str) -> None:
    """``shape`` with None for the free (block count) dimension."""
    if layer.dim() != len(shape) or any(want is not None and got != want for got, want in zip(layer.shape, shape)):
        raise ValueError(f"KV cache layout {layout!r} expects a layer of {text}, got shape {tuple(layer.shape)}")


def _split_cpu(layer: torch.Tensor, heads: int, head_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU attention (``cpu_attn_reshape_and_cache``, ISAs ``vec`` and ``vec16``) keeps
    each (block, head) page as K transposed, ``[head_size, block_size]`` (dimension ``d`` of
    the token at offset ``o`` is element ``d * block_size + o``), then V row by row,
    ``[block_size, head_size]``. Both views are plain strided views of that memory."""
    _expect(layer, (None, heads, block_size, 2 * head_size), "cpu",
            f"[num_blocks, {heads} heads, {block_size} tokens, 2 x {head_size}]")
    if layer.stride(-1) != 1 or layer.stride(-2) != 2 * head_size or layer.stride(1) != 2 * head_size * block_size:
        raise ValueError("KV cache layout 'cpu' expects each (block, head) page contiguous, "
                         f"got strides {layer.stride()}")
    shape = (layer.shape[0], block_size, heads, head_size)
    page, base = layer.stride(1), layer.storage_offset()
    keys = layer.as_strided(shape, (layer.stride(0), 1, page, block_size), base)
    values = layer.as_strided(shape, (layer.stride(0), head_size, page, 1), base + head_size * block_size)
    return keys, values


def _split_content(layer: torch.Tensor, heads: int, head_size: int, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    _expect(layer, (None, heads, block_size, 2 * head_size), "content",
            f"[num_blocks, {heads} heads, {block_size} tokens, 2 x {head_size}]")
    by_token = layer.permute(0, 2, 1, 3)
    return by_token[..., :head_size], by_token[..., head_size:]


def _split_kv_first(layer: torch.Tensor, heads: int, head_size: int, block_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    _expect(layer, (2, None, block_size, heads, head_size), "kv_first",
            f"[2, num_blocks, {block_size} tokens, {heads} heads, {head_size}]")
    return layer[0], layer[1]


def _split_blocks_first(layer: torch.Tensor, heads: int, head_size: int, block_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    _expect(layer, (None, 2, block_size, heads, head_size), "blocks_first",
            f"[num_blocks, 2, {block_size} tokens, {heads} heads, {head_size}]")
    return layer[:, 0], layer[:, 1]


_SPLITTERS: dict[str, Callable[[torch.Tensor, int, int, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "cpu": _split_cpu, "content": _split_content, "kv_first": _split_kv_first, "blocks_first": _split_blocks_first,
    MLA_LAYOUT: split_latent,
}


def detect_layout(backend_name: str | None, layer: torch.Tensor, num_kv_heads: int, head_size: int,
                  isa: str | None = None) -> tuple[str, int]:
    """The layout of ``layer`` for the attention backend named ``backend_name`` (vLLM's
    ``get_name()``, e.g. ``CPU_ATTN``, ``FLASH_ATTN``, ``FLASHINFER``) and, on CPU, the ISA
    its attention layers write with (``layer.isa``: ``vec``, ``amx``, ...), checked against
    its shape, and the block size the tensor is cut in (vLLM may split its blocks into smaller
    kernel blocks; slots address both the same way)."""
    shape = tuple(layer.shape)
    if len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size:
        cpu = (backend_name or "").upper().startswith("CPU") or (backend_name is None and layer.device.type == "cpu")
        return (layouts_for_isa(isa, layer.dtype)[0] if cpu else "content"), shape[2]
    if len(shape) == 5 and shape[0] == 2 and shape[3:] == (num_kv_heads, head_size):
        return "kv_first", shape[2]
    if len(shape) == 5 and shape[1] == 2 and shape[3:] == (num_kv_heads, head_size):
        return "blocks_first", shape[2]
    raise ValueError(
        f"unsupported KV cache of shape {shape} from attention backend {backend_name!r} ({num_kv_heads} KV heads, "
        f"head size {head_size}); tierkv reads [num_blocks, heads, block_size, 2 x head_size] (CPU and vLLM 0.32+ "
        "generic views), [2, num_blocks, block_size, heads, head_size] and [num_blocks, 2, block_size, heads, head_size]"
    )


def split_layers(layers: Sequence[torch.Tensor], layout: str, num_kv_heads: int, head_size: int,
                 block_size: int) -> KVViews:
    """Per layer, the K and V views ``[num_blocks, block_size, heads, head_size]`` of ``layout``
    (every layout but ``cpu_amx``, which no strided view addresses; for ``mla``, ``head_size`` is
    the latent's width and the views its two halves)."""
    if layout not in _SPLITTERS:
        raise ValueError(f"layout must be one of {tuple(_SPLITTERS)} to be cut in strided views, got {layout!r}")
    return [_SPLITTERS[layout](layer, num_kv_heads, head_size, block_size) for layer in layers]


def slot_mapping(block_ids: Sequence[int], block_size: int, num_tokens: int, first: int = 0,
                 last: int | None = None) -> np.ndarray:
    """The slot of each of ``num_tokens`` tokens of a request whose blocks are ``block_ids``;
    tokens outside ``[first, last)`` get ``-1`` (not to be read or written)."""
    last = num_tokens if last is None else last
    needed = -(-num_tokens // block_size)
    if len(block_ids) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {block_size}, the request has {len(block_ids)}")
    blocks = np.asarray(block_ids[:needed], dtype=np.int64)
    slots = (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)[None, :]).reshape(-1)[:num_tokens]
    slots[:first] = -1
    slots[last:] = -1
    return slots


def token_runs(slots: np.ndarray, block_size: int) -> list[tuple[int, int, int, int]]:
    """``(first_token, end_token, block, offset)`` of each run of tokens whose slots follow one
    another inside one block; tokens with slot ``-1`` belong to no run."""
    slots = np.asarray(slots, dtype=np.int64)
    valid = slots >= 0
    if not valid.any():
        return []
    offsets = slots % block_size
    breaks = np.ones(len(slots), dtype=bool)
    breaks[1:] = ~((slots[1:] == slots[:-1] + 1) & (offsets[1:] != 0) & valid[:-1])
    starts = np.flatnonzero(breaks & valid)
    boundaries = np.flatnonzero(breaks | ~valid)
    after = np.searchsorted(boundaries, starts, side="right")
    ends = np.append(boundaries, len(slots))[after]
    return [(int(first), int(end), int(slots[first] // block_size), int(offsets[first]))
            for first, end in zip(starts, ends)]


class PagedLayerConnector(GPUConnector):
    """A ``tierkv.connectors.GPUConnector`` over the K/V views of a vLLM paged cache.

    Bound to the views once (``register_kv_caches``); each call names the request's
    ``slot_mapping`` (numpy or tensor, one slot per token of the whole sequence, ``-1`` =
    leave alone). A chunk is gathered or scattered run by run (see ``token_runs``):
    strided copies straight between the cache and the chunk, through a staging chunk on the
    cache's device when the chunk lives elsewhere.
    """

    def __init__(self, views: KVViews, block_size: int) -> None:
        if not views:
            raise ValueError("a paged cache needs at least one layer")
        first = views[0][0]
        super().__init__(len(views), int(first.shape[2]), int(first.shape[3]), "vllm")
        self.views = views
        self.block_size = block_size
        self.device = first.device
        # plain [blocks, block_size, heads, head] K/V tensors: tierkv.ops moves every layer in one
        # kernel call (the CUDA kernels on a GPU); other layouts go run by run
        self.uses_ops = all(k.is_contiguous() and v.is_contiguous() for k, v in views)

    def dtype_of(self, **kwargs: Any) -> torch.dtype:
        return self.views[0][0].dtype

    def _slots(self, kwargs: dict[str, Any], start: int, end: int) -> np.ndarray:
        return requested_slots(kwargs, start, end)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        blob = self._blob(memory_obj, start, end)
        slots = self._slots(kwargs, start, end)
        target = blob if blob.device == self.device else torch.empty(blob.shape, dtype=blob.dtype, device=self.device)
        if self.uses_ops:
            ops.paged_gather(self.views, torch.as_tensor(slots, device=self.device), out=target)
        elif self._strided_kernel(target):
            ops.paged_copy_strided(self.views, torch.as_tensor(slots), target, gather=True)
        else:
            self._gather_runs(target, token_runs(slots, self.block_size))
        if target is not blob:
            blob.copy_(target)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        blob = self._blob(memory_obj, start, end)
        slots = self._slots(kwargs, start, end)
        source = blob if blob.device == self.device else blob.to(self.device)
        if self.uses_ops:
            ops.paged_scatter(source, self.views, torch.as_tensor(slots, device=self.device))
        elif self._strided_kernel(source):
            ops.paged_copy_strided(self.views, torch.as_tensor(slots), source, gather=False)
        else:
            self._scatter_runs(source, token_runs(slots, self.block_size))

    def _strided_kernel(self, chunk: torch.Tensor) -> bool:
        """Other layouts (the CPU cache's transposed K): the extension's strided kernel moves a
        chunk in one call when it is loaded, else the chunk goes run by run."""
        return self.device.type == "cpu" and chunk.is_contiguous() and ops.paged_copy_strided_available(chunk)

    def _gather_runs(self, target: torch.Tensor, runs: list[tuple[int, int, int, int]]) -> None:
        for first, last, block, offset in runs:
            count = last - first
            for layer, (keys, values) in enumerate(self.views):
                copy_into(target[layer, 0, first:last], keys[block, offset : offset + count])
                copy_into(target[layer, 1, first:last], values[block, offset : offset + count])

    def _scatter_runs(self, source: torch.Tensor, runs: list[tuple[int, int, int, int]]) -> None:
        for first, last, block, offset in runs:
            count = last - first
            for layer, (keys, values) in enumerate(self.views):
                copy_into(keys[block, offset : offset + count], source[layer, 0, first:last])
                copy_into(values[block, offset : offset + count], source[layer, 1, first:last])


def connector_for(layers: Sequence[torch.Tensor], layout: str, num_kv_heads: int, head_size: int,
                  block_size: int) -> PagedLayerConnector | MappedPageConnector:
    """The connector that moves tokens between ``layers`` (vLLM's per-layer cache tensors,
    laid out as ``layout``) and tierkv's chunks."""
    if layout in PAGE_ORDERS and layout != "cpu":
        return MappedPageConnector(layers, layout, num_kv_heads, head_size, block_size)
    return PagedLayerConnector(split_layers(layers, layout, num_kv_heads, head_size, block_size), block_size)
