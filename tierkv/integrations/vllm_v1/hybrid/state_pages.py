"""The recurrent states of a Mamba / linear-attention KV group as chunks: one state per chunk
boundary, every layer of the group in one chunk.

vLLM hands a Mamba layer's cache to a connector as raw pages, one per block (int8; a layer's
conv and SSM / recurrent state tensors packed in the page, which is padded to the attention
page). In its "align" mode the block at position ``(n - 1) // block_size`` of a request's
table holds the state after ``n`` tokens once the step that computed them has run. A chunk of
this group is the content bytes of that page for each layer of the group, shaped
``(layers, 1, 1, 1, page_bytes)`` so it travels through the engine's ``vllm`` chunk format like
any other (one "token": a state does not grow with the tokens it summarises).

A store names, per chunk end, the block holding the state there (``state_blocks``); a load
names the block to write the state into. Copies are plain byte copies of whole pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tierkv.connectors.gpu import GPUConnector


def content_bytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> int:
    """Bytes of one layer's state in a page: its tensors packed one after another."""
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        count = 1
        for dim in shape:
            count *= int(dim)
        total += count * torch.empty((), dtype=getattr(torch, str(dtype).removeprefix("torch."))).element_size()
    return total


class StatePageConnector(GPUConnector):
    """Moves the states of one Mamba group between vLLM's pages and chunks (see the module
    docstring). ``layers``: each layer's page tensor (``[num_blocks, ...]``, any dtype; a block's
    first ``page_bytes`` bytes are its state)."""

    def __init__(self, layers: Sequence[torch.Tensor], page_bytes: int) -> None:
        super().__init__(num_layers=len(layers), num_kv_heads=1, head_size=page_bytes)
        self.page_bytes = page_bytes
        self.pages = [_byte_pages(layer, page_bytes) for layer in layers]
        self.views = self.pages  # what the worker passes as ``kvcaches``

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size((self.num_layers, 1, 1, 1, self.page_bytes))

    def dtype_of(self, **kwargs: Any) -> torch.dtype:
        return torch.int8

    def _chunk_rows(self, memory_obj: Any, start: int, end: int) -> torch.Tensor:
        return self._blob(memory_obj, start, end).view(self.num_layers, self.page_bytes)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """The state after ``end`` tokens (in block ``state_blocks[end]``) into the chunk."""
        block = _block(kwargs, end)
        rows = self._chunk_rows(memory_obj, start, end)
        for row, pages in zip(rows, self.pages):
            _words(row).copy_(_words(pages[block]))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """The chunk's state into block ``state_blocks[end]``."""
        block = _block(kwargs, end)
        rows = self._chunk_rows(memory_obj, start, end)
        for row, pages in zip(rows, self.pages):
            _words(pages[block]).copy_(_words(row))


def _block(kwargs: dict[str, Any], end: int) -> int:
    blocks = kwargs.get("state_blocks") or {}
    block = blocks.get(end)
    if block is None or block <= 0:
        raise ValueError(f"no state block for the chunk ending at token {end} (known: {sorted(blocks)})")
    return int(block)


def _byte_pages(layer: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """``layer`` as ``[num_blocks, page_bytes]`` int8 over the same memory (the page stride kept)."""
    if layer.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"a Mamba page tensor of dtype {layer.dtype}: expected vLLM's raw int8 pages")
    if layer[0].numel() < page_bytes:
        raise ValueError(f"a page holds {layer[0].numel()} bytes, fewer than the state's {page_bytes}")
    return torch.as_strided(layer.view(torch.int8), (layer.shape[0], page_bytes), (layer.stride(0), 1))


def _words(row: torch.Tensor) -> torch.Tensor:
    """A contiguous byte row as 4-byte words where it divides (1-byte copies are several times slower)."""
    return row.view(torch.int32) if row.numel() % 4 == 0 and row.data_ptr() % 4 == 0 else row
