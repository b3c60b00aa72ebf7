"""``close()`` racing calls from other threads (and tasks): every call either completes or
raises BackendClosedError promptly; no thread waits on a loop that is gone (real cpu, lmdb
and fs tiers; every join is bounded). By construction, not by timing: ``close()`` refuses new
calls, lets the calls already running end against open tiers, and only then closes them
(tierkv/routing/calls.py), so a store in flight is never failed by a tier closed under it."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from test_fill_cancel import HeldWrites

from tierkv import AsyncEngine, BackendClosedError, Engine, EngineBuilder
from tierkv.routing.router import TierRouter

CHUNK, LAYERS, HEADS, HEAD = 16, 2, 2, 4
THREADS, ROUNDS, JOIN_S = 6, 4, 60.0


def config(tmp_path: Path, lower: str) -> dict[str, object]:
    below = {"lmdb": {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
             "fs": {"name": "files", "backend": "fs", "path": str(tmp_path / "fs")}}[lower]
    return {"model": "m", "chunk_size": CHUNK, "cost_aware": False,
            "tiers": [{"name": "host", "backend": "cpu", "capacity": "2MiB"}, below]}


def work(engine: Engine, seed: int, outcomes: list[str]) -> None:
    """Store, retrieve and look up prompts until the engine is closed under it."""
    rng = random.Random(seed)
    try:
        while True:
            tokens = torch.tensor([rng.randrange(50) for _ in range(rng.choice((16, 40, 64)))])
            operation = rng.choice(("store", "retrieve", "lookup", "locate"))
            if operation == "store":
                engine.store(tokens, torch.randn(LAYERS, 2, len(tokens), HEADS, HEAD))
            elif operation == "retrieve":
                engine.retrieve(tokens)
            elif operation == "lookup":
                engine.lookup(tokens)
            else:
                engine.locate_prefix(tokens)
    except BackendClosedError:
        outcomes.append("closed")
    except BaseException as exc:  # noqa: BLE001 - any other outcome fails the test below
        outcomes.append(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("lower", ["lmdb", "fs"])
def test_threads_racing_close_end_promptly(lower: str, tmp_path: Path) -> None:
    for round_ in range(ROUNDS):
        engine = Engine(config(tmp_path / str(round_), lower))
        outcomes: list[str] = []
        threads = [threading.Thread(target=work, args=(engine, round_ * 100 + i, outcomes), daemon=True)
                   for i in range(THREADS)]
        for thread in threads:
            thread.start()
        time.sleep(random.Random(round_).uniform(0.02, 0.3))
        closer = threading.Thread(target=engine.close, daemon=True)
        closer.start()
        deadline = time.monotonic() + JOIN_S
        for thread in [*threads, closer]:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [thread.name for thread in [*threads, closer] if thread.is_alive()]
        assert not hung, f"round {round_}: threads still waiting {JOIN_S:.0f} s after close(): {hung}"
        assert outcomes == ["closed"] * THREADS, f"round {round_}: {outcomes}"
        with pytest.raises(BackendClosedError):
            engine.store(torch.arange(4), torch.zeros(LAYERS, 2, 4, HEADS, HEAD))
        engine.close()  # idempotent


def test_several_threads_closing_at_once(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path, "lmdb"))
    engine.store(torch.arange(40), torch.randn(LAYERS, 2, 40, HEADS, HEAD))
    closers = [threading.Thread(target=engine.close, daemon=True) for _ in range(4)]
    for thread in closers:
        thread.start()
    for thread in closers:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in closers)
    with Engine(config(tmp_path, "lmdb")) as reopened:
        assert reopened.lookup(torch.arange(40)) == 40, "the close that ran flushed and closed the tiers"


def test_engine_builder_destroy_racing_its_users(tmp_path: Path) -> None:
    outcomes: list[str] = []
    engine = EngineBuilder.get_or_create("race", config(tmp_path, "fs"))
    threads = [threading.Thread(target=work, args=(engine, i, outcomes), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    EngineBuilder.destroy("race")
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads) and outcomes == ["closed"] * THREADS, outcomes
    assert EngineBuilder.get("race") is None


def test_async_engine_tasks_racing_close(tmp_path: Path) -> None:
    async def main() -> list[str]:
        engine = AsyncEngine(config(tmp_path, "lmdb"))
        outcomes: list[str] = []

        async def task(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while True:
                    tokens = torch.tensor([rng.randrange(50) for _ in range(40)])
                    if rng.random() < 0.5:
                        await engine.store(tokens, torch.randn(LAYERS, 2, 40, HEADS, HEAD))
                    else:
                        await engine.retrieve(tokens)
            except BackendClosedError:
                outcomes.append("closed")

        tasks = [asyncio.create_task(task(i)) for i in range(THREADS)]
        await asyncio.sleep(0.1)
        await asyncio.wait_for(engine.close(), JOIN_S)
        done, pending = await asyncio.wait(tasks, timeout=JOIN_S)
        assert not pending, f"{len(pending)} tasks still running after close()"
        for finished in done:
            finished.result()
        return outcomes

    assert asyncio.run(main()) == ["closed"] * THREADS


def disk_only(tmp_path: Path) -> dict[str, object]:
    return {"model": "m", "chunk_size": CHUNK, "cost_aware": False,
            "tiers": [{"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}]}


def test_a_store_running_when_close_starts_completes_before_its_tier_closes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store held inside its tier's write when ``close()`` starts: close waits for it (the
    tier stays open), refuses every call made meanwhile, and the store completes once let go;
    only then are the tiers closed. (A grace far past any test's bound: the wait is for the
    store, however slow the machine.)"""
    monkeypatch.setattr(TierRouter, "close_grace_s", 10 * JOIN_S)

    async def main() -> None:
        engine = AsyncEngine(disk_only(tmp_path))
        disk = engine.wrap_tier("disk", HeldWrites)
        tokens = torch.arange(40)
        store = asyncio.create_task(engine.store(tokens, torch.randn(LAYERS, 2, 40, HEADS, HEAD)))
        await asyncio.wait_for(disk.writing.wait(), JOIN_S)
        closer = asyncio.create_task(engine.close())
        for _ in range(20):  # every loop turn close could take: it waits on the store, not on a clock
            await asyncio.sleep(0)
        assert not closer.done() and not disk.inner.closed, "close() closed the tier under a running store"
        with pytest.raises(BackendClosedError):
            await engine.lookup(tokens)
        disk.open.set()
        assert await asyncio.wait_for(store, JOIN_S) == 3, "the store that began before close() completed"
        await asyncio.wait_for(closer, JOIN_S)
        assert disk.inner.closed

    asyncio.run(main())


