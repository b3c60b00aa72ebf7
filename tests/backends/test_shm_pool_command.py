"""``tierkv pool status`` and ``tierkv pool drop`` on a pool other processes use: usage per model
and scope, the attached processes, drops by model, scope or all that leave other chunks alone,
announce themselves in the journal, and never pull bytes from under a reader."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tierkv.chunks.keys import CacheKey
from tierkv.cli import main
from tierkv_backends.shm import SharedMemoryBackend
from tierkv_backends.shm.journal import Kind

TENANT_A, TENANT_B = "a" * 16, "b" * 16


def key(model: str, scope: str, index: int) -> CacheKey:
    return CacheKey("vllm", model, 1, 0, f"{index:032x}", scope)


def chunk(index: int) -> torch.Tensor:
    return torch.arange(4096, dtype=torch.float32) + index


@pytest.fixture
def engine(pool_path: Path):  # type: ignore[no-untyped-def]
    """An engine's tier holding 3 chunks of model-x under two tenants and 2 of model-y."""
    tier = SharedMemoryBackend("node", 8 << 20, path=str(pool_path))
    keys = [key("model-x", TENANT_A, i) for i in range(2)] + [key("model-x", TENANT_B, 2)] + \
        [key("model-y", "c" * 16, i) for i in range(3, 5)]
    asyncio.run(tier.batched_put(keys, [chunk(i) for i in range(5)]))
    yield tier, keys
    asyncio.run(tier.close())


def status(pool_path: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["pool", "status", "--path", str(pool_path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_status_says_what_the_pool_holds_per_model_and_scope(engine, pool_path: Path,  # type: ignore[no-untyped-def]
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import os

    tier, keys = engine
    report = status(pool_path, capsys)
    assert report["chunks"] == 5 and report["used_bytes"] == tier.used_bytes
    assert report["models"]["model-x"]["scopes"] == 2 and report["models"]["model-x"]["chunks"] == 3
    assert report["models"]["model-y"]["chunks"] == 2
    assert {row["scope"]: row["chunks"] for row in report["scopes"]} == {TENANT_A: 2, TENANT_B: 1, "c" * 16: 2}
    assert os.getpid() in report["attached_pids"], "the engine's process (this test's) is attached"
    assert report["retained_bytes"] == 0
    tier.retain(keys[:2], 600)
    assert status(pool_path, capsys)["retained_bytes"] == 2 * tier.pool.entries["alloc"].max()
    assert main(["pool", "status", "--path", str(pool_path)]) == 0
    text = capsys.readouterr().out
    assert "model-x" in text and "5 chunks" in text and "retained" in text


def test_drop_by_scope_leaves_the_other_tenants_chunks(engine, pool_path: Path,  # type: ignore[no-untyped-def]
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    tier, keys = engine
    cursor = tier.journal_cursor(everything=False)
    assert main(["pool", "drop", "--path", str(pool_path), "--scope", TENANT_A]) == 0
    assert "dropped 2 chunks" in capsys.readouterr().out
    assert asyncio.run(tier.batched_contains(keys)) == [False, False, True, True, True]
    dropped = {r.digest for r in tier.read_journal(cursor).records if r.kind == Kind.DROPPED}
    assert dropped == {tier.chunk_digest(k) for k in keys[:2]}, "engines learn of the drop from the journal"
    assert status(pool_path, capsys)["drops"] == 2


def test_drop_by_model_and_all(engine, pool_path: Path,  # type: ignore[no-untyped-def]
                               capsys: pytest.CaptureFixture[str]) -> None:
    tier, keys = engine
    assert main(["pool", "drop", "--path", str(pool_path), "--model", "model-y"]) == 0
    assert asyncio.run(tier.batched_contains(keys)) == [True, True, True, False, False]
    assert main(["pool", "drop", "--path", str(pool_path), "--all"]) == 0
    assert not any(asyncio.run(tier.batched_contains(keys)))
    assert tier.used_bytes == 0


def test_an_unknown_model_or_a_bad_scope_is_refused_and_drops_nothing(engine, pool_path: Path,  # type: ignore[no-untyped-def]
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    tier, keys = engine
    assert main(["pool", "drop", "--path", str(pool_path), "--model", "model-z"]) == 1
    error = capsys.readouterr().err
    assert "model-z" in error and "model-x" in error and "model-y" in error
    assert main(["pool", "drop", "--path", str(pool_path), "--scope", "not-hex"]) == 1
    assert "16 hex digits" in capsys.readouterr().err
    assert all(asyncio.run(tier.batched_contains(keys)))


def test_a_chunk_being_read_keeps_its_bytes_until_its_reader_lets_go(engine, pool_path: Path,  # type: ignore[no-untyped-def]
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    tier, keys = engine
    (held,) = tier.hold([keys[0]])
    assert held is not None
    assert main(["pool", "drop", "--path", str(pool_path), "--all"]) == 0
    assert not any(asyncio.run(tier.batched_contains(keys))), "dropped: no lookup finds it"
    assert tier.used_bytes > 0, "the held chunk's room is not given back while it is read"
    assert torch.equal(held.chunk, chunk(0)), "its bytes are intact under the hold"
    assert held.release() is True
    assert tier.used_bytes == 0, "freed by its last reader"


def test_no_pool_or_not_a_pool_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pool", "status", "--path", str(tmp_path / "none.pool")]) == 1
    assert "no pool at" in capsys.readouterr().err
    other = tmp_path / "other.pool"
    other.write_bytes(b"not a pool" * 1000)
    assert main(["pool", "status", "--path", str(other)]) == 1
    assert "not a pool this tierkv reads" in capsys.readouterr().err
    assert other.read_bytes() == b"not a pool" * 1000, "a file that is not a pool is never written"
