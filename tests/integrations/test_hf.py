"""Hugging Face transformers end to end with a tiny random-weight Llama on the CPU (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra (pip install '.[hf]' in tierkv's clone)")

from tierkv import Engine, ops  # noqa: E402
from tierkv.demo import build_demo_model  # noqa: E402
from tierkv.integrations import hf  # noqa: E402

TOL = {"rtol": 1e-4, "atol": 1e-4}  # float32


@pytest.fixture(scope="module")
def model():
    return build_demo_model(seed=0, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, max_positions=1024)


@pytest.fixture(params=["huggingface", "vllm"])
def engine(request, tmp_path: Path):
    # cost_aware off: these tests check what is reused, which must not hang on measured timings
    with Engine({"model": "tiny-llama", "chunk_size": 16, "kv_format": request.param, "cost_aware": False, "tiers": [
        {"name": "host", "backend": "cpu", "capacity": "64MiB"},
        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
    ]}) as eng:
        yield eng


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (count,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _full(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[None]).logits[0, -1]


def test_prefix_reuse_matches_full_prefill_mid_chunk(model, engine: Engine) -> None:
    first = _tokens(100, 1)  # 6 full chunks of 16 + 4 tokens
    stored = hf.prefill_with_reuse(model, engine, first)
    assert stored.reused_tokens == 0
    second = torch.cat([first[:90], _tokens(13, 2)])  # shares 90 tokens, ends mid-chunk
    result = hf.prefill_with_reuse(model, engine, second)
    assert result.reused_tokens == 80, "only whole chunks of the shared prefix are reused"
    torch.testing.assert_close(result.logits, _full(model, second), **TOL)
    again = hf.prefill_with_reuse(model, engine, first)  # the whole prompt is cached, last chunk partial
    assert again.reused_tokens == 99, "the last token is always computed"
    torch.testing.assert_close(again.logits, _full(model, first), **TOL)


def test_prefill_measures_the_recompute_speed_and_switches_the_plan_on(model, tmp_path: Path) -> None:
    with Engine({"model": "tiny-llama", "chunk_size": 16, "kv_format": "vllm",
                 "tiers": [{"name": "host", "backend": "cpu", "capacity": "64MiB"}]}) as eng:
        assert not eng.cost_aware  # no recompute speed known yet: everything cached is loaded
        hf.prefill_with_reuse(model, eng, _tokens(64, 7))
        recompute = eng.stats()["recompute"]
        assert recompute["known"] and recompute["measured_prefills"] == 1
        assert eng.cost_aware and 0 < recompute["tokens_per_s_at_1k"] < float("inf")
        eng.lookup(_tokens(64, 7))
        plan = eng.stats()["last_lookup"]["plan"]
        assert plan["cached_tokens"] == 64 and plan["expected_recompute_saved_ms"] > 0


def test_store_and_retrieve_round_trip_a_dynamic_cache(model, engine: Engine) -> None:
    tokens = _tokens(37, 3)
    cache = hf.document_kv(model, tokens)
    hf.store_cache(engine, tokens, cache)
    back, cached = hf.retrieve_cache(engine, tokens)
    assert cached == 37
    for (k, v), (k2, v2) in zip(hf.cache_layers(cache), hf.cache_layers(back)):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_generate_with_reuse_matches_plain_generate(model, engine: Engine) -> None:
    prompt = _tokens(50, 4)
    hf.prefill_with_reuse(model, engine, prompt[:40])
    out = hf.generate_with_reuse(model, engine, prompt, max_new_tokens=6, do_sample=False)
    with torch.inference_mode():
        expected = model.generate(prompt[None], max_new_tokens=6, do_sample=False)
    assert torch.equal(out, expected)


def _rag(model, engine: Engine):
    doc_a, doc_b, question = _tokens(70, 5), _tokens(45, 6), _tokens(9, 7)
    hf.store_documents(model, engine, [doc_a, doc_b])
    return [doc_b, doc_a, question]


def test_blend_ratio_one_equals_full_prefill(model, engine: Engine) -> None:
    segments = _rag(model, engine)
    blended = hf.blended_prefill(model, engine, segments, recompute_ratio=1.0)
    assert blended.recomputed_tokens == 124
    torch.testing.assert_close(blended.logits, _full(model, torch.cat(segments)), **TOL)


def test_blend_ratio_zero_equals_concatenated_cached_kv(model, engine: Engine) -> None:
    doc_b, doc_a, question = segments = _rag(model, engine)
    blended = hf.blended_prefill(model, engine, segments, recompute_ratio=0.0)
    assert blended.recomputed_tokens == question.numel()
    # The reference: each document's own KV, re-rotated to where it now sits, concatenated,
    # then the model runs on the question only.
    cos_sin = hf.rope_cos_sin_cache(model, 200)
    layers = []
    for (kb, vb), (ka, va) in zip(hf.cache_layers(hf.document_kv(model, doc_b)),
                                  hf.cache_layers(hf.document_kv(model, doc_a))):
        ka = ka[0].transpose(0, 1).contiguous()  # token-first
        ops.rope_rerotate(ka, torch.arange(70), torch.arange(45, 115), cos_sin)
        layers.append((torch.cat([kb, ka.transpose(0, 1)[None]], dim=2), torch.cat([vb, va], dim=2)))
    with torch.inference_mode():
        reference = model(question[None], past_key_values=hf.make_cache(layers)).logits[0, -1]
    torch.testing.assert_close(blended.logits, reference, **TOL)


def test_blend_recompute_improves_on_plain_concatenation(model, engine: Engine) -> None:
    segments = _rag(model, engine)
    full = _full(model, torch.cat(segments))
    curve = {}
    for ratio in (0.0, 0.05, 0.15, 0.3, 0.5, 1.0):
        blended = hf.blended_prefill(model, engine, segments, recompute_ratio=ratio)
        curve[ratio] = (blended.logits - full).norm().item()
    print("\nrecompute_ratio -> ||logits - full prefill||: " + ", ".join(f"{r}: {d:.4f}" for r, d in curve.items()))
    assert curve[0.15] < curve[0.0]
    assert curve[1.0] < 1e-3


def test_blended_cache_continues_generation(model, engine: Engine) -> None:
    segments = _rag(model, engine)
    blended = hf.blended_prefill(model, engine, segments, recompute_ratio=1.0)
    nxt = blended.logits.argmax().view(1, 1)
    with torch.inference_mode():
        step = model(nxt, past_key_values=blended.past_key_values).logits[0, -1]
        reference = _full(model, torch.cat([torch.cat(segments), nxt[0]]))
    torch.testing.assert_close(step, reference, **TOL)


def test_blended_prefill_rejects_non_llama_models(engine: Engine) -> None:
    with pytest.raises(ValueError, match="Llama-family"):
        hf.blended_prefill(torch.nn.Linear(2, 2), engine, [torch.arange(4)])


# -- identity: a peft-wrapped model never reads the base model's KV -------------------------------
def _peft(model, seed: int):
    peft = pytest.importorskip("peft", reason="peft is in the test extra")
    import copy

    wrapped = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return wrapped.eval()


def test_a_peft_model_never_loads_the_base_models_chunks(model, tmp_path: Path) -> None:
    """Base, then the same prompt through a peft adapter on k/v_proj, over one shared lmdb
    tier: the adapter's engine finds nothing of the base's, computes its own (equal to a
    full prefill), and hits it on a repeat; a second adapter misses both."""
    cfg = {"model": "tiny-llama", "chunk_size": 16, "kv_format": "vllm", "cost_aware": False,
           "tiers": [{"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}]}
    prompt = _tokens(100, 5)
    adapter, other = _peft(model, 1), _peft(model, 2)
    with Engine(cfg, hf.metadata_for(model, cfg)) as base_engine:
        assert hf.prefill_with_reuse(model, base_engine, prompt).reused_tokens == 0
        assert hf.prefill_with_reuse(model, base_engine, prompt).reused_tokens == 99
    for wrapped in (adapter, other):
        with Engine(cfg, hf.metadata_for(wrapped, cfg)) as engine:
            first = hf.prefill_with_reuse(wrapped, engine, prompt)
            assert first.reused_tokens == 0, "nothing of the base model's (or another adapter's) KV"
            torch.testing.assert_close(first.logits, _full(wrapped, prompt), **TOL)
            again = hf.prefill_with_reuse(wrapped, engine, prompt)
            assert again.reused_tokens == 99, "its own KV hits"
            torch.testing.assert_close(again.logits, _full(wrapped, prompt), **TOL)
    assert not torch.allclose(_full(adapter, prompt), _full(model, prompt), **TOL), "guard: the adapter matters"
    with Engine(cfg) as plain_engine, pytest.raises(ValueError, match="metadata_for"):
        hf.prefill_with_reuse(adapter, plain_engine, prompt)


def test_new_weights_under_the_same_name_are_a_miss(model, tmp_path: Path) -> None:
    cfg = {"model": "tiny-llama", "chunk_size": 16, "kv_format": "vllm", "cost_aware": False,
           "tiers": [{"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}]}
    prompt = _tokens(64, 6)
    retrained = build_demo_model(seed=1, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, max_positions=1024)
    with Engine(cfg, hf.metadata_for(model, cfg)) as engine:
        hf.prefill_with_reuse(model, engine, prompt)
    with Engine(cfg, hf.metadata_for(retrained, cfg)) as engine:
        assert hf.prefill_with_reuse(retrained, engine, prompt).reused_tokens == 0
    with Engine(cfg, hf.metadata_for(model, cfg)) as engine:
        assert hf.prefill_with_reuse(model, engine, prompt).reused_tokens == 63, "the same weights: a hit"
