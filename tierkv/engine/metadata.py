"""Who is caching: ``EngineMetadata``, the parts of every key that keep models,
revisions and shards apart, and the optional KV shape that lets a fresh process size chunks
before it has seen one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.backend.options import format_size
from tierkv.config.loader import EngineConfig
from tierkv.errors import ConfigError

KVShape = tuple[int, int, int, torch.dtype]
"""``(num_layers, num_kv_heads, head_size, dtype)`` of the KV a worker caches."""


@dataclass(frozen=True)
class EngineMetadata:
    """Who is caching: the parts of every key that keep models, revisions and shards apart.

    Given to [Engine][tierkv.Engine] by serving-engine integrations; without it an engine
    uses ``from_config``.

    Attributes:
        model_name: The model's name; part of every key.
        world_size: How many workers share the model; part of every key.
        worker_id: This worker's rank; part of every key.
        fmt: The KV layout, ``"vllm"`` or ``"huggingface"``.
        kv_shape: ``(num_layers, num_kv_heads, head_size, dtype)`` of this worker's KV, a
            sizing hint and not part of any key. Given, a fresh process knows the size of a
            chunk before it has seen one (the first lookup plans by cost and a deadline
            bounds the first retrieve). Not given, it is learned from the first chunk
            stored, or read in the background from the first chunk a lookup finds.
            Processes that share a cache may give it or not; to make the geometry part of
            every key, put it in ``identity`` (``geometry_part``: the integrations do).
        model_revision: What tells this model's weights from another revision under the
            same name (a digest of its files, ``tierkv.chunks.revisions.directory_revision``,
            or a commit id); part of every key, so a re-trained checkpoint never reads the
            old one's KV.
        kv_cache_dtype: The serving engine's KV cache dtype when it is not the model's (e.g.
            vLLM's ``fp8_e4m3``); part of every key.
        identity: Further ``(name, value)`` pairs the engine's KV depends on (a
            quantization, a serving engine's version), in every key.

    Raises:
        ValueError: if ``model_revision`` or ``kv_cache_dtype`` is neither a string nor
            None, ``identity`` is not a tuple of string pairs, or ``kv_shape`` is not three
            positive ints and a ``torch.dtype``.
    """

    model_name: str
    world_size: int = 1
    worker_id: int = 0
    fmt: str = "vllm"
    kv_shape: KVShape | None = None
    model_revision: str | None = None
    kv_cache_dtype: str | None = None
    identity: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("model_revision", "kv_cache_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: expected a string or None, got {value!r}")
        pairs = self.identity
        if not isinstance(pairs, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(p, str) for p in pair) for pair in pairs):
            raise ValueError(f"identity: expected a tuple of (name, value) string pairs, got {pairs!r}")
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
        """The metadata an engine built from ``config`` alone uses.

        Args:
            config: A validated configuration.

        Returns:
            Its model, revision, world size, worker id and KV format; no KV shape.
        """
        return cls(config.model, config.world_size, config.worker_id, config.kv_format,
                   model_revision=config.model_revision)

    def identity_parts(self) -> tuple[tuple[str, str], ...]:
        """What this engine's chunks' KV depends on beyond the model name, world size and worker id.

        Those three are fields of every key; these parts seed every chunk hash
        (``tierkv.chunks.identity``).

        Returns:
            ``(name, value)`` pairs: the KV format, then the model revision and the KV cache
                dtype when given, then ``identity``.
        """
        parts: list[tuple[str, str]] = [("fmt", self.fmt)]
        if self.model_revision:
            parts.append(("revision", self.model_revision))
        if self.kv_cache_dtype:
            parts.append(("kv_cache_dtype", self.kv_cache_dtype))
        parts.extend(self.identity)
        return tuple(parts)

    def blob_layout(self) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The layout of this worker's chunks, from ``kv_shape``.

        Returns:
            The blob shape with 0 tokens and the dtype, or None without ``kv_shape``.
        """
        if self.kv_shape is None:
            return None
        layers, heads, head_size, dtype = self.kv_shape
        shape = (layers, 2, 0, heads, head_size) if self.fmt == "vllm" else (layers, 2, heads, 0, head_size)
        return shape, dtype


def geometry_part(kv_shape: KVShape) -> tuple[str, str]:
    """The ``("geometry", "LxHxD:dtype")`` identity pair of a KV shape: in ``identity``, a
    cache of another geometry or dtype is a miss."""
    layers, heads, head_size, dtype = kv_shape
    return ("geometry", f"{layers}x{heads}x{head_size}:{str(dtype).removeprefix('torch.')}")


def check_capacities(config: EngineConfig, metadata: EngineMetadata) -> None:
    """ConfigError naming the tier when its capacity cannot hold one chunk of this worker's
    KV (known from ``kv_shape``): such a tier would start and then refuse every store."""
    if metadata.kv_shape is None:
        return
    layers, heads, head_size, dtype = metadata.kv_shape
    chunk_bytes = layers * 2 * config.chunk_size * heads * head_size * dtype.itemsize
    for tier in config.tiers:
        if tier.capacity is not None and tier.capacity < chunk_bytes:
            raise ConfigError(f"{tier.path}.capacity: {format_size(tier.capacity)} cannot hold one chunk of "
                              f"{config.chunk_size} tokens ({format_size(chunk_bytes)} of KV with {layers} layers, "
                              f"{heads} KV heads of {head_size}, {str(dtype).removeprefix('torch.')})")
