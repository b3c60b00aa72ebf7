"""The disk tiers honour the ownership rule: once ``batched_get_into`` returned, raised or was
cancelled, nothing writes into the caller's destinations any more, and a cancelled
``batched_put`` leaves every chunk it acknowledged or wrote readable and exact.

Real LMDB and real files in tmp_path, real worker threads; cancellations at seeded random
points. After each cancelled read the destinations are copied at once and compared again
a little later: a worker thread still copying would change them in between.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tierkv.backend import StorageBackend
from tierkv.testing import make_key
from tierkv.testing.requirements import missing
from tierkv_backends.fs import FSBackend
from tierkv_backends.lmdb import LMDBBackend

CHUNKS = 12
SENTINEL = -3.0


def chunk(i: int) -> torch.Tensor:
    return torch.full((4, 1 << 18), float(i), dtype=torch.float32)  # 4 MiB, large batches use every thread


def make(kind: str, path: Path) -> StorageBackend:
    return FSBackend("disk", 1 << 30, path=str(path)) if kind == "fs" else LMDBBackend("disk", 1 << 30, path=str(path))


async def cancel_reads(backend: StorageBackend, rounds: int, seed: int, max_delay_s: float) -> None:
    """Store CHUNKS chunks, then cancel ``rounds`` reads into sentinel-filled destinations at
    seeded random points; after each cancellation the destinations must not change."""
    rng = random.Random(seed)
    keys = [make_key(i) for i in range(CHUNKS)]
    await backend.batched_put(keys, [chunk(i) for i in range(CHUNKS)])
    late_writes = cancelled = 0
    for _ in range(rounds):
        outs = [torch.full_like(chunk(0), SENTINEL) for _ in keys]
        task = asyncio.ensure_future(backend.batched_get_into(keys, outs))
        await asyncio.sleep(rng.uniform(0, max_delay_s))
        task.cancel()
        try:
            hits = await task
        except asyncio.CancelledError:
            cancelled += 1
            seen = [out.clone() for out in outs]
            await asyncio.to_thread(lambda: None)  # let any straggling thread run
            await asyncio.sleep(0.03)
            late_writes += sum(not torch.equal(a, b) for a, b in zip(seen, outs))
        else:
            assert hits == [True] * CHUNKS
            assert all(torch.equal(out, chunk(i)) for i, out in enumerate(outs))
    assert cancelled > 0, "no read was cancelled mid-way: the test proves nothing"
    assert late_writes == 0, f"{late_writes} destination(s) changed after the cancelled call returned"
    outs = [torch.full_like(chunk(0), SENTINEL) for _ in keys]
    assert await backend.batched_get_into(keys, outs) == [True] * CHUNKS, "the tier keeps working"


@pytest.mark.parametrize("kind", ["fs", "lmdb"])
def test_nothing_lands_in_the_destination_after_a_cancelled_read_returned(kind: str, tmp_path: Path) -> None:
    async def body() -> None:
        backend = make(kind, tmp_path / kind)
        try:
            await cancel_reads(backend, rounds=25, seed=21, max_delay_s=0.01)
        finally:
            await backend.close()
    asyncio.run(body())


@pytest.mark.parametrize("kind", ["fs", "lmdb"])
def test_a_cancelled_put_leaves_only_whole_chunks_and_keeps_its_accounting(kind: str, tmp_path: Path) -> None:
    rng = random.Random(7)

    async def body() -> None:
        backend = make(kind, tmp_path / kind)
        try:
            for round_ in range(10):
                keys = [make_key(100 * round_ + i) for i in range(CHUNKS)]
                task = asyncio.ensure_future(backend.batched_put(keys, [chunk(100 * round_ + i) for i in range(CHUNKS)]))
                await asyncio.sleep(rng.uniform(0, 0.02))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                got = await backend.batched_get(keys)
                for i, value in enumerate(got):  # each chunk is all there, exact, or not there at all
                    assert value is None or torch.equal(value, chunk(100 * round_ + i))
                held = sum(value is not None for value in got)
                found = await backend.batched_contains(keys)
                assert sum(found) == held, "the index and the store disagree after a cancelled put"
            if kind == "fs":
                assert not [p for p in (tmp_path / kind).rglob("*.tmp")], "a cancelled put left a partial file"
        finally:
            await backend.close()
        reopened = make(kind, tmp_path / kind)  # counts what is really on disk
        try:
            assert reopened.used_bytes == backend.used_bytes, "cancelled puts left the accounting off"
        finally:
            await reopened.close()
    asyncio.run(body())


def test_redis_reads_abandoned_mid_flight_never_write_afterwards(tmp_path: Path) -> None:
    """The redis example copies on the event loop right after each reply: a cancelled read
    leaves nothing running that could write into the caller's destinations."""
    pytest.importorskip("tierkv_redis.testing", reason="the redis example plugin is not installed here")
    from tierkv_redis.backend import RedisBackend
    from tierkv_redis.testing import RedisServer, server_binary

    if server_binary() is None:
        missing("redis-server", "apt-get install redis-server")
    with RedisServer() as server:
        async def body() -> None:
            backend = RedisBackend("cache", url=server.url)
            try:
                await cancel_reads(backend, rounds=10, seed=3, max_delay_s=0.02)
            finally:
                await backend.close()
        asyncio.run(body())
