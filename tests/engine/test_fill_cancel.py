"""A cancelled store never waits for room in a full fill queue (``when_full: wait``).

Real engine (a cpu tier over LMDB, write-through), a fill queue of two chunks and a lower tier
whose writes hang until the test lets them go. Stores fill the queue; the next store's fill
has to wait for room, and that store is cancelled: it must end (hang detector, not a timing
check), its chunk stays in the cpu tier and reads back exact, its fill is dropped and counted
(nothing queued over the bound), and every chunk stored before it still reaches the tier below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tierkv import AsyncEngine
from tierkv.chunks.keys import CacheKey
from tierkv.routing.fill import FillJob, FillQueue
from tierkv.testing.faults import FaultyBackend

CHUNK = 16
CHUNK_BYTES = 3 * 2 * CHUNK * 2 * 8 * 4  # float32 vllm chunk: 6 KiB
HANG_S = 10.0  # a cancelled store that is still running after this long is stuck


class HeldWrites(FaultyBackend):
    """A real backend whose writes wait until :attr:`open` is set (a lower tier that hangs)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.open = asyncio.Event()
        self.writing = asyncio.Event()

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        self.writing.set()
        await self.open.wait()
        return await super().batched_put(keys, chunks)

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    layer = torch.arange(3, dtype=torch.float32)[:, None, None, None, None]
    rest = torch.arange(2 * 16, dtype=torch.float32).reshape(1, 2, 1, 2, 8)
    return (t * 1000 + layer * 100 + rest).contiguous()


def prompt(index: int) -> torch.Tensor:
    return torch.arange(CHUNK, dtype=torch.int64) + 10_000 * (index + 1)


def config(tmp_path: Path) -> dict[str, Any]:
    return {"model": "fill-cancel", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_through",
            "background": {"queue_bytes": f"{2 * CHUNK_BYTES}B", "when_full": "wait"},
            "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "64MiB"}]}


async def until(condition: Any, what: str) -> None:
    for _ in range(int(HANG_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_store_cancelled_while_the_fill_queue_is_full_returns_and_keeps_its_chunk(tmp_path: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(config(tmp_path))
        disk = engine.wrap_tier(engine.tiers[1].name, HeldWrites)
        try:
            # two acknowledged stores: one fill being written (held), one queued -> the queue is full
            for index in (0, 1):
                assert await engine.store(prompt(index), kv_of(prompt(index))) == 1
            await until(disk.writing.is_set, "the first fill to reach the lower tier")
            assert engine.stats()["fill_queue"]["bytes"] == 2 * CHUNK_BYTES

            # the third store's fill has no room: it waits for it (when_full: wait) ...
            blocked = asyncio.ensure_future(engine.store(prompt(2), kv_of(prompt(2))))
            key = engine.keys_for(prompt(2))[0]
            host = engine.tiers[0]
            await until(lambda: host.batched_contains_nowait([key]) == [True], "the third store to reach the cpu tier")
            for _ in range(20):
                await asyncio.sleep(0)
            assert not blocked.done(), "the third store did not wait for room: the case is not exercised"

            # ... until its caller gives up on it
            blocked.cancel()
            await asyncio.wait({blocked}, timeout=HANG_S)  # not wait_for: it would wait on a stuck task forever
            assert blocked.done(), f"a cancelled store still waits for room in the fill queue after {HANG_S}s"
            assert blocked.cancelled(), "the cancellation was delivered"

            queue = engine.stats()["fill_queue"]
            assert queue["dropped_chunks"] == 1 and queue["dropped_bytes"] == CHUNK_BYTES, queue
            assert queue["bytes"] <= 2 * CHUNK_BYTES, "the fill queue went over its bound"
            kv, mask = await engine.retrieve(prompt(2), return_tuple=False)
            assert bool(mask.all()) and torch.equal(kv, kv_of(prompt(2))), "the cpu tier keeps the cancelled chunk"
            assert engine.locate_prefix_nowait(prompt(2)) == ["host"]

            disk.open.set()  # the lower tier answers again: what was queued before lands there
            await engine.flush()
            for index in (0, 1):
                tokens = prompt(index)
                assert await disk.inner.batched_contains(engine.keys_for(tokens)) == [True], f"prompt {index} lost"
                got = await disk.inner.batched_get(engine.keys_for(tokens))
                assert got[0] is not None and torch.equal(got[0], kv_of(tokens)[:, :, :CHUNK])
            assert await disk.inner.batched_contains([key]) == [False], "the cancelled store's fill was dropped"
            assert engine.stats()["tiers"]["disk"]["dropped_fills"] == 1
            assert await engine.store(prompt(3), kv_of(prompt(3))) == 1  # and the engine keeps working
            await engine.flush()
            assert await disk.inner.batched_contains(engine.keys_for(prompt(3))) == [True]
        finally:
            disk.open.set()
            await engine.close()
    asyncio.run(main())


def _job(index: int, nbytes: int, released: list[int] | None = None) -> FillJob:
    release = None if released is None else (lambda: released.append(index))
    return FillJob([CacheKey("vllm", "m", 1, 0, f"{index}")], [torch.zeros(nbytes, dtype=torch.uint8)], [1], release)


def test_fill_queue_put_of_a_cancelled_caller_queues_with_room_and_drops_without() -> None:
    """The queue on its own: a waiting put stops at the caller's cancellation (dropped, its
    holds released, counted), one that got room first is queued, and the queue's lock is free
    afterwards (later puts, takes and joins go on)."""
    async def main() -> None:
        queue = FillQueue(max_bytes=100, when_full="wait")
        released: list[int] = []
        assert await queue.put(_job(1, 80))
        gone = asyncio.Event()
        waiting = asyncio.ensure_future(queue.put(_job(2, 80, released), gone))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done(), "no room: the put waits"
        gone.set()
        assert await asyncio.wait_for(waiting, HANG_S) is False
        assert queue.dropped_chunks == 1 and queue.dropped_bytes == 80 and released == [2]
        assert queue.pending(_job(2, 1).keys[0]) is None and queue.queued_bytes == 80

        assert await queue.put(_job(3, 80, released), gone) is False, "already cancelled, no room: dropped at once"
        assert released == [2, 3]

        later = asyncio.Event()  # room comes before the cancellation: queued as usual
        third = asyncio.ensure_future(queue.put(_job(4, 80), later))
        await asyncio.sleep(0)
        await queue.done(await queue.take(1000))
        assert await asyncio.wait_for(third, HANG_S) is True
        later.set()
        assert await queue.put(_job(5, 10), later) is True, "room: queued even for a cancelled caller"
        await queue.done(await queue.take(1000))
        await asyncio.wait_for(queue.join(), HANG_S)
        assert queue.queued_bytes == 0 and queue.dropped_chunks == 2
    asyncio.run(main())
