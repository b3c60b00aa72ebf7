"""Shapes of KV caches as serving engines hand them over, and their validation.

A KV cache is either one blob tensor — ``vllm``: ``[layers, 2, tokens, heads, head_size]``,
``huggingface``: ``[layers, 2, heads, tokens, head_size]`` — or a tuple with one
``(K, V)`` pair per layer, each ``[tokens, heads, head_size]`` (vllm) or
``[heads, tokens, head_size]`` (huggingface). No batch dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierkv.chunks.memory import cuda_available

KVCache = torch.Tensor | Sequence[Sequence[torch.Tensor]]

_LAYOUT = {
    "vllm": "[num_layers, 2, num_tokens, num_kv_heads, head_size]",
    "huggingface": "[num_layers, 2, num_kv_heads, num_tokens, head_size]",
}
_LAYER_LAYOUT = {"vllm": "[num_tokens, num_kv_heads, head_size]", "huggingface": "[num_kv_heads, num_tokens, head_size]"}


def token_dim(fmt: str) -> int:
    """Dimension of the blob that indexes tokens."""
    return 2 if fmt == "vllm" else 3


def layout_text(fmt: str) -> str:
    """The blob layout of ``fmt``, for error messages."""
    return _LAYOUT[fmt]


def with_tokens(shape: tuple[int, ...], fmt: str, num_tokens: int) -> tuple[int, ...]:
    """``shape`` of a blob with its token dimension set to ``num_tokens``."""
    dim = token_dim(fmt)
    return (*shape[:dim], num_tokens, *shape[dim + 1 :])


def as_blob(kv: KVCache, fmt: str) -> torch.Tensor:
    """The KV cache as one 5-D blob (a view of per-layer pairs that share one buffer, else
    stacking them once)."""
    if isinstance(kv, torch.Tensor):
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"a {fmt} KV blob must be {_LAYOUT[fmt]}, got shape {tuple(kv.shape)}")
        return kv
    check_layers(kv, fmt)
    view = blob_view(kv)
    return view if view is not None else torch.stack([torch.stack(tuple(layer)) for layer in kv])


def blob_view(layers: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor | None:
    """The per-layer (K, V) tensors as one 5-D blob *view* when they live in one buffer at
    regular offsets (e.g. the pairs of ``as_tuple``), else None (no copy either way)."""
    first = layers[0][0]
    storage = first.untyped_storage().data_ptr()
    offsets = []
    for pair in layers:
        for tensor in pair:
            if (tensor.untyped_storage().data_ptr() != storage or tensor.stride() != first.stride()
                    or tensor.device != first.device):
                return None
            offsets.append(tensor.storage_offset())
    base = offsets[0]
    kv_stride = offsets[1] - base
    layer_stride = offsets[2] - base if len(layers) > 1 else 0
    if kv_stride < 0 or layer_stride < 0:
        return None
    for index in range(len(layers)):
        for kv in range(2):
            if offsets[2 * index + kv] != base + index * layer_stride + kv * kv_stride:
                return None
    return first.as_strided((len(layers), 2, *first.shape), (layer_stride, kv_stride, *first.stride()), base)


def check_layers(kv: KVCache, fmt: str) -> None:
    """Raise ValueError, naming what was expected, unless ``kv`` is a non-empty sequence of
    per-layer (K, V) pairs of 3-D tensors of one shape and dtype."""
    if not isinstance(kv, Sequence) or not kv:
        raise ValueError(
            f"KV must be a tensor {_LAYOUT[fmt]} or a non-empty tuple of per-layer (K, V) pairs, got {type(kv).__name__}"
        )
    first = None
    for index, layer in enumerate(kv):
        if not isinstance(layer, Sequence) or len(layer) != 2:
            raise ValueError(f"KV layer {index}: expected a (K, V) pair, got {type(layer).__name__}")
        for part, tensor in zip("KV", layer):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"KV layer {index} {part}: expected a tensor {_LAYER_LAYOUT[fmt]}, got {shape}")
            if first is None:
                first = tensor
            elif tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise ValueError(
                    f"KV layer {index} {part}: shape {tuple(tensor.shape)} {tensor.dtype} differs from layer 0 K "
                    f"{tuple(first.shape)} {first.dtype}"
                )


@dataclass(frozen=True)
class CallerKV:
    """A caller's KV, checked once: one 5-D ``blob`` (a tensor, or per-layer pairs that live in
    one buffer at regular offsets, viewed as one) or, when the pairs are separate allocations,
    the ``layers`` themselves; with the blob's ``shape``, dtype, device and token dimension."""

    blob: torch.Tensor | None
    layers: Sequence[Sequence[torch.Tensor]] | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    token_dim: int


