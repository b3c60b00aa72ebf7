"""The ``shm`` pool's journal: what one process stored (its description) and what left the pool
(evicted or deleted, by whichever process) reach every other process attached to the pool, a
reader that attaches late finds what the pool still holds, and nothing in the ring (a record a
writer died halfway through, a damaged length, a reader left behind by a full ring) makes a
reader read wrong bytes or fail."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import numpy as np
import pytest
import shm_workers as workers

from tierkv_backends.shm.journal import HEADER, Kind
from tierkv_backends.shm.layout import MIN_JOURNAL_BYTES, Word


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def chunk_bytes(index: int) -> int:
    chunk = workers.chunk_of(index)
    return chunk.numel() * chunk.element_size()


def store(tier: workers.SharedMemoryBackend, *indices: int) -> None:
    run(tier.batched_put([workers.key_of(i) for i in indices], [workers.chunk_of(i) for i in indices]))


def described(records: list, kind: Kind = Kind.DESCRIBED) -> dict[tuple[int, int], bytes]:
    return {record.digest: record.payload for record in records if record.kind == kind}


def payloads(records: list) -> list[bytes]:
    """The descriptions' payloads, in order (a store also names its scope's model: NAMED)."""
    return [record.payload for record in records if record.kind == Kind.DESCRIBED]


def test_another_process_reads_what_one_described_and_what_left(pool_path: Path) -> None:
    capacity = 6 * chunk_bytes(8)
    writer = workers.backend(pool_path, capacity)
    reader = workers.backend(pool_path, capacity)
    try:
        cursor = reader.journal_cursor(everything=False)
        store(writer, 0, 1)
        assert writer.describe([(workers.key_of(0), b"zero"), (workers.key_of(1), b"one")]) == 2
        reading = reader.read_journal(cursor)
        assert described(reading.records) == {writer.chunk_digest(workers.key_of(0)): b"zero",
                                              writer.chunk_digest(workers.key_of(1)): b"one"}
        assert reading.lost_bytes == 0
        store(writer, 0)  # a newer copy of chunk 0 replaces it: it did not leave
        run(reader.delete(workers.key_of(1)))  # the reader deletes the writer's chunk
        reading = reader.read_journal(reading.cursor)
        assert set(described(reading.records, Kind.DROPPED)) == {writer.chunk_digest(workers.key_of(1))}
        # a flood evicts chunk 0: the evicting process journals it
        for index in range(100, 112):
            store(reader, index)
        dropped = described(reader.read_journal(reading.cursor).records, Kind.DROPPED)
        assert writer.chunk_digest(workers.key_of(0)) in dropped
        assert writer.describe([(workers.key_of(1), b"gone")]) == 0, "a chunk no longer held is not described"
    finally:
        run(writer.close())
        run(reader.close())


def test_a_late_reader_reads_the_pools_history_from_the_oldest_record(pool_path: Path) -> None:
    capacity = 64 * chunk_bytes(8)
    first = workers.backend(pool_path, capacity)
    try:
        store(first, *range(5))
        first.describe([(workers.key_of(i), f"chunk {i}".encode()) for i in range(5)])
        late = workers.backend(pool_path, capacity)
        try:
            records = late.read_journal(late.journal_cursor(everything=True)).records
            assert described(records) == {first.chunk_digest(workers.key_of(i)): f"chunk {i}".encode()
                                          for i in range(5)}
            assert [r.seq for r in records] == sorted(r.seq for r in records)
        finally:
            run(late.close())
    finally:
        run(first.close())


def test_a_full_ring_drops_the_oldest_records_and_a_reader_left_behind_counts_them(pool_path: Path) -> None:
    tier = workers.backend(pool_path, 64 * chunk_bytes(8), journal_bytes=MIN_JOURNAL_BYTES)
    try:
        store(tier, 0)
        cursor = tier.journal_cursor(everything=True)
        payload = bytes(range(256)) * 4  # 1 KiB: the 64 KiB ring holds about 60
        for round_ in range(200):
            assert tier.describe([(workers.key_of(0), payload + struct.pack("<I", round_))]) == 1
        reading = tier.read_journal(cursor, limit=1_000_000)
        assert reading.lost_bytes > 0, "the reader was lapped: it must say it lost records"
        rounds = [struct.unpack("<I", p[-4:])[0] for p in payloads(reading.records)]
        assert rounds == list(range(rounds[0], 200)) and len(rounds) > 40, "the newest records, whole, in order"
        assert all(p[:-4] == payload for p in payloads(reading.records))
        assert tier.read_journal(reading.cursor).records == [], "nothing new"
    finally:
        run(tier.close())


def test_a_record_a_writer_died_in_is_never_read_and_damage_is_contained(pool_path: Path) -> None:
    tier = workers.backend(pool_path, 64 * chunk_bytes(8), journal_bytes=MIN_JOURNAL_BYTES)
    try:
        store(tier, 0)
        journal = tier.pool.journal
        cursor = tier.journal_cursor(everything=True)
        tier.describe([(workers.key_of(0), b"whole")])
        # a writer killed halfway through its record: bytes past HEAD, HEAD not moved
        head = int(tier.pool.words[Word.JOURNAL_HEAD]) % journal.size
        journal.ring[head : head + 64] = np.frombuffer(HEADER.pack(64, Kind.DESCRIBED, 40, 0, 99) + bytes(40),
                                                       dtype=np.uint8)
        reading = tier.read_journal(cursor)
        assert payloads(reading.records) == [b"whole"]
        tier.describe([(workers.key_of(0), b"next")])  # the next writer writes over the half record
        assert payloads(tier.read_journal(reading.cursor).records) == [b"next"]
        # damage inside the readable part: a flipped payload byte fails its CRC, a length past the
        # ring's end stops the read; neither raises, both are counted as lost
        start = int(tier.pool.words[Word.JOURNAL_HEAD])
        tier.describe([(workers.key_of(0), b"flipped")])
        journal.ring[(start % journal.size) + HEADER.size + 17] ^= 0xFF
        tier.describe([(workers.key_of(0), b"after")])
        reading = tier.read_journal(start)
        assert payloads(reading.records) == [b"after"] and reading.lost_bytes > 0
        start = int(tier.pool.words[Word.JOURNAL_HEAD])
        tier.describe([(workers.key_of(0), b"long")])
        journal.ring[start % journal.size : start % journal.size + 4] = np.frombuffer(
            struct.pack("<I", 1 << 30), dtype=np.uint8)
        reading = tier.read_journal(start)
        assert reading.records == [] and reading.cursor == int(tier.pool.words[Word.JOURNAL_HEAD])
        for round_ in range(100):  # writers go on past the damage as the ring wraps
            tier.describe([(workers.key_of(0), bytes(1000) + struct.pack("<I", round_))])
        last = payloads(tier.read_journal(tier.journal_cursor(everything=True), limit=1_000_000).records)
        assert struct.unpack("<I", last[-1][-4:])[0] == 99
    finally:
        run(tier.close())


def test_a_payload_larger_than_the_journal_allows_is_left_out(pool_path: Path) -> None:
    tier = workers.backend(pool_path, 64 * chunk_bytes(8), journal_bytes=MIN_JOURNAL_BYTES)
    try:
        store(tier, 0)
        assert tier.describe([(workers.key_of(0), bytes(MIN_JOURNAL_BYTES // 4))]) == 0
        assert payloads(tier.read_journal(tier.journal_cursor()).records) == []
    finally:
        run(tier.close())


def test_journal_bytes_below_the_minimum_is_refused_by_name(pool_path: Path) -> None:
    with pytest.raises(ValueError, match="journal_bytes"):
        workers.backend(pool_path, 1 << 20, journal_bytes=1024)


def test_pools_of_different_journal_sizes_refuse_each_other(pool_path: Path) -> None:
    from tierkv.errors import ConfigError

    tier = workers.backend(pool_path, 1 << 20, journal_bytes=MIN_JOURNAL_BYTES)
    try:
        with pytest.raises(ConfigError, match="journal_bytes"):
            workers.backend(pool_path, 1 << 20, journal_bytes=2 * MIN_JOURNAL_BYTES)
    finally:
        run(tier.close())


