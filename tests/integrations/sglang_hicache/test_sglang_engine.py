"""A real SGLang (CPU, tiny random-weight Llama) with tierkv as its HiCache L3 backend.

Each run is one SGLang process (start-up is most of its cost): the test reads what the
process generated, how many prompt tokens came from storage, and the backend's own counters
(its stats file). The first generation of a prompt in a process computes it from scratch
(nothing cached anywhere: the reference); after ``flush_cache()`` the prefix can only come
from L3.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from exactness import assert_same_generation

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is installed only in the tox 'sglang' env (tox -e sglang)")

from conftest import damage_page, tier_entry  # noqa: E402
from sglang_runner import make_model, run_spec  # noqa: E402

from tierkv.integrations.sglang import BACKEND_CLASS, BACKEND_MODULE  # noqa: E402
from tierkv.integrations.sglang.keys import PageKeySpace  # noqa: E402

PAGE = 16
PROMPT = 600  # above SGLang's storage-prefetch threshold (256 tokens)
LAYERS, HIDDEN, HEADS, KV_HEADS = 2, 256, 4, 2
pytestmark = pytest.mark.timeout(900)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(PROMPT)]


def extra(tiers: list[dict[str, Any]], stats: Path, module: str = BACKEND_MODULE,
          cls: str = BACKEND_CLASS) -> dict[str, Any]:
    return {"backend_name": "tierkv", "module_path": module, "class_name": cls, "interface_v1": 1,
            "config": {"tiers": tiers}, "stats_file": str(stats)}


def spec(model: Path, extra_config: dict[str, Any], prompts: list[list[int]], steps: list[dict[str, Any]]
         ) -> dict[str, Any]:
    return {"model": str(model), "backend": "tierkv", "extra_config": extra_config, "prompts": prompts,
            "steps": steps, "page_size": PAGE}


def assert_same_as(name: str, got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same tokens, and top-5 log-probabilities within 0.01 of SGLang's own run."""
    assert_same_generation(name, got["output_ids"], got["logprobs"], want["output_ids"], want["logprobs"],
                           len(want["output_ids"]), 0.01)


def storage_tokens(result: dict[str, Any]) -> int:
    return int((result.get("cached_tokens_details") or {}).get("storage", 0))


def gens(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if "gen" in r]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    shape = {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS}
    return make_model(root / "llama-a", seed=0, **shape), make_model(root / "llama-b", seed=1, **shape)


