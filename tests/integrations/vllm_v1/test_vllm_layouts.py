"""tierkv's views of vLLM's paged KV cache, checked against the kernels that write it.

For vLLM's CPU attention the writer is the installed vLLM's own op,
``vllm._custom_ops.cpu_attn_reshape_and_cache`` (ISAs ``vec`` and ``vec16``, the ones vLLM
picks on a CPU without AMX, and ``amx``, whose cache write is plain packing but is compiled
only into vLLM's AVX512-BF16 build of its kernels, so it runs on any CPU with AVX-512 and
AVX512-BF16 and is skipped elsewhere, an AVX2-only CPU included; bf16/fp16/fp32 caches and
fp8 ones (``fp8_e4m3``, ``fp8_e5m2``, where the CPU has AVX-512); block and head sizes it
allows; tests/vllm_marks.py says which build has which kernel): a known pattern written by the
op must read back exactly through tierkv's views, token by token, and tierkv writing tokens
into a partly filled block (87 of 128 slots) must leave the cache byte for byte as vLLM's op
leaves it. The CUDA backends' writer (``reshape_and_cache_flash``) cannot run on CPU; for
those layouts the writer is its documented semantics (``key_cache[slot // block_size,
slot % block_size] = key``) applied to the views vLLM's backends cut from the cache
(``vllm/v1/attention/backends/flash_attn.py``: ``kv_cache.transpose(1, 2).split(head_size,
-1)``; FlashAttention before the generic views: ``kv_cache.unbind(0)``; FlashInfer:
``kv_cache.unbind(1)``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from paged_caches import build_extension_for_tests
from vllm_marks import needs_vllm, needs_vllm_amx_kernel, needs_vllm_fp8_cache

from tierkv import ops
from tierkv.integrations.vllm_v1.layout_check import LayoutMismatchError, cached_pattern, verify_layout
from tierkv.integrations.vllm_v1.layouts import PagedLayerConnector, connector_for, slot_mapping, split_layers

HEADS, LAYERS = 2, 2


@pytest.fixture(params=["extension", "torch"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every layout test runs through both copy paths: the extension's strided kernel (built
    here, as tests/ops/test_ops.py builds it) and the pure-torch run-by-run copies."""
    if request.param == "extension":
        build_extension_for_tests(request.config)
        monkeypatch.delenv("TIERKV_NO_EXT", raising=False)
        assert ops.paged_copy_strided_available(torch.empty(1))
    else:
        monkeypatch.setenv("TIERKV_NO_EXT", "1")
    return str(request.param)
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def cpu_writer(isa: str, kv_cache_dtype: str = "auto") -> Writer:
    """vLLM's CPU cache-write op, called as its CPU backend calls it (cpu_attn.py, do_kv_cache_update)."""
    from vllm import _custom_ops as ops

    def write(layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        blocks, heads, block_size, _ = layer.shape
        key_cache, value_cache = layer.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_cache_dtype)

    return write


def fp8_kind(kind: str) -> str:
    """``"amx:fp8_e5m2"`` -> ``"fp8_e5m2"``; ``"vec"`` -> ``"auto"``."""
    return kind.split(":")[1] if ":" in kind else "auto"


