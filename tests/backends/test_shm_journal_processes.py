"""The ``shm`` pool's journal across real processes on a busy machine: three writers store,
describe and delete at once through a ring small enough to wrap many times, while a reader in
this process reads it without the lock, falling behind now and then (so the writers lap it and
overwrite records as it copies them). Every record the reader gets is whole and exact (a
description's every byte, a drop's digest of a real chunk), whatever the writers were doing when
it copied; what it could not read it counts as lost, never returns."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from pathlib import Path

import shm_workers as workers
from busy import busy_cores

from tierkv_backends.shm.journal import Kind
from tierkv_backends.shm.layout import MIN_JOURNAL_BYTES

CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "tierkv", "tierkv_backends.shm", "shm_workers"])


def test_a_lock_free_reader_gets_only_whole_records_while_writers_wrap_the_ring(pool_path: Path) -> None:
    capacity, keyspace, journal = 40 * (6 << 10), 60, MIN_JOURNAL_BYTES
    reader = workers.backend(pool_path, capacity, journal_bytes=journal)
    digests = {reader.chunk_digest(workers.key_of(i)): i for i in range(keyspace)}
    written = CONTEXT.Value("i", 0)
    cursor = reader.journal_cursor(everything=False)
    seen = {Kind.DESCRIBED: 0, Kind.DROPPED: 0}
    wrong: list[str] = []
    lost = reads = 0
    try:
        with busy_cores():
            jobs = [CONTEXT.Process(target=workers.journal_writer,
                                    args=(str(pool_path), capacity, journal, seed, keyspace, 4.0, written))
                    for seed in range(3)]
            for job in jobs:
                job.start()
            while any(job.is_alive() for job in jobs) or cursor < reader.journal_cursor(everything=False):
                reading = reader.read_journal(cursor, limit=64)
                cursor, lost = reading.cursor, lost + reading.lost_bytes
                for record in reading.records:
                    if record.kind == Kind.DESCRIBED:
                        seen[Kind.DESCRIBED] += 1
                        index = int.from_bytes(record.payload[:4], "little")
                        round_ = int.from_bytes(record.payload[4:8], "little")
                        if digests.get(record.digest) != index or record.payload != workers.description_of(index,
                                                                                                          round_):
                            wrong.append(f"description of chunk {index}, round {round_}")
                    elif record.kind == Kind.DROPPED:
                        seen[Kind.DROPPED] += 1
                        if record.digest not in digests:
                            wrong.append(f"a drop of an unknown digest {record.digest}")
                reads += 1
                if not reading.records or reads % 8 == 0:  # now and then fall behind: lapped, torn copies
                    time.sleep(0.02)
            for job in jobs:
                job.join(60)
                assert job.exitcode == 0
    finally:
        asyncio.run(reader.close())
    print(f"journal under load: {seen[Kind.DESCRIBED]} descriptions and {seen[Kind.DROPPED]} drops read whole of "
          f"{written.value} descriptions written; {lost} bytes lost to the ring's wrap")
    assert not wrong, wrong[:5]
    assert seen[Kind.DESCRIBED] > 100 and seen[Kind.DROPPED] > 10
    assert written.value * 3000 > 8 * journal, "the writers wrapped the ring several times"
