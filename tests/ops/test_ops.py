"""tierkv.ops: the C++ extension's kernels against the pure-torch reference, and the reference
against independent math. Gathers and scatters must be bit-exact."""

from __future__ import annotations

import math
import random

import pytest
import torch
from paged_caches import (
    build_extension_for_tests,
    cache_bytes_equal,
    clone_cache,
    make_cache,
    random_values,
    same_bytes,
)

from tierkv import ops

BYTE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.uint8]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="session")
def ext(request: pytest.FixtureRequest) -> None:
    build_extension_for_tests(request.config)


# Shapes: (layers, blocks, block_size, heads, head_size, tokens). Single token, partial last
# block, block size 1 and odd sizes (no 16-byte alignment), a realistic row.
SHAPES = [(1, 4, 16, 1, 8, 1), (3, 7, 5, 2, 6, 17), (2, 9, 1, 3, 4, 9), (4, 6, 16, 8, 128, 40), (2, 5, 3, 1, 1, 11)]


def slot_mapping(blocks: int, block_size: int, tokens: int, seed: int, holes: bool) -> torch.Tensor:
    rng = random.Random(seed)
    slots = rng.sample(range(blocks * block_size), tokens)  # shuffled, distinct
    if holes and tokens > 1:
        for index in rng.sample(range(tokens), max(1, tokens // 4)):
            slots[index] = -1
    return torch.tensor(slots, dtype=torch.int64)


# ---------------------------------------------------------------------------- reference math


def test_reference_gather_reads_the_addressed_slot() -> None:
    cache = make_cache("pairs", 2, 3, 4, 2, 5, torch.float32)
    slots = torch.tensor([5, -1, 0, 11])
    chunk = ops.paged_gather_reference(cache, slots)
    assert chunk.shape == (2, 2, 4, 2, 5)
    assert torch.equal(chunk[1, 0, 0], cache[1][0][1, 1])  # slot 5 = block 1, offset 1
    assert torch.equal(chunk[0, 1, 3], cache[0][1][2, 3])  # slot 11 = block 2, offset 3
    assert torch.count_nonzero(chunk[:, :, 1]) == 0  # slot -1 left as allocated (zeros)
    hf = ops.paged_gather_reference(cache, slots, order="huggingface")
    assert torch.equal(hf, chunk.transpose(2, 3))


def test_reference_scatter_inverts_gather() -> None:
    cache = make_cache("fused", 2, 4, 3, 2, 4, torch.bfloat16)
    slots = torch.tensor([7, 2, 11, -1, 0])
    chunk = ops.paged_gather_reference(cache, slots)
    fresh = [torch.zeros_like(layer) for layer in cache]
    ops.paged_scatter_reference(chunk, fresh, slots)
    assert same_bytes(ops.paged_gather_reference(fresh, slots), chunk)
    keys, _ = ops.split_paged_cache(fresh)
    assert torch.count_nonzero(keys[0][1, 0]) == 0  # slot 3 was never written


def test_kv_deviation_is_per_token_squared_distance() -> None:
    a = torch.randn(5, 3, 8, dtype=torch.float64)
    b = torch.randn(5, 3, 8, dtype=torch.float64)
    expected = ((a - b) ** 2).sum(dim=(1, 2)).float()
    got = ops.kv_deviation(a.to(torch.bfloat16), b.to(torch.bfloat16))
    assert got.dtype == torch.float32 and got.shape == (5,)
    assert torch.allclose(got, expected, rtol=0.05)
    assert torch.equal(ops.kv_deviation(a.float(), a.float()), torch.zeros(5))


def test_blend_scatter_writes_rows_in_place() -> None:
    dst = torch.zeros(6, 2, 3)
    src = torch.randn(2, 2, 3)
    out = ops.blend_scatter(dst, src, torch.tensor([4, 1]))
    assert out is dst
    assert torch.equal(dst[4], src[0]) and torch.equal(dst[1], src[1])
    assert torch.count_nonzero(dst[[0, 2, 3, 5]]) == 0


def test_make_cos_sin_cache_layout() -> None:
    cache = ops.make_cos_sin_cache(10, 8, base=100.0)
    assert cache.shape == (10, 8) and cache.dtype == torch.float32
    inv_freq = [100.0 ** (-2 * i / 8) for i in range(4)]
    for pos in (0, 3, 9):
        for i in range(4):
            assert cache[pos, i].item() == pytest.approx(math.cos(pos * inv_freq[i]), abs=1e-6)
            assert cache[pos, 4 + i].item() == pytest.approx(math.sin(pos * inv_freq[i]), abs=1e-6)


def rope_by_complex(k: torch.Tensor, positions: torch.Tensor, rot_dim: int, base: float, is_neox: bool) -> torch.Tensor:
    """Independent oracle: RoPE as multiplication by e^{i p theta} on complex pairs (float64)."""
    half = rot_dim // 2
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angle = positions.double()[:, None] * inv_freq[None, :]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]
    x = k.double()
    if is_neox:
        z = torch.complex(x[..., :half], x[..., half:rot_dim]) * rot
        rotated = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.complex(x[..., 0:rot_dim:2], x[..., 1:rot_dim:2]) * rot
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., rot_dim:]), dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rope_rerotate_matches_rotation_by_the_difference(is_neox: bool, rot_dim: int) -> None:
    tokens, heads, head_size, base = 7, 3, 16, 10000.0
    cache = ops.make_cos_sin_cache(128, rot_dim, base)
    raw = torch.randn(tokens, heads, head_size, dtype=torch.float64)
    old = torch.randint(0, 128, (tokens,))
    new = torch.randint(0, 128, (tokens,))
    stored = rope_by_complex(raw, old, rot_dim, base, is_neox).float()
    expected = rope_by_complex(raw, new, rot_dim, base, is_neox).float()
    got = ops.rope_rerotate_reference(stored.clone(), old, new, cache, is_neox)
    assert torch.allclose(got, expected, atol=1e-4)
    assert torch.equal(got[..., rot_dim:], stored[..., rot_dim:])  # dims past rot_dim untouched


