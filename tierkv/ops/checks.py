"""Argument checks and layout parsing shared by the public ops and their references: every
bad argument is a clear TypeError/ValueError/IndexError before any kernel or reference runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Tensor = torch.Tensor
# Per layer: a (K, V) pair of [num_blocks, block_size, heads, head_size], or one fused
# [2, num_blocks, block_size, heads, head_size] tensor.
PagedKVCache = Sequence[Tensor | Sequence[Tensor]]

_ORDERS = ("vllm", "huggingface")


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
