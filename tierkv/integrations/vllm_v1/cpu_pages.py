"""Where vLLM's CPU attention puts each token's K and V inside one (block, head) page.

vLLM's CPU backend (``CPU_ATTN``) keeps a layer's cache as ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]``: each (block, head) page is ``block_size * head_size`` elements
of K followed by as many of V. How the elements are ordered inside the page depends on the ISA
vLLM picks for the machine (``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``,
written by ``cpu_attn_reshape_and_cache``):

- ``vec``, ``vec16``, ``neon`` (fp32/fp16), ``vsx``, ``vxe``, ``rvv``: K transposed
  (``d * block_size + t``), V row by row (``t * head_size + d``): plain strided views, the
  ``cpu`` layout of ``tierkv.integrations.vllm_v1.layouts``;
- ``amx`` (bf16 models on CPUs with AMX tiles, cache bf16 or fp8): K in 16-token tiles
  of dimension pairs, ``(t // 16) * 16 * head_size + (d // 2) * 32 + (t % 16) * 2 + d % 2``;
  V in 16-dimension tiles of token pairs, ``(d // 16) * block_size * 16 + (t // 2) * 32 +
  (d % 16) * 2 + t % 2`` (the pairs are what an AMX bf16 tile multiply reads). No strided view
  addresses that, so the ``cpu_amx`` layout moves tokens through an offset map (see
  ``PageMap``);
- ``neon`` with bf16 on a vLLM built with ``ARM_BF16_SUPPORT`` (Graviton 3+, Grace): the
  BFMMLA order, K ``(t // 8) * 8 * head_size + (d // 4) * 32 + (t % 8) * 4 + d % 4``, V
  ``(d // 2) * 2 * block_size + (t // 4) * 8 + (d % 2) * 4 + t % 4`` (``cpu_bfmmla``; from
  ``csrc/cpu/cpu_attn_neon_bfmmla.hpp``, as this order cannot be written on x86). Whether a
  vLLM was built with it is not visible from Python, so for ``neon`` + bf16 the registration
  self-check picks the order that reads what vLLM wrote.

fp8 caches (``kv_cache_dtype`` ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``) hold one byte per
element, quantized with the layer's scalar ``k_scale`` / ``v_scale``, in the same orders
counted in bytes. tierkv stores those bytes as they are (the chunk is ``uint8``, its key binds
the cache dtype), so an fp8 chunk is never read as another format.

Each formula here is checked element by element against vLLM's own op where it runs
(``tests/test_vllm_cpu_pages.py``), and the registration self-check
(``tierkv.integrations.vllm_v1.layout_check``) checks it again on every start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from tierkv import ops
from tierkv.connectors import GPUConnector

# (t, d, block_size, head_size) -> element offset inside the page's K (or V) half
OffsetFormula = Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]


def vec_key(t: np.ndarray, d: np.ndarray, block_size: int, head_size: int) -> np.ndarray:
    """Element offset of K[token t, dim d] in a ``vec`` page (head_size-major: d * block + t)."""
    return d * block_size + t


def vec_value(t: np.ndarray, d: np.ndarray, block_size: int, head_size: int) -> np.ndarray:
    """Element offset of V[token t, dim d] in a ``vec`` page (token-major rows)."""
    return t * head_size + d


def amx_key(t: np.ndarray, d: np.ndarray, block_size: int, head_size: int) -> np.ndarray:
    """Element offset of K[t, d] in an ``amx`` page: 16-token tiles of dim pairs."""
    return (t // 16) * 16 * head_size + (d // 2) * 32 + (t % 16) * 2 + d % 2


def amx_value(t: np.ndarray, d: np.ndarray, block_size: int, head_size: int) -> np.ndarray:
    """Element offset of V[t, d] in an ``amx`` page: 16-dim tiles of token pairs."""
    return (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2


def bfmmla_key(t: np.ndarray, d: np.ndarray, block_size: int, head_size: int) -> np.ndarray:
    """Element offset of K[t, d] in a neon ``bfmmla`` page: 8-token tiles of 4-dim groups."""
    return (t // 8) * 8 * head_size + (d // 4) * 32 + (t % 8) * 4 + d % 4


def bfmmla_value(t: np.ndarray, d: np.ndarray, block_size: int, head_size: int) -> np.ndarray:
    """Element offset of V[t, d] in a neon ``bfmmla`` page: dim pairs of 4-token groups."""
    return (d // 2) * 2 * block_size + (t // 4) * 8 + (d % 2) * 4 + t % 4


@dataclass(frozen=True)
class PageFormulas:
    """One page order: the K and V offset formulas and the sizes they hold for."""

    name: str
    key: OffsetFormula
    value: OffsetFormula
    block_multiple: int  # block_size must be a multiple of this
    head_multiple: int  # head_size must be a multiple of this

    def check_sizes(self, block_size: int, head_size: int) -> None:
        if block_size % self.block_multiple or head_size % self.head_multiple:
            raise ValueError(f"vLLM's {self.name!r} CPU cache order needs a block size that is a multiple of "
                             f"{self.block_multiple} and a head size that is a multiple of {self.head_multiple}, "
                             f"got {block_size} and {head_size}")


PAGE_ORDERS = {
    "cpu": PageFormulas("vec", vec_key, vec_value, 1, 1),
    "cpu_amx": PageFormulas("amx", amx_key, amx_value, 32, 32),  # vLLM picks vec16 for other head sizes
    "cpu_bfmmla": PageFormulas("neon bfmmla", bfmmla_key, bfmmla_value, 8, 4),
}

# vLLM 0.32's CPU ISAs (``layer.isa``) -> tierkv layouts, the likeliest first
ISA_LAYOUTS = {"vec": ("cpu",), "vec16": ("cpu",), "neon": ("cpu",), "vsx": ("cpu",), "vxe": ("cpu",),
               "rvv": ("cpu",), "amx": ("cpu_amx",)}


def layouts_for_isa(isa: str | None, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """tierkv's candidate layouts for a vLLM CPU cache of ``dtype`` written with ``isa``, the
    likeliest first (None: vLLM did not say, so the ``vec`` order). The registration
    self-check keeps the first that reads what vLLM's op wrote."""
    if isa is None:
        return ("cpu",)
    if isa == "neon" and dtype == torch.bfloat16:
        return ("cpu_bfmmla", "cpu")  # BFMMLA kernels when vLLM was built with ARM_BF16_SUPPORT
    try:
        return ISA_LAYOUTS[str(isa)]
    except KeyError:
        raise ValueError(f"vLLM's CPU attention ISA {isa!r} is not one tierkv knows the cache order of "
                         f"(known: {sorted(ISA_LAYOUTS)})") from None


