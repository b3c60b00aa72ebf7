"""DeepSeek-family models (MLA) through real vLLM CPU processes: the latent cache stored by one
process and loaded by another, exactly, and once per node whatever the tensor parallelism.

Tiny random DeepSeek-V2 and V3 models (tierkv.testing.hybrid_models, ``initializer_range``
0.15). vLLM picks its MLA backend by the CPU: ``AMX_MLA`` (block 128, its prefix cache on) where
the CPU has AMX tiles, ``CPU_MLA`` (block 16, its prefix cache off) elsewhere; on an AMX CPU the
suite also runs ``CPU_MLA``, forced, so both are covered wherever both can run. Per family and
backend:

- the truth: vLLM fed its own pages back at the same hit (tierkv.testing.page_copy, one
  process, no tierkv): P (600 tokens) alone, then served again from its own pages (599: a hit
  that ends inside a block); Q1 (a 512-token document and a question) alone, then Q2 (the same
  document, another question) from Q1's pages (512: a block boundary). vLLM's own prefix cache
  does not equal a no-cache run for MLA (0.36 to 0.62 on these models without AMX: the
  prefill-with-context path sums otherwise), so a hit is held to vLLM fed the same pages, bit for
  bit. Where vLLM keeps its prefix cache on (``AMX_MLA``), Q2 after Q1 in that process is vLLM's
  own cache at 512 too, and tierkv's Q2 must equal it bit for bit as well;
- process A (tierkv over one ``shm`` pool with an ``fs`` tier below) serves P and Q1; process B,
  new, on the same pool, serves P and Q2: it loads 599 and 512 tokens, and every output (tokens
  and top-5 logprobs of 8 generated tokens) equals the truth's bit for bit; for DeepSeek-V2 a
  third process reads the ``fs`` tier alone.

A last test runs DeepSeek-V2 at ``tensor_parallel_size=2`` (two worker processes) over a pool:
rank 0 alone stores, the pool holds one copy, both ranks load, the output is the truth's (a TP=2
page-copy run).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from exactness import assert_same_generation
from vllm_events import Subscriber, free_port
from vllm_marks import VLLM_PROCESSES
from vllm_truth import CHUNK, VLLM_ENV, after_saves, saves_a_cut, tokens

from tierkv.ops.amx_tiles import cpu_has_amx
from tierkv.testing.hybrid_models import MLA_FAMILIES, save_hybrid_model
from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm
from tierkv_backends.shm import SharedMemoryBackend

pytestmark = VLLM_PROCESSES
TOP, MAX_TOKENS, POOL = 5, 8, 256 << 20
P = tokens(61, 600)
DOC = tokens(63, 512)
Q1, Q2 = DOC + tokens(64, 40), DOC + tokens(65, 40)
HITS = [len(P) - 1, len(DOC)]  # B's: all but P's last token; Q2's document
DEFAULT = "AMX_MLA" if cpu_has_amx() else "CPU_MLA"  # what vLLM picks here for a bf16 MLA model
BACKENDS = [pytest.param("default", id=DEFAULT),
            pytest.param("CPU_MLA", id="CPU_MLA-forced", marks=pytest.mark.skipif(
                DEFAULT == "CPU_MLA", reason="vLLM picks CPU_MLA on this CPU (no AMX tiles): the default run is it"))]


def pages(request: dict[str, Any], salt: str) -> dict[str, Any]:
    return {**request, "cache_salt": salt}


TRUTH = [pages({"ids": P, "kv_transfer_params": {"page_copy": {"save_as": "P"}}}, "t-p"),
         pages({"ids": P, "kv_transfer_params": {"page_copy": {"load_from": "P", "tokens": HITS[0]}}}, "t-p-hit"),
         pages({"ids": Q1, "kv_transfer_params": {"page_copy": {"save_as": "Q1"}}}, "t-q1"),
         pages({"ids": Q2, "kv_transfer_params": {"page_copy": {"load_from": "Q1", "tokens": HITS[1]}}}, "t-q2"),
         pages({"ids": Q1}, "own"), pages({"ids": Q2}, "own")]  # vLLM's own cache, where it keeps one


def run_spec(model: Path, backend: str, prompts: list[Any], extra: dict[str, Any] | None, **more: Any
             ) -> dict[str, Any]:
    spec = {"model": str(model), "prompts": prompts, "max_tokens": MAX_TOKENS, "logprobs": TOP, "tierkv": extra,
            "max_model_len": 2048, **more}
    if backend != "default":
        spec["attention_backend"] = backend
    return spec


def tiers_extra(tiers: list[dict[str, Any]], stats: Path) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "tiers": tiers}, "stats_file": str(stats)}


def pool_chunks(path: str) -> int:
    tier = SharedMemoryBackend("node", POOL, path=path)
    try:
        return int(tier.stats()["pool_chunks"])
    finally:
        asyncio.run(tier.close())


def assert_bit_for_bit(name: str, ours: dict[str, Any], truth: dict[str, Any]) -> None:
    assert_same_generation(name, ours["tokens"], ours["logprobs"], truth["tokens"], truth["logprobs"], MAX_TOKENS, 0.0)


def new_pool() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    return f"{base}/tierkv-test-mla-{uuid.uuid4().hex[:12]}.pool"


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Per (family, backend), run lazily once: the truth, A, B (and for DeepSeek-V2 with the
    default backend, C over the fs tier alone), their stats, the pool's chunk count."""
    made: dict[tuple[str, str], dict[str, Any]] = {}
    pools: list[str] = []

    def runs(family: str, backend: str) -> dict[str, Any]:
        if (family, backend) in made:
            return made[family, backend]
        work = tmp_path_factory.mktemp(f"{family}-{backend}")
        model = save_hybrid_model(family, work / "model")
        truth = run_vllm({**run_spec(model, backend, TRUTH, None, prefix_caching=True), "page_copy": True},
                         work / "truth", env=VLLM_ENV)
        pool = new_pool()
        pools.append(pool)
        node = {"name": "node", "backend": "shm", "path": pool, "capacity": POOL}
        files = {"name": "files", "backend": "fs", "path": str(work / "fs"), "capacity": "1GiB"}
        retained = {"ids": Q1, "kv_transfer_params": {"tierkv": {"retain_s": 600}},  # a hint, as for any model
                    "then_wait_for": ["hint_retained_tokens", len(Q1)]}  # its save lands after the call
        a = run_vllm(run_spec(model, backend, [P, retained], tiers_extra([node, files], work / "a.json")),
                     work / "a", env=VLLM_ENV)
        port = free_port()
        subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
        try:  # B with vLLM's KV events and metrics: what a router and /metrics see of an MLA hit
            b = run_vllm({**run_spec(model, backend, [P, Q2], tiers_extra([node], work / "b.json")),
                          "kv_events": f"tcp://*:{port}", "metrics": True}, work / "b", env=VLLM_ENV)
        finally:
            subscriber.close()
        events = [{"kind": type(event).__name__, "medium": getattr(event, "medium", None),
                   "group": getattr(event, "group_idx", None), "spec": getattr(event, "kv_cache_spec_kind", None),
                   "blocks": len(getattr(event, "block_hashes", []))} for event in subscriber.events]
        found = {"truth": truth, "a": a, "b": b, "pool_chunks": pool_chunks(pool), "b_events": events}
        if family == "deepseek_v2" and backend == "default":
            found["c"] = run_vllm(run_spec(model, backend, [P, Q2], tiers_extra([files], work / "c.json")),
                                  work / "c", env=VLLM_ENV)
        (work / "results.json").write_text(json.dumps(found))  # for a look after a failure
        made[family, backend] = found
        return found

    yield runs
    for pool in pools:
        Path(pool).unlink(missing_ok=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_a_new_process_loads_what_another_stored_through_one_pool(family: str, backend: str, mla_runs: Any) -> None:
    runs = mla_runs(family, backend)
    assert loaded_per_prompt(runs["a"]) == [0, 0], "A finds nothing cached"
    assert loaded_per_prompt(runs["b"]) == HITS, "B loads what A stored: all of P but its last token, Q2's document"
    for name in ("a", "b"):
        stats = runs[name][-1]["stats"] or {}
        assert not stats.get("disabled"), f"tierkv turned itself off for this MLA model: {stats}"
        assert stats.get("load_failures", 0) == 0 and stats.get("save_failures", 0) == 0, stats
    chunks = -(-len(P) // CHUNK) + -(-len(Q1) // CHUNK) + 1  # B adds Q2's last chunk (its question), nothing else
    step = int((runs["a"][-1]["stats"] or {})["continuation_step"])
    cuts = sum(saves_a_cut(len(prompt), step) for prompt in (P, Q1, Q2))
    assert runs["pool_chunks"] == chunks + cuts, "each chunk once in the pool: B stores only what A had not"
    assert (runs["a"][-1]["stats"] or {}).get("hint_retained_tokens") == len(Q1), "every token of Q1 retained"


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_routers_and_metrics_see_an_mla_hit_as_vllms_own_blocks(family: str, mla_runs: Any) -> None:
    """B's KV events announce the pool's chunks as vLLM announces its own MLA blocks (group 0,
    ``mla_attention``), and vLLM's per-source hit count takes both hits as host memory (the pool)."""
    runs = mla_runs(family, "default")
    ours = [event for event in runs["b_events"] if event["kind"] == "BlockStored" and event["medium"] == "node"]
    assert ours, f"no BlockStored from the pool among {runs['b_events']}"
    assert {(event["group"], event["spec"]) for event in ours} == {(0, "mla_attention")}
    host = (runs["b"][-1]["metrics"] or {}).get("vllm:prompt_tokens_cached_by_source:host", 0)
    assert host == sum(HITS), runs["b"][-1]["metrics"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_every_output_is_vllm_fed_its_own_pages_at_the_same_hit(family: str, backend: str, mla_runs: Any) -> None:
    runs = mla_runs(family, backend)
    truth, a, b = runs["truth"], runs["a"], runs["b"]
    assert [result["cached_tokens"] for result in truth[:4]] == [0, HITS[0], 0, HITS[1]], "the truth's own hits"
    assert_bit_for_bit(f"{family} A: P, a miss", a[0], truth[0])
    assert_bit_for_bit(f"{family} A: Q1, a miss", a[1], truth[2])
    assert_bit_for_bit(f"{family} B: P, a {HITS[0]}-token hit", b[0], truth[1])
    assert_bit_for_bit(f"{family} B: Q2, a {HITS[1]}-token hit", b[1], truth[3])
    own = truth[5]["cached_tokens"]
    if own:  # vLLM keeps its prefix cache on (AMX_MLA): its own hit at the same length, bit for bit too
        assert own == HITS[1], f"vLLM's own cache hit {own} of Q2"
        assert_bit_for_bit(f"{family} B: Q2 against vLLM's own cache", b[1], truth[5])
    else:
        assert "CPU_MLA" in (DEFAULT, backend), "vLLM turns its prefix cache off for CPU_MLA alone"


def test_an_fs_tier_serves_a_new_process(mla_runs: Any) -> None:
    """DeepSeek-V2: a third process over the fs tier A wrote through to, alone."""
    runs = mla_runs("deepseek_v2", "default")
    assert loaded_per_prompt(runs["c"]) == HITS
    assert_bit_for_bit("fs: P", runs["c"][0], runs["truth"][1])
    assert_bit_for_bit("fs: Q2", runs["c"][1], runs["truth"][3])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel workers need two cores to bind")
def test_tensor_parallel_ranks_share_one_copy(tmp_path: Path) -> None:
    """DeepSeek-V2 at ``tensor_parallel_size=2`` over one pool: the keys bind no TP rank, rank 0
    alone saves (every tier is one both ranks read), both ranks load all of P but its last token
    from the one copy, and the output is a TP=2 vLLM fed its own pages at the same hit."""
    model = save_hybrid_model("deepseek_v2", tmp_path / "model")
    env = {**VLLM_ENV, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    truth = run_vllm({**run_spec(model, "default", TRUTH[:2], None, tensor_parallel_size=2), "page_copy": True},
                     tmp_path / "truth", env=env)
    pool = new_pool()
    try:
        node = {"name": "node", "backend": "shm", "path": pool, "capacity": POOL}
        repeat = after_saves(1, P)  # once the first's save landed
        results = run_vllm(run_spec(model, "default", [P, repeat], tiers_extra([node], tmp_path / "stats.json"),
                                    tensor_parallel_size=2), tmp_path / "tierkv", env=env)
        stored = pool_chunks(pool)
    finally:
        Path(pool).unlink(missing_ok=True)
    rank0 = json.loads((tmp_path / "stats.json").read_text())
    rank1 = json.loads((tmp_path / "stats.json.rank1").read_text())
    cut = int(saves_a_cut(len(P), int(rank0["continuation_step"])))
    assert stored == -(-len(P) // CHUNK) + cut, "one copy of P's chunks (and its cut) for both ranks"
    assert rank0.get("chunks_saved") == stored - cut and not rank1.get("chunks_saved"), (rank0, rank1)
    assert rank0.get("continuation_tails_saved", 0) == cut and not rank1.get("continuation_tails_saved"), rank1
    assert rank1.get("saves_left_to_rank0", 0) >= 1, rank1
    assert rank0.get("tokens_loaded") == rank1.get("tokens_loaded") == HITS[0], "both ranks load the hit"
    assert loaded_per_prompt(results) == [0, HITS[0]]
    assert_bit_for_bit("TP=2: P, a miss", results[0], truth[0])
    assert_bit_for_bit("TP=2: P, a hit", results[1], truth[1])
