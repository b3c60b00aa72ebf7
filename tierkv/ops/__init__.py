"""Kernel entry points: the ``cuda_ext`` extension when it is built, a pure-torch reference otherwise.

Every public function here has one signature whatever runs underneath. The reference
implementations are plain torch (``index_select`` / ``index_copy_`` / float32 math); they are
used when the extension is not loaded and are the oracle the extension is tested against.
When the extension is loaded (see ``extension_status``), the same calls dispatch to
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
with ``python -m tierkv.ops build`` (or ``build_extension``); later processes load the
prebuilt library from the cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).
``TIERKV_NO_EXT=1`` forces the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.ops.checks import (
    PagedKVCache,
    Tensor,
    _check_blend_scatter,
    _check_kv_deviation,
    _check_paged,
    _check_rope,
    _chunk_shape,
    split_paged_cache,
)
from tierkv.ops.extension import _dispatch, build_extension, build_in_background, extension_status, source_dir
from tierkv.ops.reference import (
    blend_scatter_reference,
    kv_deviation_reference,
    paged_copy_mapped_reference,
    paged_copy_strided_reference,
    paged_gather_reference,
    paged_scatter_reference,
    rope_rerotate_reference,
)

__all__ = [
    "PagedKVCache", "blend_scatter", "blend_scatter_reference", "build_extension", "build_in_background",
    "extension_status",
    "kv_deviation", "kv_deviation_reference", "make_cos_sin_cache", "paged_copy_mapped",
    "paged_copy_mapped_reference", "paged_copy_strided", "paged_copy_strided_available",
    "paged_copy_strided_reference", "paged_gather", "paged_gather_reference",
    "paged_scatter", "paged_scatter_reference", "rope_rerotate", "rope_rerotate_reference", "source_dir",
    "split_paged_cache",
]


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
    ``make_cos_sin_cache``); only the first ``rot_dim`` dims of each head rotate.
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
    """Scatter a contiguous chunk into a paged cache (the reverse of ``paged_gather``).

    Token ``i`` of ``chunk`` goes to slot ``slot_mapping[i]`` of every layer's K and V; ``-1``
    slots are skipped. Layouts as in ``paged_gather``; the chunk must be on the cache's device.
    """
    keys, values = split_paged_cache(kv_caches)
    _check_paged(keys, chunk, slot_mapping, order, "chunk")
    if _dispatch(chunk) and _ext_paged_ok(keys, values, chunk):
        torch.ops.tierkv.paged_scatter(chunk, keys, values, slot_mapping, order == "huggingface")
        return
    paged_scatter_reference(chunk, tuple(zip(keys, values)), slot_mapping, order)


def paged_copy_strided_available(tensor: Tensor) -> bool:
    """Whether ``paged_copy_strided`` runs the extension's kernel for tensors like ``tensor``
    (a CPU tensor and the extension loaded); otherwise it runs the (slower) reference."""
    return tensor.device.type == "cpu" and _dispatch(tensor)


def paged_copy_strided(views: Sequence[tuple[Tensor, Tensor]], slot_mapping: Tensor, chunk: Tensor,
                       gather: bool) -> None:
    """Move tokens between per-layer K/V *views* of any strides and a contiguous ``vllm``-order chunk.

    ``views``: per layer ``(K, V)``, each ``[num_blocks, block_size, heads, head_size]`` with any
    strides (vLLM's CPU cache keeps K transposed per (block, head) page: head_size stride
    ``block_size``, token stride 1). ``chunk``: contiguous ``[layers, 2, tokens, heads, head_size]``.
    ``slot_mapping``: ``[tokens]`` int64, ``-1`` = skip. ``gather``: cache -> chunk, else chunk ->
    cache. The C++ kernel moves a transposed view in tiles (each cache line fetched once per
    tile, not once per token) and rows with a unit stride by memcpy; CPU only.
    """
    pairs = [(k, v) for k, v in views]
    if not pairs:
        raise ValueError("views must hold a (K, V) pair per layer, got none")
    shape = tuple(pairs[0][0].shape)
    if len(shape) != 4 or any(tuple(t.shape) != shape for pair in pairs for t in pair):
        raise ValueError(f"every K and V view must be [num_blocks, block_size, heads, head_size] like the first, "
                         f"got {[tuple(t.shape) for pair in pairs for t in pair]}")
    want = (len(pairs), 2, slot_mapping.numel(), shape[2], shape[3])
    if tuple(chunk.shape) != want or not chunk.is_contiguous() or chunk.dtype != pairs[0][0].dtype:
        raise ValueError(f"chunk must be a contiguous {pairs[0][0].dtype} tensor {want}, got "
                         f"{chunk.dtype} {tuple(chunk.shape)}")
    if paged_copy_strided_available(chunk) and all(t.device.type == "cpu" for pair in pairs for t in pair):
        slots = slot_mapping.to(torch.int64).contiguous()
        torch.ops.tierkv.paged_copy_strided([t for pair in pairs for t in pair], slots, chunk, gather)
        return
    paged_copy_strided_reference(pairs, slot_mapping, chunk, gather)


def paged_copy_mapped(layers: Sequence[Tensor], key_map: Tensor, value_map: Tensor, key_unit: int, value_unit: int,
                      block_size: int, slot_mapping: Tensor, chunk: Tensor, gather: bool) -> None:
    """Move tokens between paged caches whose pages have their own element order and a
    contiguous ``vllm``-order chunk (vLLM's ``amx`` CPU cache: tiles no strided view addresses).

    ``layers``: per layer ``[num_blocks, heads, ...]``, each (block, head) page contiguous.
    ``key_map`` / ``value_map``: int32 ``[block_size, head_size // unit]``, the page offset of
    each run of ``unit`` consecutive dimensions of a token's K / V (V's counted from the page
    start). ``chunk``: contiguous ``[layers, 2, tokens, heads, head_size]`` of the layers' dtype;
    ``slot_mapping``: ``[tokens]`` int64, ``-1`` = skip; ``gather``: cache -> chunk, else back.
    The C++ kernel moves each run as one element of ``unit`` times the width; CPU only.
    """
    if not layers:
        raise ValueError("layers must hold one paged cache tensor per layer, got none")
    first = layers[0]
    if any(layer.shape != first.shape or layer.stride() != first.stride() or layer.dtype != first.dtype
           for layer in layers):
        raise ValueError("every layer must have the first layer's shape, strides and dtype")
    page = first[0, 0]
    if first.dim() < 3 or not page.is_contiguous() or first.stride(1) < page.numel():
        raise ValueError(f"each (block, head) page must be contiguous, got shape {tuple(first.shape)} strides "
                         f"{first.stride()}")
    head_size = key_map.shape[1] * key_unit
    want = (len(layers), 2, slot_mapping.numel(), first.shape[1], head_size)
    if tuple(chunk.shape) != want or not chunk.is_contiguous() or chunk.dtype != first.dtype:
        raise ValueError(f"chunk must be a contiguous {first.dtype} tensor {want}, got {chunk.dtype} {tuple(chunk.shape)}")
    if (key_map.shape[0] != block_size or value_map.shape[0] != block_size
            or value_map.shape[1] * value_unit != head_size):
        raise ValueError(f"key_map and value_map must be [{block_size}, head_size // unit], got "
                         f"{tuple(key_map.shape)} and {tuple(value_map.shape)}")
    if paged_copy_strided_available(chunk) and all(layer.device.type == "cpu" for layer in layers):
        torch.ops.tierkv.paged_copy_mapped(list(layers), key_map.to(torch.int32).contiguous(),
                                           value_map.to(torch.int32).contiguous(), key_unit, value_unit, block_size,
                                           slot_mapping.to(torch.int64).contiguous(), chunk, gather)
        return
    paged_copy_mapped_reference(list(layers), key_map, value_map, key_unit, value_unit, block_size, slot_mapping,
                                chunk, gather)


def set_copy_threads(threads: int) -> None:
    """How many threads the extension's CPU kernels use when called from *this* thread.

    By default a thread is capped at the CPUs its affinity allows, so a tierkv thread kept on a
    serving engine's spare core does not start a full OpenMP team there. ``0`` lifts the cap: the
    kernels then use the calling thread's whole OpenMP team (vLLM's worker thread, whose team is
    pinned to the compute cores, serving a synchronous load). A no-op without the extension.
    """
    if threads < 0:
        raise ValueError(f"threads must be 0 (the calling thread's OpenMP team) or a positive count, got {threads}")
    if _dispatch(torch.empty(0)):
        torch.ops.tierkv.set_copy_threads(threads)


def copy_threads() -> int:
    """The threads the extension's CPU kernels use for a large copy called from this thread
    (1 without the extension: the reference runs torch ops, which use torch's own threads)."""
    if _dispatch(torch.empty(0)):
        return int(torch.ops.tierkv.copy_threads())
    return 1
