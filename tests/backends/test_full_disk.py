"""A disk that fills up: fs and lmdb tiers on a real 8 MiB tmpfs, filled past capacity.

A write the disk cannot take is a tierkv error naming the tier and the path (never a raw
OSError), leaves no partial file or entry, keeps what was stored before readable and exact,
and once space is freed the tier takes chunks again. Mounting needs root; elsewhere the
tests skip and say so.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tmpfs import small_tmpfs
from waiting import wait_until

from tierkv import Engine
from tierkv.errors import TierFullError, TierKVError
from tierkv.testing import make_key
from tierkv_backends.fs import FSBackend
from tierkv_backends.lmdb import LMDBBackend

CHUNK = 16
TOKENS = 8 * CHUNK  # 8 chunks of 64 KiB: one prompt is 512 KiB
BALLAST = 2 << 20


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    """[layers, K/V, tokens, heads, dim] float32, distinct for every token id."""
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 4 * 64, dtype=torch.float32).reshape(2, 2, 1, 4, 64) / 1024).contiguous()


def prompt(i: int) -> torch.Tensor:
    return torch.arange(TOKENS) + 10_000 * (i + 1)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs holding a 2 MiB ballast file (deleting it is "space returns")."""
    with small_tmpfs(tmp_path / "disk", "8m") as mount:
        (mount / "ballast").write_bytes(b"\0" * BALLAST)
        yield mount


def chain_text(exc: BaseException) -> str:
    parts = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 10:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(parts)




def leftovers(root: Path) -> list[str]:
    """Temporary files a failed write left behind (there must be none)."""
    return [name for _, _, files in os.walk(root) for name in files if name.endswith(".tmp")]


def fill_until_full(eng: Engine, limit: int = 40) -> tuple[list[int], BaseException]:
    """Store prompts until one fails; the ones acknowledged, and the error."""
    stored = []
    for i in range(limit):
        try:
            eng.store(prompt(i), kv_of(prompt(i)))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return stored, exc
        stored.append(i)
    pytest.fail(f"{limit} prompts of {TOKENS * 4096 // CHUNK} bytes never filled an 8 MiB disk")


def assert_exact_or_miss(eng: Engine, i: int, whole: bool) -> None:
    kv, mask = eng.retrieve(prompt(i), return_tuple=False)
    hits = int(mask.sum())
    if whole:
        assert hits == TOKENS, f"prompt {i} was acknowledged before the disk filled: it must stay whole"
    assert torch.equal(kv[:, :, :hits], kv_of(prompt(i))[:, :, :hits])


def engine_config(*tiers: dict[str, Any]) -> dict[str, Any]:
    return {"model": "full-disk", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_through",
            "health": {"failure_threshold": 3, "retry_after_s": 0.1}, "tiers": list(tiers)}


@pytest.mark.parametrize("backend", ["fs", "lmdb"])
def test_a_full_disk_is_a_tier_error_and_the_tier_takes_chunks_again_once_space_returns(
        backend: str, small_disk: Path) -> None:
    where = small_disk / "kv"
    tier = {"name": "disk", "backend": backend, "path": str(where), "capacity": "64MiB"}
    with Engine(engine_config(tier)) as eng:
        stored, error = fill_until_full(eng)
        assert len(stored) >= 4
        assert isinstance(error, TierKVError), f"a full disk must be a tierkv error, got {chain_text(error)}"
        text = chain_text(error)
        assert "'disk'" in text and str(where) in text, f"the error must name the tier and the path: {text}"
        assert leftovers(where) == [], "a failed write left a partial file"
        for i in stored:
            assert_exact_or_miss(eng, i, whole=True)

        (small_disk / "ballast").unlink()  # space returns

        def stores_again() -> bool:
            try:
                eng.store(prompt(100), kv_of(prompt(100)))
            except TierKVError:
                return False
            return True
        wait_until(stores_again, f"the {backend} tier to take chunks again")
        assert_exact_or_miss(eng, 100, whole=True)
        for i in stored:
            assert_exact_or_miss(eng, i, whole=True)


