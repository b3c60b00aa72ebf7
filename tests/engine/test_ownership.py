"""The ownership rule under cancellation (issue 21): memory handed to a copy stays the copy's
until the copy finished.

Real tiers (cpu slabs, LMDB, files), real worker threads, real cancellations at random points
(seeded). Checked after every cancellation: no exception but the cancellation leaks, a
sentinel-filled ``out`` does not change after the call returned (watched for a while), every
acknowledged store reads back exact, the memory tier accounts exactly the chunks it holds (no
leaked reservations, holds or pins; 0 bytes after everything was deleted), and the engine keeps
working.
"""

from __future__ import annotations

import asyncio
import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv import AsyncEngine
from tierkv_backends.memory.tier import MemoryTier

LAYERS, HEADS, HEAD = 4, 8, 64  # 8 KiB per token in float16
CHUNK = 64  # 512 KiB chunks: a prompt of 16 chunks (8 MiB) is copied on a worker thread
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD * 2


def config(kind: str, tmp_path: Path, policy: str = "write_through", capacity: str = "12MiB") -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"name": "host", "backend": "cpu", "capacity": capacity}]
    if kind == "cpu+lmdb":
        tiers.append({"name": "disk", "backend": "lmdb", "capacity": "512MiB", "path": str(tmp_path / "lmdb")})
    elif kind == "cpu+fs":
        tiers.append({"name": "files", "backend": "fs", "path": str(tmp_path / "fs")})
    elif kind != "cpu":
        raise AssertionError(kind)
    return {"model": "ownership", "chunk_size": CHUNK, "tiers": tiers, "write_policy": policy,
            "background": {"queue_bytes": "64MiB"}}


def prompt(seed: int, chunks: int) -> torch.Tensor:
    """Tokens of a prompt that shares no chunk with another seed's."""
    return torch.arange(chunks * CHUNK) + seed * 100_000


MAX_CHUNKS = 16


