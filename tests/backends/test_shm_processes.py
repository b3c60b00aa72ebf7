"""The ``shm`` tier across real processes: one pool file that several OS processes store into,
read from and evict out of at once, and processes SIGKILLed at any instant (inside the pool's
lock, holding chunks, halfway through a write, at random under a CPU load). Every read is
exact or a miss, the pool never holds more than its capacity, each process sees what the others
stored, and what a dead process held or was writing comes back to the others."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import shm_workers as workers
from busy import busy_cores

from tierkv_backends.shm.layout import State

CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "tierkv", "tierkv_backends.shm", "shm_workers"])


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def consistent(tier: workers.SharedMemoryBackend) -> None:
    """No space unaccounted for: what the pool says it uses is its entries' extents, and the rest
    is in its free list (nobody else attached, so nothing is being written)."""
    pool = tier.pool
    with pool.lock():
        pool.reap()
        state = pool.entries["state"]
        live = (state == State.COMMITTED) | (state == State.RETIRED)
        assert not (state == State.WRITING).any(), "an unfinished write outlived its process"
        used = int(pool.entries["alloc"][live].sum())
        free = int(pool.free[: int(pool.words[11]), 1].sum())
        assert pool.used_bytes == used and used + free == tier.capacity, (pool.used_bytes, used, free)
        assert not pool.entries["readers"][live].any(), "a dead process's hold was not given back"
        assert not (state == State.RETIRED).any(), "a retired entry outlived its last reader"
        committed = np.flatnonzero(state == State.COMMITTED)
        found = pool.find(pool.entries["digest"][committed]) if len(committed) else committed
        assert (found == committed).all(), "a committed entry no lookup can find holds space"


def every_byte_returns(tier: workers.SharedMemoryBackend, indices: range) -> None:
    """No space leaked: with chunks ``indices`` stored (the pool full), deleting them leaves the
    pool empty and its free space one extent of the whole capacity; then chunks of one size fill
    it to within one chunk (sizes that differ leave holes between them; one size cannot)."""
    consistent(tier)
    for index in indices:
        run(tier.delete(workers.key_of(index)))
    pool = tier.pool
    with pool.lock():
        extents = pool.free[: int(pool.words[11])]
        assert pool.used_bytes == 0 and extents.tolist() == [[0, tier.capacity]], (pool.used_bytes, extents.tolist())
    size = workers.chunk_of(8).numel() * 4
    run(tier.batched_put([workers.key_of(1_000_000 + n) for n in range(tier.capacity // size)],
                         [workers.chunk_of(8) for _ in range(tier.capacity // size)]))
    assert tier.used_bytes > tier.capacity - size, "space leaked"
    consistent(tier)


def fill(tier: workers.SharedMemoryBackend, indices: range) -> None:
    """Store chunks ``indices``, four at a time (a batch never evicts its own chunks)."""
    for start in range(indices.start, indices.stop, 4):
        batch = range(start, min(start + 4, indices.stop))
        run(tier.batched_put([workers.key_of(i) for i in batch], [workers.chunk_of(i) for i in batch]))


def check_every_key(tier: workers.SharedMemoryBackend, keyspace: int) -> tuple[int, int]:
    """(hits, wrong) over every key: each held chunk must be exactly the truth."""
    found = run(tier.batched_get([workers.key_of(i) for i in range(keyspace)]))
    return sum(c is not None for c in found), sum(not workers.exact(i, c) for i, c in enumerate(found))


def test_four_processes_see_what_each_stored(pool_path: Path) -> None:
    capacity, per_process, processes = 64 << 20, 20, 4
    barrier, results = CONTEXT.Barrier(processes), CONTEXT.Queue()
    jobs = [CONTEXT.Process(target=workers.store_and_read_all,
                            args=(pool_path, capacity, me, per_process, processes, barrier, results))
            for me in range(processes)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(180)
        assert job.exitcode == 0
    seen = sorted(results.get(timeout=10) for _ in range(processes))
    assert seen == [(me, processes * per_process, 0) for me in range(processes)], "each sees all 80, exact"
    tier = workers.backend(pool_path, capacity)
    try:
        assert tier.stats()["pool_chunks"] == processes * per_process and tier.used_bytes <= capacity
        assert check_every_key(tier, processes * per_process) == (processes * per_process, 0)
        consistent(tier)
    finally:
        run(tier.close())


def test_processes_storing_reading_and_evicting_at_once_read_only_the_truth(pool_path: Path) -> None:
    capacity, keyspace = 40 * (6 << 10), 120  # about 40 chunks: every process evicts the others' chunks
    wrong, operations = CONTEXT.Value("i", 0), CONTEXT.Value("i", 0)
    tier = workers.backend(pool_path, capacity)
    try:
        jobs = [CONTEXT.Process(target=workers.hammer, args=(pool_path, capacity, seed, keyspace, 3.0, wrong, operations))
                for seed in range(4)]
        for job in jobs:
            job.start()
        most = 0
        while any(job.is_alive() for job in jobs):
            most = max(most, tier.used_bytes)
            time.sleep(0.005)
        for job in jobs:
            job.join(60)
            assert job.exitcode == 0
        assert wrong.value == 0 and operations.value > 100
        assert most <= capacity, "the pool held more than its capacity"
        assert tier.stats()["pool_evictions"] > 0
        assert check_every_key(tier, keyspace)[1] == 0
        consistent(tier)
    finally:
        run(tier.close())


def test_a_process_killed_inside_the_lock_leaves_a_pool_the_others_rebuild(pool_path: Path) -> None:
    capacity = 4 << 20
    tier = workers.backend(pool_path, capacity)
    try:
        run(tier.batched_put([workers.key_of(i) for i in range(5)], [workers.chunk_of(i) for i in range(5)]))
        ready = CONTEXT.Event()
        child = CONTEXT.Process(target=workers.die_inside_the_lock, args=(pool_path, capacity, ready))
        child.start()
        assert ready.wait(60)
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(30)
        assert check_every_key(tier, 5) == (5, 0), "what was committed before the kill is still there"
        assert tier.stats()["recoveries"] == 1
        consistent(tier)
        run(tier.batched_put([workers.key_of(i) for i in range(5, 10)], [workers.chunk_of(i) for i in range(5, 10)]))
        assert check_every_key(tier, 10) == (10, 0)
    finally:
        run(tier.close())


def test_a_killed_process_gives_back_its_holds_and_its_unfinished_write(pool_path: Path) -> None:
    chunk = workers.chunk_of(0).numel() * 4
    capacity = 64 * chunk
    tier = workers.backend(pool_path, capacity)
    try:
        ready = CONTEXT.Event()
        child = CONTEXT.Process(target=workers.die_holding_and_writing, args=(pool_path, capacity, ready))
        child.start()
        assert ready.wait(60)
        pool = tier.pool
        entry = int(pool.find(tier._digest_rows([workers.key_of(0)]))[0])
        assert entry >= 0 and int(pool.entries["readers"][entry]) == 1
        assert int((pool.entries["state"] == State.WRITING).sum()) == 1
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(30)
        assert check_every_key(tier, 2) == (1, 0), "chunk 0 was committed; chunk 1 never was"
        consistent(tier)  # reaps: the hold and the reserved room come back
        assert tier.stats()["reaped_processes"] == 1
        # no space leaked: the pool fills up, evicting chunk 0 like any other, and every byte returns
        fill(tier, range(100, 200))
        every_byte_returns(tier, range(100, 200))
    finally:
        run(tier.close())


@pytest.mark.slow  # writers, readers and evicting processes killed at random for 20 rounds, every core busy
def test_processes_killed_at_random_instants_never_cost_a_wrong_byte_or_a_byte_of_space(pool_path: Path) -> None:
    capacity, keyspace, rounds = 48 * (6 << 10), 150, 20
    rng = random.Random(46)
    wrong, operations = CONTEXT.Value("i", 0), CONTEXT.Value("i", 0)
    kills = checked = 0
    tier = workers.backend(pool_path, capacity)
    try:
        with busy_cores():
            for round_ in range(rounds):
                jobs = [CONTEXT.Process(target=workers.hammer,
                                        args=(pool_path, capacity, 1000 * round_ + n, keyspace, 1.5, wrong, operations))
                        for n in range(3)]
                for job in jobs:
                    job.start()
                time.sleep(rng.uniform(0.3, 1.2))  # attached and busy, or still attaching
                for job in rng.sample(jobs, rng.randint(1, 3)):
                    if job.is_alive():
                        os.kill(job.pid, signal.SIGKILL)  # type: ignore[arg-type]
                        kills += 1
                for job in jobs:
                    job.join(60)
                assert tier.used_bytes <= capacity
                hits, bad = check_every_key(tier, keyspace)
                checked += hits
                assert bad == 0, f"round {round_}: a chunk read back wrong after a kill"
                consistent(tier)
        assert wrong.value == 0, "a process read bytes that were not its chunk's"
        fill(tier, range(10_000, 10_200))
        every_byte_returns(tier, range(10_000, 10_200))
        print(f"shm crash test: {rounds} rounds, {kills} kills, {operations.value} operations by the killed and "
              f"surviving processes, {checked} chunks checked after the kills, "
              f"{tier.stats()['reaped_processes']} processes reaped, {tier.stats()['recoveries']} recoveries")
    finally:
        run(tier.close())

