"""Byte copies between a contiguous chunk and the (layer, K/V) runs of a token slice: what
every byte-level tier reads into and writes from (``tierkv.chunks.memory.scatter_bytes`` and
``gather_bytes``), for runs below and above the size numpy copies without the GIL; and the
one torch copy of read-only bytes into a slice (``copy_from_bytes``, the trusted reads)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tierkv.chunks.memory import byte_runs, copy_from_bytes, gather_bytes, scatter_bytes


@pytest.mark.parametrize("tokens", [3, 300])  # runs of 6 KiB (memoryview copies) and 600 KiB (numpy's)
def test_scatter_and_gather_of_a_token_slice_round_trip(tokens: int) -> None:
    blob = torch.zeros(2, 2, 2 * tokens, 8, 128, dtype=torch.bfloat16)
    chunk = torch.randn(2, 2, tokens, 8, 128).to(torch.bfloat16)
    target = blob.narrow(2, tokens, tokens)  # the second half of each (layer, K/V) piece
    scatter_bytes(memoryview(chunk.view(torch.uint8).numpy()).cast("B"), byte_runs(target))
    assert torch.equal(target, chunk) and not blob.narrow(2, 0, tokens).any()
    packed = bytearray(chunk.numel() * chunk.element_size())
    gather_bytes(byte_runs(target), memoryview(packed))
    assert bytes(packed) == chunk.view(torch.uint8).numpy().tobytes()
    with pytest.raises(ValueError, match="scatter_bytes: 10 source bytes"):
        scatter_bytes(memoryview(bytes(10)), byte_runs(target))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32], ids=str)
def test_read_only_bytes_copied_into_a_token_slice(dtype: torch.dtype) -> None:
    chunk = (torch.randn(2, 2, 5, 3, 8) * 50).to(dtype)
    blob = torch.zeros(2, 2, 10, 3, 8, dtype=dtype)
    source = memoryview(chunk.view(torch.uint8).numpy().tobytes())  # read-only, like an LMDB value
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on tensors over read-only memory: none made here
        copy_from_bytes(blob.narrow(2, 5, 5), source)
    assert torch.equal(blob.narrow(2, 5, 5), chunk) and not blob.narrow(2, 0, 5).any()
    with pytest.raises(ValueError, match="copy_from_bytes: 7 source bytes"):
        copy_from_bytes(blob.narrow(2, 5, 5), memoryview(bytes(7)))
    assert torch.equal(blob.narrow(2, 5, 5), chunk)  # a wrong size leaves the destination as it was
