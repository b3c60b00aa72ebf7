"""Byte copies between a contiguous chunk and the (layer, K/V) runs of a token slice: what
every byte-level tier reads into and writes from (``tierkv.memory.scatter_bytes`` and
``gather_bytes``), for runs below and above the size numpy copies without the GIL."""

from __future__ import annotations

import pytest
import torch

from tierkv.memory import byte_runs, gather_bytes, scatter_bytes


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