def test_cpu_over_a_full_fs_keeps_serving_and_fills_fs_again_once_space_returns(small_disk: Path) -> None:
    where = small_disk / "kv"
    tiers = ({"name": "host", "backend": "cpu", "capacity": "64MiB"},
             {"name": "disk", "backend": "fs", "path": str(where), "capacity": "64MiB"})
    with Engine(engine_config(*tiers)) as eng:
        acknowledged = []
        for i in range(20):  # 10 MiB: more than the disk holds, less than the host tier
            try:
                eng.store(prompt(i), kv_of(prompt(i)))
            except Exception as exc:  # noqa: BLE001
                assert isinstance(exc, TierKVError), f"never a raw OSError: {chain_text(exc)}"
                continue
            acknowledged.append(i)
        eng.flush()
        assert acknowledged, "the host tier takes the prompts the disk cannot"
        for i in acknowledged:
            assert_exact_or_miss(eng, i, whole=True)
        assert leftovers(where) == []
        on_disk = sum(1 for _, _, files in os.walk(where) for name in files if name.endswith(".tkv"))
        assert 0 < on_disk < 20 * TOKENS // CHUNK, "the disk filled part way"
        (small_disk / "ballast").unlink()  # space returns
        remaining = on_disk
        fresh = iter(range(200, 400))

        def reaches_disk() -> bool:
            i = next(fresh)
            try:
                eng.store(prompt(i), kv_of(prompt(i)))
                eng.flush()
            except TierKVError:
                return False
            return len(list(where.rglob("*.tkv"))) > remaining
        wait_until(reaches_disk, "fills to reach the fs tier again")


# -- the backends on their own ------------------------------------------------------------------
def _fill_backend(backend: FSBackend | LMDBBackend) -> tuple[int, TierFullError]:
    async def body() -> tuple[int, TierFullError]:
        chunk = kv_of(prompt(0))[:, :, :CHUNK]
        for i in range(400):
            try:
                await backend.batched_put([make_key(i)], [chunk + i])
            except TierFullError as exc:
                return i, exc
        pytest.fail("400 chunks of 64 KiB never filled an 8 MiB disk")
    return asyncio.run(body())


@pytest.mark.parametrize("kind", ["fs", "lmdb"])
def test_backend_raises_tier_full_chained_to_the_os_error_and_admits_again(kind: str, small_disk: Path) -> None:
    where = small_disk / "kv"
    backend: FSBackend | LMDBBackend
    backend = FSBackend("disk", 64 << 20, path=str(where)) if kind == "fs" else \
        LMDBBackend("disk", 64 << 20, path=str(where))
    count, error = _fill_backend(backend)
    assert "'disk'" in str(error) and str(where) in str(error)
    assert isinstance(error.__cause__, OSError) or "lmdb" in type(error.__cause__).__module__
    assert leftovers(where) == []
    chunk = kv_of(prompt(0))[:, :, :CHUNK]

    async def check() -> None:
        got = await backend.batched_get([make_key(i) for i in range(count + 1)])
        assert all(torch.equal(got[i], chunk + i) for i in range(count)), "chunks stored before must stay exact"
        assert got[count] is None, "the failed chunk must not be there at all"
        (small_disk / "ballast").unlink()
        await backend.batched_put([make_key(count)], [chunk + count])
        assert torch.equal((await backend.batched_get([make_key(count)]))[0], chunk + count)
        await backend.close()
    asyncio.run(check())


def test_faulty_backend_full_refuses_writes_as_a_full_disk_and_keeps_reads(tmp_path: Path) -> None:
    """tierkv.testing.faults.FaultyBackend.full: a full disk without mounting one (for router tests)."""
    from tierkv.testing.faults import FaultyBackend

    async def body() -> None:
        wrapped = FaultyBackend(LMDBBackend("disk", 64 << 20, path=str(tmp_path / "kv")))
        try:
            chunk = kv_of(prompt(0))[:, :, :CHUNK]
            await wrapped.batched_put([make_key(1)], [chunk])
            wrapped.full = True
            with pytest.raises(TierFullError, match="tier 'disk'.*No space left"):
                await wrapped.batched_put([make_key(2)], [chunk])
            assert torch.equal((await wrapped.batched_get([make_key(1)]))[0], chunk)
            assert (await wrapped.batched_get([make_key(2)]))[0] is None
            wrapped.full = False
            await wrapped.batched_put([make_key(2)], [chunk])
        finally:
            await wrapped.close()
    asyncio.run(body())