@functools.lru_cache(maxsize=12)
def _full_kv(seed: int) -> torch.Tensor:
    per_token = TOKEN_BYTES // (LAYERS * 2)
    shape = (LAYERS, 2, MAX_CHUNKS * CHUNK, per_token)
    index = torch.arange(shape[0] * shape[1] * shape[2] * shape[3], dtype=torch.int64).view(shape)
    raw = ((index * 7 + seed * 131 + index // per_token * 13) % 251).to(torch.uint8)
    return raw.view(torch.float16).view(LAYERS, 2, MAX_CHUNKS * CHUNK, HEADS, HEAD)


def kv_for(seed: int, chunks: int) -> torch.Tensor:
    """The KV of the first ``chunks`` chunks of prompt ``seed``: bytes that differ by prompt,
    layer, token and position (a mix-up cannot go unnoticed), the same for every prefix."""
    return _full_kv(seed)[:, :, : chunks * CHUNK]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def memory_tier(engine: AsyncEngine) -> MemoryTier:
    tier = engine.tiers[0]
    assert isinstance(tier, MemoryTier)
    return tier


def assert_accounts_exactly(engine: AsyncEngine) -> None:
    """The memory tier's bytes are exactly its resident chunks': nothing reserved, held or pinned."""
    tier = memory_tier(engine)
    resident = sum(r.slab.numel() for r in tier._resident.values())
    assert tier._reserved == 0, f"{tier._reserved} bytes still reserved"
    assert tier._retired_held == 0, f"{tier._retired_held} bytes of retired slabs still held"
    assert tier.used_bytes == resident, f"used {tier.used_bytes} != {resident} bytes of resident chunks"
    assert not any(tier._index._pins.values()), "chunks still pinned"
    assert all(r.readers == 0 for r in tier._resident.values()), "chunks still held"
    assert tier.stats()["chunks"] == len(tier._resident)


async def cancel_after(coro: Any, delay: float) -> tuple[bool, Any]:
    """Run ``coro``, cancel it after ``delay`` seconds; (finished, result).

    ``finished`` is False only when the call was still in flight at the cancellation (it had
    started: ``asyncio.sleep`` yields to it at least once) and ended by raising
    ``CancelledError``; a call that ended first, or that returned despite the cancellation,
    finished. Tests count the False ones, so they cannot pass without cancelling anything.
    """
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(delay)
    if task.done():
        return True, task.result()
    task.cancel()
    try:
        return True, await task
    except asyncio.CancelledError:
        assert task.cancelled(), "the CancelledError came from the call"
        return False, None


def some_delays(rng: random.Random, count: int, longest: float) -> list[float]:
    """``count`` delays before a cancellation: random up to ``longest``, and every fourth 0 (the
    call is cancelled at its first suspension, so each test surely cancels calls in flight)."""
    return [0.0 if i % 4 == 0 else rng.uniform(0, longest) for i in range(count)]


def assert_cancelled_some(cancelled: int, calls: int) -> None:
    assert cancelled > 0, f"none of {calls} calls was in flight when cancelled: the test cancelled nothing"


async def retrieve_exact_or_miss(engine: AsyncEngine, seed: int, chunks: int) -> int:
    """Retrieve a prompt; the prefix served must be exact. Tokens served."""
    kv, mask = await engine.retrieve(prompt(seed, chunks), return_tuple=False)
    served = int(mask.sum())
    if served:
        exact = same(kv, kv_for(seed, chunks)[:, :, :served])
        assert exact, f"prompt {seed}: wrong bytes served"
    return served


# -- the targeted case: a cancelled store, then a small store into the slab it freed ----------------------
@pytest.mark.parametrize("kind", ["cpu+lmdb", "cpu"])
def test_cancelled_store_never_lends_its_slab_to_a_later_store(tmp_path: Path, kind: str) -> None:
    """A store cancelled while its copy thread runs keeps its slabs until the copy stopped:
    the small store after it (acknowledged) is served with its own bytes, every trial."""
    rng = random.Random(21)

    async def main() -> None:
        async with with_engine(config(kind, tmp_path, capacity="16MiB")) as engine:
            big = kv_for(0, 16)
            cancelled = 0
            for trial, delay in enumerate(some_delays(rng, 30, 0.004)):
                seed_small = 1000 + trial
                small_kv = kv_for(seed_small, 1)
                finished, _ = await cancel_after(engine.store(prompt(trial + 1, 16), big), delay)
                cancelled += not finished
                assert await engine.store(prompt(seed_small, 1), small_kv) == 1
                await asyncio.sleep(0.02)  # a copy that outlived its store would land now
                assert await retrieve_exact_or_miss(engine, seed_small, 1) == CHUNK, f"trial {trial}"
                await engine.batched_delete(engine.keys_for(prompt(trial + 1, 16)))
            await engine.flush()
            assert_accounts_exactly(engine)
            assert_cancelled_some(cancelled, 30)
    asyncio.run(main())


# -- write-back: stores cancelled while they evict and demote give back what they reserved -----------------
def test_stores_cancelled_while_demoting_leave_no_reserved_bytes(tmp_path: Path) -> None:
    rng = random.Random(5)

    async def main() -> None:
        async with with_engine(config("cpu+lmdb", tmp_path, "write_back", capacity="4MiB")) as engine:
            stored: list[torch.Tensor] = []
            cancelled = 0
            for round_ in range(40):
                # stores at once, each must demote chunks to make room and the others take the room
                # one made; partial last chunks of all sizes fragment the slabs: reserving a later
                # chunk of a batch evicts (and demotes) too, and a cancellation lands there
                batch = []
                for seed, delay in zip(range(1000 + 4 * round_, 1004 + 4 * round_), some_delays(rng, 4, 0.01)):
                    length = rng.randrange(CHUNK, 6 * CHUNK)
                    stored.append(prompt(seed, MAX_CHUNKS)[:length])
                    batch.append(cancel_after(engine.store(stored[-1], kv_for(seed % 12, MAX_CHUNKS)[:, :, :length]),
                                              delay))
                cancelled += sum(not finished for finished, _ in await asyncio.gather(*batch))
                await engine.flush()
                assert_accounts_exactly(engine)
            assert_cancelled_some(cancelled, 160)
            for tokens in stored:
                await engine.batched_delete(engine.keys_for(tokens))
            await engine.flush()
            tier = memory_tier(engine)
            assert tier.used_bytes == 0 and tier.stats()["chunks"] == 0, (
                f"{tier.used_bytes} bytes for {tier.stats()['chunks']} chunks: reserved {tier._reserved}, "
                f"indexed {len(tier._index)} ({tier._index.used_bytes} bytes)")
            assert await engine.store(prompt(9, 4), kv_for(9, 4)) == 4
            assert await retrieve_exact_or_miss(engine, 9, 4) == 4 * CHUNK
    asyncio.run(main())


# -- write-through: concurrent stores into a small memory tier lose no acknowledged chunk -----------------
def test_concurrent_write_through_stores_keep_every_acknowledged_chunk_somewhere(tmp_path: Path) -> None:
    """Stores evict each other's chunks from a memory tier of four chunks while their fills
    are still queued: every acknowledged chunk is in the fill queue or a tier, and reads back."""

    async def main(run: int) -> None:
        async with with_engine(config("cpu+lmdb", tmp_path / str(run), capacity="2MiB")) as engine:
            seeds = list(range(400, 424))
            kvs = {seed: kv_for(seed % 12, 2) for seed in seeds}

            async def store_then_read(seed: int) -> None:
                tokens = prompt(seed, 2)
                assert await engine.store(tokens, kvs[seed]) == 2
                kv, mask = await engine.retrieve(tokens, return_tuple=False)
                assert bool(mask.all()), f"prompt {seed}: acknowledged, then missed ({engine.locate_prefix_nowait(tokens)})"
                assert same(kv, kvs[seed])
            await asyncio.gather(*(store_then_read(seed) for seed in seeds))
            await engine.flush()
            for seed in seeds:
                tokens = prompt(seed, 2)
                assert await engine.lookup(tokens) == len(tokens), f"prompt {seed} lost"
            assert_accounts_exactly(engine)
    for run in range(5):
        asyncio.run(main(run))


# -- retrieve(out=...) cancelled mid-read: nothing lands in out after the call returned -------------------
async def watch_unchanged(out: torch.Tensor, seconds: float = 0.05) -> bool:
    """Whether ``out`` keeps the bytes it had when the call returned, for ``seconds``."""
    before = out.clone()
    await asyncio.sleep(seconds)
    return same(out, before)


async def evict_from_memory(engine: AsyncEngine, seeds: list[int], round_: int) -> None:
    """Fill the memory tier with new prompts so ``seeds``' chunks are read from below."""
    for filler in range(500 + 3 * round_, 503 + 3 * round_):
        await engine.store(prompt(filler, MAX_CHUNKS), kv_for(filler, MAX_CHUNKS))
    await engine.flush()
    keys = [k for seed in seeds for k in engine.keys_for(prompt(seed, MAX_CHUNKS))]
    assert not any(memory_tier(engine).batched_contains_nowait(keys) or [])


@pytest.mark.parametrize("kind", ["cpu", "cpu+lmdb", "cpu+fs"])
def test_cancelled_retrieve_into_out_writes_nothing_after_it_returned(tmp_path: Path, kind: str) -> None:
    rng = random.Random(7)
    sentinel = -77.0

    async def main() -> None:
        async with with_engine(config(kind, tmp_path)) as engine:
            tokens, kv = prompt(1, MAX_CHUNKS), kv_for(1, MAX_CHUNKS)
            cancelled = 0
            for trial, delay in enumerate(some_delays(rng, 12, 0.01)):
                await engine.store(tokens, kv)
                await engine.flush()
                if kind != "cpu" and trial % 2:
                    await evict_from_memory(engine, [1], trial)
                out = torch.full_like(kv, sentinel)
                finished, result = await cancel_after(engine.retrieve(tokens, out=out, return_tuple=False), delay)
                cancelled += not finished
                assert await watch_unchanged(out), f"trial {trial}: bytes landed in out after the call returned"
                if finished:
                    served = int(result[1].sum())
                    exact = same(out[:, :, :served], kv[:, :, :served])
                    assert exact, f"trial {trial}: wrong bytes"
                await engine.flush()
                assert_accounts_exactly(engine)
            assert await retrieve_exact_or_miss(engine, 1, MAX_CHUNKS) == MAX_CHUNKS * CHUNK
            assert_cancelled_some(cancelled, 12)
    asyncio.run(main())


# -- cancellation storms: every entry point cancelled at random points ----------------------------------
STORM_CHUNKS = {1: 16, 2: 2, 3: 8, 4: 1, 5: 12, 6: 4, 7: 16, 8: 3}  # prompt seed -> chunks


def chunk_blobs(seed: int) -> list[torch.Tensor]:
    kv = kv_for(seed, STORM_CHUNKS[seed])
    return [kv[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous() for i in range(STORM_CHUNKS[seed])]


async def storm_op(engine: AsyncEngine, rng: random.Random, acknowledged: set[int]) -> bool:
    """One entry point with a random prompt, cancelled after a random delay (or finished);
    whether it was cancelled in flight."""
    seed = rng.choice(list(STORM_CHUNKS))
    chunks = STORM_CHUNKS[seed]
    tokens, kv = prompt(seed, chunks), kv_for(seed, chunks)
    keys = engine.keys_for(tokens)
    op = rng.choice(["store", "store", "retrieve_out", "retrieve_deadline", "retrieve_fresh", "prefetch",
                     "batched_put", "batched_get", "batched_contains", "batched_delete"])
    delay = rng.choice([0.0, rng.uniform(0, 0.002), rng.uniform(0, 0.02)])
    out = torch.full_like(kv, -5.0)
    if op == "store":
        work: Any = engine.store(tokens, kv)
    elif op == "retrieve_out":
        work = engine.retrieve(tokens, out=out, return_tuple=False)
    elif op == "retrieve_deadline":
        work = engine.retrieve(tokens, out=out, return_tuple=False, deadline_s=rng.uniform(0, 0.01))
    elif op == "retrieve_fresh":
        work = engine.retrieve(tokens, return_tuple=False)
    elif op == "prefetch":
        work = engine.prefetch(tokens)
    elif op == "batched_put":
        work = engine.batched_put(keys, chunk_blobs(seed))
    elif op == "batched_get":
        work = engine.batched_get(keys)
    elif op == "batched_contains":
        work = engine.batched_contains(keys)
    else:
        work = engine.batched_delete(keys)
    if op == "batched_delete":
        acknowledged.discard(seed)  # a cancelled delete may have removed some chunks
    finished, result = await cancel_after(work, delay)
    if op.startswith("retrieve") and op != "retrieve_fresh":
        before = out.clone()
        await asyncio.sleep(0.01)
        changed = (out.view(torch.uint8) != before.view(torch.uint8)).any(dim=(0, 1, 3, 4)).nonzero().flatten()
        assert not len(changed), (f"{op} of prompt {seed} ({'finished' if finished else 'cancelled'} after "
                                  f"{delay:.4f}s): tokens {changed.tolist()[:3]}..{changed.tolist()[-1:]} of out "
                                  "changed after the call returned")
    if not finished:
        return True
    if op in ("store", "batched_put"):
        acknowledged.add(seed)
    elif op.startswith("retrieve"):
        blob, mask = result
        served = int(mask.sum())
        if served:
            got = (out if op != "retrieve_fresh" else blob)[:, :, :served]
            assert same(got, kv[:, :, :served]), f"{op} of prompt {seed}: wrong bytes"
    elif op == "batched_get":
        blobs = chunk_blobs(seed)
        for index, chunk in enumerate(result):
            assert chunk is None or same(chunk, blobs[index]), f"batched_get of prompt {seed}: wrong chunk {index}"
    return False


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("kind", ["cpu", "cpu+lmdb", "cpu+fs"])
def test_cancellation_storm_keeps_every_promise(tmp_path: Path, kind: str, policy: str) -> None:
    rng = random.Random(f"{kind}-{policy}")

    async def main() -> None:
        async with with_engine(config(kind, tmp_path, policy, capacity="20MiB")) as engine:
            acknowledged: set[int] = set()
            cancelled = 0
            for _ in range(80):
                cancelled += await storm_op(engine, rng, acknowledged)
            assert_cancelled_some(cancelled, 80)
            await engine.flush()
            assert_accounts_exactly(engine)
            for seed in sorted(acknowledged):  # exact or a miss (the memory tier alone may have evicted it)
                await retrieve_exact_or_miss(engine, seed, STORM_CHUNKS[seed])
            if kind != "cpu":  # a lower tier keeps what was acknowledged
                for seed in sorted(acknowledged):
                    tokens = prompt(seed, STORM_CHUNKS[seed])
                    assert await engine.lookup(tokens) == len(tokens), f"acknowledged prompt {seed} lost"
            for seed in STORM_CHUNKS:
                await engine.batched_delete(engine.keys_for(prompt(seed, STORM_CHUNKS[seed])))
            await engine.flush()
            assert_accounts_exactly(engine)
            assert memory_tier(engine).used_bytes == 0 and memory_tier(engine).stats()["chunks"] == 0
            assert await engine.store(prompt(9, 4), kv_for(9, 4)) == 4  # and it keeps working
            assert await retrieve_exact_or_miss(engine, 9, 4) == 4 * CHUNK
    asyncio.run(main())


# -- connectors: a paged cache gathered into slabs, scattered out of them ---------------------------------
BLOCK = 16


def paged_cache(fill: float | None, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A [blocks, block_size, heads, head_size] K/V pair per layer, room for a whole prompt."""
    shape = (MAX_CHUNKS * CHUNK // BLOCK, BLOCK, HEADS, HEAD)
    if fill is not None:
        return [(torch.full(shape, fill, dtype=torch.float16), torch.full(shape, fill, dtype=torch.float16))
                for _ in range(LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(shape, generator=generator).to(torch.float16) for _ in range(2))  # type: ignore[misc]
            for _ in range(LAYERS)]


def flat(cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for layer in cache for t in layer])


@pytest.mark.parametrize("kind", ["cpu", "cpu+lmdb"])
def test_cancelled_connector_store_and_retrieve_keep_the_paged_cache_and_the_slabs(tmp_path: Path, kind: str) -> None:
    from tierkv.connectors import PagedConnector, retrieve_with_connector, store_with_connector

    rng = random.Random(11)
    connector = PagedConnector(LAYERS, HEADS, HEAD)
    num_tokens = MAX_CHUNKS * CHUNK
    slots = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(3))
    target_slots = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(4))

    async def main() -> None:
        async with with_engine(config(kind, tmp_path)) as engine:
            cancelled = 0
            delays = some_delays(rng, 12, 0.01)
            for trial in range(6):
                tokens = prompt(300 + trial, MAX_CHUNKS)
                source = paged_cache(None, seed=trial)
                finished, _ = await cancel_after(store_with_connector(engine, connector, tokens, kvcaches=source,
                                                                      slot_mapping=slots), delays[2 * trial])
                cancelled += not finished
                await engine.flush()
                assert_accounts_exactly(engine)
                await store_with_connector(engine, connector, tokens, kvcaches=source, slot_mapping=slots)
                assert await engine.lookup(tokens) == len(tokens), "a store after a cancelled one left the prompt uncached"
                if kind != "cpu" and trial % 2:
                    await evict_from_memory(engine, [], trial)
                target = paged_cache(-3.0)
                finished, _ = await cancel_after(retrieve_with_connector(engine, connector, tokens, kvcaches=target,
                                                                         slot_mapping=target_slots),
                                                 delays[2 * trial + 1])
                cancelled += not finished
                before = flat(target).clone()
                await asyncio.sleep(0.02)
                assert torch.equal(flat(target), before), f"trial {trial}: the paged cache changed after return"
                await engine.flush()
                assert_accounts_exactly(engine)
                target = paged_cache(-3.0)
                mask = await retrieve_with_connector(engine, connector, tokens, kvcaches=target,
                                                     slot_mapping=target_slots)
                assert bool(mask.all())
                for (k, v), (sk, sv) in zip(target, source):
                    got = torch.stack([k.reshape(-1, HEADS, HEAD)[target_slots], v.reshape(-1, HEADS, HEAD)[target_slots]])
                    want = torch.stack([sk.reshape(-1, HEADS, HEAD)[slots], sv.reshape(-1, HEADS, HEAD)[slots]])
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"trial {trial}: wrong KV"
            assert_cancelled_some(cancelled, 12)
    asyncio.run(main())


class with_engine:  # noqa: N801 - used as ``async with with_engine(cfg) as engine``
    """An AsyncEngine closed on the way out."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.engine = AsyncEngine(cfg)

    async def __aenter__(self) -> AsyncEngine:
        return self.engine

    async def __aexit__(self, *exc: object) -> None:
        await self.engine.close()
