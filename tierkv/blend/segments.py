"""Segments: the KV of one document, stored so it is found wherever the document appears.

The engine's chunk keys are prefix-chained, so the KV of a document placed after a
different prefix never hits. For blending, each segment is stored on its own: its tokens
are hashed from the segment's first token, under the ``blend-segment`` key namespace (so a
segment never answers a prefix lookup, nor the other way round), chunked like any prompt.
The positions at which the KV was computed (RoPE is baked into K) are stored beside it,
under ``blend-positions``, and written *after* the chunks: a segment whose positions are
missing is treated as not cached. A chunk evicted on its own makes only its tokens invalid.

Usage::

    store_segments(engine, [doc_a_tokens, doc_b_tokens], [kv_a, kv_b])          # computed from position 0
    store_segments(engine, [doc_tokens], [kv], positions=[torch.arange(40, 90)])  # computed at 40..89

Each KV is in the engine's format (``engine.metadata.fmt``), a blob or a tuple of per-layer
(K, V), covering exactly that segment's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierkv.chunks import kvlayout
from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.chunks.keys import CacheKey, as_token_array
from tierkv.chunks.namespaces import in_namespace, namespaced_keys
from tierkv.engine.blocking import Engine

SEGMENT_NAMESPACE = "blend-segment"
POSITIONS_NAMESPACE = "blend-positions"


@dataclass
class SegmentKeys:
    """The keys of one segment: its chunks, and the record of its original positions."""

    num_tokens: int
    chunks: list[CacheKey]
    positions: CacheKey


def segment_keys(engine: Engine, tokens: torch.Tensor | Sequence[int],
                 identity: RequestIdentity = PLAIN) -> SegmentKeys:
    """Keys of a segment, hashed from its own first token (not from the prompt's), under
    ``identity`` (the adapter and salt of the requests that may reuse it; media offsets
    count from the segment's first token)."""
    token_array = as_token_array(tokens)
    if not len(token_array):
        raise ValueError("a segment must hold at least one token")
    prefix_keys = engine.keys_for(token_array, identity)
    return SegmentKeys(len(token_array), namespaced_keys(prefix_keys, SEGMENT_NAMESPACE),
                       in_namespace(prefix_keys[-1], POSITIONS_NAMESPACE))


def _as_positions(value: int | torch.Tensor | None, num_tokens: int, index: int) -> torch.Tensor:
    if value is None:
        value = 0
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"segment {index}: start position must be >= 0, got {value}")
        return torch.arange(value, value + num_tokens, dtype=torch.int64)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() != num_tokens:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"segment {index}: positions must be an int start or a 1-D tensor of {num_tokens} "
                         f"positions, got {shape}")
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"segment {index}: positions must be integers, got {value.dtype}")
    if value.numel() and int(value.min()) < 0:
        raise ValueError(f"segment {index}: positions must be >= 0")
    return value.detach().to("cpu", torch.int64).contiguous()


def store_segments(
    engine: Engine,
    segments_tokens: Sequence[torch.Tensor | Sequence[int]],
    kvs: Sequence[kvlayout.KVCache],
    positions: Sequence[int | torch.Tensor | None] | None = None,
    skip_existing: bool = True,
    identity: RequestIdentity = PLAIN,
) -> int:
    """Store each segment's KV as its own entry; returns the number of segments written.

    ``positions[i]`` is where segment ``i``'s KV was computed: an int start (contiguous
    positions from there), a 1-D tensor with one position per token, or None for 0. With
    ``skip_existing``, a segment whose chunks and positions are all cached is not rewritten;
    otherwise every chunk is rewritten, so chunks and positions always come from one store.
    ``identity``: the adapter and salt the segments are stored under (only requests of the
    same identity reuse them).
    """
    if len(segments_tokens) != len(kvs):
        raise ValueError(f"store_segments got {len(segments_tokens)} segments but {len(kvs)} KV caches")
    if positions is not None and len(positions) != len(segments_tokens):
        raise ValueError(f"store_segments got {len(segments_tokens)} segments but {len(positions)} positions")
    fmt = engine.metadata.fmt
    dim = kvlayout.token_dim(fmt)
    chunk_size = engine.config.chunk_size
    written = 0
    for index, (tokens, kv) in enumerate(zip(segments_tokens, kvs)):
        keys = segment_keys(engine, tokens, identity)
        blob = kvlayout.as_blob(kv, fmt)
        if blob.shape[dim] != keys.num_tokens:
            raise ValueError(f"segment {index}: KV holds {blob.shape[dim]} tokens (dim {dim} of {fmt} shape "
                             f"{tuple(blob.shape)}) but the segment has {keys.num_tokens} tokens")
        segment_positions = _as_positions(None if positions is None else positions[index], keys.num_tokens, index)
        if skip_existing and all(engine.batched_contains([*keys.chunks, keys.positions])):
            continue
        chunks = [blob.narrow(dim, start, min(chunk_size, keys.num_tokens - start))
                  for start in range(0, keys.num_tokens, chunk_size)]
        engine.batched_put(keys.chunks, chunks)
        engine.batched_put([keys.positions], [segment_positions])
        written += 1
    return written


@dataclass
class FetchedSegment:
    """A segment's cached KV as read back: per-chunk blobs (None where evicted) and positions."""

    num_tokens: int
    chunks: list[torch.Tensor | None]
    positions: torch.Tensor | None


def fetch_segments(engine: Engine, segments: Sequence[SegmentKeys]) -> list[FetchedSegment]:
    """Read every segment's chunks and positions in one batched get; damaged pieces become misses."""
    keys: list[CacheKey] = []
    for seg in segments:
        keys.extend([seg.positions, *seg.chunks])
    values = engine.batched_get(keys) if keys else []
    fmt = engine.metadata.fmt
    dim = kvlayout.token_dim(fmt)
    chunk_size = engine.config.chunk_size
    fetched: list[FetchedSegment] = []
    offset = 0
    for seg in segments:
        positions, *chunks = values[offset : offset + 1 + len(seg.chunks)]
        offset += 1 + len(seg.chunks)
        if positions is None or positions.dim() != 1 or positions.numel() != seg.num_tokens \
                or positions.dtype != torch.int64:
            fetched.append(FetchedSegment(seg.num_tokens, [None] * len(seg.chunks), None))
            continue
        checked: list[torch.Tensor | None] = []
        for number, chunk in enumerate(chunks):
            expected = min(chunk_size, seg.num_tokens - number * chunk_size)
            ok = chunk is not None and chunk.dim() == 5 and chunk.shape[1] == 2 and chunk.shape[dim] == expected
            checked.append(chunk if ok else None)
        fetched.append(FetchedSegment(seg.num_tokens, checked, positions))
    return fetched
