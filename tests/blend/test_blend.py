"""CacheBlend pieces on real engines: re-rotation, segment store/retrieve, executor selection."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tierkv import Engine, ops
from tierkv.blend import CacheBlendExecutor, SegmentBlendRetriever, segment_keys, split_segments, store_segments


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """RoPE applied from scratch (the test's own oracle): x [tokens, heads, head_size] at ``positions``."""
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[positions, :half][:, None, :], cos_sin[positions, half:][:, None, :]
    if is_neox:
        first, second = x[..., :half], x[..., half:]
    else:
        first, second = x[..., 0::2], x[..., 1::2]
    out_first, out_second = first * cos - second * sin, second * cos + first * sin
    if is_neox:
        return torch.cat((out_first, out_second), dim=-1)
    return torch.stack((out_first, out_second), dim=-1).flatten(-2)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rerotation_equals_k_computed_at_the_new_positions(is_neox: bool) -> None:
    cos_sin = ops.make_cos_sin_cache(4096, 64)
    raw = torch.randn(50, 4, 64)
    old = torch.randint(0, 4096, (50,))
    new = torch.randint(0, 4096, (50,))
    k = _rotate(raw, old, cos_sin, is_neox)
    ops.rope_rerotate(k, old, new, cos_sin, is_neox)
    torch.testing.assert_close(k, _rotate(raw, new, cos_sin, is_neox), rtol=1e-4, atol=1e-4)


def _engine(tmp_path: Path, fmt: str = "vllm") -> Engine:
    return Engine({"model": "blend-test", "chunk_size": 8, "kv_format": fmt, "tiers": [
        {"name": "host", "backend": "cpu", "capacity": "64MiB"},
        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
    ]})


def _segment_kv(num_tokens: int, fmt: str, seed: int, layers: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, num_tokens, 2, 4) if fmt == "vllm" else (layers, 2, 2, num_tokens, 4)
    return torch.randn(shape, generator=gen)


@pytest.mark.parametrize("fmt", ["vllm", "huggingface"])
def test_segments_are_found_in_any_order_with_their_positions(tmp_path: Path, fmt: str) -> None:
    doc_a, doc_b, question = torch.arange(0, 20), torch.arange(100, 113), torch.arange(500, 505)
    kv_a, kv_b = _segment_kv(20, fmt, 1), _segment_kv(13, fmt, 2)
    with _engine(tmp_path, fmt) as engine:
        assert store_segments(engine, [doc_a, doc_b], [kv_a, kv_b], positions=[None, 40]) == 2
        assert store_segments(engine, [doc_a], [kv_a]) == 0, "an already stored segment is skipped"
        prompt = torch.cat([question, doc_b, doc_a])
        task = SegmentBlendRetriever(engine).new_request([prompt], [[5, 18]])
        expected_valid = torch.tensor([False] * 5 + [True] * 33)
        for layer in (2, 0, 1):  # any order
            result = task.result(layer)
            assert torch.equal(result.valid_mask, expected_valid)
            to_tokens_first = (lambda t: t) if fmt == "vllm" else (lambda t: t.transpose(0, 1))
            assert torch.equal(result.k[5:18], to_tokens_first(kv_b[layer, 0]))
            assert torch.equal(result.v[18:], to_tokens_first(kv_a[layer, 1]))
            assert torch.equal(result.original_positions,
                               torch.cat([torch.zeros(5, dtype=torch.int64), torch.arange(40, 53), torch.arange(20)]))
        with pytest.raises(ValueError, match=r"layer_id must lie in \[0, 3\)"):
            task.result(3)
        # The segment keys never answer a prefix lookup of the same tokens.
        assert engine.lookup(doc_a) == 0


def test_an_evicted_chunk_invalidates_only_its_tokens(tmp_path: Path) -> None:
    doc = torch.arange(30)
    with _engine(tmp_path) as engine:
        store_segments(engine, [doc], [_segment_kv(30, "vllm", 3)])
        keys = segment_keys(engine, doc)
        # Overwrite the second chunk with a tensor of the wrong shape: it must read as a miss.
        engine.batched_put([keys.chunks[1]], [torch.zeros(3)])
        result = SegmentBlendRetriever(engine).new_request([doc], [[]]).result(0)
        assert result.valid_mask.tolist() == [True] * 8 + [False] * 8 + [True] * 14


def test_nothing_cached_gives_no_kv(tmp_path: Path) -> None:
    with _engine(tmp_path) as engine:
        result = SegmentBlendRetriever(engine).new_request([torch.arange(12)], [[4]]).result(0)
        assert result.k is None and result.v is None and not result.valid_mask.any()


def test_retrieval_runs_in_the_background(tmp_path: Path) -> None:
    """new_request returns before the engine is read: result() is what waits."""
    doc = torch.arange(16)
    with _engine(tmp_path) as engine:
        store_segments(engine, [doc], [_segment_kv(16, "vllm", 4)])
        gate = threading.Event()
        original = engine.batched_get

        def gated_get(keys):
            gate.wait(timeout=30)
            return original(keys)

        engine.batched_get = gated_get  # type: ignore[method-assign]
        task = SegmentBlendRetriever(engine).new_request([doc], [[]])
        assert task._done_layers == 0  # nothing assembled while the read is held
        gate.set()
        assert task.result(1).valid_mask.all()


def test_bad_segment_input_is_rejected(tmp_path: Path) -> None:
    with _engine(tmp_path) as engine:
        with pytest.raises(ValueError, match="holds 5 tokens"):
            store_segments(engine, [torch.arange(6)], [_segment_kv(5, "vllm", 0)])
        with pytest.raises(ValueError, match="1-D tensor of 6 positions"):
            store_segments(engine, [torch.arange(6)], [_segment_kv(6, "vllm", 0)], positions=[torch.arange(3)])
        with pytest.raises(ValueError, match="must lie in"):
            split_segments(torch.arange(6), [9])


def _executor_inputs(num_tokens: int, valid: torch.Tensor) -> dict:
    cos_sin = ops.make_cos_sin_cache(256, 8)
    return {
        "retrieved_k": torch.randn(num_tokens, 2, 8), "retrieved_v": torch.randn(num_tokens, 2, 8),
        "valid_mask": valid, "original_positions": torch.where(valid, torch.arange(num_tokens), 0),
        "cos_sin": cos_sin,
    }


def test_executor_selects_top_deviation_invalid_and_last_tokens_per_request() -> None:
    num_tokens = 20
    valid = torch.ones(num_tokens, dtype=torch.bool)
    valid[[3, 15]] = False
    data = _executor_inputs(num_tokens, valid)
    executor = CacheBlendExecutor(data["cos_sin"], recompute_ratio=0.25, check_layer=1)
    fresh_k = data["retrieved_k"].clone()
    fresh_k[[1, 12]] += 10.0  # the two most deviating tokens, one per request
    fresh_q, fresh_v = torch.randn(num_tokens, 4, 8), torch.randn(num_tokens, 2, 8)
    positions = torch.cat([torch.arange(10), torch.arange(10)])
    data["original_positions"] = torch.where(valid, positions, 0)
    start_loc = torch.tensor([0, 10, 20])
    retrieved_v = data["retrieved_v"].clone()
    layer0 = executor.blend(0, data["retrieved_k"].clone(), data["retrieved_v"].clone(), valid,
                            data["original_positions"], fresh_q, fresh_k, fresh_v, positions, start_loc, 0)
    assert layer0.q is fresh_q and layer0.query_start_loc is None, "layers before the check layer compute everything"
    out = executor.blend(1, data["retrieved_k"], data["retrieved_v"], valid, data["original_positions"], fresh_q,
                         fresh_k, fresh_v, positions, start_loc, 0)
    # per request: 9 valid tokens * 0.25 -> 3 top ones, plus the invalid token, plus the last token
    selected = out.local_indices.tolist()
    assert {1, 3, 9}.issubset(selected) and {12, 15, 19}.issubset(selected)
    per_request = out.query_start_loc.diff().tolist()
    assert all(count in (4, 5) for count in per_request), per_request  # 3 top + 1 invalid + last (may overlap)
    assert out.query_start_loc.tolist() == [0, per_request[0], len(selected)]
    assert torch.equal(out.q, fresh_q[out.local_indices])
    assert torch.equal(out.k[out.local_indices], fresh_k[out.local_indices])
    untouched = torch.ones(num_tokens, dtype=torch.bool)
    untouched[out.local_indices] = False
    assert torch.equal(out.v[untouched], retrieved_v[untouched]), "unselected tokens keep their cached V"
    assert torch.equal(out.v[out.local_indices], fresh_v[out.local_indices])
    # the next layer computes only the selected tokens
    short = len(selected)
    nxt = executor.blend(2, torch.randn(num_tokens, 2, 8), torch.randn(num_tokens, 2, 8), valid,
                         data["original_positions"], torch.randn(short, 4, 8), torch.randn(short, 2, 8),
                         torch.randn(short, 2, 8), out.positions, out.query_start_loc, 0)
    assert nxt.q.shape[0] == short and nxt.k.shape[0] == num_tokens
    with pytest.raises(ValueError, match=r"holds 20 tokens .* expected \d+ of"):
        executor.blend(3, torch.randn(num_tokens, 2, 8), torch.randn(num_tokens, 2, 8), valid,
                       data["original_positions"], torch.randn(num_tokens, 4, 8), torch.randn(num_tokens, 2, 8),
                       torch.randn(num_tokens, 2, 8), positions, start_loc, 0)


def test_executor_rejects_bad_settings() -> None:
    cos_sin = ops.make_cos_sin_cache(16, 8)
    with pytest.raises(ValueError, match="recompute_ratio"):
        CacheBlendExecutor(cos_sin, recompute_ratio=1.5)
    with pytest.raises(ValueError, match="token_dim"):
        CacheBlendExecutor(cos_sin).blend(0, None, None, torch.ones(2, dtype=torch.bool), torch.zeros(2),
                                          torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8),
                                          torch.arange(2), torch.tensor([0, 2]), 2)


def test_segments_are_reused_only_under_their_identity(tmp_path: Path) -> None:
    """A document stored for one tenant and adapter is blended only into that identity's
    prompts: another salt, another adapter or no identity finds none of it."""
    from tierkv import RequestIdentity

    doc = torch.arange(30)
    tenant = RequestIdentity(adapter="adapter:1", salt="tenant-a")
    with _engine(tmp_path) as engine:
        assert store_segments(engine, [doc], [_segment_kv(30, "vllm", 3)], identity=tenant) == 1
        own = SegmentBlendRetriever(engine, identity=tenant).new_request([doc], [[]]).result(0)
        assert own.valid_mask.all()
        for other in (RequestIdentity(), RequestIdentity(salt="tenant-b"), RequestIdentity(adapter="adapter:2",
                                                                                          salt="tenant-a")):
            result = SegmentBlendRetriever(engine, identity=other).new_request([doc], [[]]).result(0)
            assert not result.valid_mask.any(), other.describe()
        assert store_segments(engine, [doc], [_segment_kv(30, "vllm", 3)], identity=tenant) == 0, "already stored"
