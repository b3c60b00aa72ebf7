"""Hybrid models through real vLLM CPU processes, the hybrid KV cache manager on: every KV cache
group stored by one process and loaded by another, exactly.

One tiny random-weight model per family that runs here (tierkv.testing.hybrid_models, weights
at ``initializer_range`` 0.15 so a wrong state or window moves the logprobs): Gemma 3 and
gpt-oss (sliding window + full attention), Qwen3-Next (Gated DeltaNet + full), Nemotron-H
(Mamba2 + attention, 128-token steps: vLLM's CPU prefix caching for it needs them). Per family:

- process A serves four prompts of 1,000 tokens (the fourth after its first 513 tokens alone)
  into an ``fs`` tier; for the families with a recurrent state, one group's state after 768
  tokens of the fourth is then deleted from the tier (its KV stays);
- process B, new, serves prompts sharing 769, 600, 300 and 769 tokens with A's four: hits of
  768 (ending exactly on a block boundary), 512, 256, and for the fourth 512 where a state
  was deleted (a shorter hit, never KV without its state), else 768;
- vLLM alone (no connector, its prefix cache on) is the truth (tests/vllm_truth.py): per B
  prompt, once with nothing cached, then once hitting its own cache at B's hit (after B's
  first hit + 1 tokens alone, under a salt of its own). B's answers are held to vLLM alone
  within 1.5 times the widest distance of vLLM's own cache from it in that run, 0.01 at least:
  on AVX2 vLLM's own cache of gemma3 and gpt-oss moves logprobs by 0.035 and 0.067 (its
  sliding-window attention sums a cached context in another order than a prefill). Not bit for
  bit at an equal hit, as for a dense model: the pages themselves depend on the batch that
  computed them (gpt-oss's experts; the tokens A stored after its own hit), so vLLM's own cache
  holds other bytes than the ones tierkv stored (gpt-oss 0.036 apart at 768 tokens). The truth
  runs first: a family vLLM's CPU build cannot run on this CPU at all is skipped, naming vLLM's
  error (a limit of vLLM's kernels there, not of tierkv).

A last test runs Nemotron-H's A and B as two replicas of one node sharing an ``shm`` pool.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from exactness import worst_difference
from vllm_marks import VLLM_PROCESSES
from vllm_truth import VLLM_ENV, Truth, assert_truthful

from tierkv.chunks.serde import decode_header
from tierkv.testing.hybrid_models import save_hybrid_model
from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm

pytestmark = VLLM_PROCESSES
CHUNK, TOP, MAX_TOKENS = 256, 5, 4
STEP_TOKENS = {"nemotron_h": 128, "qwen3_next": 256}  # vLLM's steps: each ends on a block boundary
RECURRENT = ("nemotron_h", "qwen3_next")
FAMILIES = ("gemma3", "gpt_oss", "qwen3_next", "nemotron_h")


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + index * 104729) % 1000 + 1 for index in range(count)]


A_PROMPTS = [tokens(seed, 1000) for seed in (21, 22, 23, 24)]
SHARED = [769, 600, 300, 769]  # B's prompt i shares this many tokens with A's
B_PROMPTS = [a[:shared] + tokens(30 + i, 60) for i, (a, shared) in enumerate(zip(A_PROMPTS, SHARED))]


def expected_hits(family: str) -> list[int]:
    return [768, 512, 256, 512 if family in RECURRENT else 768]


def chunk_tokens(count: int) -> int:
    return count // CHUNK * CHUNK


def run_spec(model: Path, family: str, prompts: list[Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": str(model), "prompts": prompts, "max_tokens": MAX_TOKENS, "logprobs": TOP,
            "prefix_caching": True, "max_model_len": 2048,
            "max_num_batched_tokens": STEP_TOKENS.get(family, 2048), "tierkv": extra}


def tiers_extra(tiers: list[dict[str, Any]], stats: Path) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "tiers": tiers}, "stats_file": str(stats)}


def a_prompts() -> list[Any]:
    """A's prompts; the fourth's first 513 tokens alone first, and each prompt once the saves of
    those before it landed, so the state files the fourth adds are the newest on the tier."""
    first_part = A_PROMPTS[3][:513]
    prompts: list[Any] = [A_PROMPTS[0]]
    saved = chunk_tokens(1000)
    for prompt in (A_PROMPTS[1], A_PROMPTS[2], first_part, A_PROMPTS[3]):
        prompts.append({"ids": prompt, "wait_for": ["hybrid_tokens_saved", saved]})
        saved += chunk_tokens(len(prompt))
    return prompts


def state_files(directory: Path) -> list[Path]:
    """The fs tier's chunk files holding a recurrent state (raw int8 pages), newest last."""
    found = []
    for path in directory.rglob("*"):
        if path.is_file():
            try:
                header = decode_header(path.read_bytes()[:4096])
            except Exception:  # noqa: BLE001 - not a chunk file (the tier's own files)
                continue
            if str(header.dtype) == "torch.int8":
                found.append(path)
    return sorted(found, key=lambda path: path.stat().st_mtime_ns)


