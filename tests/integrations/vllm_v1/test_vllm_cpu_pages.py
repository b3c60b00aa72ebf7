"""The page orders of vLLM's CPU ISAs (tierkv/integrations/vllm_v1/cpu_pages.py) and the
mapped copy kernel that moves tokens through them.

The orders vLLM's op can write on an x86 CPU (vec, amx, fp8) are checked against that op in
tests/integrations/vllm_v1/test_vllm_layouts.py; the ones it cannot (neon's BFMMLA order) are checked here against
their formula: every page element is addressed exactly once, and the kernel moves each token
where the formula says, in both directions, for 1-, 2- and 4-byte elements.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_vllm_layouts import copy_path  # noqa: F401  (the fixture: every copy through both paths)

from tierkv import ops
from tierkv.integrations.vllm_v1.cpu_pages import (
    PAGE_ORDERS,
    MappedPageConnector,
    layouts_for_isa,
    page_map,
)
from tierkv.integrations.vllm_v1.layouts import slot_mapping

HEADS, LAYERS = 2, 3
MAPPED = ("cpu_amx", "cpu_bfmmla")


def full_offsets(layout: str, block_size: int, head_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (token, dim) element offsets of K and V, expanded from the map's runs."""
    found = page_map(layout, block_size, head_size)
    key = (found.key[..., None] + np.arange(found.key_unit)).reshape(block_size, head_size)
    value = (found.value[..., None] + np.arange(found.value_unit)).reshape(block_size, head_size)
    return key, value


@pytest.mark.parametrize("layout", sorted(PAGE_ORDERS))
@pytest.mark.parametrize(("block_size", "head_size"), [(32, 64), (128, 128), (64, 256)])
def test_every_page_element_is_one_token_dimension(layout: str, block_size: int, head_size: int) -> None:
    key, value = full_offsets(layout, block_size, head_size)
    together = np.sort(np.concatenate([key.ravel(), value.ravel()]))
    assert np.array_equal(together, np.arange(2 * block_size * head_size)), "not a permutation of the page"
    assert key.max() < block_size * head_size <= value.min(), "K in the first half of the page, V in the second"


def test_runs_are_as_wide_as_the_order_allows() -> None:
    """amx K keeps dimension pairs together (4-byte moves for bf16), V single elements; vec V
    is a whole row (one memcpy); BFMMLA K keeps 4 dimensions, V 1."""
    amx, vec, bfmmla = page_map("cpu_amx", 128, 128), page_map("cpu", 128, 128), page_map("cpu_bfmmla", 128, 128)
    assert (amx.key_unit, amx.value_unit) == (2, 1)
    assert (vec.key_unit, vec.value_unit) == (1, 128)
    assert (bfmmla.key_unit, bfmmla.value_unit) == (4, 1)


def test_bfmmla_formula_spot_values() -> None:
    """From vLLM's cpu_attn_neon_bfmmla.hpp: K groups 8 tokens x 4 dims (32 elements per dim
    quad), V pairs of dims over runs of 4 tokens."""
    key, value = full_offsets("cpu_bfmmla", 32, 64)
    base = 32 * 64
    assert [key[0, 0], key[0, 3], key[1, 0], key[7, 3], key[0, 4], key[8, 0]] == [0, 3, 4, 31, 32, 8 * 64]
    assert [value[0, 0] - base, value[3, 0] - base, value[0, 1] - base, value[4, 0] - base,
            value[0, 2] - base] == [0, 3, 4, 8, 64]


def test_unknown_isa_and_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="ISA 'sve9' is not one tierkv knows"):
        layouts_for_isa("sve9")
    with pytest.raises(ValueError, match="multiple of 32"):
        page_map("cpu_amx", 16, 64)
    assert layouts_for_isa("neon", torch.bfloat16) == ("cpu_bfmmla", "cpu")
    assert layouts_for_isa("neon", torch.float16) == ("cpu",)


def zeroed_at(shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
    """A zeroed tensor ``offset`` elements into its storage (an odd offset: pages off the
    16-byte alignment the amx kernel's streamed stores need)."""
    return torch.zeros(int(np.prod(shape)) + offset, dtype=dtype)[offset:].view(shape)


@pytest.mark.parametrize("layout", MAPPED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.usefixtures("copy_path")
def test_mapped_copy_puts_each_token_where_the_formula_says(layout: str, dtype: torch.dtype, offset: int) -> None:
    """Gather from pages filled by the formula (each element's value names its token and
    dimension), scatter back into a zeroed cache: byte for byte, -1 slots untouched."""
    block_size, head_size, blocks, tokens = 32, 64, 5, 70
    key_at, value_at = full_offsets(layout, block_size, head_size)
    generator = torch.Generator().manual_seed(7)
    truth = torch.randint(0, 120, (LAYERS, 2, blocks * block_size, HEADS, head_size), generator=generator).to(dtype)
    shape = (blocks, HEADS, block_size, 2 * head_size)
    layers = [zeroed_at(shape, dtype, offset) for _ in range(LAYERS)]
    for index, layer in enumerate(layers):
        pages = layer.view(blocks, HEADS, -1)
        for block in range(blocks):
            for part, offsets in enumerate((key_at, value_at)):
                rows = truth[index, part, block * block_size:(block + 1) * block_size]  # [tokens, heads, dims]
                pages[block][:, torch.from_numpy(offsets.ravel())] = rows.permute(1, 0, 2).reshape(HEADS, -1)
    slots = torch.as_tensor(slot_mapping([3, 0, 4], block_size, tokens, first=2, last=66))
    slots[40:44] = torch.tensor([33, 34, -1, 100])
    connector = MappedPageConnector(layers, layout, HEADS, head_size, block_size)
    got = torch.zeros(LAYERS, 2, tokens, HEADS, head_size, dtype=dtype)
    connector.from_gpu(got, 0, tokens, slot_mapping=slots)
    valid = slots >= 0
    assert torch.equal(got[:, :, valid], truth[:, :, slots[valid]])
    assert int(got[:, :, ~valid].count_nonzero()) == 0
    fresh = [zeroed_at(shape, dtype, offset) for _ in layers]
    MappedPageConnector(fresh, layout, HEADS, head_size, block_size).to_gpu(got, 0, tokens, slot_mapping=slots)
    for theirs, ours in zip(layers, fresh):
        touched = torch.zeros(blocks * block_size, dtype=torch.bool)
        touched[slots[valid]] = True
        for slot in range(blocks * block_size):
            block, offset = divmod(slot, block_size)
            for offsets in (key_at, value_at):
                where = torch.from_numpy(offsets[offset])
                want = theirs.view(blocks, HEADS, -1)[block][:, where] if touched[slot] else 0
                assert torch.equal(ours.view(blocks, HEADS, -1)[block][:, where],
                                   want if isinstance(want, torch.Tensor) else torch.zeros_like(
                                       ours.view(blocks, HEADS, -1)[block][:, where]))


def test_mapped_copy_rejects_a_chunk_of_the_wrong_shape() -> None:
    layers = [torch.zeros(2, HEADS, 32, 128, dtype=torch.bfloat16)]
    found = page_map("cpu_amx", 32, 64)
    with pytest.raises(ValueError, match="chunk must be a contiguous"):
        ops.paged_copy_mapped(layers, torch.from_numpy(found.key), torch.from_numpy(found.value), found.key_unit,
                              found.value_unit, 32, torch.zeros(4, dtype=torch.int64),
                              torch.zeros(1, 2, 5, HEADS, 32, dtype=torch.bfloat16), gather=True)