def test_rope_rerotate_keeps_dtype_and_runs_in_place() -> None:
    k = torch.randn(4, 2, 8).to(torch.bfloat16)
    cache = ops.make_cos_sin_cache(16, 8)
    positions = torch.arange(4)
    out = ops.rope_rerotate(k, positions, positions, cache)
    assert out is k and k.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- bad input


def test_bad_inputs_are_clear_errors_and_change_nothing() -> None:
    cache = make_cache("pairs", 2, 3, 4, 2, 5, torch.float32)
    before = clone_cache(cache)
    chunk = torch.randn(2, 2, 2, 2, 5)
    with pytest.raises(IndexError, match=r"slot_mapping values must be -1 \(skip\) or in \[0, num_blocks"):
        ops.paged_scatter(chunk, cache, torch.tensor([3, 12]))
    with pytest.raises(ValueError, match=r"chunk must be vllm-order \(2, 2, 3, 2, 5\)"):
        ops.paged_scatter(chunk, cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D int32/int64"):
        ops.paged_gather(cache, torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"a fused layer must be \[2, num_blocks, block_size, heads, head_size\]"):
        ops.paged_gather([torch.zeros(3)], torch.tensor([0]))
    with pytest.raises(ValueError, match="order must be one of"):
        ops.paged_gather(cache, torch.tensor([0]), order="sglang")
    assert cache_bytes_equal(cache, before)
    dst = torch.zeros(3, 2)
    with pytest.raises(IndexError, match=r"indices must lie in \[0, 3\)"):
        ops.blend_scatter(dst, torch.ones(1, 2), torch.tensor([3]))
    with pytest.raises(ValueError, match="indices must be a 1-D int64"):
        ops.blend_scatter(dst, torch.ones(1, 2), torch.tensor([1], dtype=torch.int32))
    assert torch.count_nonzero(dst) == 0
    with pytest.raises(ValueError, match="fresh_k must have retrieved_k's shape"):
        ops.kv_deviation(torch.zeros(2, 1, 4), torch.zeros(3, 1, 4))
    cos_sin = ops.make_cos_sin_cache(8, 4)
    with pytest.raises(IndexError, match=r"new_positions must lie in \[0, 8\)"):
        ops.rope_rerotate(torch.zeros(1, 1, 4), torch.tensor([0]), torch.tensor([8]), cos_sin)
    with pytest.raises(ValueError, match="rot_dim must be even and <= head_size=2"):
        ops.rope_rerotate(torch.zeros(1, 1, 2), torch.tensor([0]), torch.tensor([1]), cos_sin)
    with pytest.raises(ValueError, match="rot_dim must be a positive even number"):
        ops.make_cos_sin_cache(8, 3)


# ---------------------------------------------------------------------------- extension == reference


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["pairs", "fused", "flash"])
@pytest.mark.parametrize("order", ["vllm", "huggingface"])
def test_extension_paged_gather_scatter_bit_exact(ext: None, dtype: torch.dtype, layout: str, order: str) -> None:
    for seed, (layers, blocks, block_size, heads, head_size, tokens) in enumerate(SHAPES):
        cache = make_cache(layout, layers, blocks, block_size, heads, head_size, dtype)
        keys, values = ops.split_paged_cache(cache)
        for holes in (False, True):
            slots = slot_mapping(blocks, block_size, tokens, seed, holes)
            slots = slots.int() if seed % 2 else slots
            expected = ops.paged_gather_reference(cache, slots, order=order)
            got = torch.zeros_like(expected)
            torch.ops.tierkv.paged_gather(keys, values, slots, got, order == "huggingface")
            assert same_bytes(got, expected), (layout, order, seed, holes)
            assert same_bytes(ops.paged_gather(cache, slots, order=order), expected)

            chunk = random_values(tuple(expected.shape), dtype)
            by_reference, by_kernel = clone_cache(cache), clone_cache(cache)
            ops.paged_scatter_reference(chunk, by_reference, slots, order=order)
            kernel_keys, kernel_values = ops.split_paged_cache(by_kernel)
            torch.ops.tierkv.paged_scatter(chunk, kernel_keys, kernel_values, slots, order == "huggingface")
            assert cache_bytes_equal(by_kernel, by_reference), (layout, order, seed, holes)


