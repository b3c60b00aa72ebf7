"""Who is caching: :class:`EngineMetadata`, the parts of every key that keep models and
shards apart, and the optional KV shape that lets a fresh process size chunks before it has
seen one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.config import EngineConfig

KVShape = tuple[int, int, int, torch.dtype]
"""``(num_layers, num_kv_heads, head_size, dtype)`` of the KV a worker caches."""


@dataclass(frozen=True)
class EngineMetadata:
    """Who is caching: the parts of every key that keep models and shards apart.

    ``kv_shape`` (optional, not part of any key): ``(num_layers, num_kv_heads, head_size,
    dtype)`` of this worker's KV. Given, a fresh process knows the size of a chunk before it
    has seen one: the first lookup plans by cost and a deadline bounds the first retrieve.
    Not given, it is learned from the first chunk stored, or read in the background from the
    first chunk a lookup finds.
    """

    model_name: str
    world_size: int = 1
    worker_id: int = 0
    fmt: str = "vllm"
    kv_shape: KVShape | None = None

    def __post_init__(self) -> None:
        if self.kv_shape is None:
            return
        shape = self.kv_shape
        dims_ok = (isinstance(shape, tuple) and len(shape) == 4
                   and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape[:3]))
        if not dims_ok or not isinstance(shape[3], torch.dtype):
            raise ValueError("kv_shape: expected (num_layers, num_kv_heads, head_size, dtype) with three positive "
                             f"ints and a torch.dtype, got {shape!r}")

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineMetadata:
        """The metadata an engine built from ``config`` alone uses (its model, rank, format)."""
        return cls(config.model, config.world_size, config.worker_id, config.kv_format)

    def blob_layout(self) -> tuple[tuple[int, ...], torch.dtype] | None:
        """(blob shape with 0 tokens, dtype) of this worker's chunks, from ``kv_shape``."""
        if self.kv_shape is None:
            return None
        layers, heads, head_size, dtype = self.kv_shape
        shape = (layers, 2, 0, heads, head_size) if self.fmt == "vllm" else (layers, 2, heads, 0, head_size)
        return shape, dtype