def test_a_store_that_outlasts_the_close_grace_ends_with_backend_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store still held when close()'s grace is over (a hung tier) has its tier closed under
    it: it ends with BackendClosedError, not with the TierUnavailableError of a store no tier
    took."""
    monkeypatch.setattr(TierRouter, "close_grace_s", 0.0)

    async def main() -> None:
        engine = AsyncEngine(disk_only(tmp_path))
        disk = engine.wrap_tier("disk", HeldWrites)
        store = asyncio.create_task(engine.store(torch.arange(40), torch.randn(LAYERS, 2, 40, HEADS, HEAD)))
        await asyncio.wait_for(disk.writing.wait(), JOIN_S)
        await asyncio.wait_for(engine.close(), JOIN_S)
        assert disk.inner.closed
        disk.open.set()
        with pytest.raises(BackendClosedError):
            await asyncio.wait_for(store, JOIN_S)

    asyncio.run(main())


def test_a_second_close_waits_for_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``close()`` calls at once: the second returns only once the first has closed the tiers."""
    monkeypatch.setattr(TierRouter, "close_grace_s", 10 * JOIN_S)

    async def main() -> None:
        engine = AsyncEngine(disk_only(tmp_path))
        disk = engine.wrap_tier("disk", HeldWrites)
        store = asyncio.create_task(engine.store(torch.arange(40), torch.randn(LAYERS, 2, 40, HEADS, HEAD)))
        await asyncio.wait_for(disk.writing.wait(), JOIN_S)
        first, second = asyncio.create_task(engine.close()), asyncio.create_task(engine.close())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not second.done(), "the second close() returned while the first was still closing"
        disk.open.set()
        await asyncio.wait_for(asyncio.gather(store, first, second), JOIN_S)
        assert disk.inner.closed

    asyncio.run(main())
