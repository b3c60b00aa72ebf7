"""Shared fixtures for the tierkv test suite."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest_plugins = ["s3_fixtures"]  # the local S3 server fixture (issue 4)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def pool_path(tmp_path: Path) -> Iterator[Path]:
    """A pool file for the ``shm`` tier on /dev/shm (a memory file system; ``tmp_path`` where there
    is none), removed after the test."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = base / f"tierkv-test-{uuid.uuid4().hex[:12]}.pool"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def context_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random Llama whose output depends on its context (tests/vllm_truth.py), saved once
    for the session (one path for every xdist worker: tierkv keys chunks by the model's path,
    and vLLM processes of two workers share stored runs, tests/session_once.py)."""
    from session_once import once
    from vllm_truth import HEADS, HIDDEN, KV_HEADS, LAYERS

    from tierkv.testing.vllm_runner import save_random_llama

    def save(directory: Path) -> str:
        return str(save_random_llama(directory, num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS,
                                     num_kv_heads=KV_HEADS, initializer_range=0.15))

    return Path(once(tmp_path_factory, "context-llama", save))


@pytest.fixture(scope="session")
def truths(context_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The truth of every prompt of tests/vllm_truth.py (``vllm_truth.Truth``: vLLM alone, vLLM's
    own prefix cache, and vLLM fed its own pages at the hits its cache cannot make, in one vLLM
    without tierkv): one process for the session, whichever xdist worker asks first (the other
    reads its results)."""
    from session_once import once
    from vllm_truth import FED_HITS, PROMPTS, truth_spec, truths_from, vllm

    def run(directory: Path) -> list[dict[str, Any]]:
        return vllm(truth_spec(context_llama, PROMPTS, FED_HITS), directory)

    return truths_from(list(PROMPTS), once(tmp_path_factory, "vllm-truth", run), fed_hits=FED_HITS)


# The modules that take longest on a 2-core machine (whole seconds of vLLM processes, kernel
# builds, crash rounds), longest first. Collected first, pytest-xdist's loadfile scheduler
# hands them out before the many short modules, which then fill in around them: the suite
# ends when its longest module does, not a long module started last.
LONGEST_FIRST = (
    "integrations/vllm_v1/test_vllm_hybrid.py",
    "integrations/vllm_v1/test_vllm_exact.py",
    "integrations/vllm_v1/test_vllm_mla.py",
    "integrations/vllm_v1/test_vllm_node_cache.py",
    "integrations/vllm_v1/test_vllm_identity.py",
    "integrations/vllm_v1/test_vllm_events.py",
    "ops/test_cuda_ext_build.py",
    "integrations/vllm_v1/test_vllm_v1.py",
    "integrations/vllm_v1/test_serving_client.py",
    "engine/test_durable_flush.py",
    "backends/test_shm_processes.py",
    "backends/test_cross_node.py",
    "engine/test_ownership.py",
    "integrations/test_hf_fp8.py",
    "engine/test_fresh_process.py",
    "engine/test_cost_aware.py",
)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop every serving-engine process group a test started and did not stop (vLLM, SGLang,
    ``vllm serve``: tierkv.testing.processes), in each xdist worker: nothing a test started
    outlives the suite, even a test interrupted before its own cleanup ran."""
    from tierkv.testing.processes import stop_all_groups

    stop_all_groups()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the collected tests module by module, the longest modules first (a stable sort:
    tests keep their order inside a module, and the other modules theirs)."""
    tests_dir = Path(__file__).parent
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        try:
            relative = item.path.relative_to(tests_dir).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(relative, len(rank))

    items.sort(key=key)
