"""tierkv's ``mla`` layout (tierkv.integrations.vllm_v1.mla) against the kernels that write vLLM's
MLA latent caches, in this process (no vLLM engine).

Writers: vLLM's ``CPU_MLA`` backend's own ``do_kv_cache_update`` (plain torch, any CPU: a
``[num_blocks, 1, 16, 576]`` cache written row by row); vLLM's ``AMX_MLA`` op
``amx_mla_concat_and_cache`` (compiled only into vLLM's AVX512-BF16 build: skipped elsewhere,
naming why); and the CUDA backends' ``concat_and_cache_mla`` by its documented semantics
(``kv_cache[slot // block_size, slot % block_size] = concat(kv_c, k_pe)`` on ``[num_blocks,
block_size, 576]``: FlashMLA, FlashInfer, Triton and CUTLASS MLA), which cannot run on CPU.
vLLM 0.32 registers every MLA cache as ``[num_blocks, 1, block_size, 576]`` and its layer hands
the writer the squeezed view (``bind_kv_cache``): ``AMX_MLA``'s op refuses the 4D tensor, so
the registered shape is a case of its own.
For each: the registration self-check (``verify_layout``) passes, a latent written by the
writer reads back exactly through tierkv's views, token by token across blocks with the last
block partly filled, and tierkv's scatter of the same tokens leaves the cache as the writer
would; halves read in the wrong order are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_marks import needs_vllm, x86_flag

from tierkv.integrations.vllm_v1.layout_check import LayoutMismatchError, verify_layout
from tierkv.integrations.vllm_v1.layouts import connector_for, slot_mapping
from tierkv.integrations.vllm_v1.mla import MLA_LAYOUT, block_size_of, bound_view, chunk_head_size, write_latent

RANK, ROPE, LAYERS = 512, 64, 2
LATENT = RANK + ROPE

needs_vllm_amx_mla_kernel = pytest.mark.skipif(
    not (x86_flag("avx512") and x86_flag("avx512_bf16")),
    reason="AMX_MLA's cache write (concat_and_cache_mla_cpu) is only in vLLM's AVX512-BF16 build of its kernels "
           "(vllm._C); this CPU lacks AVX-512 or AVX512-BF16, so vLLM loads _C_AVX2 or _C_AVX512 (and picks "
           "CPU_MLA, tested here, on a CPU without AMX)")

# (kv_c [tokens, 512], k_pe [tokens, 1, 64], kv_cache, slot_mapping [tokens]) -> None
Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def cpu_mla_op() -> Op:
    """vLLM's CPU_MLA cache write, its own method (it uses nothing of its instance)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    def op(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, cache, slots, "auto", torch.ones(()))  # type: ignore[arg-type]

    return op


