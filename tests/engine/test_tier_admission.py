"""Which tier takes a store, and why not (issue 21, item 3).

A store that no tier takes raises :class:`~tierkv.TierUnavailableError` naming every tier and
why it was skipped (under memory pressure, unhealthy since when and after what, full, rejected
the size, failed with what). A tier whose disk is full does not crash a store: the tiers above
keep taking chunks, what it holds stays readable, and it admits again once there is room.
Real tiers on a real, small tmpfs (mounted by the test; skipped with the reason where it cannot).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tmpfs import small_tmpfs

from tierkv import Engine, TierUnavailableError
from tierkv.errors import TierFullError
from tierkv.policy.pressure import ScriptedProbe
from tierkv.testing.faults import FaultyBackend

LAYERS, HEADS, HEAD = 2, 4, 64
CHUNK = 64
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HEAD * 4  # 256 KiB in float32


def prompt(seed: int, chunks: int = 4) -> torch.Tensor:
    return torch.arange(chunks * CHUNK) + seed * 100_000


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    base = tokens.to(torch.float32)[None, None, :, None, None]
    return (base + torch.arange(LAYERS * 2 * HEADS * HEAD, dtype=torch.float32).view(LAYERS, 2, 1, HEADS, HEAD) / 997)


def exact(eng: Engine, tokens: torch.Tensor) -> bool:
    kv, mask = eng.retrieve(tokens, return_tuple=False)
    return bool(mask.all()) and torch.equal(kv, kv_of(tokens))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: room for about ten 256 KiB chunks."""
    with small_tmpfs(tmp_path / f"disk-{uuid.uuid4().hex[:8]}", "3m") as mount:
        yield mount


def health(**extra: Any) -> dict[str, Any]:
    return {"failure_threshold": 100, "retry_after_s": 0.3, **extra}


DISK_TIERS = {"fs": {"backend": "fs"}, "lmdb": {"backend": "lmdb", "capacity": "64MiB"}}


@pytest.mark.parametrize("backend", list(DISK_TIERS))
def test_a_disk_tier_alone_on_a_full_disk_names_itself_and_why_then_admits_again(small_disk: Path,
                                                                                 backend: str) -> None:
    cfg = {"model": "admission", "chunk_size": CHUNK, "health": health(),
           "tiers": [{"name": "files", "path": str(small_disk / backend), **DISK_TIERS[backend]}]}
    with Engine(cfg) as eng:
        stored: list[torch.Tensor] = []
        error: TierUnavailableError | None = None
        for seed in range(40):
            tokens = prompt(seed)
            try:
                eng.store(tokens, kv_of(tokens))
            except TierUnavailableError as exc:  # never a raw OSError
                error = exc
                break
            stored.append(tokens)
        assert error is not None, "a 3 MiB disk took 40 MiB"
        assert stored, "nothing fit at all"
        message = str(error)
        assert isinstance(error.__cause__, TierFullError), repr(error.__cause__)  # the fs tier says it is full
        assert "'files': full:" in message, message
        with pytest.raises(TierUnavailableError, match=r"'files': full for"):  # so it is not asked for a while
            eng.store(prompt(99), kv_of(prompt(99)))
        assert eng.stats()["tiers"]["files"]["full"] is not None
        assert all(exact(eng, tokens) for tokens in stored), "chunks stored before the disk filled up changed"
        for tokens in stored[: len(stored) // 2 + 1]:  # space returns
            eng.batched_delete(eng.keys_for(tokens))
        time.sleep(0.4)  # past retry_after_s
        again = prompt(77, 2)
        assert eng.store(again, kv_of(again)) == 2  # admitted again: space returned
        assert exact(eng, again)
        assert eng.stats()["tiers"]["files"]["full"] is None


def test_cpu_over_a_full_fs_keeps_storing_and_counts_the_fills_it_dropped(small_disk: Path) -> None:
    cfg = {"model": "admission", "chunk_size": CHUNK, "health": health(), "write_policy": "write_through",
           "tiers": [{"name": "host", "backend": "cpu", "capacity": "32MiB"},
                     {"name": "files", "backend": "fs", "path": str(small_disk / "fs")}]}
    with Engine(cfg) as eng:
        prompts = [prompt(seed) for seed in range(20)]  # 20 MiB over a 3 MiB disk
        for tokens in prompts:
            assert eng.store(tokens, kv_of(tokens)) == 4  # acknowledged by the cpu tier
        eng.flush()
        assert eng.stats()["tiers"]["files"]["dropped_fills"] > 0
        assert all(exact(eng, tokens) for tokens in prompts)


def test_every_tier_is_named_with_why_it_did_not_take_the_store(tmp_path: Path) -> None:
    probe = ScriptedProbe([(99, 100)])  # host memory 99% in use: the cpu tier stops admitting
    cfg = {"model": "admission", "chunk_size": CHUNK, "health": {"failure_threshold": 1, "retry_after_s": 2.0},
           "pressure": {"poll_interval_ms": 10},
           "tiers": [{"name": "host", "backend": "cpu", "capacity": "8MiB"},
                     {"name": "disk", "backend": "lmdb", "capacity": "64MiB", "path": str(tmp_path / "lmdb")},
                     {"name": "tiny", "backend": "lmdb", "capacity": "64KiB", "path": str(tmp_path / "tiny")}]}
    with Engine(cfg, probes={"host": probe}) as eng:
        disk = eng.wrap_tier(eng.tiers[1].name, FaultyBackend)
        first = prompt(1)
        eng.store(first, kv_of(first))  # starts the pressure monitor
        deadline = time.monotonic() + 30
        while eng.stats()["tiers"]["host"]["pressure"]["admitting"] and time.monotonic() < deadline:
            time.sleep(0.01)
        disk.failing = True
        tokens = prompt(2)
        with pytest.raises(TierUnavailableError) as info:
            eng.store(tokens, kv_of(tokens), skip_existing=False)  # no contains first: the put fails
        message = str(info.value)
        assert "'host': under memory pressure" in message, message
        assert "'disk': failed: TierUnavailableError: tier 'disk': injected failure" in message, message
        assert "'tiny': rejected the size" in message, message
        with pytest.raises(TierUnavailableError) as info:  # the breaker tripped: skipped, and said why
            eng.store(tokens, kv_of(tokens))
        assert "'disk': unhealthy for" in str(info.value) and "injected failure" in str(info.value), str(info.value)
        disk.failing = False
        time.sleep(2.1)  # past retry_after_s: the disk is asked again, and still holds the first prompt
        assert exact(eng, first)
