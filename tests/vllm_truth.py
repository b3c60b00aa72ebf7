"""The truth a vLLM test compares against: one context-dependent random Llama and one run of
vLLM without tierkv over every prompt the vLLM tests ask (session fixtures in conftest.py),
and the comparison itself (:func:`assert_exact`: tokens and top-5 log-probabilities).

The model's output depends on its context (``initializer_range=0.15``: with transformers'
default 0.02 a random Llama answers every prompt with the same tokens, and equal outputs prove
nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from exactness import assert_same_generation

from tierkv.testing.vllm_runner import run_vllm

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