def truth_prompts(family: str) -> list[Any]:
    """Per B prompt: alone (a salt of its own), then its first hit + 1 tokens and itself under
    another salt (vLLM's own cache hits it as far as B's hit)."""
    prompts: list[Any] = []
    for index, (prompt, hit) in enumerate(zip(B_PROMPTS, expected_hits(family))):
        own = f"own-{index}"
        prompts += [{"ids": prompt, "cache_salt": f"alone-{index}"}, {"ids": prompt[:hit + 1], "cache_salt": own},
                    {"ids": prompt, "cache_salt": own}]
    return prompts


def truths_of(results: list[dict[str, Any]]) -> list[Truth]:
    alone, own = results[0::3], results[2::3]
    spread = max(worst_difference(cached, first) for cached, first in zip(own, alone))
    return [Truth(first, cached, spread, exact_at_own_hit=False) for first, cached in zip(alone, own)]


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per family (run lazily, once): A's and B's results and stats, and vLLM alone's."""
    made: dict[str, dict[str, Any]] = {}
    cannot_run: dict[str, str] = {}  # family -> why vLLM alone could not run it here

    def runs(family: str) -> dict[str, Any]:
        if family in cannot_run:
            pytest.skip(cannot_run[family])
        if family in made:
            return made[family]
        work = tmp_path_factory.mktemp(family)
        model = save_hybrid_model(family, work / "model")
        try:  # vLLM alone first: a family vLLM's CPU build cannot run on this CPU is not tierkv's to test
            truth = run_vllm(run_spec(model, family, truth_prompts(family), None), work / "truth", env=VLLM_ENV)
        except RuntimeError as exc:
            if "did not end within" in str(exc):  # slow is not unable: a timeout fails the test
                raise
            cannot_run[family] = (f"vLLM alone (no connector) cannot run {family} on this CPU: "
                                  f"{str(exc).strip().splitlines()[-1][:300]}")
            pytest.skip(cannot_run[family])
        tier = [{"name": "disk", "backend": "fs", "path": str(work / "fs"), "capacity": "1GiB"}]
        a = run_vllm(run_spec(model, family, a_prompts(), tiers_extra(tier, work / "a.json")), work / "a",
                     env=VLLM_ENV)
        evicted = None
        if family in RECURRENT:
            evicted = state_files(work / "fs")[-1]  # one group's state after 768 tokens of A's fourth prompt
            evicted.unlink()
        b = run_vllm(run_spec(model, family, B_PROMPTS, tiers_extra(tier, work / "b.json")), work / "b",
                     env=VLLM_ENV)
        made[family] = {"a": a, "b": b, "truth": truths_of(truth), "evicted": evicted,
                        "b_stats": json.loads((work / "b.json").read_text())}
        (work / "results.json").write_text(json.dumps({"a": a, "b": b, "truth": truth}))  # for a look after a failure
        return made[family]

    return runs  # type: ignore[return-value]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_process_loads_every_group_of_the_hits_another_stored(family: str, hybrid_runs: Any) -> None:
    runs = hybrid_runs(family)
    assert loaded_per_prompt(runs["b"]) == expected_hits(family), "each hit, whole chunks, from tierkv"
    stats = runs["b_stats"]
    groups = sorted(name for name in stats if name.startswith("tokens_loaded_group"))
    assert len(groups) >= 2 and all(stats[name] > 0 for name in groups), f"every group loaded some: {stats}"
    assert stats.get("load_failures", 0) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_what_a_hybrid_hit_computes_is_what_vllm_computes_alone(family: str, hybrid_runs: Any) -> None:
    runs = hybrid_runs(family)
    for index, (ours, hit, truth) in enumerate(zip(runs["b"], loaded_per_prompt(runs["b"]), runs["truth"])):
        assert_truthful(f"{family} prompt {index}", ours, hit, truth, MAX_TOKENS)


