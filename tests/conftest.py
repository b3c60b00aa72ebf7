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
def vllm_reference(context_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """vLLM without tierkv over every prompt of tests/vllm_truth.py: one process for the
    session, whichever xdist worker asks first (the other reads its results)."""
    from session_once import once
    from vllm_truth import PROMPTS, spec, vllm

    names = list(PROMPTS)

    def run(directory: Path) -> dict[str, dict[str, Any]]:
        return dict(zip(names, vllm(spec(context_llama, [PROMPTS[n] for n in names], None), directory)))

    return dict(once(tmp_path_factory, "vllm-reference", run))