def _contiguous_unit(offsets: np.ndarray) -> int:
    """The largest power of two ``g`` dividing the row length such that every aligned run of
    ``g`` dimensions sits at ``g`` consecutive offsets (so it moves as one wider element)."""
    width = offsets.shape[-1]
    unit = 1
    while width % (unit * 2) == 0:
        trial = unit * 2
        runs = offsets.reshape(offsets.shape[0], width // trial, trial)
        if not np.array_equal(runs - runs[..., :1], np.broadcast_to(np.arange(trial), runs.shape)):
            break
        unit = trial
    return unit


@dataclass(frozen=True)
class PageMap:
    """Element offsets of each (token, dimension) of one page, in units of ``*_unit``
    consecutive dimensions: ``key[t, j]`` is the offset of dimensions ``j * key_unit ...
    (j + 1) * key_unit - 1`` of token ``t``'s K, which sit together (V likewise, counted from
    the start of the page, so past the K half)."""

    key: np.ndarray  # int32 [block_size, head_size // key_unit]
    value: np.ndarray  # int32 [block_size, head_size // value_unit]
    key_unit: int
    value_unit: int
    page_elements: int  # 2 * block_size * head_size


@lru_cache(maxsize=32)
def page_map(layout: str, block_size: int, head_size: int) -> PageMap:
    """The ``PageMap`` of ``layout`` (a key of ``PAGE_ORDERS``) for these sizes."""
    try:
        formulas = PAGE_ORDERS[layout]
    except KeyError:
        raise ValueError(f"no page order for layout {layout!r}; known: {sorted(PAGE_ORDERS)}") from None
    formulas.check_sizes(block_size, head_size)
    tokens = np.arange(block_size, dtype=np.int64)[:, None]
    dims = np.arange(head_size, dtype=np.int64)[None, :]
    key = np.broadcast_to(formulas.key(tokens, dims, block_size, head_size), (block_size, head_size))
    value = np.broadcast_to(formulas.value(tokens, dims, block_size, head_size), (block_size, head_size))
    value = value + block_size * head_size
    key_unit, value_unit = _contiguous_unit(key), _contiguous_unit(value)
    return PageMap(np.ascontiguousarray(key[:, ::key_unit], dtype=np.int32),
                   np.ascontiguousarray(value[:, ::value_unit], dtype=np.int32),
                   key_unit, value_unit, 2 * block_size * head_size)


def requested_slots(kwargs: dict[str, Any], start: int, end: int) -> np.ndarray:
    """The ``slot_mapping`` a connector call names (numpy or tensor, one slot per token of the
    whole sequence, ``-1`` = leave alone), for tokens ``[start, end)``, as int64."""
    if "slot_mapping" not in kwargs:
        raise ValueError("slot_mapping is required: one slot per token of the sequence (-1 = skip)")
    slots = kwargs["slot_mapping"]
    slots = slots.cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots)
    if len(slots) < end:
        raise ValueError(f"slot_mapping has {len(slots)} entries, tokens up to {end} are asked for")
    return np.ascontiguousarray(slots[start:end], dtype=np.int64)


