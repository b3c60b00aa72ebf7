"""Pure-torch implementations of every op: what runs when the extension is not loaded, and
the oracle the C++ and CUDA kernels are tested against (``index_select`` / ``index_copy_`` and
float32 math; gathers and scatters move raw bytes, so every dtype is bit-exact)."""

from __future__ import annotations

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


def kv_deviation_reference(retrieved_k: Tensor, fresh_k: Tensor) -> Tensor:
    """Reference for ``kv_deviation``."""
    _check_kv_deviation(retrieved_k, fresh_k)
    diff = retrieved_k.to(torch.float32) - fresh_k.to(torch.float32)
    return diff.square().sum(dim=(1, 2))


def blend_scatter_reference(dst: Tensor, src: Tensor, indices: Tensor) -> Tensor:
    """Reference for ``blend_scatter``."""
    _check_blend_scatter(dst, src, indices)
    _as_raw(dst).index_copy_(0, indices, _as_raw(src))  # float8 as raw bytes
    return dst


def rope_rerotate_reference(
    k: Tensor, old_positions: Tensor, new_positions: Tensor, cos_sin_cache: Tensor, is_neox: bool = True
) -> Tensor:
    """Reference for ``rope_rerotate``."""
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
    """Reference for ``paged_gather`` (``index_select`` per layer)."""
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
    """Reference for ``paged_scatter`` (``index_copy_`` per layer)."""
    keys, values = split_paged_cache(kv_caches)
    _check_paged(keys, chunk, slot_mapping, order, "chunk")
    positions, slots = _valid(slot_mapping)
    raw_chunk = _as_raw(chunk)
    for layer, pair in enumerate(zip(keys, values)):
        for kv, cache in enumerate(pair):
            source = raw_chunk[layer, kv]
            rows = source.index_select(0, positions) if order == "vllm" else source.index_select(1, positions).transpose(0, 1)
            _write_slots(_as_raw(cache), slots, rows)


def paged_copy_strided_reference(views: list[tuple[Tensor, Tensor]], slot_mapping: Tensor, chunk: Tensor,
                                 gather: bool) -> None:
    """Reference for ``paged_copy_strided`` (advanced indexing on the strided views)."""
    slots = slot_mapping.to(torch.int64)
    valid = torch.nonzero(slots >= 0).flatten()
    if valid.numel() == 0:
        return
    block_size = views[0][0].shape[1]
    blocks, offsets = slots[valid] // block_size, slots[valid] % block_size
    for layer, pair in enumerate(views):
        for part, cache in enumerate(pair):
            if gather:
                chunk[layer, part, valid] = cache[blocks, offsets]
            else:
                cache[blocks, offsets] = chunk[layer, part, valid]


def paged_copy_mapped_reference(layers: list[Tensor], key_map: Tensor, value_map: Tensor, key_unit: int,
                                value_unit: int, block_size: int, slot_mapping: Tensor, chunk: Tensor,
                                gather: bool) -> None:
    """Reference for ``paged_copy_mapped`` (element indices built from the maps, then
    ``take`` / ``index_put_`` on each layer's storage)."""
    slots = slot_mapping.to(torch.int64)
    valid = torch.nonzero(slots >= 0).flatten()
    if valid.numel() == 0:
        return
    blocks, offsets = slots[valid] // block_size, slots[valid] % block_size
    heads = layers[0].shape[1]
    for index, layer in enumerate(layers):
        page_starts = (blocks * layer.stride(0))[:, None] + (torch.arange(heads) * layer.stride(1))[None, :]
        span = int((layer.shape[0] - 1) * layer.stride(0) + (heads - 1) * layer.stride(1) + layer[0, 0].numel())
        flat = layer.as_strided((span,), (1,), layer.storage_offset())
        for part, (table, unit) in enumerate(((key_map, key_unit), (value_map, value_unit))):
            within = (table.to(torch.int64)[offsets][..., None] + torch.arange(unit)).flatten(1)  # [tokens, head_size]
            where = page_starts[..., None] + within[:, None, :]  # [tokens, heads, head_size]
            if gather:
                chunk[index, part, valid] = flat[where]
            else:
                flat[where] = chunk[index, part, valid]