def caller_kv(kv: KVCache, fmt: str, name: str = "KV") -> CallerKV:
    """``kv`` (what a store reads or a retrieve's ``out``) checked and viewed, without a copy;
    a ValueError naming ``name`` and the expected layout otherwise."""
    if isinstance(kv, torch.Tensor):
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"{name} must be a {fmt} KV blob {_LAYOUT[fmt]}, got shape {tuple(kv.shape)}")
        return CallerKV(kv, None, tuple(kv.shape), kv.dtype, kv.device, token_dim(fmt))
    check_layers(kv, fmt)
    first = kv[0][0]
    view = blob_view(kv)
    return CallerKV(view, None if view is not None else kv, (len(kv), 2, *first.shape), first.dtype, first.device,
                    token_dim(fmt))


def check_out(out: CallerKV, fmt: str, num_tokens: int, layout: tuple[tuple[int, ...], torch.dtype] | None,
              dtype: torch.dtype | None) -> None:
    """A retrieve's ``out`` must hold exactly ``num_tokens`` tokens in ``fmt``, on the CPU or a
    CUDA device, and match the chunk ``layout`` (per-token shape and dtype) when the engine
    knows it, and the configured ``dtype``: anything else is a ValueError saying what was expected."""
    if out.device.type not in ("cpu", "cuda") or (out.device.type == "cuda" and not cuda_available()):
        raise ValueError(f"out must be on the CPU or a CUDA device, got {out.device}")
    tokens = out.shape[out.token_dim]
    if tokens != num_tokens:
        raise ValueError(f"out holds {tokens} tokens (dim {out.token_dim} of {fmt} shape {out.shape}) but "
                         f"{num_tokens} tokens are to be retrieved")
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"out dtype {out.dtype} does not match the configured dtype {dtype}")
    if layout is not None:
        expected = with_tokens(layout[0], fmt, num_tokens)
        actual = with_tokens(out.shape, fmt, num_tokens)
        if actual != expected or out.dtype != layout[1]:
            raise ValueError(f"out must be {expected} {layout[1]} (the layout of the stored chunks), "
                             f"got {actual} {out.dtype}")


def as_tuple(blob: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per-layer (K, V) views of a blob (no copy)."""
    return tuple((blob[layer, 0], blob[layer, 1]) for layer in range(blob.shape[0]))


def store_mask_skip(mask: torch.Tensor | None, num_tokens: int, chunk_size: int) -> int:
    """Leading tokens a store's suffix mask leaves out; they must be whole chunks."""
    skip = suffix_mask_skip(mask, num_tokens)
    if skip % chunk_size:
        raise ValueError(
            f"store mask must be aligned to chunks: it skips {skip} tokens, not a multiple of chunk_size {chunk_size}"
        )
    return skip


def suffix_mask_skip(mask: torch.Tensor | None, num_tokens: int) -> int:
    """Number of leading tokens a suffix mask leaves out (0 for no mask).

    A suffix mask is False for a prefix of the tokens and True for the rest; anything
    else is a ValueError saying so.
    """
    if mask is None:
        return 0
    if not isinstance(mask, torch.Tensor) or mask.dim() != 1:
        raise ValueError("mask must be a 1-D boolean tensor with one entry per token")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must have dtype torch.bool, got {mask.dtype}")
    if mask.numel() != num_tokens:
        raise ValueError(f"mask has {mask.numel()} entries but there are {num_tokens} tokens")
    skip = num_tokens - int(mask.sum())
    if not bool(mask[skip:].all()):
        raise ValueError("mask must be a suffix mask: False for a prefix of the tokens, True for all the rest")
    return skip


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.itemsize