@pytest.mark.parametrize("family", RECURRENT)
def test_a_state_gone_while_its_kv_stays_is_a_shorter_hit(family: str, hybrid_runs: Any) -> None:
    """The state after 768 tokens of A's fourth prompt was deleted (one group's): B's fourth
    prompt loads the 512 tokens below it, with their states, and computes what vLLM alone does."""
    runs = hybrid_runs(family)
    assert runs["evicted"] is not None
    assert loaded_per_prompt(runs["b"])[3] == 512
    assert runs["b"][3]["tokens"] == runs["truth"][3].alone["tokens"]


def test_two_replicas_share_a_hybrid_models_chunks_through_one_pool(pool_path: Path,
                                                                     tmp_path_factory: pytest.TempPathFactory,
                                                                     hybrid_runs: Any) -> None:
    """Nemotron-H (Mamba2 + attention) through the node's shm pool: replica B's hits come from
    what replica A stored there, exactly."""
    family = "nemotron_h"
    truth = hybrid_runs(family)["truth"]
    work = tmp_path_factory.mktemp("replicas")
    model = save_hybrid_model(family, work / "model")
    pool = [{"name": "node", "backend": "shm", "path": str(pool_path), "capacity": "256MiB"}]
    run_vllm(run_spec(model, family, A_PROMPTS[:3], tiers_extra(pool, work / "a.json")), work / "a", env=VLLM_ENV)
    b = run_vllm(run_spec(model, family, B_PROMPTS[:3], tiers_extra(pool, work / "b.json")), work / "b",
                 env=VLLM_ENV)
    hits = loaded_per_prompt(b)
    assert hits == [768, 512, 256]
    for index, (ours, hit, want) in enumerate(zip(b, hits, truth)):
        assert_truthful(f"replica B prompt {index}", ours, hit, want, MAX_TOKENS)


