"""Where a prompt's chunks come from on a store and go to on a retrieve, without a
prompt-sized intermediate.

A store reads the caller's KV through a ``ChunkSource``; a retrieve writes it through
a ``ChunkSink``. Both speak in token ranges ``[start, end)`` of the *stored* tokens
(the same coordinates the chunk keys use). A blob gives zero-copy views of each chunk, so
a tier copies straight out of, or into, the caller's memory; a tuple of separately
allocated per-layer tensors cannot be viewed as one chunk, so its chunks are copied piece
by piece into, or out of, a chunk buffer (the tier's own slab where there is one). The
connectors (``tierkv.connectors``) supply sources and sinks over a paged cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tierkv.chunks import kvlayout
from tierkv.chunks.memory import copy_into


class ChunkSource(Protocol):
    """The KV of a run of stored tokens, for a store."""

    dtype: torch.dtype
    device: torch.device
    num_tokens: int

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of the chunk holding ``num_tokens`` tokens."""

    def view(self, start: int, end: int) -> torch.Tensor | None:
        """The chunk for tokens ``[start, end)`` as a zero-copy tensor, or None if there is none."""

    def write_into(self, dest: torch.Tensor, start: int, end: int) -> None:
        """Copy tokens ``[start, end)`` into the chunk tensor ``dest``."""


class ChunkSink(Protocol):
    """Where the KV of a run of stored tokens goes, for a retrieve."""

    dtype: torch.dtype

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of the chunk holding ``num_tokens`` tokens."""

    def destination(self, start: int, end: int) -> torch.Tensor | None:
        """A tensor a tier may write the chunk for ``[start, end)`` straight into, or None."""

    def read_from(self, chunk: torch.Tensor, start: int, end: int) -> None:
        """Copy a whole chunk (tokens ``[start, end)``) into place."""


def write_all(source: ChunkSource, work: list[tuple[torch.Tensor, int, int]]) -> None:
    """Fill each ``(dest, start, end)`` from ``source``, returning once all are filled. A source
    that can queue its copies and wait once (a GPU connector: ``write_many``) does, so the
    host's per-chunk work overlaps the device's copies instead of waiting for each."""
    many = getattr(source, "write_many", None)
    if many is not None:
        many(work)
        return
    for dest, start, end in work:
        source.write_into(dest, start, end)


def read_all(sink: ChunkSink, work: list[tuple[torch.Tensor, int, int]]) -> None:
    """Copy each ``(chunk, start, end)`` into ``sink``, returning once every chunk was read (so
    the caller may release it); through ``read_many`` where the sink has it (see ``write_all``)."""
    many = getattr(sink, "read_many", None)
    if many is not None:
        many(work)
        return
    for chunk, start, end in work:
        sink.read_from(chunk, start, end)


def _with_tokens(shape: Sequence[int], dim: int, num_tokens: int) -> tuple[int, ...]:
    return (*shape[:dim], num_tokens, *shape[dim + 1 :])


class BlobSource:
    """A KV blob (token dimension ``dim``) covering stored tokens from ``offset`` on."""

    def __init__(self, blob: torch.Tensor, dim: int, offset: int) -> None:
        self.blob = blob
        self.dim = dim
        self.offset = offset
        self.dtype = blob.dtype
        self.device = blob.device
        self.num_tokens = int(blob.shape[dim])

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return _with_tokens(self.blob.shape, self.dim, num_tokens)

    def view(self, start: int, end: int) -> torch.Tensor:
        return self.blob.narrow(self.dim, start - self.offset, end - start)

    def write_into(self, dest: torch.Tensor, start: int, end: int) -> None:
        copy_into(dest, self.view(start, end))


class BlobSink:
    """A KV blob (token dimension ``dim``) receiving stored tokens from ``offset`` on; tokens
    before ``offset`` in a chunk (an unaligned retrieve mask) are dropped."""

    def __init__(self, blob: torch.Tensor, dim: int, offset: int) -> None:
        self.blob = blob
        self.dim = dim
        self.offset = offset
        self.dtype = blob.dtype

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return _with_tokens(self.blob.shape, self.dim, num_tokens)

    def destination(self, start: int, end: int) -> torch.Tensor | None:
        if start < self.offset:
            return None  # only part of this chunk is wanted: read it whole elsewhere first
        return self.blob.narrow(self.dim, start - self.offset, end - start)

    def read_from(self, chunk: torch.Tensor, start: int, end: int) -> None:
        skip = max(0, self.offset - start)
        copy_into(self.blob.narrow(self.dim, start + skip - self.offset, end - start - skip),
                  chunk.narrow(self.dim, skip, end - start - skip))


class TupleSink:
    """Per-layer ``(K, V)`` tensors (separate allocations; the blob's token dimension ``dim``)
    receiving stored tokens from ``offset`` on."""

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], dim: int, offset: int) -> None:
        self.layers = layers
        self.dim = dim
        self.offset = offset
        self.layer_dim = dim - 2
        self.dtype = layers[0][0].dtype

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return _with_tokens((len(self.layers), 2, *self.layers[0][0].shape), self.dim, num_tokens)

    def narrowed(self, num_tokens: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The caller's tensors cut to the first ``num_tokens`` tokens (what a retrieve returns)."""
        return tuple((k.narrow(self.layer_dim, 0, num_tokens), v.narrow(self.layer_dim, 0, num_tokens))
                     for k, v in self.layers)

    def destination(self, start: int, end: int) -> torch.Tensor | None:
        return None

    def read_from(self, chunk: torch.Tensor, start: int, end: int) -> None:
        skip = max(0, self.offset - start)
        count = end - start - skip
        for index, pair in enumerate(self.layers):
            for kv, tensor in enumerate(pair):
                copy_into(tensor.narrow(self.layer_dim, start + skip - self.offset, count),
                          chunk[index, kv].narrow(self.layer_dim, skip, count))


class TupleSource:
    """Per-layer ``(K, V)`` tensors (separate allocations; the blob's token dimension ``dim``)
    covering stored tokens from ``offset`` on."""

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], dim: int, offset: int) -> None:
        self.layers = layers
        self.dim = dim
        self.offset = offset
        self.layer_dim = dim - 2
        first = layers[0][0]
        self.dtype = first.dtype
        self.device = first.device
        self.num_tokens = int(first.shape[self.layer_dim])

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return _with_tokens((len(self.layers), 2, *self.layers[0][0].shape), self.dim, num_tokens)

    def view(self, start: int, end: int) -> torch.Tensor | None:
        return None

    def write_into(self, dest: torch.Tensor, start: int, end: int) -> None:
        for index, pair in enumerate(self.layers):
            for kv, tensor in enumerate(pair):
                copy_into(dest[index, kv], tensor.narrow(self.layer_dim, start - self.offset, end - start))