class MappedPageConnector(GPUConnector):
    """A ``tierkv.connectors.GPUConnector`` over a vLLM CPU cache whose pages have an
    order no strided view addresses (``cpu_amx``): tokens move through the page's
    ``PageMap`` (``tierkv.ops.paged_copy_mapped``, one call for every layer).

    ``layers``: vLLM's per-layer tensors ``[num_blocks, heads, block_size, 2 * head_size]``.
    ``views`` (what the worker hands the engine as ``kvcaches``): per layer the K and V halves
    of every page, ``[num_blocks, heads, block_size * head_size]`` each.
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: str, num_kv_heads: int, head_size: int,
                 block_size: int) -> None:
        if not layers:
            raise ValueError("a paged cache needs at least one layer")
        for layer in layers:
            if layer.dim() != 4 or tuple(layer.shape[1:]) != (num_kv_heads, block_size, 2 * head_size):
                raise ValueError(f"KV cache layout {layout!r} expects a layer of [num_blocks, {num_kv_heads} heads, "
                                 f"{block_size} tokens, 2 x {head_size}], got shape {tuple(layer.shape)}")
            if not layer[0, 0].is_contiguous() or layer.stride(1) != 2 * block_size * head_size:
                raise ValueError(f"KV cache layout {layout!r} expects each (block, head) page contiguous, "
                                 f"got strides {layer.stride()}")
        super().__init__(len(layers), num_kv_heads, head_size, "vllm")
        self.layers = list(layers)
        self.map = page_map(layout, block_size, head_size)
        self.block_size = block_size
        self.device = layers[0].device
        halves = [layer.view(layer.shape[0], num_kv_heads, 2, block_size * head_size) for layer in layers]
        self.views = [(half[:, :, 0], half[:, :, 1]) for half in halves]
        self._key_map = torch.from_numpy(self.map.key)
        self._value_map = torch.from_numpy(self.map.value)
        self._tiles_kernel = layout == "cpu_amx" and layers[0].element_size() in (1, 2)

    def dtype_of(self, **kwargs: Any) -> torch.dtype:
        return self.layers[0].dtype

    def _slots(self, kwargs: dict[str, Any], start: int, end: int) -> torch.Tensor:
        return torch.from_numpy(requested_slots(kwargs, start, end))

    def _copy(self, chunk: torch.Tensor, slots: torch.Tensor, gather: bool) -> None:
        if self._tiles_kernel and ops.paged_copy_strided_available(chunk):
            # the extension's own amx kernel: register transposes per 16-token tile
            torch.ops.tierkv.paged_copy_amx(self.layers, self.block_size, slots.contiguous(), chunk, gather)
            return
        ops.paged_copy_mapped(self.layers, self._key_map, self._value_map, self.map.key_unit, self.map.value_unit,
                              self.block_size, slots, chunk, gather)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        blob = self._blob(memory_obj, start, end)
        slots = self._slots(kwargs, start, end)
        target = blob if blob.is_contiguous() else torch.empty(blob.shape, dtype=blob.dtype)
        self._copy(target, slots, gather=True)
        if target is not blob:
            blob.copy_(target)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        blob = self._blob(memory_obj, start, end)
        self._copy(blob.contiguous(), self._slots(kwargs, start, end), gather=False)
