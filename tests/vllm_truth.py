"""The truth a vLLM test compares against: one context-dependent random Llama, one run of vLLM
without tierkv over every prompt the vLLM tests ask (session fixtures in conftest.py), and the
comparison itself (:func:`assert_truthful`: tokens and top-5 log-probabilities).

**The truth is vLLM's own prefix cache, in the same run** (:class:`Truth`). The truth run serves
every prompt twice under a cache salt of its own (:func:`truth_prompts`): the first answer is
vLLM with nothing cached, the second hits vLLM's own prefix cache (whole blocks: 512 of a
600-token prompt); where tierkv's hit ends inside a block (all but a prompt's last token), a
third answer is vLLM fed its first answer's pages for exactly that many tokens
(tierkv.testing.page_copy: a connector that knows nothing of tierkv). A tierkv hit is then held to

- a miss: vLLM alone, bit for bit;
- a hit as long as the fed one: vLLM fed its own pages, bit for bit;
- a hit as long as vLLM's own (it ends on a block boundary): vLLM's own cached run, bit for bit;
- any other hit: within ``MARGIN`` times the widest distance of vLLM's own cache from vLLM
  alone over the whole truth run (at least ``FLOOR``), of vLLM alone.

Why not a fixed tolerance: how far a cached context moves the logprobs is the CPU's, not
tierkv's. On AVX2 and AVX-512 vLLM's own cache and tierkv's hits of this model are 0.0 from a
no-cache run; on an AMX CPU vLLM's AMX attention sums a long cached context in another order
than a prefill, and its own cache moves logprobs by ~0.03 (0.032 at a 512-token hit), where a
fixed 0.01 fails whatever tierkv does and a fixed 0.05 would hide a wrong byte on the others.
A corrupted block moves them by far more on every CPU (test_vllm_exact.py's negative control).

The two tierkv processes that tests/integrations/vllm_v1/test_vllm_v1.py and
test_vllm_exact.py share (:func:`first_run`, :func:`second_run`): each module's prompts run in
the same process, one after the other, made once per session (tests/session_once.py); each
module reads its own results, and counts of its part alone (:func:`loaded_in`, :func:`grown`).

The model's output depends on its context (``initializer_range=0.15``: with transformers'
default 0.02 a random Llama answers every prompt with the same tokens, and equal outputs prove
nothing).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from exactness import assert_same_generation, worst_difference
from session_once import once

from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm

CHUNK, BLOCK, TOP, MAX_TOKENS = 256, 128, 5, 8
FLOOR = 0.01
"""The least tolerance of a hit vLLM's cache cannot make: bf16 logprobs of two summation orders,
where vLLM's own cache is exact (AVX2, AVX-512)."""
MARGIN = 1.5
"""How far past vLLM's own cache's widest distance a hit of another length may land: it sums its
cached context in yet another order (on AMX, tierkv's 599-token hit 0.034 where vLLM's own
512-token hit was 0.032; gpt-oss on AVX2, 0.067 where vLLM's own was 0.067)."""
LAYERS, HIDDEN, HEADS, KV_HEADS = 2, 256, 4, 2
# The environment of every vLLM process of the suite:
# - vLLM's CPU backend reserves a core for other work when a KV connector is set: fewer compute
#   threads sum in another order, and bf16 logprobs move by a few hundredths. Every run here
#   reserves the same one, so the runs with and without tierkv compute on the same cores.
# - vLLM's engine core in the process that drives it (the worker stays a process of its own, so
#   the connector's scheduler and worker halves still talk across processes): an engine core
#   process imports vLLM once more and polls its peer, 36 s and 32 CPU-seconds for a one-prompt
#   run on this project's 2-core machine, against 17 and 15 in one process.
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + index * 104729) % 1000 + 1 for index in range(count)]


