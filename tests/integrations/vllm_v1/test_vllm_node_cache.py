"""Real vLLM (CPU build) processes sharing one node cache, the ``shm`` tier, with no new option
beyond the tier:

- two replicas running at once: a prompt replica A prefilled is a hit in replica B (the tokens
  come from tierkv), B's output is the truth's (tests/vllm_truth.py: tokens and top-5
  log-probabilities), and the pool holds the prompt once (B stores nothing of it again);
- a prefill instance (``kv_producer``) and a decode instance (``kv_consumer``) on one pool: the
  producer saves every block of the prompt, the partial last one included; the consumer loads
  all but the last token, answers as the truth says, and stores nothing.

Each replica's first request is a hit or leads to one in a new process: on an AMX CPU its first
forward is vLLM's AMX attention on a cached context (the connector asks for the tile state).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_marks import RUN_S, VLLM_PROCESSES
from vllm_truth import CHUNK, PROMPTS, VLLM_ENV, Truth, assert_truthful, saves_a_cut, spec, vllm

from tierkv.testing.processes import stop_group
from tierkv.testing.vllm_runner import finish_vllm, loaded_per_prompt, start_vllm
from tierkv_backends.shm import SharedMemoryBackend

# STEP_S bounds each step's wait (A's start and first save, A's pause while B runs, A's end), as
# run_vllm bounds B's run: on a loaded 2-core machine (load 4-12) a vLLM start and a prompt take
# minutes, not the seconds they take on a quiet one; the test's budget is VLLM_PROCESSES' (it
# covers the session's reference run too, a fixture this test may be the one to make). Whatever
# ends the test, replica A's whole process group is stopped (start_held, stop_group).
STEP_S = float(RUN_S)
pytestmark = VLLM_PROCESSES
CAPACITY = 256 << 20
HOLD = Path(__file__).resolve().parents[2] / "vllm_hold.py"


def node_extra(pool_path: Path, stats: Path) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "tiers": [{"name": "node", "backend": "shm", "path": str(pool_path),
                                                        "capacity": CAPACITY}]},
            "stats_file": str(stats)}


def chunks_of(*names: str) -> int:
    """The chunks a save of each prompt leaves: its whole chunks, its partial last one, and its
    cut at the connector's step where that ends inside the last chunk and short of its end (a
    continuation tail: 592 of 600, 992 of 1,000)."""
    total = 0
    for name in names:
        length = len(PROMPTS[name])
        total += -(-length // CHUNK) + int(saves_a_cut(length))
    return total


def pool_chunks(pool_path: Path) -> int:
    import asyncio

    tier = SharedMemoryBackend("node", CAPACITY, path=str(pool_path))
    try:
        return int(tier.stats()["pool_chunks"])
    finally:
        asyncio.run(tier.close())


def start_held(run_spec: dict[str, Any], workdir: Path, go: Path) -> subprocess.Popen[str]:
    """tierkv.testing.vllm_runner.start_vllm's process (same cores as the reference, a process
    group of its own), run through tests/vllm_hold.py: a prompt's pause ends once ``go`` exists."""
    return start_vllm(run_spec, workdir, env={**VLLM_ENV, "TIERKV_TEST_GO": str(go)},
                      command=[sys.executable, str(HOLD)])


def wait_for_saves(stats_file: Path, count: int, process: Any) -> None:
    """Until replica A's stats file reports ``count`` saved requests (a failure detector bounded
    by STEP_S, not a timing: on a busy machine a vLLM start and a prompt take minutes)."""
    deadline = time.monotonic() + STEP_S
    while time.monotonic() < deadline:
        if stats_file.exists():
            try:
                if json.loads(stats_file.read_text()).get("requests_saved", 0) >= count:
                    return
            except ValueError:
                pass  # being replaced
        if process.poll() is not None:
            pytest.fail(f"replica A ended before it reported {count} save(s):\n{process.stderr.read()[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"replica A did not report {count} save(s) within {STEP_S:.0f} s")


def test_two_replicas_running_at_once_share_one_pool(context_llama: Path, pool_path: Path, tmp_path: Path,
                                                     truths: dict[str, Truth]) -> None:
    first = PROMPTS["partial_600"]
    go = tmp_path / "b-done"
    later = {"ids": PROMPTS["partial_1000"], "pause_s": STEP_S}  # A stays up until B is done (go), STEP_S at most
    a_stats = tmp_path / "a.json"
    replica_a = start_held(spec(context_llama, [first, later], node_extra(pool_path, a_stats)), tmp_path / "a", go)
    try:
        wait_for_saves(a_stats, 1, replica_a)
        assert pool_chunks(pool_path) == chunks_of("partial_600")
        b_results = vllm(spec(context_llama, [first], node_extra(pool_path, tmp_path / "b.json")), tmp_path / "b")
        assert replica_a.poll() is None, "replica A ran beside B until B was done"
        go.touch()
        a_results = finish_vllm(replica_a, timeout=STEP_S)
    finally:
        stop_group(replica_a)  # replica A's engine core and worker too, however the test ends
    assert loaded_per_prompt(b_results) == [len(first) - 1], "B's prompt came from the pool A filled"
    assert_truthful("replica B", b_results[0], len(first) - 1, truths["partial_600"])
    assert b_results[0]["stats"].get("chunks_saved", 0) == 0, "B stored nothing again: one copy on the node"
    assert loaded_per_prompt(a_results) == [0, 0]
    assert_truthful("replica A", a_results[0], 0, truths["partial_600"])
    assert_truthful("replica A, later", a_results[1], 0, truths["partial_1000"])
    assert pool_chunks(pool_path) == chunks_of("partial_600", "partial_1000"), "each prompt once in host memory"


def test_a_producer_prefills_into_the_pool_and_a_consumer_decodes_from_it(
        context_llama: Path, pool_path: Path, tmp_path: Path, truths: dict[str, Truth]) -> None:
    names = ["partial_600", "block_edge_513"]  # each ends with a partial chunk
    producer = vllm({**spec(context_llama, [PROMPTS[n] for n in names], node_extra(pool_path, tmp_path / "p.json")),
                     "role": "kv_producer"}, tmp_path / "producer")
    stored = pool_chunks(pool_path)
    assert stored == chunks_of(*names), "every block of each prompt, the partial last one included"
    assert loaded_per_prompt(producer) == [0, 0]
    consumer = vllm({**spec(context_llama, [PROMPTS[n] for n in names], node_extra(pool_path, tmp_path / "c.json")),
                     "role": "kv_consumer"}, tmp_path / "consumer")
    hits = loaded_per_prompt(consumer)
    assert hits == [len(PROMPTS[n]) - 1 for n in names], "all but the last token"
    for name, result, hit in zip(names, consumer, hits):
        assert_truthful(f"consumer: {name}", result, hit, truths[name])
    assert consumer[-1]["stats"].get("chunks_saved", 0) == 0 and pool_chunks(pool_path) == stored, \
        "a consumer stores nothing"