def amx_mla_op() -> Op:
    from vllm import _custom_ops as vllm_ops

    if not hasattr(torch.ops._C, "concat_and_cache_mla_cpu"):
        pytest.skip("vLLM's build of its kernels loaded here has no concat_and_cache_mla_cpu (AMX_MLA's cache write "
                    "is compiled only into its AVX512-BF16 build)")

    def op(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        vllm_ops.amx_mla_concat_and_cache(kv_c, k_pe.squeeze(1), cache, slots)

    return op


def cuda_semantics_op() -> Op:
    """``concat_and_cache_mla``'s documented semantics on ``[num_blocks, block_size, latent]``."""

    def op(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        block_size = cache.shape[1]
        for index, slot in enumerate(slots.tolist()):
            if slot >= 0:
                cache[slot // block_size, slot % block_size] = torch.cat([kv_c[index], k_pe[index, 0]])

    return op


def layer_writer(op: Op, layers: list[torch.Tensor], swap: bool = False) -> Callable[..., None]:
    """``verify_layout``'s writer over ``op`` (through tierkv's ``write_latent``, as the connector
    calls vLLM); ``swap``: hand vLLM the halves the wrong way round (a layout that must be refused)."""
    impl = SimpleNamespace(kv_lora_rank=RANK)

    def write(index: int, first: torch.Tensor, second: torch.Tensor, slots: torch.Tensor) -> None:
        impl.do_kv_cache_update = lambda kv_c, k_pe, cache, slot_mapping, dtype, scale: op(kv_c, k_pe, cache,
                                                                                           slot_mapping)
        if swap:
            first, second = second, first
        write_latent(impl, layers[index], first, second, slots)

    return write


CASES = [
    pytest.param("cpu_mla", (96, 1, 16, LATENT), marks=needs_vllm, id="CPU_MLA-16"),
    # as vLLM registers every MLA cache (its layer binds the squeezed view, which the writer takes)
    pytest.param("amx_mla", (24, 1, 128, LATENT), marks=[needs_vllm, needs_vllm_amx_mla_kernel],
                 id="AMX_MLA-128-registered"),
    pytest.param("amx_mla", (48, 32, LATENT), marks=[needs_vllm, needs_vllm_amx_mla_kernel], id="AMX_MLA-32"),
    pytest.param("cuda", (24, 1, 64, LATENT), id="FlashMLA-64-registered"),
    pytest.param("cuda", (24, 64, LATENT), id="FlashMLA-64"),
]
OPS: dict[str, Callable[[], Op]] = {"cpu_mla": cpu_mla_op, "amx_mla": amx_mla_op, "cuda": cuda_semantics_op}


@pytest.mark.parametrize(("writer", "shape"), CASES)
def test_the_self_check_passes_on_the_writers_cache(writer: str, shape: tuple[int, ...]) -> None:
    op = OPS[writer]()
    layers = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    block = block_size_of(layers[0], LATENT)
    connector = connector_for(layers, MLA_LAYOUT, 1, LATENT, block)
    assert (connector.num_kv_heads, connector.head_size) == (1, chunk_head_size(LATENT))
    verify_layout(layers, connector, layer_writer(op, layers), torch.bfloat16)
    with pytest.raises(LayoutMismatchError):
        verify_layout(layers, connector, layer_writer(op, layers, swap=True), torch.bfloat16)


@pytest.mark.parametrize(("writer", "shape"), CASES)
def test_a_prompt_reads_back_token_by_token_and_scatters_as_the_writer_wrote(writer: str,
                                                                           shape: tuple[int, ...]) -> None:
    """599 tokens over shuffled blocks (the last partly filled): what the writer put there is each
    token's latent, as two halves, in tierkv's chunk; scattered into other blocks, the same bytes."""
    op = OPS[writer]()
    generator = torch.Generator().manual_seed(1)
    theirs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ours = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    block = block_size_of(theirs[0], LATENT)
    tokens = 599 if shape[0] * block >= 2 * 599 + 2 * block else shape[0] * block // 2 - 1
    needed = -(-tokens // block)
    order = torch.randperm(shape[0], generator=generator).tolist()
    their_blocks, our_blocks = order[:needed], order[needed:2 * needed]
    latents = torch.randint(-8, 8, (LAYERS, tokens, LATENT), generator=generator).to(torch.bfloat16)
    slots = torch.as_tensor(slot_mapping(their_blocks, block, tokens))
    for layer, cache in enumerate(theirs):
        op(latents[layer, :, :RANK].contiguous(), latents[layer, :, RANK:].unsqueeze(1).contiguous(),
           bound_view(cache), slots)
    read = connector_for(theirs, MLA_LAYOUT, 1, LATENT, block)
    chunk = torch.empty(tuple(read.get_shape(tokens)), dtype=torch.bfloat16)
    read.from_gpu(chunk, 0, tokens, slot_mapping=slots.numpy())
    half = chunk_head_size(LATENT)
    assert torch.equal(chunk[:, 0, :, 0], latents[..., :half]) and torch.equal(chunk[:, 1, :, 0], latents[..., half:])
    connector_for(ours, MLA_LAYOUT, 1, LATENT, block).to_gpu(chunk, 0, tokens,
                                                             slot_mapping=slot_mapping(our_blocks, block, tokens))
    for mine, vllms in zip(ours, theirs):
        for our_block, their_block in zip(our_blocks, their_blocks):
            assert torch.equal(mine[our_block], vllms[their_block]), "a block tierkv filled differs from vLLM's"


def test_an_mla_cache_of_another_shape_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="layout 'mla' expects"):
        connector_for([torch.zeros(8, 2, 16, LATENT)], MLA_LAYOUT, 1, LATENT, 16)
    with pytest.raises(ValueError, match="MLA latent of 577"):
        chunk_head_size(577)
    odd = torch.zeros(8, 16, LATENT)[..., ::2]  # a latent that is not contiguous
    with pytest.raises(ValueError):
        connector_for([odd], MLA_LAYOUT, 1, LATENT // 2, 16)


def test_slots_of_minus_one_leave_the_cache_alone() -> None:
    cache = torch.full((4, 16, LATENT), 3.0, dtype=torch.bfloat16)
    connector = connector_for([cache], MLA_LAYOUT, 1, LATENT, 16)
    chunk = torch.zeros(tuple(connector.get_shape(20)), dtype=torch.bfloat16)
    slots = np.full(20, -1, dtype=np.int64)
    slots[5] = 17
    connector.to_gpu(chunk, 0, 20, slot_mapping=slots)
    assert int((cache != 3.0).sum()) == LATENT and bool((cache[1, 1] == 0).all())