def test_extension_rejects_bad_slots_before_writing(ext: None) -> None:
    cache = make_cache("pairs", 2, 3, 4, 2, 8, torch.float16)
    before = clone_cache(cache)
    keys, values = ops.split_paged_cache(cache)
    chunk = torch.ones(2, 2, 3, 2, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 12 must be -1 \(skip\) or in \[0, num_blocks"):
        torch.ops.tierkv.paged_scatter(chunk, keys, values, torch.tensor([0, 1, 12]), False)
    assert cache_bytes_equal(cache, before)
    with pytest.raises(RuntimeError, match=r"out must be vllm-order \[2, 2, 3, 2, 8\], got \[2, 2, 2, 2, 8\]"):
        torch.ops.tierkv.paged_gather(keys, values, torch.tensor([0, 1, 2]), chunk[:, :, :2].contiguous(), False)
    with pytest.raises(RuntimeError, match=r"value_caches\[1\] must be \[3, 4, 2, 8\]"):
        torch.ops.tierkv.paged_gather(keys, [values[0], values[1][:2]], torch.tensor([0]), chunk[:, :, :1], False)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_extension_kv_deviation(ext: None, dtype: torch.dtype) -> None:
    for tokens, heads, head_size in ((1, 1, 4), (33, 8, 128), (5, 3, 7)):
        a = torch.randn(tokens, heads, head_size).to(dtype)
        b = torch.randn(tokens, heads, head_size).to(dtype)
        got = torch.ops.tierkv.kv_deviation(a, b)
        assert got.dtype == torch.float32
        assert torch.allclose(got, ops.kv_deviation_reference(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
def test_extension_blend_scatter_bit_exact(ext: None, dtype: torch.dtype) -> None:
    dst = random_values((20, 3, 5), dtype)
    src = random_values((6, 3, 5), dtype)
    indices = torch.tensor([19, 0, 7, 3, 12, 5])
    expected = ops.blend_scatter_reference(dst.clone(), src, indices)
    got = dst.clone()
    torch.ops.tierkv.blend_scatter(got, src, indices)
    assert same_bytes(got, expected)
    with pytest.raises(RuntimeError, match=r"indices\[0\] = 20 must be in \[0, 20\)"):
        torch.ops.tierkv.blend_scatter(got, src[:1], torch.tensor([20]))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
def test_extension_rope_rerotate(ext: None, dtype: torch.dtype, is_neox: bool) -> None:
    for tokens, heads, head_size, rot_dim in ((1, 1, 8, 8), (19, 4, 64, 64), (6, 2, 16, 8)):
        cache = ops.make_cos_sin_cache(256, rot_dim)
        k = torch.randn(tokens, heads, head_size).to(dtype)
        old = torch.randint(0, 256, (tokens,))
        new = torch.randint(0, 256, (tokens,))
        expected = ops.rope_rerotate_reference(k.clone(), old, new, cache, is_neox)
        got = k.clone()
        torch.ops.tierkv.rope_rerotate(got, old, new, cache, is_neox)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.float(), expected.float(), atol=tolerance)


def test_public_ops_dispatch_to_extension_and_honour_no_ext(ext: None, monkeypatch: pytest.MonkeyPatch) -> None:
    status = ops.extension_status()
    assert status["loaded"] and status["cpu_kernels"] and status["library"]
    cache = make_cache("pairs", 2, 3, 4, 2, 8, torch.float32)
    slots = torch.tensor([3, -1, 5])
    with_ext = ops.paged_gather(cache, slots)
    monkeypatch.setenv("TIERKV_NO_EXT", "1")
    assert ops.extension_status()["reason"] == "disabled by TIERKV_NO_EXT"
    assert same_bytes(ops.paged_gather(cache, slots), with_ext)


def test_opcheck_every_op(ext: None) -> None:
    cache = make_cache("pairs", 2, 4, 4, 2, 8, torch.bfloat16)
    keys, values = ops.split_paged_cache(cache)
    slots = torch.tensor([3, -1, 9, 0])
    out = torch.zeros(2, 2, 4, 2, 8, dtype=torch.bfloat16)
    cos_sin = ops.make_cos_sin_cache(32, 8)
    cases = [
        (torch.ops.tierkv.paged_gather.default, (keys, values, slots, out, False)),
        (torch.ops.tierkv.paged_gather.default, (keys, values, slots, out.transpose(2, 3).contiguous(), True)),
        (torch.ops.tierkv.paged_scatter.default, (out, keys, values, slots, False)),
        (torch.ops.tierkv.kv_deviation.default, (torch.randn(5, 2, 8), torch.randn(5, 2, 8))),
        (torch.ops.tierkv.blend_scatter.default, (torch.zeros(6, 2, 8), torch.ones(2, 2, 8), torch.tensor([1, 4]))),
        (torch.ops.tierkv.rope_rerotate.default,
         (torch.randn(3, 2, 8), torch.tensor([0, 5, 9]), torch.tensor([7, 2, 31]), cos_sin, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------- CUDA


def require_cuda_kernels() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA kernels run only on a GPU")
    if not ops.extension_status()["cuda_kernels"]:
        pytest.skip(f"the extension has no CUDA kernels here: {ops.extension_status()['cuda_reason']}")


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["pairs", "fused", "flash"])
@pytest.mark.parametrize("order", ["vllm", "huggingface"])
def test_cuda_paged_gather_scatter_bit_exact(ext: None, dtype: torch.dtype, layout: str, order: str) -> None:
    require_cuda_kernels()
    for seed, (layers, blocks, block_size, heads, head_size, tokens) in enumerate(SHAPES):
        cache = make_cache(layout, layers, blocks, block_size, heads, head_size, dtype, "cuda")
        slots = slot_mapping(blocks, block_size, tokens, seed, holes=True).cuda()
        expected = ops.paged_gather_reference(cache, slots, order=order)
        assert same_bytes(ops.paged_gather(cache, slots, order=order), expected)
        chunk = random_values(tuple(expected.shape), dtype, "cuda")
        by_reference, by_kernel = clone_cache(cache), clone_cache(cache)
        ops.paged_scatter_reference(chunk, by_reference, slots, order=order)
        ops.paged_scatter(chunk, by_kernel, slots, order=order)
        assert cache_bytes_equal(by_kernel, by_reference)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_blend_ops(ext: None, dtype: torch.dtype) -> None:
    require_cuda_kernels()
    a = torch.randn(33, 8, 128, device="cuda").to(dtype)
    b = torch.randn(33, 8, 128, device="cuda").to(dtype)
    assert torch.allclose(ops.kv_deviation(a, b), ops.kv_deviation_reference(a, b), rtol=1e-4)
    indices = torch.tensor([32, 0, 5], device="cuda")
    assert same_bytes(ops.blend_scatter(a.clone(), b[:3], indices), ops.blend_scatter_reference(a.clone(), b[:3], indices))
    cos_sin = ops.make_cos_sin_cache(512, 128).cuda()
    old = torch.randint(0, 512, (33,), device="cuda")
    new = torch.randint(0, 512, (33,), device="cuda")
    for is_neox in (True, False):
        expected = ops.rope_rerotate_reference(a.clone(), old, new, cos_sin, is_neox)
        got = ops.rope_rerotate(a.clone(), old, new, cos_sin, is_neox)
        assert torch.allclose(got.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 1e-2)
