"""A fresh process knows its layout (issue 21, item 7).

An engine that has not stored or read a chunk yet (a new process over persistent tiers) either
is given the KV shape (``EngineMetadata.kv_shape``; the HF integration passes it) or learns it
from the first chunk a lookup finds, in the background. Either way its first lookup plans by
cost, and a deadline bounds its very first retrieve, even over a tier that never answers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv import Engine, EngineMetadata

LAYERS, HEADS, HEAD = 2, 2, 16
CHUNK = 16


def make_kv(num_tokens: int) -> torch.Tensor:
    return torch.arange(LAYERS * 2 * num_tokens * HEADS * HEAD, dtype=torch.float32).view(
        LAYERS, 2, num_tokens, HEADS, HEAD) / 7


def fs_config(tmp_path: Path, **top: Any) -> dict[str, Any]:
    return {"model": "fresh", "chunk_size": CHUNK, "tiers": [{"name": "files", "backend": "fs",
                                                              "path": str(tmp_path / "fs")}], **top}


def store_in_another_engine(tmp_path: Path, tokens: torch.Tensor) -> None:
    with Engine(fs_config(tmp_path)) as writer:
        assert writer.store(tokens, make_kv(len(tokens))) == len(tokens) // CHUNK


KV_SHAPE = (LAYERS, HEADS, HEAD, torch.float32)


def test_first_lookup_of_a_new_process_plans_by_cost_without_a_known_chunk_size(tmp_path: Path) -> None:
    """Recomputing is all but free: even reads of no bytes lose, so the plan says 0 tokens
    although no chunk size is known yet (it used to load everything: "not known yet")."""
    tokens = torch.arange(4 * CHUNK)
    store_in_another_engine(tmp_path, tokens)
    with Engine(fs_config(tmp_path, recompute={"tokens_per_s": 1e12})) as fresh:
        assert fresh.lookup(tokens) == 0
        plan = fresh.stats()["last_lookup"]["plan"]
        assert "recomputing is faster" in plan["reason"], plan


def test_a_new_process_learns_the_chunk_size_in_the_background(tmp_path: Path) -> None:
    """A slow recompute: the first lookup loads everything (the size is not known yet) and
    starts reading the first chunk's header; a later lookup plans from the measured layout."""
    tokens = torch.arange(4 * CHUNK)
    store_in_another_engine(tmp_path, tokens)
    with Engine(fs_config(tmp_path, recompute={"tokens_per_s": 1.0})) as fresh:
        assert fresh.lookup(tokens) == len(tokens)
        assert "not known yet" in fresh.stats()["last_lookup"]["plan"]["reason"]
        deadline = time.monotonic() + 30  # generous: a background read of one small file
        while "not known yet" in fresh.stats()["last_lookup"]["plan"]["reason"] and time.monotonic() < deadline:
            time.sleep(0.02)
            fresh.lookup(tokens)
        assert fresh.stats()["last_lookup"]["plan"]["reason"] == "loading all of it is faster than recomputing it"
        kv, mask = fresh.retrieve(tokens, return_tuple=False)
        assert bool(mask.all()) and torch.equal(kv, make_kv(len(tokens)))


def test_kv_shape_given_plans_and_sizes_from_the_start(tmp_path: Path) -> None:
    tokens = torch.arange(4 * CHUNK)
    store_in_another_engine(tmp_path, tokens)
    cfg = fs_config(tmp_path, recompute={"tokens_per_s": 1.0})
    with Engine(cfg, EngineMetadata("fresh", kv_shape=KV_SHAPE)) as fresh:
        assert fresh.lookup(tokens) == len(tokens)
        assert fresh.stats()["last_lookup"]["plan"]["reason"] == "loading all of it is faster than recomputing it"
        kv, mask = fresh.retrieve(tokens, return_tuple=False)
        assert bool(mask.all()) and torch.equal(kv, make_kv(len(tokens)))
        with pytest.raises(ValueError, match="out"):  # `out` is checked against the given shape before any read
            fresh.retrieve(tokens, out=torch.empty(LAYERS, 2, len(tokens), HEADS + 1, HEAD))


@pytest.mark.parametrize("bad", [(2, 2, 16), (2, 0, 16, torch.float32), (2, 2, 16, "float32"), [2, 2, 16, torch.half]])
def test_a_bad_kv_shape_names_what_was_expected(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"kv_shape: expected \(num_layers, num_kv_heads, head_size, dtype\)"):
        EngineMetadata("m", kv_shape=bad)


@pytest.mark.slow  # a tier that never answers, waited out by each new process
@pytest.mark.parametrize("given", [False, True], ids=["learned", "kv_shape"])
def test_first_retrieve_of_a_new_process_keeps_its_deadline_over_a_tier_that_never_answers(
        black_hole: str, given: bool) -> None:
    """An S3 endpoint that accepts and never answers, a 6 s tier timeout: a retrieve without
    ``out`` and with ``deadline_s=0.3`` returns a miss within the deadline (it used to size the
    output by reading a first chunk outside the deadline, taking the tier's whole timeout).
    Closing the engine waits for the abandoned request's thread (up to the 6 s)."""
    cfg = {"model": "fresh", "chunk_size": CHUNK, "tiers": [{
        "name": "shared", "backend": "s3", "bucket": "never", "endpoint_url": black_hole, "region": "us-east-1",
        "access_key_id": "fresh-process", "secret_access_key": "fresh-process-secret", "check_on_start": False,
        "timeout_s": 6.0, "read_timeout_s": 6.0, "connect_timeout_s": 0.5, "retries": 0}]}
    tokens = torch.arange(4 * CHUNK)
    with Engine(cfg, EngineMetadata("fresh", kv_shape=KV_SHAPE) if given else None) as fresh:
        started = time.monotonic()
        kv, mask = fresh.retrieve(tokens, deadline_s=0.3)
        elapsed = time.monotonic() - started
        assert kv == () and not bool(mask.any())
        assert elapsed < 4, f"the first retrieve took {elapsed:.1f}s despite deadline_s=0.3 (tier timeout 6 s)"


def test_the_hf_integration_passes_the_models_kv_shape(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs the hf extra (pip install '.[hf]' in tierkv's clone)")
    from tierkv.demo import build_demo_model
    from tierkv.integrations import hf

    model = build_demo_model(seed=0, num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, max_positions=256)
    cfg = fs_config(tmp_path, kv_format="huggingface")
    metadata = hf.metadata_for(model, cfg)
    assert metadata.kv_shape == (3, 2, 16, model.dtype) and metadata.fmt == "huggingface"
    tokens = torch.randint(0, 100, (1, 2 * CHUNK))
    with torch.no_grad():
        cache = model(tokens, use_cache=True).past_key_values
    with Engine(cfg, metadata) as writer:
        assert hf.store_cache(writer, tokens, cache) == 2
    with Engine(cfg, hf.metadata_for(model, cfg)) as fresh:  # a new process: sizes the output at once
        restored, cached = hf.retrieve_cache(fresh, tokens)
        assert cached == 2 * CHUNK
        for (k, v), (rk, rv) in zip(hf.cache_layers(cache), hf.cache_layers(restored)):
            assert torch.equal(k[:, :, :cached], rk) and torch.equal(v[:, :, :cached], rv)
    with Engine(cfg, hf.metadata_for(model, cfg)) as fresh:  # another: plans by cost at once
        fresh.observe_recompute(100, 0, 100.0)  # a slow recompute: loading pays
        assert fresh.lookup(tokens[0]) == 2 * CHUNK
        assert fresh.stats()["last_lookup"]["plan"]["reason"] == "loading all of it is faster than recomputing it"