def test_hints_reach_every_group_of_a_hybrid_model(pool_path: Path, tmp_path: Path) -> None:
    """Nemotron-H (Mamba2 + attention) on one shm pool. Process A stores four prompts, one with
    ``retain_s`` (each group's chunks leased: counted in tokens), then sends one of them again
    with ``drop`` and a tenant's request with ``drop_tenant``; process B, new (nothing in vLLM's
    own cache), finds the retained prompt and the other tenant's, and neither dropped one; vLLM
    counts those hits as host memory."""
    family = "nemotron_h"
    model = save_hybrid_model(family, tmp_path / "model")
    kept, dropped, tenant_a, tenant_b = (tokens(seed, 600) for seed in (41, 42, 43, 44))
    pool = [{"name": "node", "backend": "shm", "path": str(pool_path), "capacity": "256MiB"}]
    saved = chunk_tokens(600)

    def hinted(ids: list[int], wait_for: list[Any], salt: str | None = None, **hints: object) -> dict[str, Any]:
        prompt: dict[str, Any] = {"ids": ids, "wait_for": wait_for}
        if salt is not None:
            prompt["cache_salt"] = salt
        if hints:
            prompt["kv_transfer_params"] = {"tierkv": hints}
        return prompt

    a_prompts = [
        {"ids": kept, "kv_transfer_params": {"tierkv": {"retain_s": 600}}},
        hinted(dropped, ["hybrid_tokens_saved", saved]),
        hinted(tenant_a, ["hybrid_tokens_saved", 2 * saved], salt="tenant-a"),
        hinted(tenant_b, ["hybrid_tokens_saved", 3 * saved], salt="tenant-b"),
        hinted(dropped, ["hybrid_tokens_saved", 4 * saved], drop=True),  # the session's last turn
        hinted(tokens(45, 100), ["hint_dropped_tokens", saved], salt="tenant-a", drop_tenant=True),
        hinted(tokens(46, 100), ["hint_dropped_scope_chunks", 1], prefetch_token_ids=kept),
        hinted(tokens(47, 100), ["hint_prefetched_tokens", saved]),
    ]
    a = run_vllm(run_spec(model, family, a_prompts, tiers_extra(pool, tmp_path / "a.json")), tmp_path / "a",
                 env=VLLM_ENV)
    stats = a[-1]["stats"]
    assert stats["hint_retained_tokens"] == saved, "the retained prompt's whole chunks, in every group"
    assert stats["hint_dropped_tokens"] == saved
    assert stats["hint_dropped_scope_chunks"] >= 2 * (saved // CHUNK), "tenant A's chunks of both groups"
    assert stats["hint_prefetched_tokens"] == saved
    b_prompts = [kept, dropped, {"ids": tenant_a, "cache_salt": "tenant-a"}, {"ids": tenant_b, "cache_salt": "tenant-b"}]
    b = run_vllm({**run_spec(model, family, b_prompts, tiers_extra(pool, tmp_path / "b.json")), "metrics": True},
                 tmp_path / "b", env=VLLM_ENV)
    assert loaded_per_prompt(b) == [saved, 0, 0, saved], "the dropped prompt and tenant miss; the others hit"
    host = [(result["metrics"] or {}).get("vllm:prompt_tokens_cached_by_source:host", 0) for result in b]
    assert [now - before for before, now in zip([0, *host], host)] == [saved, 0, 0, saved], \
        "vLLM counts a hybrid hit from the pool as host memory (every group's chunks there)"


def test_a_hybrid_models_chunks_are_announced_per_group_as_vllm_announces_its_blocks(tmp_path: Path) -> None:
    """Nemotron-H (Mamba2 + attention) with vLLM's KV events on and a cpu tier: tierkv announces
    each group's chunks with that group's ``group_idx`` and vLLM's kind, with the block hashes
    vLLM computes (what a router matches): an attention group every block of its chunks, as vLLM
    announces its own; a state group the block each stored state ends (vLLM's own cache keeps
    only the state at the prompt's last block; tierkv has one at every chunk's end)."""
    from vllm_events import Subscriber, free_port

    family = "nemotron_h"
    model = save_hybrid_model(family, tmp_path / "model")
    prompts = [tokens(seed, 600) for seed in (51, 52)]
    port = free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    host = [{"name": "host", "backend": "cpu", "capacity": "256MiB"}]
    spec = {**run_spec(model, family, [prompts[0], {"ids": prompts[1], "wait_for": ["hybrid_tokens_saved", 512]}],
                       tiers_extra(host, tmp_path / "stats.json")), "kv_events": f"tcp://*:{port}"}
    try:
        run_vllm(spec, tmp_path / "run", env=VLLM_ENV)
    finally:
        subscriber.close()
    stored = [e for e in subscriber.events if type(e).__name__ == "BlockStored"]
    ours = [e for e in stored if e.medium == "host"]
    vllm_own: dict[int | None, set[Any]] = {}
    for event in stored:
        if event.medium != "host":
            vllm_own.setdefault(event.group_idx, set()).update(event.block_hashes)
    assert ours, f"no BlockStored with medium 'host' among {len(subscriber.events)} events"
    groups = {e.group_idx for e in ours}
    assert len(groups) >= 2 and None not in groups, f"one announcement per group: {groups}"
    assert {e.kv_cache_spec_kind for e in ours} >= {"mamba"}, "the state group says it is vLLM's mamba kind"
    attention = next(e.group_idx for e in ours if e.kv_cache_spec_kind != "mamba")
    every_block = vllm_own.get(attention, set())  # vLLM's attention group announces every block it hashed
    block = ours[0].block_size
    for group in groups:
        announced = {h for e in ours if e.group_idx == group for h in e.block_hashes}
        assert announced <= every_block, f"group {group}: hashes vLLM did not compute for these prompts"
        kind = next(e.kv_cache_spec_kind for e in ours if e.group_idx == group)
        if kind == "mamba":  # the state at each chunk's end: its last block (vLLM keeps only the prompt's last)
            assert len(announced) == 2 * chunk_tokens(600) // CHUNK, f"group {group}: {len(announced)} states"
        else:
            assert announced <= vllm_own.get(group, set()), f"group {group}: hashes vLLM did not announce for it"
            assert len(announced) == 2 * chunk_tokens(600) // block, "each prompt's blocks in its two whole chunks"