def flash_writer(layout: str) -> Writer:
    """``reshape_and_cache_flash``'s semantics on the K/V caches vLLM's CUDA backends cut from a layer."""

    def write(layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        if layout == "content":
            key_cache, value_cache = layer.transpose(1, 2).split(key.shape[-1], dim=-1)
        elif layout == "kv_first":
            key_cache, value_cache = layer.unbind(0)
        else:
            key_cache, value_cache = layer.unbind(1)
        block_size = key_cache.shape[1]
        for token, slot in enumerate(slots.tolist()):
            if slot >= 0:
                key_cache[slot // block_size, slot % block_size] = key[token]
                value_cache[slot // block_size, slot % block_size] = value[token]

    return write


def new_layer(layout: str, blocks: int, block_size: int, head_size: int, dtype: torch.dtype) -> torch.Tensor:
    if layout in ("cpu", "cpu_amx", "content"):
        return torch.zeros(blocks, HEADS, block_size, 2 * head_size, dtype=dtype)
    if layout == "kv_first":
        return torch.zeros(2, blocks, block_size, HEADS, head_size, dtype=dtype)
    return torch.zeros(blocks, 2, block_size, HEADS, head_size, dtype=dtype)


def pattern(tokens: int, head_size: int, dtype: torch.dtype, seed: int, bound: int = 256
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Values for every (token, head, dim), exact in ``dtype`` (up to 256 in bf16; ``bound`` 8
    keeps them exact in fp8)."""
    generator = torch.Generator().manual_seed(seed)
    key = torch.randint(-bound, bound, (tokens, HEADS, head_size), generator=generator).to(dtype)
    value = torch.randint(-bound, bound, (tokens, HEADS, head_size), generator=generator).to(dtype)
    return key, value


def written(kind: str, tokens: int, head_size: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key, value) to hand vLLM's op and (key, value) as the cache then holds them (fp8 bytes
    for an fp8 cache)."""
    kv_cache_dtype = fp8_kind(kind)
    key, value = pattern(tokens, head_size, dtype, seed, bound=8 if kv_cache_dtype != "auto" else 256)
    cache_dtype = dtype if kv_cache_dtype == "auto" else torch.uint8
    return key, value, cached_pattern(key, cache_dtype, kv_cache_dtype), cached_pattern(value, cache_dtype,
                                                                                        kv_cache_dtype)


def cache_dtype_of(kind: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if fp8_kind(kind) == "auto" else torch.uint8


def byte_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


CASES = [  # (layout, writer, block_size, head_size, dtype)
    *[("cpu", "vec", bs, hs, dt) for bs, hs in ((128, 128), (32, 64), (64, 256)) for dt in
      (torch.bfloat16, torch.float16, torch.float32)],
    *[("cpu", "vec16", bs, hs, dt) for bs, hs in ((16, 80), (128, 112), (32, 128)) for dt in
      (torch.bfloat16, torch.float32)],
    *[("cpu_amx", "amx", bs, hs, dt) for bs, hs in ((128, 128), (32, 64), (64, 256), (256, 96)) for dt in
      (torch.bfloat16, torch.float16)],
    *[(layout, f"{isa}:{fp8}", bs, hs, torch.bfloat16) for layout, isa in (("cpu", "vec"), ("cpu_amx", "amx"))
      for fp8 in ("fp8_e4m3", "fp8_e5m2") for bs, hs in ((128, 128), (32, 64))],
    *[(layout, "flash", 16, 64, torch.bfloat16) for layout in ("content", "kv_first", "blocks_first")],
]


def writer_for(layout: str, kind: str) -> Writer:
    return cpu_writer(kind.split(":")[0], fp8_kind(kind)) if layout.startswith("cpu") else flash_writer(layout)


def writer_marks(kind: str) -> list[pytest.MarkDecorator]:
    """What vLLM's CPU writer ``kind`` (``"amx:fp8_e5m2"``, ``"vec"``, ``"flash"``) needs of
    this CPU: vLLM's build with its amx kernel, its fp8 kernels (tests/vllm_marks.py)."""
    isa = kind.split(":")[0]
    if isa == "flash":
        return []
    return [needs_vllm, *([needs_vllm_amx_kernel] if isa == "amx" else []),
            *([needs_vllm_fp8_cache] if fp8_kind(kind) != "auto" else [])]


def params(cases: list[tuple]) -> list:
    return [pytest.param(*case, marks=writer_marks(case[1]),
                         id=f"{case[0]}-{case[1]}-b{case[2]}-h{case[3]}-{case[4]}".replace("torch.", ""))
            for case in cases]


@pytest.mark.parametrize(("layout", "kind", "block_size", "head_size", "dtype"), params(CASES))
def test_views_read_exactly_what_the_kernel_wrote(layout: str, kind: str, block_size: int, head_size: int,
                                                  dtype: torch.dtype, copy_path: str) -> None:
    """Tokens written by vLLM's op over two full blocks and a partial one (out of order in the
    cache) read back through tierkv's views, K and V, every head and dimension."""
    write = writer_for(layout, kind)
    num_tokens = 2 * block_size + block_size * 2 // 3 + 1
    stored = cache_dtype_of(kind, dtype)
    layers = [new_layer(layout, 6, block_size, head_size, stored) for _ in range(LAYERS)]
    slots = slot_mapping([4, 1, 3], block_size, num_tokens)
    chunk_want = torch.empty(LAYERS, 2, num_tokens, HEADS, head_size, dtype=stored)
    for index, layer in enumerate(layers):
        key, value, cached_key, cached_value = written(kind, num_tokens, head_size, dtype, seed=index)
        write(layer, key, value, torch.as_tensor(slots))
        chunk_want[index, 0], chunk_want[index, 1] = cached_key, cached_value
    connector = connector_for(layers, layout, HEADS, head_size, block_size)
    got = torch.empty_like(chunk_want)
    connector.from_gpu(got, 0, num_tokens, slot_mapping=slots)
    assert byte_equal(got, chunk_want), f"{layout}/{kind}: tierkv reads other K/V than vLLM's kernel wrote"


@pytest.mark.parametrize(("layout", "kind", "block_size", "head_size", "dtype"), params(
    [("cpu", "vec", 128, 128, torch.bfloat16), ("cpu", "vec16", 128, 80, torch.float16),
     ("cpu", "vec", 32, 64, torch.float32), ("cpu_amx", "amx", 128, 128, torch.bfloat16),
     ("cpu_amx", "amx", 64, 96, torch.bfloat16), ("cpu_amx", "amx:fp8_e4m3", 128, 128, torch.bfloat16),
     ("cpu", "vec:fp8_e5m2", 128, 64, torch.bfloat16), *[c for c in CASES if not c[0].startswith("cpu")]]))
def test_partial_block_load_leaves_the_cache_as_vllm_would(layout: str, kind: str, block_size: int, head_size: int,
                                                           dtype: torch.dtype, copy_path: str) -> None:
    """A block already holding other tokens gets 87 of 128 slots (2/3 of a block) from tierkv:
    the cache must be byte for byte what vLLM's op leaves when it writes those tokens itself,
    the other slots and blocks untouched. (A whole block round-trips even through a wrong
    view; a partial one does not.)"""
    write = writer_for(layout, kind)
    filled = block_size * 87 // 128
    old_tokens = 3 * block_size
    stored = cache_dtype_of(kind, dtype)
    before = [new_layer(layout, 5, block_size, head_size, stored) for _ in range(LAYERS)]
    for index, layer in enumerate(before):
        write(layer, *written(kind, old_tokens, head_size, dtype, seed=10 + index)[:2],
              torch.as_tensor(slot_mapping([0, 2, 4], block_size, old_tokens)))
    num_tokens = block_size + filled
    slots = slot_mapping([3, 2], block_size, num_tokens)  # a fresh block, then 87/128 of a used one
    by_vllm = [layer.clone() for layer in before]
    chunk = torch.empty(LAYERS, 2, num_tokens, HEADS, head_size, dtype=stored)
    for index, layer in enumerate(by_vllm):
        key, value, cached_key, cached_value = written(kind, num_tokens, head_size, dtype, seed=20 + index)
        write(layer, key, value, torch.as_tensor(slots))
        chunk[index, 0], chunk[index, 1] = cached_key, cached_value
    by_tierkv = [layer.clone() for layer in before]
    connector = connector_for(by_tierkv, layout, HEADS, head_size, block_size)
    connector.to_gpu(chunk, 0, num_tokens, slot_mapping=slots)
    for index in range(LAYERS):
        assert byte_equal(by_tierkv[index], by_vllm[index]), f"layer {index}: tierkv's load differs from vLLM's write"
    # and back out: the same tokens, read through the views
    got = torch.empty_like(chunk)
    connector.from_gpu(got, 0, num_tokens, slot_mapping=slots)
    assert byte_equal(got, chunk)


def test_loaded_slots_skip_minus_one() -> None:
    """Tokens with slot -1 (vLLM computed them already) are neither read nor written."""
    layers = [new_layer("content", 3, 16, 64, torch.bfloat16) for _ in range(LAYERS)]
    connector = PagedLayerConnector(split_layers(layers, "content", HEADS, 64, 16), 16)
    chunk = torch.ones(LAYERS, 2, 20, HEADS, 64, dtype=torch.bfloat16)
    connector.to_gpu(chunk, 0, 20, slot_mapping=slot_mapping([1, 2], 16, 20, first=5))
    assert all(int(layer[1, :, :5].count_nonzero()) == 0 for layer in layers)
    assert all(int(layer[1, :, 5:].count_nonzero()) == HEADS * 11 * 128 for layer in layers)


def vllm_layer_writer(layers: list[torch.Tensor], write: Writer) -> Callable[[int, torch.Tensor, torch.Tensor,
                                                                               torch.Tensor], None]:
    return lambda index, key, value, slots: write(layers[index], key, value, slots)


@pytest.mark.parametrize(("isa", "layout"), [pytest.param(isa, layout, marks=writer_marks(isa))
                                            for isa, layout in (("vec", "cpu"), ("vec16", "cpu"), ("amx", "cpu_amx"))])
def test_self_check_passes_on_vllms_cpu_kernel(isa: str, layout: str, copy_path: str) -> None:
    layers = [torch.randn(8, HEADS, 128, 256).to(torch.bfloat16) for _ in range(LAYERS)]
    before = [layer.clone() for layer in layers]
    connector = connector_for(layers, layout, HEADS, 128, 128)
    verify_layout(layers, connector, vllm_layer_writer(layers, cpu_writer(isa)), torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(layers, before)), "the check restores the blocks it used"


@pytest.mark.parametrize(("isa", "layout", "fp8"), [pytest.param(isa, layout, fp8, marks=writer_marks(f"{isa}:{fp8}"))
                                                   for isa, layout, fp8 in (("vec", "cpu", "fp8_e4m3"),
                                                                            ("amx", "cpu_amx", "fp8_e5m2"))])
def test_self_check_passes_on_an_fp8_cache_with_scales(isa: str, layout: str, fp8: str) -> None:
    """An fp8 cache (uint8 bytes) with scales other than 1: the check expects what vLLM's
    quantizer stores (divided by the scale, rounded toward zero) and finds it."""
    layers = [torch.randint(0, 255, (6, HEADS, 64, 128), dtype=torch.uint8) for _ in range(LAYERS)]
    connector = connector_for(layers, layout, HEADS, 64, 64)

    def write(index: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        blocks, heads, block_size, _ = layers[index].shape
        key_cache, value_cache = layers[index].view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        from vllm import _custom_ops as vllm_ops
        vllm_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=0.37,
                                            v_scale=3.0, kv_cache_dtype=fp8)

    verify_layout(layers, connector, write, torch.bfloat16, kv_cache_dtype=fp8, scales=(0.37, 3.0))
    with pytest.raises(LayoutMismatchError):  # told the wrong scale, it refuses
        verify_layout(layers, connector, write, torch.bfloat16, kv_cache_dtype=fp8, scales=(1.0, 1.0))


@needs_vllm
@needs_vllm_amx_kernel
def test_self_check_refuses_the_vec_order_on_an_amx_cache() -> None:
    """vLLM's amx op writes tiles: tierkv's vec views read them wrong, and the check says so."""
    layers = [torch.zeros(4, HEADS, 32, 128, dtype=torch.bfloat16) for _ in range(LAYERS)]
    connector = connector_for(layers, "cpu", HEADS, 64, 32)
    with pytest.raises(LayoutMismatchError):
        verify_layout(layers, connector, vllm_layer_writer(layers, cpu_writer("amx")), torch.bfloat16)


@needs_vllm
def test_self_check_refuses_a_layout_that_reads_k_row_by_row() -> None:
    """tierkv's old cpu view (K row by row): whole blocks round-trip, so only a check that
    writes through vLLM's op finds it wrong."""
    layers = [torch.zeros(4, HEADS, 32, 128, dtype=torch.bfloat16) for _ in range(LAYERS)]
    rows = [layer.view(4, HEADS, 64, 64) for layer in layers]
    wrong = [(r[:, :, :32].permute(0, 2, 1, 3), r[:, :, 32:].permute(0, 2, 1, 3)) for r in rows]
    connector = PagedLayerConnector(wrong, 32)
    with pytest.raises(LayoutMismatchError, match="K view does not read what vLLM"):
        verify_layout(layers, connector, vllm_layer_writer(layers, cpu_writer("vec")), torch.bfloat16)
    assert all(int(layer.count_nonzero()) == 0 for layer in layers), "blocks restored after a failed check"


@pytest.mark.parametrize("layout", ["content", "kv_first", "blocks_first"])
def test_self_check_refuses_views_of_another_layout(layout: str) -> None:
    """Views built for one layout checked against another layout's writer (same shapes where possible)."""
    other = {"content": "cpu", "kv_first": "kv_first", "blocks_first": "blocks_first"}[layout]
    layers = [new_layer(layout, 4, 16, 64, torch.bfloat16) for _ in range(LAYERS)]
    if layout == "content":  # the cpu views of a FlashAttention-style cache
        views = split_layers(layers, other, HEADS, 64, 16)
    else:  # K and V swapped
        views = [(v, k) for k, v in split_layers(layers, layout, HEADS, 64, 16)]
    connector = PagedLayerConnector(views, 16)
    with pytest.raises(LayoutMismatchError):
        verify_layout(layers, connector, vllm_layer_writer(layers, flash_writer(layout)), torch.bfloat16,
                      block_dim=1 if layout == "kv_first" else 0)


@needs_vllm
def test_every_isa_vllm_picks_here_has_a_layout() -> None:
    """The ISA vLLM's CPU backend picks (cpu_attn._get_attn_isa) on this CPU, for each dtype and
    for block sizes it allows, maps to a tierkv layout (amx on AMX CPUs, vec elsewhere)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from tierkv.integrations.vllm_v1.cpu_pages import layouts_for_isa

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for block_size, head_size in ((128, 128), (32, 80), (16, 64)):
            isa = _get_attn_isa(dtype, block_size, head_size)
            want = "cpu_amx" if isa == "amx" else "cpu"
            assert layouts_for_isa(isa, dtype)[-1 if dtype != torch.bfloat16 else 0] in (want, "cpu_bfmmla")
    if torch.cpu._is_amx_tile_supported():
        assert _get_attn_isa(torch.bfloat16, 128, 128) == "amx"


def test_slot_mapping_marks_partial_ranges() -> None:
    slots = slot_mapping([5, 2], 4, 7, first=1, last=6)
    assert slots.tolist() == [-1, 21, 22, 23, 8, 9, -1]
    assert np.asarray(slots).dtype == np.int64


def layers_at(shape: tuple[int, ...], dtype: torch.dtype, offset: int, generator: torch.Generator
              ) -> list[torch.Tensor]:
    """LAYERS cache tensors of ``shape``; each starts ``offset`` elements into its storage, so an
    odd offset leaves every page off the 16-byte alignment the streamed stores need."""
    size = int(np.prod(shape))
    return [torch.randint(0, 100, (size + offset,), generator=generator).to(dtype)[offset:].view(shape)
            for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64])
@pytest.mark.parametrize(("head_size", "block_size", "offset"), [(64, 32, 0), (12, 32, 0), (20, 32, 0),
                                                                 (64, 128, 0), (64, 128, 1)])
def test_strided_kernel_matches_the_reference(dtype: torch.dtype, head_size: int, block_size: int, offset: int,
                                              copy_path: str) -> None:
    """ops.paged_copy_strided (kernel: register transposes, 16x16 for 1-byte, 8x8 for 2-byte and
    4x4 for 4-byte elements, where a group of tokens runs in one block; whole cache lines of a
    page streamed out on a load; tiles elsewhere; memcpy rows) against its reference, on
    transposed K and row-major V views, with -1 slots, runs that cross blocks, runs not aligned
    to a group, head sizes the transposes do not divide, and pages off the streamed stores'
    alignment."""
    if copy_path == "torch":
        pytest.skip("the reference against itself proves nothing")
    blocks, tokens = 6, 77 if block_size == 32 else 300
    generator = torch.Generator().manual_seed(head_size)
    layers = layers_at((blocks, HEADS, block_size, 2 * head_size), dtype, offset, generator)
    views = split_layers(layers, "cpu", HEADS, head_size, block_size)
    slots = torch.as_tensor(slot_mapping([5, 0, 3], block_size, tokens, first=3, last=tokens - 7))
    # scattered over blocks 1, 2 and 4, which no other token uses
    slots[20:25] = torch.tensor([block_size + 8, block_size + 9, 2 * block_size + 6, -1, 4 * block_size + 2])
    want = torch.zeros(LAYERS, 2, tokens, HEADS, head_size, dtype=dtype)
    ops.paged_copy_strided_reference(views, slots, want, gather=True)
    got = torch.zeros_like(want)
    ops.paged_copy_strided(views, slots, got, gather=True)
    assert byte_equal(got, want)
    chunk = torch.randint(0, 100, tuple(want.shape), generator=generator).to(dtype)
    by_reference = [layer.clone() for layer in layers]
    ops.paged_copy_strided_reference(split_layers(by_reference, "cpu", HEADS, head_size, block_size), slots, chunk,
                                     gather=False)
    ops.paged_copy_strided(views, slots, chunk, gather=False)
    assert all(byte_equal(a, b) for a, b in zip(layers, by_reference))


def test_strided_copy_rejects_a_chunk_of_the_wrong_shape() -> None:
    layers = [torch.zeros(2, HEADS, 16, 16, dtype=torch.bfloat16)]
    views = split_layers(layers, "cpu", HEADS, 8, 16)
    with pytest.raises(ValueError, match="chunk must be a contiguous"):
        ops.paged_copy_strided(views, torch.zeros(4, dtype=torch.int64), torch.zeros(1, 2, 5, HEADS, 8), gather=True)


def test_copy_threads_follow_the_calling_threads_affinity(request: pytest.FixtureRequest) -> None:
    """A thread pinned to one CPU copies on one thread (no OpenMP team of the process's size on
    that core) until it lifts the cap with set_copy_threads(0), as vLLM's worker thread does;
    the main thread keeps its own setting."""
    import os
    import threading

    build_extension_for_tests(request.config)
    before = ops.copy_threads()
    seen: dict[str, int] = {}

    def pinned() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        seen["pinned"] = ops.copy_threads()
        ops.set_copy_threads(0)
        seen["lifted"] = ops.copy_threads() - torch.get_num_threads()  # this thread's OpenMP team
        ops.set_copy_threads(1)
        seen["one"] = ops.copy_threads()

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen == {"pinned": 1, "lifted": 0, "one": 1}
    assert ops.copy_threads() == before == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    with pytest.raises(ValueError, match="positive count"):
        ops.set_copy_threads(-1)
