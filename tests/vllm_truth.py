"""The truth a vLLM test compares against: one context-dependent random Llama and one run of
vLLM without tierkv over every prompt the vLLM tests ask (session fixtures in conftest.py),
and the comparison itself (:func:`assert_exact`: tokens and top-5 log-probabilities).

Also the two tierkv processes that tests/integrations/vllm_v1/test_vllm_v1.py and
test_vllm_exact.py share (:func:`first_run`, :func:`second_run`): each module's prompts run in
the same process, one after the other, made once per session (tests/session_once.py); each
module reads its own results, and counts of its part alone (:func:`loaded_in`, :func:`grown`).

The model's output depends on its context (``initializer_range=0.15``: with transformers'
default 0.02 a random Llama answers every prompt with the same tokens, and equal outputs prove
nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from exactness import assert_same_generation
from session_once import once

from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm

CHUNK, BLOCK, TOP, MAX_TOKENS, TOLERANCE = 256, 128, 5, 8, 0.01
LAYERS, HIDDEN, HEADS, KV_HEADS = 2, 256, 4, 2
# vLLM's CPU backend reserves a core for other work when a KV connector is set: fewer compute
# threads sum in another order, and bf16 logprobs move by a few hundredths. Every run here
# reserves the same one, so the runs with and without tierkv compute on the same cores.
SAME_CORES = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + index * 104729) % 1000 + 1 for index in range(count)]


DOC = tokens(3, 2 * CHUNK)
PROMPTS = {
    # tests/integrations/vllm_v1/test_vllm_exact.py: the last loaded block partly filled, or the load ending on a block edge
    "partial_600": tokens(11, 600), "block_edge_513": tokens(12, 513), "partial_1000": tokens(13, 1000),
    # tests/integrations/vllm_v1/test_vllm_v1.py
    "repeated": tokens(1, 600),  # two chunks and a partial one
    "doc_q1": DOC + tokens(4, 40),
    "doc_q2": DOC + tokens(5, 40),  # shares the two document chunks with doc_q1
    "short": tokens(6, 100),  # shorter than a chunk
}


def vllm(run_spec: dict[str, Any], workdir: Path, pythonpath: Path | None = None,
         env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One vLLM process on the same cores as the reference; results also saved for a look after a failure."""
    results = run_vllm(run_spec, workdir, pythonpath=pythonpath, env={**SAME_CORES, **(env or {})})
    (workdir / "results.json").write_text(json.dumps(results))
    return results


def spec(model_dir: Path, prompts: list[Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": str(model_dir), "prompts": prompts, "max_tokens": MAX_TOKENS, "logprobs": TOP, "tierkv": extra}


def assert_exact(name: str, got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same tokens, and every top-5 log-probability of every generated token within TOLERANCE
    (see :func:`exactness.assert_same_generation`)."""
    assert_same_generation(name, got["tokens"], got["logprobs"], want["tokens"], want["logprobs"], MAX_TOKENS,
                           TOLERANCE)


# The first tierkv process of test_vllm_v1.py and test_vllm_exact.py: v1's sequence (a repeat,
# a shared document with two questions, a prompt shorter than a chunk), then exact's prompts
# twice (stored through cpu -> lmdb -> fs, then hit from the cpu tier); no prompt shares a
# chunk with another module's. The second process: a new vLLM over the lmdb tier the first filled.
V1_SEQUENCE = ["repeated", "repeated", "doc_q1", "doc_q2", "short", "short"]
EXACT_NAMES = ["partial_600", "block_edge_513", "partial_1000"]
FIRST_RUN = V1_SEQUENCE + EXACT_NAMES * 2
SECOND_RUN = ["repeated", "doc_q2"] + EXACT_NAMES


def first_run_tiers(directory: Path) -> list[dict[str, Any]]:
    return [{"name": "host", "backend": "cpu", "capacity": "256MiB"},
            {"name": "disk", "backend": "lmdb", "path": str(directory / "lmdb"), "capacity": "1GiB"},
            {"name": "files", "backend": "fs", "path": str(directory / "fs")}]


def shared_extra(directory: Path, tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "cost_aware": False, "tiers": tiers},
            "stats_file": str(directory / "stats.json")}


def first_run(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Any]:
    """FIRST_RUN in one vLLM with tierkv (cpu -> lmdb -> fs, vLLM's metrics on): ``results``
    per prompt, and the ``tiers`` it filled."""
    def run(directory: Path) -> dict[str, Any]:
        tiers = first_run_tiers(directory)
        results = vllm({**spec(model_dir, [PROMPTS[n] for n in FIRST_RUN], shared_extra(directory, tiers)),
                        "metrics": True}, directory / "run")
        return {"results": results, "tiers": {tier["backend"]: tier for tier in tiers}}

    return dict(once(tmp_path_factory, "vllm-first-run", run))


def second_run(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> list[dict[str, Any]]:
    """SECOND_RUN in a new vLLM process with tierkv over the first run's lmdb tier (a cpu tier
    above it, empty in a new process; vLLM's metrics on)."""
    first = first_run(tmp_path_factory, model_dir)

    def run(directory: Path) -> list[dict[str, Any]]:
        tiers = [{"name": "host", "backend": "cpu", "capacity": "256MiB"}, first["tiers"]["lmdb"]]
        return vllm({**spec(model_dir, [PROMPTS[n] for n in SECOND_RUN], shared_extra(directory, tiers)),
                     "metrics": True}, directory / "run")

    return list(once(tmp_path_factory, "vllm-second-run", run))


def loaded_in(results: list[dict[str, Any]], start: int, stop: int | None = None) -> list[int]:
    """Tokens the connector loaded during each of ``results[start:stop]`` (a module's part of a shared run)."""
    return loaded_per_prompt(results)[start:stop]


def grown(results: list[dict[str, Any]], start: int, name: str, last: int | None = None) -> float:
    """How much vLLM's metric ``name`` grew over ``results[start:last + 1]`` (a module's part of a
    shared run; 0 where the registry does not have it yet)."""
    end = results[-1 if last is None else last]["metrics"] or {}
    before = (results[start - 1]["metrics"] or {}) if start > 0 else {}
    return float(end.get(name, 0)) - float(before.get(name, 0))