def page_key(model: Path, tokens: list[int], page: int) -> Any:
    """The tierkv key SGLang's page ``page`` of ``tokens`` is stored under (SGLang's own page hash)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from tierkv.chunks.revisions import directory_revision

    hashes = get_storage_hash_str(tokens[: (page + 1) * PAGE], None, page_size=PAGE)
    geometry = (f"mha:layers={LAYERS}:heads={KV_HEADS}:head_dim={HIDDEN // HEADS}:page={PAGE}:dtype=bfloat16"
                ":pp=0/1")
    return PageKeySpace(str(model), 1, 0, geometry, directory_revision(model)).key(hashes[page])


def test_outputs_identical_pages_from_tierkv_across_processes_and_damage(models: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    model_a, model_b = models
    tiers = [tier_entry("lmdb", tmp_path)]
    p0, p1 = prompt(0), prompt(1)
    stats = tmp_path / "stats-1.json"
    first = gens(run_spec(spec(model_a, extra(tiers, stats), [p0, p1],
                               [{"gen": 0}, {"gen": 1}, {"flush": True}, {"gen": 0}, {"gen": 1}]), tmp_path / "run1"))
    reference = {0: first[0], 1: first[1]}
    assert first[0]["cached_tokens"] == 0 and first[1]["cached_tokens"] == 0
    assert reference[0]["output_ids"] != reference[1]["output_ids"], \
        "the model's output must depend on its prompt (test premise)"
    for result in first[2:]:
        assert_same_as(f"hit of prompt {result['gen']}", result, reference[result["gen"]])
        assert storage_tokens(result) >= PROMPT - PAGE, f"prefix not served from tierkv: {result}"
    counters = json.loads(stats.read_text())["counters"]
    assert counters["pages_stored"] >= 2 * (PROMPT // PAGE) - 2, counters
    assert counters["pages_loaded"] >= 2 * (PROMPT // PAGE) - 2, counters

    # damage page 3 of p1 in the LMDB file; a new SGLang process over the same tier
    damaged = page_key(model_a, p1, 3)
    damage_page(tmp_path, "lmdb", damaged)
    stats = tmp_path / "stats-2.json"
    second = gens(run_spec(spec(model_a, extra(tiers, stats), [p0, p1], [{"gen": 0}, {"gen": 1}]), tmp_path / "run2"))
    assert_same_as("a new process's hit", second[0], reference[0])
    assert storage_tokens(second[0]) >= PROMPT - PAGE, "a new process did not hit what the first one stored"
    assert_same_as("a hit around a damaged page", second[1], reference[1])
    assert 0 < storage_tokens(second[1]) <= 3 * PAGE, f"the damaged page was not recomputed: {second[1]}"
    counters = json.loads(stats.read_text())["counters"]
    assert counters["pages_missed"] >= 1, counters

    # another model over the same path never reads model A's pages
    stats = tmp_path / "stats-3.json"
    third = gens(run_spec(spec(model_b, extra(tiers, stats), [p0], [{"gen": 0}, {"flush": True}, {"gen": 0}]),
                          tmp_path / "run3"))
    assert storage_tokens(third[0]) == 0, "model B was served model A's pages"
    assert third[0]["output_ids"] != reference[0]["output_ids"], "the two random models should not agree (test premise)"
    assert_same_as("model B's own hit", third[1], third[0])
    assert storage_tokens(third[1]) >= PROMPT - PAGE


def test_a_failing_tier_leaves_outputs_correct(models: tuple[Path, Path], tmp_path: Path) -> None:
    model_a, _ = models
    stats = tmp_path / "stats.json"
    config = extra([tier_entry("cpu", tmp_path)], stats, module="faulty_storage", cls="FailingTiersStorage")
    results = gens(run_spec(spec(model_a, config, [prompt(0)], [{"gen": 0}, {"flush": True}, {"gen": 0}]),
                            tmp_path / "run"))
    assert_same_as("a recompute after a failing tier", results[1], results[0])
    assert storage_tokens(results[1]) == 0
    counters = json.loads(stats.read_text())["counters"]
    assert counters.get("store_errors", 0) >= 1 and counters.get("pages_loaded", 0) == 0, counters


def test_salted_and_lora_pages_never_mix(models: tuple[Path, Path], tmp_path: Path) -> None:
    """SGLang seeds its page hashes with the request's ``cache_salt`` and ``extra_key`` (what it
    sets from a LoRA adapter); tierkv keys pages by those hashes. After ``flush_cache()`` only
    tierkv can serve a prefix: another tenant or adapter gets none of it, the same one all."""
    model_a, _ = models
    stats = tmp_path / "stats.json"
    identities = [{"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, {"extra_key": "lora-1"},
                  {"extra_key": "lora-2"}, {"extra_key": "lora-1", "cache_salt": "tenant-a"}, {}]
    steps: list[dict[str, Any]] = []
    for identity in identities * 2:  # each identity once (a miss), then each again (its own hit)
        steps += [{"gen": 0, **identity}, {"flush": True}]
    results = gens(run_spec(spec(model_a, extra([tier_entry("lmdb", tmp_path)], stats), [prompt(0)], steps),
                            tmp_path / "run"))
    first, again = results[: len(identities)], results[len(identities):]
    assert [storage_tokens(r) for r in first] == [0] * len(identities), (
        f"a tenant or adapter was served another's pages: {[storage_tokens(r) for r in first]}")
    assert all(storage_tokens(r) >= PROMPT - PAGE for r in again), (
        f"each identity hits its own pages: {[storage_tokens(r) for r in again]}")
    assert len({tuple(r["output_ids"]) for r in results}) == 1, "no adapter is loaded: one output for all"
    counters = json.loads(stats.read_text())["counters"]
    assert counters["pages_loaded"] >= len(identities) * (PROMPT // PAGE - 1), counters
