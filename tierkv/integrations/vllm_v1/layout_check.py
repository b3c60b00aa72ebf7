"""The registration self-check: do tierkv's K/V views address what vLLM's own kernel writes?

tierkv's layouts (``tierkv.integrations.vllm_v1.layouts``) are written from vLLM's
sources; a vLLM that packs its cache differently (another version, a CPU ISA tierkv has no
order for, another attention backend) would make every partial-block load wrong while whole
blocks still round-trip. So when vLLM registers its caches, ``verify_layout`` writes a
known pattern for a few tokens through vLLM's own cache-write op (the attention layer's
``impl.do_kv_cache_update``, the very call vLLM makes in its forward pass) and checks, per
layer, that

1. tierkv's gather reads back exactly the pattern, token by token (K and V, every head and
   dimension), and
2. tierkv's scatter of the same tokens into a second block leaves that block byte for byte
   equal to the block vLLM's op wrote (so tokens tierkv loads sit where vLLM's attention reads).

It uses the two last blocks of the cache, before vLLM has handed any block to a request,
and restores their bytes afterwards. The pattern is small integers, exact in every float
dtype a KV cache uses (bf16, fp16, fp32, fp8); an fp8 cache (``uint8`` bytes) holds them
divided by the layer's scale, as vLLM quantizes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tierkv.integrations.vllm_v1.cpu_pages import MappedPageConnector
from tierkv.integrations.vllm_v1.layouts import PagedLayerConnector

# (layer index, key [tokens, heads, head_size], value, slot_mapping int64 [tokens]) -> None
CacheWriter = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutMismatchError(RuntimeError):
    """tierkv's views of vLLM's KV cache disagree with what vLLM's kernel wrote."""


def probe_offsets(block_size: int) -> list[int]:
    """Offsets in a block the check writes: the first, the second, one past the middle and
    the last (a transposed or shifted layout moves at least one of them)."""
    return sorted({0, min(1, block_size - 1), min(block_size // 2 + 1, block_size - 1), block_size - 1})


def probe_pattern(num_tokens: int, heads: int, head_size: int, dtype: torch.dtype, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_tokens, heads, head_size]`` of integers in [-8, 8), exact in any float dtype."""
    generator = torch.Generator().manual_seed(seed)
    key = torch.randint(-8, 8, (num_tokens, heads, head_size), generator=generator).to(dtype)
    value = torch.randint(-8, 8, (num_tokens, heads, head_size), generator=generator).to(dtype)
    return key, value


FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cached_pattern(pattern: torch.Tensor, cache_dtype: torch.dtype, kv_cache_dtype: str = "auto",
                   scale: float = 1.0) -> torch.Tensor:
    """What a cache of ``cache_dtype`` holds for ``pattern`` once vLLM wrote it: the values in
    the cache dtype, or for an fp8 cache (``kv_cache_dtype`` ``fp8*``, stored as ``uint8``)
    the fp8 bytes of ``pattern * (1 / scale)`` rounded toward zero, as vLLM's CPU quantizer
    rounds (``csrc/cpu/cpu_attn_fp8.hpp``)."""
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    if fp8 is None:
        return pattern.to(cache_dtype)
    exact = pattern.to(torch.float32) * (1.0 / scale)
    nearest = exact.to(fp8)
    raw = nearest.view(torch.uint8).to(torch.int16)
    away_from_zero = nearest.to(torch.float32).abs() > exact.abs()  # sign-magnitude: one step down is byte - 1
    toward_zero = (raw & 0x80) | ((raw & 0x7F) - away_from_zero.to(torch.int16))
    return toward_zero.to(torch.uint8).view(cache_dtype)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _first_difference(got: torch.Tensor, want: torch.Tensor, offsets: Sequence[int]) -> str:
    differs = (_as_bytes(got) != _as_bytes(want)).reshape(got.shape[0], -1).any(dim=1)
    token = int(torch.nonzero(differs)[0]) if bool(differs.any()) else 0
    return f"token at offset {offsets[token]} reads {got[token, 0, :4].tolist()}..., vLLM wrote {want[token, 0, :4].tolist()}..."


def verify_layout(layers: Sequence[torch.Tensor], connector: PagedLayerConnector | MappedPageConnector,
                  write: CacheWriter, model_dtype: torch.dtype, block_dim: int = 0, kv_cache_dtype: str = "auto",
                  scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Raise ``LayoutMismatchError`` unless ``connector``'s views of ``layers`` address
    exactly what ``write`` (vLLM's cache-write op) writes; see the module docstring.

    ``block_dim``: the dimension of each layer tensor that counts blocks (1 for ``kv_first``,
    else 0); the two last blocks are used and restored. ``model_dtype``: the dtype vLLM hands
    its op (the cache may hold another, e.g. fp8: ``kv_cache_dtype`` and the layer's
    ``scales`` (k, v) say how vLLM quantizes).
    """
    block_size = connector.block_size
    num_blocks = int(layers[0].shape[block_dim])
    if num_blocks < 2:
        raise LayoutMismatchError(f"the KV cache has {num_blocks} block(s); the layout check needs two")
    heads, head_size = connector.num_kv_heads, connector.head_size
    offsets = probe_offsets(block_size)
    count = len(offsets)
    vllm_block, tierkv_block = num_blocks - 1, num_blocks - 2
    vllm_slots = np.asarray([vllm_block * block_size + o for o in offsets], dtype=np.int64)
    tierkv_slots = np.asarray([tierkv_block * block_size + o for o in offsets], dtype=np.int64)
    key, value = probe_pattern(count, heads, head_size, model_dtype)
    cache_dtype = connector.dtype_of()
    want = torch.stack([cached_pattern(key, cache_dtype, kv_cache_dtype, scales[0]),
                        cached_pattern(value, cache_dtype, kv_cache_dtype, scales[1])])  # [2, tokens, heads, head]
    backups = [(layer.select(block_dim, vllm_block).clone(), layer.select(block_dim, tierkv_block).clone())
               for layer in layers]
    try:
        for layer in layers:
            layer.select(block_dim, vllm_block).zero_()
            layer.select(block_dim, tierkv_block).zero_()
        for index in range(len(layers)):
            write(index, key.clone(), value.clone(), torch.as_tensor(vllm_slots))
        got = torch.empty(tuple(connector.get_shape(count)), dtype=cache_dtype, device=connector.device)
        connector.from_gpu(got, 0, count, slot_mapping=vllm_slots)
        chunk = torch.empty_like(got)
        for index in range(len(layers)):
            for part, name in ((0, "K"), (1, "V")):
                if not torch.equal(_as_bytes(got[index, part]), _as_bytes(want[part])):
                    raise LayoutMismatchError(
                        f"layer {index}: tierkv's {name} view does not read what vLLM's cache-write op wrote: "
                        + _first_difference(got[index, part], want[part], offsets))
            chunk[index] = want
        connector.to_gpu(chunk, 0, count, slot_mapping=tierkv_slots)
        for index, layer in enumerate(layers):
            theirs, ours = layer.select(block_dim, vllm_block), layer.select(block_dim, tierkv_block)
            if not torch.equal(_as_bytes(theirs), _as_bytes(ours)):
                raise LayoutMismatchError(
                    f"layer {index}: a block tierkv wrote differs from the block vLLM's cache-write op wrote "
                    f"for the same tokens ({int((_as_bytes(theirs) != _as_bytes(ours)).sum())} bytes differ)")
    finally:
        for layer, (theirs, ours) in zip(layers, backups):
            layer.select(block_dim, vllm_block).copy_(theirs)
            layer.select(block_dim, tierkv_block).copy_(ours)