DOC = tokens(3, 2 * CHUNK)
PROMPTS = {
    # tests/integrations/vllm_v1/test_vllm_exact.py: the last loaded block partly filled, or the load ending on a block edge
    "partial_600": tokens(11, 600), "block_edge_513": tokens(12, 513), "partial_1000": tokens(13, 1000),
    # tests/integrations/vllm_v1/test_vllm_v1.py
    "repeated": tokens(1, 600),  # two chunks and a partial one
    "doc_q1": DOC + tokens(4, 40),
    "doc_q2": DOC + tokens(5, 40),  # shares the two document chunks with doc_q1
    "short": tokens(6, 100),  # shorter than a chunk
    # a chat's two turns: the second extends the first, whose end (420) lies inside a chunk and a
    # block; the first's save also keeps it cut at a step (416), which the second finds in a new process
    "turn_1": tokens(16, 420), "turn_2": tokens(16, 420) + tokens(17, 200),
    # test_vllm_exact.py's negative control: one chunk each (one corrupted block), a hit vLLM's
    # own cache makes (256 tokens) and one it cannot (299)
    "one_chunk_257": tokens(14, 257), "one_chunk_300": tokens(15, 300),
}
STEP = 16
"""Where the connector cuts a prompt's continuation tail and probes for one (its ``tail_step``
for vLLM's CPU blocks): a chat's next turn loads its previous turn up to a multiple of it."""
TURN_CUT = len(PROMPTS["turn_1"]) // STEP * STEP


def saves_a_cut(length: int, step: int = STEP) -> bool:
    """Whether a save of a ``length``-token prompt also stores it cut at its last multiple of
    ``step`` (the connector's ``continuation_step``; a continuation tail: where that cut ends
    inside the last chunk of CHUNK tokens, short of the prompt's end)."""
    return length // CHUNK * CHUNK < length // step * step < length


FED_HITS = {**{name: len(prompt) - 1 for name, prompt in PROMPTS.items() if (len(prompt) - 1) % BLOCK},
            "turn_2": TURN_CUT}
"""The truth run's hits fed from vLLM's own pages: every prompt's all-but-its-last-token (tierkv's
hit of a stored prompt) where vLLM's own cache cannot make it (it ends inside a block), and for
turn 2 the hit it has instead (turn 1's cut)."""


def vllm(run_spec: dict[str, Any], workdir: Path, pythonpath: Path | None = None,
         env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One vLLM process on the same cores as the reference; results also saved for a look after a failure."""
    results = run_vllm(run_spec, workdir, pythonpath=pythonpath, env={**VLLM_ENV, **(env or {})})
    (workdir / "results.json").write_text(json.dumps(results))
    return results


def after_saves(saved: int, ids: list[int], **params: object) -> dict[str, Any]:
    """A prompt sent once ``saved`` requests' saves landed (the stats file's ``requests_saved``,
    not a timing), with tierkv's ``kv_transfer_params`` where ``params`` are given."""
    prompt: dict[str, Any] = {"ids": ids, "wait_for": ["requests_saved", saved]}
    if params:
        prompt["kv_transfer_params"] = {"tierkv": params}
    return prompt


