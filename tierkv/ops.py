"""Kernel entry points: the ``cuda_ext`` extension when it is built, a pure-torch reference otherwise.

Every public function here has one signature whatever runs underneath. The reference
implementations are plain torch (``index_select`` / ``index_copy_`` / float32 math); they are
used when the extension is not loaded and are the oracle the extension is tested against.
When the extension is loaded (see :func:`extension_status`), the same calls dispatch to
``torch.ops.tierkv.*``, whose C++ CPU kernels and CUDA kernels share one op schema and one
header of index math (``cuda_ext/tierkv_index.h``).

Layouts:

* a *paged* cache, per layer, is K and V tensors ``[num_blocks, block_size, num_kv_heads, head_size]``
  (separate K/V: a sequence of ``(K, V)`` pairs) or one fused tensor ``[2, num_blocks, block_size,
  num_kv_heads, head_size]`` per layer; token ``i`` lives in slot ``slot_mapping[i]`` =
  ``block * block_size + offset``; slot ``-1`` means "not in the cache" and is skipped;
* a *chunk* is contiguous ``[num_layers, 2, num_tokens, num_kv_heads, head_size]`` (vllm order) or
  ``[num_layers, 2, num_kv_heads, num_tokens, head_size]`` (huggingface order).

Gathers and scatters are raw byte copies, so any dtype works (float8 and int8 as raw bytes);
the extension is bit-exact with the reference for them.

The extension is optional and never built implicitly on import (it takes ~30 s): build it once
with ``python -m tierkv.ops build`` (or :func:`build_extension`); later processes load the
prebuilt library from the cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).
``TIERKV_NO_EXT=1`` forces the reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

Tensor = torch.Tensor
# Per layer: a (K, V) pair of [num_blocks, block_size, heads, head_size], or one fused
# [2, num_blocks, block_size, heads, head_size] tensor.
PagedKVCache = Sequence[Tensor | Sequence[Tensor]]

_ORDERS = ("vllm", "huggingface")


# --------------------------------------------------------------------------------------------
# Blend ops (CacheBlend) and RoPE re-rotation
# --------------------------------------------------------------------------------------------


def _check_tensor(name: str, value: Any) -> Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_kv_deviation(retrieved_k: Tensor, fresh_k: Tensor) -> None:
    _check_tensor("retrieved_k", retrieved_k)
    _check_tensor("fresh_k", fresh_k)
    if retrieved_k.dim() != 3:
        raise ValueError(
            f"retrieved_k must be [num_tokens, num_heads, head_size], got shape {tuple(retrieved_k.shape)}"
        )
    if fresh_k.shape != retrieved_k.shape:
        raise ValueError(
            f"fresh_k must have retrieved_k's shape {tuple(retrieved_k.shape)}, got {tuple(fresh_k.shape)}"
        )
    if not retrieved_k.is_floating_point() or not fresh_k.is_floating_point():
        raise ValueError(f"kv_deviation needs floating-point K, got {retrieved_k.dtype} and {fresh_k.dtype}")
    if retrieved_k.device != fresh_k.device:
        raise ValueError(f"retrieved_k is on {retrieved_k.device} but fresh_k is on {fresh_k.device}")


def kv_deviation_reference(retrieved_k: Tensor, fresh_k: Tensor) -> Tensor:
    """Reference for :func:`kv_deviation`."""
    _check_kv_deviation(retrieved_k, fresh_k)
    diff = retrieved_k.to(torch.float32) - fresh_k.to(torch.float32)
    return diff.square().sum(dim=(1, 2))


def kv_deviation(retrieved_k: Tensor, fresh_k: Tensor) -> Tensor:
    """Per-token squared L2 distance between retrieved and freshly computed K at one layer.

    This is CacheBlend's token-selection score: tokens whose cached K deviates most from the
    fresh K are the ones worth recomputing. ``retrieved_k`` and ``fresh_k`` are
    ``[num_tokens, num_heads, head_size]`` of the same shape, any floating dtype; the result is
    float32 ``[num_tokens]``, accumulated in float32.
    """
    _check_kv_deviation(retrieved_k, fresh_k)
    if _dispatch(retrieved_k):
        return torch.ops.tierkv.kv_deviation(retrieved_k, fresh_k)
    return kv_deviation_reference(retrieved_k, fresh_k)


def _check_blend_scatter(dst: Tensor, src: Tensor, indices: Tensor) -> None:
    _check_tensor("dst", dst)
    _check_tensor("src", src)
    _check_tensor("indices", indices)
    if indices.dim() != 1 or indices.dtype != torch.int64:
        raise ValueError(f"indices must be a 1-D int64 tensor, got {indices.dim()}-D {indices.dtype}")
    if dst.dim() < 1:
        raise ValueError("dst must be [num_tokens, ...] with at least one dimension")
    expected = (indices.numel(), *dst.shape[1:])
    if tuple(src.shape) != expected:
        raise ValueError(f"src must be [len(indices), *dst.shape[1:]] = {expected}, got {tuple(src.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} differs from dst dtype {dst.dtype}")
    if src.device != dst.device or indices.device != dst.device:
        raise ValueError(
            f"dst, src and indices must be on one device, got {dst.device}, {src.device}, {indices.device}"
        )
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= dst.shape[0]:
            raise IndexError(f"indices must lie in [0, {dst.shape[0]}), got values in [{low}, {high}]")


def blend_scatter_reference(dst: Tensor, src: Tensor, indices: Tensor) -> Tensor:
    """Reference for :func:`blend_scatter`."""
    _check_blend_scatter(dst, src, indices)
    _as_raw(dst).index_copy_(0, indices, _as_raw(src))  # float8 as raw bytes
    return dst


def blend_scatter(dst: Tensor, src: Tensor, indices: Tensor) -> Tensor:
    """Write recomputed rows into the retrieved KV, in place: ``dst[indices] = src``; returns ``dst``.

    ``dst`` is ``[num_tokens, ...]``, ``src`` is ``[len(indices), ...]`` with the same trailing
    shape and dtype, ``indices`` is 1-D int64 with values in ``[0, num_tokens)`` (checked: an
    index out of range is an IndexError, never a silent write elsewhere). With repeated indices
    the last row wins on CPU; on CUDA which one wins is unspecified, as with ``index_copy_``.
    """
    _check_blend_scatter(dst, src, indices)
    if _dispatch(dst) and dst.is_contiguous() and src.is_contiguous():
        torch.ops.tierkv.blend_scatter(dst, src, indices)
        return dst
    return blend_scatter_reference(dst, src, indices)


def make_cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> Tensor:
    """The standard RoPE cos/sin table in vLLM's layout: float32 ``[max_position, rot_dim]``.

    Row ``p`` holds ``cos(p * inv_freq)`` in its first ``rot_dim / 2`` columns and
    ``sin(p * inv_freq)`` in the last ``rot_dim / 2``, with
    ``inv_freq[i] = base ** (-2 i / rot_dim)``.
    """
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    if rot_dim < 2 or rot_dim % 2:
        raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
    if base <= 0:
        raise ValueError(f"base must be > 0, got {base}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=1).to(torch.float32)


def _check_rope(k: Tensor, old_positions: Tensor, new_positions: Tensor, cos_sin_cache: Tensor) -> None:
    _check_tensor("k", k)
    _check_tensor("old_positions", old_positions)
    _check_tensor("new_positions", new_positions)
    _check_tensor("cos_sin_cache", cos_sin_cache)
    if k.dim() != 3:
        raise ValueError(f"k must be [num_tokens, num_heads, head_size], got shape {tuple(k.shape)}")
    if not k.is_floating_point():
        raise ValueError(f"k must be floating point, got {k.dtype}")
    for name, positions in (("old_positions", old_positions), ("new_positions", new_positions)):
        if positions.dim() != 1 or positions.numel() != k.shape[0]:
            raise ValueError(f"{name} must be 1-D with num_tokens={k.shape[0]} entries, got {tuple(positions.shape)}")
        if positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {positions.dtype}")
        if positions.device != k.device:
            raise ValueError(f"{name} is on {positions.device} but k is on {k.device}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.dtype != torch.float32:
        raise ValueError(
            f"cos_sin_cache must be float32 [max_position, rot_dim], got {cos_sin_cache.dtype} "
            f"{tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.device != k.device:
        raise ValueError(f"cos_sin_cache is on {cos_sin_cache.device} but k is on {k.device}")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim < 2 or rot_dim % 2 or rot_dim > k.shape[2]:
        raise ValueError(f"cos_sin_cache rot_dim must be even and <= head_size={k.shape[2]}, got {rot_dim}")
    max_position = cos_sin_cache.shape[0]
    for name, positions in (("old_positions", old_positions), ("new_positions", new_positions)):
        if positions.numel():
            low, high = int(positions.min()), int(positions.max())
            if low < 0 or high >= max_position:
                raise IndexError(f"{name} must lie in [0, {max_position}), got values in [{low}, {high}]")


def rope_rerotate_reference(
    k: Tensor, old_positions: Tensor, new_positions: Tensor, cos_sin_cache: Tensor, is_neox: bool = True
) -> Tensor:
    """Reference for :func:`rope_rerotate`."""
    _check_rope(k, old_positions, new_positions, cos_sin_cache)
    half = cos_sin_cache.shape[1] // 2
    old = cos_sin_cache.index_select(0, old_positions.long())
    new = cos_sin_cache.index_select(0, new_positions.long())
    cos_o, sin_o, cos_n, sin_n = old[:, :half], old[:, half:], new[:, :half], new[:, half:]
    # rotation by (new - old): cos(n - o), sin(n - o) by the angle-difference identities
    cos = (cos_n * cos_o + sin_n * sin_o).unsqueeze(1)
    sin = (sin_n * cos_o - cos_n * sin_o).unsqueeze(1)
    rot = k[..., : 2 * half].to(torch.float32)
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    k[..., : 2 * half] = out.to(k.dtype)
    return k


def rope_rerotate(
    k: Tensor, old_positions: Tensor, new_positions: Tensor, cos_sin_cache: Tensor, is_neox: bool = True
) -> Tensor:
    """Re-rotate cached K in place from the positions it was stored at to new positions; returns ``k``.

    RoPE rotates K by an angle proportional to its position, so a chunk reused at another
    offset (CacheBlend, non-prefix reuse) must be rotated by ``new - old``. This does it in one
    pass: the combined rotation is built from the cache rows of both positions (undo old, apply
    new), so any table of pure rotations works (plain, linear- or NTK-scaled RoPE).

    ``k`` is ``[num_tokens, num_heads, head_size]``; ``old_positions`` / ``new_positions`` are
    ``[num_tokens]`` int32/int64 in ``[0, max_position)``; ``cos_sin_cache`` is float32
    ``[max_position, rot_dim]`` (cos in the first half of the columns, sin in the second: see
    :func:`make_cos_sin_cache`); only the first ``rot_dim`` dims of each head rotate.
    ``is_neox`` selects rotate-halves (GPT-NeoX, Llama) or interleaved pairs (GPT-J). Math is
    float32; the result is written back in ``k``'s dtype.
    """
    _check_rope(k, old_positions, new_positions, cos_sin_cache)
    if _dispatch(k) and k.stride(2) == 1 and cos_sin_cache.is_contiguous():
        torch.ops.tierkv.rope_rerotate(
            k, old_positions.long().contiguous(), new_positions.long().contiguous(), cos_sin_cache, is_neox
        )
        return k
    return rope_rerotate_reference(k, old_positions, new_positions, cos_sin_cache, is_neox)


# --------------------------------------------------------------------------------------------
# Paged gather / scatter
# --------------------------------------------------------------------------------------------


def split_paged_cache(kv_caches: PagedKVCache) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer K and V views ``[num_blocks, block_size, heads, head_size]`` of a paged cache.

    Accepts a sequence with, per layer, either a ``(K, V)`` pair or one fused
    ``[2, num_blocks, block_size, heads, head_size]`` tensor (views, no copy). All layers must
    agree in shape, dtype, device and strides, so one launch can address them all.
    """
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() != 6 or kv_caches.shape[1] != 2:
            raise ValueError(
                "a paged KV cache tensor must be [num_layers, 2, num_blocks, block_size, heads, head_size], "
                f"got shape {tuple(kv_caches.shape)}"
            )
    elif not isinstance(kv_caches, Sequence) or len(kv_caches) == 0:
        raise ValueError(
            "kvcaches must be a non-empty sequence with one (K, V) pair or one fused "
            f"[2, num_blocks, block_size, heads, head_size] tensor per layer, got {type(kv_caches).__name__}"
        )
    keys: list[Tensor] = []
    values: list[Tensor] = []
    for index, layer in enumerate(kv_caches):
        if isinstance(layer, torch.Tensor):
            if layer.dim() != 5 or layer.shape[0] != 2:
                raise ValueError(
                    f"kvcaches layer {index}: a fused layer must be [2, num_blocks, block_size, heads, head_size], "
                    f"got shape {tuple(layer.shape)}"
                )
            key, value = layer[0], layer[1]
        elif isinstance(layer, Sequence) and len(layer) == 2:
            key, value = layer
        else:
            raise ValueError(f"kvcaches layer {index}: expected a (K, V) pair or a fused tensor, got {type(layer).__name__}")
        for part, tensor in (("K", key), ("V", value)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(
                    f"kvcaches layer {index} {part}: expected [num_blocks, block_size, heads, head_size], got {shape}"
                )
        keys.append(key)
        values.append(value)
    first = keys[0]
    for index, (key, value) in enumerate(zip(keys, values)):
        for part, tensor in (("K", key), ("V", value)):
            if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
                raise ValueError(
                    f"kvcaches layer {index} {part}: {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} "
                    f"differs from layer 0 K {tuple(first.shape)} {first.dtype} on {first.device}"
                )
    return keys, values


def _chunk_shape(keys: Sequence[Tensor], num_tokens: int, order: str) -> tuple[int, ...]:
    _, _, heads, head_size = keys[0].shape
    if order == "vllm":
        return (len(keys), 2, num_tokens, heads, head_size)
    return (len(keys), 2, heads, num_tokens, head_size)


def _check_paged(keys: Sequence[Tensor], chunk: Tensor, slot_mapping: Tensor, order: str, chunk_name: str) -> None:
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    _check_tensor("slot_mapping", slot_mapping)
    _check_tensor(chunk_name, chunk)
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dim()}-D {slot_mapping.dtype}")
    if slot_mapping.device != keys[0].device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but the paged cache is on {keys[0].device}")
    expected = _chunk_shape(keys, slot_mapping.numel(), order)
    if tuple(chunk.shape) != expected:
        raise ValueError(f"{chunk_name} must be {order}-order {expected}, got {tuple(chunk.shape)}")
    if chunk.dtype != keys[0].dtype:
        raise ValueError(f"{chunk_name} dtype {chunk.dtype} differs from the paged cache dtype {keys[0].dtype}")
    if chunk.device != keys[0].device:
        raise ValueError(
            f"{chunk_name} is on {chunk.device} but the paged cache is on {keys[0].device}; "
            "gather on the cache's device, then copy"
        )
    num_slots = keys[0].shape[0] * keys[0].shape[1]
    if slot_mapping.numel():
        low, high = int(slot_mapping.min()), int(slot_mapping.max())
        if low < -1 or high >= num_slots:
            raise IndexError(
                f"slot_mapping values must be -1 (skip) or in [0, num_blocks * block_size = {num_slots}), "
                f"got values in [{low}, {high}]"
            )