def source_for(kv: kvlayout.KVCache, fmt: str, offset: int) -> BlobSource | TupleSource:
    """A source over the caller's KV (a blob, or per-layer pairs viewed as one blob when they
    share one storage with regular strides), after validating its layout."""
    caller = kvlayout.caller_kv(kv, fmt)
    if caller.blob is not None:
        return BlobSource(caller.blob, caller.token_dim, offset)
    assert caller.layers is not None
    return TupleSource(caller.layers, caller.token_dim, offset)


def sink_for(out: kvlayout.KVCache, fmt: str, offset: int, num_tokens: int,
             layout: tuple[tuple[int, ...], torch.dtype] | None, dtype: torch.dtype | None
             ) -> BlobSink | TupleSink:
    """A sink over the caller's ``out``, checked before anything is read
    (``tierkv.chunks.kvlayout.check_out`` says what ``out`` must be)."""
    caller = kvlayout.caller_kv(out, fmt, name="out")
    kvlayout.check_out(caller, fmt, num_tokens, layout, dtype)
    if caller.blob is not None:
        return BlobSink(caller.blob, caller.token_dim, offset)
    assert caller.layers is not None
    return TupleSink(caller.layers, caller.token_dim, offset)


def chunk_ranges(first: int, end: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk from the chunk-aligned ``first`` token up to ``end``."""
    return [(start, min(start + chunk_size, end)) for start in range(first, end, chunk_size)]