def spec(model_dir: Path, prompts: list[Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": str(model_dir), "prompts": prompts, "max_tokens": MAX_TOKENS, "logprobs": TOP, "tierkv": extra}


def truth_spec(model_dir: Path, prompts: Mapping[str, Any], fed_hits: Mapping[str, int] | None = None,
               **more: Any) -> dict[str, Any]:
    """vLLM alone (its prefix cache on) over :func:`truth_prompts` of ``prompts``; with
    ``fed_hits``, through tierkv.testing.page_copy's connector, which feeds vLLM its own pages."""
    spec_ = {**spec(model_dir, truth_prompts(prompts, fed_hits), None), "prefix_caching": True, **more}
    return {**spec_, "page_copy": True} if fed_hits else spec_


@dataclass(frozen=True)
class Truth:
    """What vLLM computes for one prompt in a truth run (:func:`truth_prompts`)."""

    alone: dict[str, Any]
    """The first answer: nothing cached."""
    own: dict[str, Any]
    """The second: the same prompt hitting vLLM's own prefix cache (``own["cached_tokens"]``)."""
    spread: float
    """The widest distance of vLLM's own cache from vLLM alone over the whole truth run: how far a
    cached context moves this model's logprobs on this CPU."""
    exact_at_own_hit: bool = True
    """Whether a hit as long as vLLM's own must equal it bit for bit: False where the cached pages
    themselves depend on the batch that computed them (a mixture of experts; tokens stored after
    a hit), so vLLM's own cache holds other bytes than the ones tierkv stored."""
    fed: dict[str, Any] | None = None
    """The prompt once more, vLLM fed its own pages at a hit its cache cannot make (one ending
    inside a block: ``fed["cached_tokens"]``; tierkv.testing.page_copy), where the run has one."""

    @property
    def own_hit(self) -> int:
        return int(self.own.get("cached_tokens") or 0)

    @property
    def fed_hit(self) -> int | None:
        return None if self.fed is None else int(self.fed.get("cached_tokens") or 0)

    @property
    def tolerance(self) -> float:
        """For a hit neither vLLM's own cache nor its fed pages made."""
        return max(FLOOR, MARGIN * self.spread)


def truth_prompts(prompts: Mapping[str, Any], fed_hits: Mapping[str, int] | None = None) -> list[Any]:
    """A truth run's prompts for a vLLM with its prefix cache on: each prompt twice in a row under
    a cache salt of its own (a prompt's own salt, a tenant's, is kept: it must then be unique to
    the prompt), so the first is a miss and the second a hit of its own blocks alone; for a prompt
    in ``fed_hits``, then once more under another salt fed its first answer's pages
    (tierkv.testing.page_copy) for that many tokens."""
    run: list[Any] = []
    for name, prompt in prompts.items():
        described = dict(prompt) if isinstance(prompt, dict) else {"ids": list(prompt)}
        described.setdefault("cache_salt", f"truth-{name}")
        first = {**described, "kv_transfer_params": {"page_copy": {"save_as": name}}} if fed_hits else described
        run += [first, described]
        if fed_hits and name in fed_hits:
            run.append({**described, "cache_salt": f"{described['cache_salt']}-fed",
                        "kv_transfer_params": {"page_copy": {"load_from": name, "tokens": fed_hits[name]}}})
    return run


def truths_from(names: Sequence[str], results: Sequence[dict[str, Any]], exact_at_own_hit: bool = True,
                fed_hits: Mapping[str, int] | None = None) -> dict[str, Truth]:
    """The :class:`Truth` of each of ``names`` from a truth run's ``results`` (in
    :func:`truth_prompts`' order, with the same ``fed_hits``); the spread is the whole run's."""
    fed_hits = fed_hits or {}
    expected = 2 * len(names) + sum(name in fed_hits for name in names)
    if len(results) != expected:
        raise ValueError(f"a truth run of {len(names)} prompts has {expected} results, got {len(results)}")
    found: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]] = {}
    position = 0
    for name in names:
        fed = results[position + 2] if name in fed_hits else None
        found[name] = (results[position], results[position + 1], fed)
        position += 3 if name in fed_hits else 2
    spread = max(worst_difference(own, alone) for alone, own, _ in found.values())
    return {name: Truth(alone, own, spread, exact_at_own_hit, fed) for name, (alone, own, fed) in found.items()}


def assert_truthful(name: str, got: dict[str, Any], hit: int, truth: Truth, steps: int = MAX_TOKENS) -> None:
    """``got``, a run whose request had ``hit`` prompt tokens it did not compute (tierkv's load),
    computes what vLLM computes: see the module's docstring for which truth and how close."""
    if hit == 0:
        want, tolerance, what = truth.alone, 0.0, "a miss: vLLM alone, bit for bit"
    elif hit == truth.fed_hit:
        want, tolerance, what = truth.fed, 0.0, f"a {hit}-token hit: vLLM fed its own pages at it, bit for bit"
    elif hit == truth.own_hit and truth.exact_at_own_hit:
        want, tolerance, what = truth.own, 0.0, f"a {hit}-token hit: vLLM's own cache at the same hit, bit for bit"
    else:
        want, tolerance, what = truth.alone, truth.tolerance, (
            f"a {hit}-token hit (vLLM's own: {truth.own_hit}): vLLM alone within {MARGIN} x vLLM's own cache's "
            f"widest distance {truth.spread:.4f}")
    assert want is not None
    assert_same_generation(f"{name} ({what})", got["tokens"], got["logprobs"], want["tokens"], want["logprobs"],
                           steps, tolerance)


