"""Worker processes for the ``shm`` tier's multi-process and crash tests: each attaches to one
pool by its path and stores, reads, holds and deletes chunks whose bytes are a function of their
key, so any read anywhere can be checked against the truth."""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import torch

from tierkv.chunks.keys import CacheKey
from tierkv_backends.shm import SharedMemoryBackend

MAX_CHUNKS = 512


def key_of(index: int) -> CacheKey:
    return CacheKey("vllm", "shm-test", 1, 0, f"{index:032x}", f"{index % 3:016x}")


def chunk_of(index: int) -> torch.Tensor:
    """A float32 chunk of 8..40 tokens (sizes differ: extents fragment), its values from ``index``."""
    tokens = 8 + (index % 9) * 4
    values = torch.arange(2 * 2 * tokens * 2 * 8, dtype=torch.float32).reshape(2, 2, tokens, 2, 8)
    return values + float(index) * 1000.0


def backend(path: str | os.PathLike[str], capacity: int, **options: Any) -> SharedMemoryBackend:
    return SharedMemoryBackend("node", capacity, path=str(path), max_chunks=MAX_CHUNKS, **options)


def exact(index: int, chunk: torch.Tensor | None) -> bool:
    return chunk is None or (chunk.shape == chunk_of(index).shape and torch.equal(chunk, chunk_of(index)))


def store_and_read_all(path: str, capacity: int, me: int, per_process: int, processes: int, barrier: Any,
                       results: Any) -> None:
    """Store this process's chunks, wait for every process, then read every process's."""
    async def main() -> None:
        tier = backend(path, capacity)
        try:
            mine = [me * per_process + i for i in range(per_process)]
            await tier.batched_put([key_of(i) for i in mine], [chunk_of(i) for i in mine])
            barrier.wait(120)
            everyone = list(range(processes * per_process))
            found = await tier.batched_get([key_of(i) for i in everyone])
            results.put((me, sum(c is not None for c in found), sum(not exact(i, c) for i, c in zip(everyone, found))))
        finally:
            await tier.close()
    asyncio.run(main())


def hammer(path: str, capacity: int, seed: int, keyspace: int, seconds: float, wrong: Any, operations: Any) -> None:
    """Random puts, gets, reads into a destination, holds and deletes for ``seconds``; every read
    is checked against the truth (a wrong byte counts in ``wrong``)."""
    async def main() -> None:
        tier = backend(path, capacity)
        rng = random.Random(seed)
        done = 0
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                batch = [rng.randrange(keyspace) for _ in range(rng.randint(1, 4))]
                keys = [key_of(i) for i in batch]
                op = rng.random()
                if op < 0.4:
                    await tier.batched_put(keys, [chunk_of(i) for i in batch])
                elif op < 0.65:
                    for index, chunk in zip(batch, await tier.batched_get(keys)):
                        if not exact(index, chunk):
                            with wrong.get_lock():
                                wrong.value += 1
                elif op < 0.85:
                    outs = [torch.full_like(chunk_of(i), -1.0) for i in batch]
                    for index, out, hit in zip(batch, outs, await tier.batched_get_into(keys, outs)):
                        if hit and not exact(index, out):
                            with wrong.get_lock():
                                wrong.value += 1
                elif op < 0.95:
                    holds = tier.hold(keys)
                    await asyncio.sleep(rng.random() * 0.002)
                    for index, hold in zip(batch, holds):
                        if hold is not None:
                            copy = hold.chunk.clone()
                            if hold.release() and not exact(index, copy):
                                with wrong.get_lock():
                                    wrong.value += 1
                else:
                    await tier.delete(keys[0])
                done += 1
        finally:
            with operations.get_lock():
                operations.value += done
            await tier.close()
    asyncio.run(main())


def die_inside_the_lock(path: str, capacity: int, ready: Any) -> None:
    """Take the pool's lock, change half of the index (an extent taken from the free list, a
    WRITING entry without its layout), say so, and wait to be killed there."""
    tier = backend(path, capacity)
    pool = tier.pool
    with pool.lock():
        pool._take(64 << 10)
        entry = pool._new_entry()
        assert entry is not None
        pool.entries["state"][entry] = 1  # WRITING, owned by whoever the slot field names
        ready.set()
        time.sleep(600)


def die_holding_and_writing(path: str, capacity: int, ready: Any) -> None:
    """Commit chunk 0, then hold chunk 0 and reserve room for chunk 1 (never committed), say so,
    and wait to be killed."""
    async def main() -> None:
        tier = backend(path, capacity)
        await tier.put(key_of(0), chunk_of(0))
        tier.hold([key_of(0)])

        async def never(views: dict[CacheKey, torch.Tensor]) -> None:
            ready.set()
            await asyncio.sleep(600)
        await tier.put_with([key_of(1)], [(tuple(chunk_of(1).shape), torch.float32)], never)
    asyncio.run(main())


def description_of(index: int, round_: int) -> bytes:
    """A journal payload that says which chunk and round it belongs to, so a reader can check
    every byte of it (sizes vary: 8 bytes to a few KiB)."""
    body = bytes((index * 31 + round_ * 7 + i) % 251 for i in range((index * 97 + round_ * 13) % 3000))
    return index.to_bytes(4, "little") + round_.to_bytes(4, "little") + body


def journal_writer(path: str, capacity: int, journal_bytes: int, seed: int, keyspace: int, seconds: float,
                   written: Any) -> None:
    """Store, describe and delete chunks at random for ``seconds`` (every write under the pool's
    lock, as engines make them), counting the descriptions written."""
    async def main() -> None:
        tier = backend(path, capacity, journal_bytes=journal_bytes)
        rng = random.Random(seed)
        end = time.monotonic() + seconds
        round_ = 0
        try:
            while time.monotonic() < end:
                index = rng.randrange(keyspace)
                round_ += 1
                if rng.random() < 0.2:
                    await tier.delete(key_of(index))
                    continue
                await tier.batched_put([key_of(index)], [chunk_of(index)])
                count = tier.describe([(key_of(index), description_of(index, round_))])
                with written.get_lock():
                    written.value += count
        finally:
            await tier.close()
    asyncio.run(main())