def _as_raw(tensor: Tensor) -> Tensor:
    """A view whose dtype index_select/index_copy_ support on every device (bytes for 1-byte types)."""
    if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8):
        return tensor.view(torch.uint8)
    return tensor


def _flat_slots(tensor: Tensor) -> Tensor | None:
    """[num_blocks, block_size, heads, head_size] -> [num_slots, heads, head_size] view, or None
    when blocks and slots cannot be addressed with one stride (then callers index (block, offset))."""
    try:
        return tensor.view(-1, *tensor.shape[2:])
    except RuntimeError:
        return None


def _read_slots(cache: Tensor, slots: Tensor) -> Tensor:
    flat = _flat_slots(cache)
    if flat is not None:
        return flat.index_select(0, slots)
    block_size = cache.shape[1]
    return cache[slots // block_size, slots % block_size]


def _write_slots(cache: Tensor, slots: Tensor, rows: Tensor) -> None:
    flat = _flat_slots(cache)
    if flat is not None:
        flat.index_copy_(0, slots, rows)
        return
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = rows


def _valid(slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    slots = slot_mapping.long()
    positions = torch.nonzero(slots >= 0).flatten()
    return positions, slots.index_select(0, positions)


def paged_gather_reference(
    kv_caches: PagedKVCache, slot_mapping: Tensor, out: Tensor | None = None, order: str = "vllm"
) -> Tensor:
    """Reference for :func:`paged_gather` (``index_select`` per layer)."""
    keys, values = split_paged_cache(kv_caches)
    if out is None:
        out = torch.zeros(_chunk_shape(keys, slot_mapping.numel(), order), dtype=keys[0].dtype, device=keys[0].device)
    _check_paged(keys, out, slot_mapping, order, "out")
    positions, slots = _valid(slot_mapping)
    raw_out = _as_raw(out)
    every_slot = positions.numel() == slot_mapping.numel()
    for layer, pair in enumerate(zip(keys, values)):
        for kv, cache in enumerate(pair):
            flat = _flat_slots(_as_raw(cache))
            if every_slot and order == "vllm" and flat is not None and raw_out[layer, kv].is_contiguous():
                torch.index_select(flat, 0, slots, out=raw_out[layer, kv])  # one pass, the common case
                continue
            rows = _read_slots(_as_raw(cache), slots)  # [valid, heads, head_size]
            if order == "vllm":
                raw_out[layer, kv].index_copy_(0, positions, rows)
            else:
                raw_out[layer, kv].index_copy_(1, positions, rows.transpose(0, 1))
    return out


def paged_scatter_reference(
    chunk: Tensor, kv_caches: PagedKVCache, slot_mapping: Tensor, order: str = "vllm"
) -> None:
    """Reference for :func:`paged_scatter` (``index_copy_`` per layer)."""
    keys, values = split_paged_cache(kv_caches)
    _check_paged(keys, chunk, slot_mapping, order, "chunk")
    positions, slots = _valid(slot_mapping)
    raw_chunk = _as_raw(chunk)
    for layer, pair in enumerate(zip(keys, values)):
        for kv, cache in enumerate(pair):
            source = raw_chunk[layer, kv]
            rows = source.index_select(0, positions) if order == "vllm" else source.index_select(1, positions).transpose(0, 1)
            _write_slots(_as_raw(cache), slots, rows)


def _ext_paged_ok(keys: Sequence[Tensor], values: Sequence[Tensor], chunk: Tensor) -> bool:
    """Whether the kernel's addressing (one block stride, one slot stride, contiguous rows) fits."""
    if not chunk.is_contiguous():
        return False
    first = keys[0]
    heads, head_size = first.shape[2], first.shape[3]
    for tensor in (*keys, *values):
        if tensor.stride() != first.stride():
            return False
        if tensor.stride(3) != 1 or tensor.stride(2) != head_size:
            return False
    return heads * head_size > 0


def paged_gather(
    kv_caches: PagedKVCache, slot_mapping: Tensor, out: Tensor | None = None, order: str = "vllm"
) -> Tensor:
    """Gather all layers' K and V of a run of tokens from a paged cache into one contiguous chunk.

    ``kv_caches``: per layer a ``(K, V)`` pair of ``[num_blocks, block_size, heads, head_size]``
    or one fused ``[2, num_blocks, block_size, heads, head_size]`` tensor. ``slot_mapping``:
    ``[num_tokens]`` int32/int64, ``-1`` = skip (the chunk row is left as it was). ``out``:
    optional preallocated chunk (``vllm`` order ``[layers, 2, tokens, heads, head_size]`` or
    ``huggingface`` order ``[layers, 2, heads, tokens, head_size]``) on the cache's device;
    when omitted a zero-filled one is allocated. With the extension this is one launch for all
    layers (layer base pointers passed as an array). Returns the chunk.
    """
    keys, values = split_paged_cache(kv_caches)
    if out is None:
        out = torch.zeros(_chunk_shape(keys, slot_mapping.numel(), order), dtype=keys[0].dtype, device=keys[0].device)
    _check_paged(keys, out, slot_mapping, order, "out")
    if _dispatch(out) and _ext_paged_ok(keys, values, out):
        torch.ops.tierkv.paged_gather(keys, values, slot_mapping, out, order == "huggingface")
        return out
    return paged_gather_reference((tuple(zip(keys, values))), slot_mapping, out, order)


def paged_scatter(chunk: Tensor, kv_caches: PagedKVCache, slot_mapping: Tensor, order: str = "vllm") -> None:
    """Scatter a contiguous chunk into a paged cache (the reverse of :func:`paged_gather`).

    Token ``i`` of ``chunk`` goes to slot ``slot_mapping[i]`` of every layer's K and V; ``-1``
    slots are skipped. Layouts as in :func:`paged_gather`; the chunk must be on the cache's device.
    """
    keys, values = split_paged_cache(kv_caches)
    _check_paged(keys, chunk, slot_mapping, order, "chunk")
    if _dispatch(chunk) and _ext_paged_ok(keys, values, chunk):
        torch.ops.tierkv.paged_scatter(chunk, keys, values, slot_mapping, order == "huggingface")
        return
    paged_scatter_reference(chunk, tuple(zip(keys, values)), slot_mapping, order)


# --------------------------------------------------------------------------------------------
# The optional extension: building, loading, reporting
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_state: dict[str, Any] = {"attempted": False, "loaded": False, "cuda": False, "reason": "not loaded yet", "path": None}


def _dispatch(tensor: Tensor) -> bool:
    """Whether the extension should run an op on ``tensor``'s device (``TIERKV_NO_EXT`` is read
    on every call, so it can be flipped at run time, e.g. to compare against the reference)."""
    if _env_disabled():
        return False
    if not _state["attempted"]:
        _try_load_prebuilt()
    if not _state["loaded"]:
        return False
    if tensor.device.type == "cpu":
        return True
    return tensor.device.type == "cuda" and bool(_state["cuda"])


def source_dir() -> Path:
    """Where the extension sources are: the checkout's ``cuda_ext/``, else the copy a wheel installs
    under ``<prefix>/share/tierkv/cuda_ext``."""
    candidates = [Path(__file__).resolve().parent.parent / "cuda_ext"]
    for prefix in (sysconfig.get_paths().get("data"), sys.prefix, sysconfig.get_config_var("userbase")):
        if prefix:
            candidates.append(Path(prefix) / "share" / "tierkv" / "cuda_ext")
    for candidate in candidates:
        if (candidate / "tierkv_ops.cpp").is_file():
            return candidate
    return candidates[0]


def _sources(with_cuda: bool) -> list[Path]:
    root = source_dir()
    found = sorted(root.glob("*.cpp"))
    if with_cuda:
        found += sorted(root.glob("*.cu"))
    return found


def _cuda_buildable() -> tuple[bool, str]:
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    if cpp_extension.CUDA_HOME is None:
        return False, "nvcc / CUDA_HOME not found"
    return True, "torch has CUDA and nvcc was found"


def _build_name(with_cuda: bool) -> str:
    digest = hashlib.sha256()
    for path in _sources(with_cuda) + sorted(source_dir().glob("*.h")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return f"tierkv_ops_{'cuda' if with_cuda else 'cpu'}_{digest.hexdigest()[:12]}"


def _default_build_root() -> Path:
    from torch.utils.cpp_extension import _get_build_directory  # noqa: F401  (documents where torch caches)

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions"
    )
    return Path(root)


def _library_path(build_root: Path, name: str) -> Path:
    return build_root / name / f"{name}.so"


def _env_disabled() -> bool:
    return os.environ.get("TIERKV_NO_EXT", "").strip().lower() not in ("", "0", "false", "no")


def _disabled() -> str | None:
    if _env_disabled():
        return "disabled by TIERKV_NO_EXT"
    if not _sources(False):
        return f"extension sources not found in {source_dir()}"
    return None


def _try_load_prebuilt(build_root: Path | None = None) -> bool:
    """Load an already built extension for these sources and this torch, never compiling."""
    with _lock:
        if _state["loaded"]:
            return True
        _state["attempted"] = True
        reason = _disabled()
        if reason:
            _state["reason"] = reason
            return False
        root = build_root or _default_build_root()
        with_cuda, _ = _cuda_buildable()
        for cuda in ((True, False) if with_cuda else (False,)):
            path = _library_path(root, _build_name(cuda))
            if path.is_file():
                return _load_library(path, cuda)
        _state["reason"] = (
            f"not built for this torch ({torch.__version__}) and these sources: run `python -m tierkv.ops build`"
        )
        return False


def _load_library(path: Path, cuda: bool) -> bool:
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        _state.update(loaded=False, reason=f"failed to load {path}: {exc}")
        logger.warning("tierkv extension at %s failed to load, using the reference: %s", path, exc)
        return False
    _state.update(loaded=True, cuda=cuda, path=str(path), reason="loaded")
    return True


def build_extension(build_root: str | os.PathLike[str] | None = None, verbose: bool = False) -> bool:
    """Compile (if needed) and load the extension; returns whether it is loaded.

    CPU kernels are built wherever a C++ compiler exists; CUDA kernels too when torch is a
    CUDA build and nvcc is found. The build is cached per source hash and torch version in
    ``build_root`` (default ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), so a
    second call is a quick load. Failures are recorded in :func:`extension_status`, not raised.
    """
    reason = _disabled()
    if reason:
        with _lock:
            _state.update(attempted=True, reason=reason)
        return False
    if _state["loaded"]:
        return True
    from torch.utils import cpp_extension

    root = Path(build_root) if build_root is not None else _default_build_root()
    with_cuda, why_cuda = _cuda_buildable()
    name = _build_name(with_cuda)
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    flags = ["-O3"]
    cuda_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    try:
        cpp_extension.load(
            name=name,
            sources=[str(path) for path in _sources(with_cuda)],
            extra_cflags=flags + (["-DTIERKV_WITH_CUDA"] if with_cuda else []),
            extra_cuda_cflags=cuda_flags + ["-DTIERKV_WITH_CUDA"],
            extra_include_paths=[str(source_dir())],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as exc:  # a missing compiler or a build error: keep working from the reference
        with _lock:
            _state.update(attempted=True, loaded=False, reason=f"build failed: {exc}")
        logger.warning("building the tierkv extension failed, using the reference: %s", exc)
        return False
    with _lock:
        _state.update(attempted=True, loaded=True, cuda=with_cuda, path=str(_library_path(root, name)), reason="loaded")
        if not with_cuda:
            _state["cuda_reason"] = why_cuda
    return True


def extension_status() -> dict[str, Any]:
    """What was loaded and why not: for ``tierkv info`` and bug reports."""
    if not _state["attempted"]:
        _try_load_prebuilt()
    with_cuda, why_cuda = _cuda_buildable()
    reason = "disabled by TIERKV_NO_EXT" if _env_disabled() else _state["reason"] if not _state["loaded"] else "loaded"
    return {
        "loaded": bool(_state["loaded"]),
        "in_use": bool(_state["loaded"]) and not _env_disabled(),
        "cpu_kernels": bool(_state["loaded"]),
        "cuda_kernels": bool(_state["loaded"] and _state["cuda"]),
        "reason": reason,
        "cuda_reason": "built with CUDA kernels" if _state["cuda"] else why_cuda,
        "library": _state["path"],
        "sources": str(source_dir()),
    }


def _main(argv: Sequence[str]) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m tierkv.ops", description="build or inspect the tierkv extension")
    parser.add_argument("command", choices=("build", "status"))
    parser.add_argument("--build-dir", default=None, help="cache directory (default $TORCH_EXTENSIONS_DIR)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "build":
        build_extension(args.build_dir, verbose=args.verbose)
    elif args.build_dir:
        _try_load_prebuilt(Path(args.build_dir))
    print(json.dumps(extension_status(), indent=2))
    return 0 if args.command == "status" or _state["loaded"] else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