# The first tierkv process of test_vllm_v1.py and test_vllm_exact.py: v1's sequence (a repeat,
# a shared document with two questions, a prompt shorter than a chunk, a chat's first turn), then exact's prompts
# twice (stored through cpu -> lmdb -> fs, then hit from the cpu tier); no prompt shares a
# chunk with another module's. The second process: a new vLLM over the lmdb tier the first filled.
V1_SEQUENCE = ["repeated", "repeated", "doc_q1", "doc_q2", "short", "short", "turn_1"]
EXACT_NAMES = ["partial_600", "block_edge_513", "partial_1000"]
FIRST_RUN = V1_SEQUENCE + EXACT_NAMES * 2
SECOND_RUN = ["repeated", "doc_q2", "turn_2"] + EXACT_NAMES
FIRST_RUN_WAITS = {"turn_1": ["continuation_tails_saved",
                              sum(saves_a_cut(len(PROMPTS[name])) for name in dict.fromkeys(V1_SEQUENCE))]}
"""Prompts of the first run whose stats are read once a save of theirs landed (saves run after
the call returns): turn 1's cut, the last of the cuts its test counts (one per distinct prompt
up to it that leaves one: a repeat's save writes nothing new)."""


def first_run_prompt(index: int, name: str) -> dict[str, Any]:
    """FIRST_RUN's prompt ``index``: sent once the saves of the ``index`` prompts before it
    landed (a repeat's hit, a shared document's, must not depend on how fast a save is: under
    load the repeat of a short prompt once came before its save), and for a prompt in
    FIRST_RUN_WAITS, its stats read once its own save's counter reached the value."""
    prompt = after_saves(index, PROMPTS[name]) if index else {"ids": PROMPTS[name]}
    wait = FIRST_RUN_WAITS.get(name)
    return prompt if wait is None else {**prompt, "then_wait_for": wait}


def first_run_tiers(directory: Path) -> list[dict[str, Any]]:
    return [{"name": "host", "backend": "cpu", "capacity": "256MiB"},
            {"name": "disk", "backend": "lmdb", "path": str(directory / "lmdb"), "capacity": "1GiB"},
            {"name": "files", "backend": "fs", "path": str(directory / "fs")}]


def shared_extra(directory: Path, tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "cost_aware": False, "tiers": tiers},
            "stats_file": str(directory / "stats.json")}


def first_run(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Any]:
    """FIRST_RUN in one vLLM with tierkv (cpu -> lmdb -> fs, vLLM's metrics on): ``results``
    per prompt, and the ``tiers`` it filled."""
    def run(directory: Path) -> dict[str, Any]:
        tiers = first_run_tiers(directory)
        results = vllm({**spec(model_dir, [first_run_prompt(i, n) for i, n in enumerate(FIRST_RUN)], shared_extra(directory, tiers)),
                        "metrics": True}, directory / "run")
        return {"results": results, "tiers": {tier["backend"]: tier for tier in tiers}}

    return dict(once(tmp_path_factory, "vllm-first-run", run))


def second_run(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> list[dict[str, Any]]:
    """SECOND_RUN in a new vLLM process with tierkv over the first run's lmdb tier (a cpu tier
    above it, empty in a new process; vLLM's metrics on)."""
    first = first_run(tmp_path_factory, model_dir)

    def run(directory: Path) -> list[dict[str, Any]]:
        tiers = [{"name": "host", "backend": "cpu", "capacity": "256MiB"}, first["tiers"]["lmdb"]]
        return vllm({**spec(model_dir, [PROMPTS[n] for n in SECOND_RUN], shared_extra(directory, tiers)),
                     "metrics": True}, directory / "run")

    return list(once(tmp_path_factory, "vllm-second-run", run))


def loaded_in(results: list[dict[str, Any]], start: int, stop: int | None = None) -> list[int]:
    """Tokens the connector loaded during each of ``results[start:stop]`` (a module's part of a shared run)."""
    return loaded_per_prompt(results)[start:stop]


def grown(results: list[dict[str, Any]], start: int, name: str, last: int | None = None) -> float:
    """How much vLLM's metric ``name`` grew over ``results[start:last + 1]`` (a module's part of a
    shared run; 0 where the registry does not have it yet)."""
    end = results[-1 if last is None else last]["metrics"] or {}
    before = (results[start - 1]["metrics"] or {}) if start > 0 else {}
    return float(end.get(name, 0)) - float(before.get(name, 0))
