"""The serving benchmark's harness against a real ``vllm serve`` (CPU build) with tierkv, for a few
requests, so the benchmark (benchmarks/serving.py) cannot rot: the server starts with the
benchmark's flags, the client replays a closed-loop chat and a document trace through the
OpenAI-compatible API, streams every first token back, and the Prometheus counters show tierkv
loading the prefixes vLLM's small KV space let go."""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_marks import VLLM_PROCESSES

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import serving  # noqa: E402
import serving_workloads as workloads  # noqa: E402

pytestmark = VLLM_PROCESSES


def test_the_benchmark_client_replays_traces_against_vllm_serve_with_tierkv(context_llama: Path,
                                                                             tmp_path: Path) -> None:
    config = serving.Config("tierkv-cpu", [{"name": "host", "backend": "cpu", "capacity": "256MiB"}])
    documents = [workloads.tokens(50 + d, 1200) for d in range(3)]  # 3,600 tokens: more than vLLM keeps
    asked = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]  # each document back after the other two
    docqa = workloads.Trace("docqa", [workloads.Request(f"doc{d}-q{q}", tuple(documents[d] + workloads.tokens(
        90 + 10 * d + q, 24)), "docqa") for d, q in asked], concurrency=1)
    traces = [workloads.chat(users=2, rounds=2, system=256, context=256, question=32, answer=32), docqa]
    results, deltas, startup = serving.run_config(config, context_llama, traces, tmp_path, max_tokens=4)
    assert startup > 0
    chat, docs = results["chat"], results["docqa"]
    assert [r.name for r in chat] == [r.name for r in traces[0].requests], "every request answered, in trace order"
    assert len(docs) == 6
    for result in chat + docs:
        assert 0 < result.ttft <= result.latency and result.first_token is not None and result.generated == 4
    rounds = {r.name: r for r in chat}
    assert rounds["chat-u0-r1"].sent >= rounds["chat-u0-r0"].sent + rounds["chat-u0-r0"].latency - 0.05, \
        "a user's round waits for its previous round's answer"
    assert deltas["docqa"]["prompt_tokens"] == sum(len(r.prompt) for r in traces[1].requests)
    assert deltas["docqa"]["tierkv_tokens_loaded"] > 0, "tierkv supplied the documents vLLM let go"
    # vLLM's own count of prompt tokens from a connector (how the benchmarks count LMCache's) agrees
    assert deltas["docqa"]["external_loaded"] == deltas["docqa"]["tierkv_tokens_loaded"]
    row = serving.summarize("tierkv-cpu", "docqa", docs, deltas["docqa"], None, {})
    assert row["requests"] == 6 and row["tierkv_loaded_tok"] == int(deltas["docqa"]["tierkv_tokens_loaded"])
