"""The engine's small modules, each on its own: what write-back holds dirty, where a chunk is
(levels inside, names outside), how copies are counted, namespaced keys, the tier handle,
and the memory tier's slab arena. The whole engine runs them in test_engine/test_tiering;
these pin each one's contract where a regression would otherwise show up far away."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from tierkv import Engine
from tierkv.backend import StorageBackend
from tierkv.chunks import copies
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.kvlayout import nbytes_of
from tierkv.chunks.namespaces import in_namespace, named_key, namespaced_keys
from tierkv.config import HealthConfig
from tierkv.errors import ConfigError
from tierkv.routing.fill import FillJob, FillQueue
from tierkv.routing.locate import FILL_QUEUE, FILL_QUEUE_LEVEL, levels, levels_nowait, names, read_levels
from tierkv.routing.write_back import DirtyChunks
from tierkv.tiers.tier import Tier
from tierkv_backends._paths import ensure_writable_dir
from tierkv_backends.cpu import CPUBackend
from tierkv_backends.memory.slabs import SlabArena


class UnindexedBackend(StorageBackend):
    """A store that must be asked to know what it holds (as S3 is): no in-memory index."""

    bounded = False

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.data: dict[CacheKey, torch.Tensor] = {}

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        self.data[key] = chunk.clone()

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return self.data.get(key)

    async def delete(self, key: CacheKey) -> bool:
        return self.data.pop(key, None) is not None

    async def contains(self, key: CacheKey) -> bool:
        return key in self.data


def key(index: int, model: str = "parts") -> CacheKey:
    return CacheKey("vllm", model, 1, 0, f"{index:032x}")


# -- write_back --------------------------------------------------------------------------------
def test_dirty_chunks_keep_order_per_level_and_forget_what_was_written_or_deleted() -> None:
    dirty = DirtyChunks()
    dirty.mark(1, [key(3), key(1)])
    dirty.mark(0, [key(2), key(1), key(2)])
    assert dirty.levels() == [0, 1] and dirty.count() == 4
    assert dirty.pending(0) == [key(2), key(1)], "oldest first, a key once"
    dirty.clean(0, [key(2), key(9)])
    assert dirty.pending(0) == [key(1)]
    dirty.discard([key(1)])
    assert dirty.levels() == [1] and dirty.pending(1) == [key(3)]
    dirty.clean(1, [key(3)])
    assert dirty.levels() == [] and dirty.count() == 0


# -- locate: levels inside, names outside -------------------------------------------------------
def test_levels_find_the_highest_tier_then_the_fill_queue_and_names_translate_them(tmp_path: Path) -> None:
    async def main() -> None:
        health = HealthConfig()
        top, disk = CPUBackend("host", 1 << 20), UnindexedBackend("disk")
        tiers = [Tier(top, 0, False, health), Tier(disk, 1, False, health)]
        fill = FillQueue(1 << 20)
        chunk = torch.ones(2, 2, 4, 1, 2)
        await top.batched_put([key(0)], [chunk])
        await disk.batched_put([key(0), key(1)], [chunk, chunk])
        await fill.put(FillJob([key(2)], [chunk], [1]))
        found = await levels(tiers, fill, [key(0), key(1), key(2), key(3)])
        assert found == [0, 1, FILL_QUEUE_LEVEL, None]
        assert names(tiers, found) == ["host", "disk", FILL_QUEUE, None]
        assert levels_nowait(tiers, fill, [key(0)]) == [0], "every chunk in the top tier: no I/O"
        assert levels_nowait(tiers, fill, [key(1)]) is None, "a tier without an in-memory index needs I/O"
        # a read plan without I/O: what no indexed tier holds goes to the first tier without an index
        assert read_levels(tiers, fill, [key(0), key(1), key(2)]) == [0, 1, FILL_QUEUE_LEVEL]
        for backend in (top, disk):
            await backend.close()

    asyncio.run(main())


def test_a_tier_that_fails_to_answer_is_skipped_and_counted(tmp_path: Path) -> None:
    from tierkv.testing.faults import FaultyBackend

    async def main() -> None:
        failing = FaultyBackend(CPUBackend("host", 1 << 20))
        failing.failing = True
        below = CPUBackend("below", 1 << 20)
        await below.batched_put([key(5)], [torch.zeros(2, 2, 4, 1, 2)])
        tiers = [Tier(failing, 0, False, HealthConfig()), Tier(below, 1, False, HealthConfig())]
        assert await levels(tiers, FillQueue(1 << 20), [key(5)]) == [1]
        assert tiers[0].metrics.counters["errors"] == 1
        assert await tiers[0].contains([key(5)]) is None and await tiers[0].delete([key(5)]) == 0

    asyncio.run(main())


def test_public_locate_answers_with_names_only(tmp_path: Path) -> None:
    config = {"model": "parts", "chunk_size": 4, "kv_format": "vllm",
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "1MiB"},
                        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "8MiB"}]}
    tokens = torch.arange(8)
    with Engine(config) as eng:
        eng.store(tokens, torch.ones(2, 2, 8, 1, 2))
        eng.flush()
        eng.run(eng.tiers[0].delete(eng.keys_for(tokens)[1]))
        assert eng.locate(tokens) == ["host", "disk"]
        assert eng.locate_prefix(tokens) == ["host", "disk"]
        assert eng.core.locate_keys_nowait(eng.keys_for(tokens)) == ["host", "disk"]
        assert eng.run(eng.core.locate_keys(eng.keys_for(tokens) + [key(99)])) == ["host", "disk", None]
        plan = eng.core.plan_located(["host", "disk"], 8)
        assert plan.planned_tokens == 8 and plan.summary()


# -- copies -----------------------------------------------------------------------------------
def test_copies_are_counted_on_the_path_that_made_them_even_in_worker_threads() -> None:
    counter = copies.CopyCounter()
    copies.count(100)  # outside any path: not counted
    with copies.on_path(counter, "retrieve"):
        counter.add_delivered("retrieve", 50)
        copies.count(50)

        async def in_thread() -> None:
            await asyncio.to_thread(copies.count, 25)

        asyncio.run(in_thread())
        assert copies.current_path() == "retrieve"
    assert copies.current_path() is None
    snapshot = counter.snapshot()
    assert snapshot["retrieve"] == {"copied_bytes": 75, "delivered_bytes": 50, "copies_per_byte": 1.5}
    assert snapshot["store"]["copied_bytes"] == 0
    with pytest.raises(ValueError, match="copy path must be one of"):
        with copies.on_path(counter, "elsewhere"):
            pass


def test_copy_counter_is_exact_under_concurrent_adds() -> None:
    counter = copies.CopyCounter()
    threads = [threading.Thread(target=lambda: [counter.add_copied("fill", 1) for _ in range(10_000)])
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counter.snapshot()["fill"]["copied_bytes"] == 40_000


# -- namespaces -------------------------------------------------------------------------------
def test_namespaced_keys_never_meet_prefix_chunks_or_each_other() -> None:
    base = key(7)
    moved = in_namespace(base, "blend")
    assert moved.chunk_hash == base.chunk_hash and moved != base and moved.model_name == "parts::blend"
    assert namespaced_keys([base, key(8)], "buffers") == [in_namespace(base, "buffers"), in_namespace(key(8), "buffers")]
    first = named_key(base, "named", "ab", "c")
    assert first == named_key(key(1), "named", "ab", b"c"), "the same name in every process, from any template"
    assert first != named_key(base, "named", "a", "bc"), "parts are length-prefixed: no ambiguous joins"
    assert first != named_key(base, "other", "ab", "c")
    assert len(first.chunk_hash) == 32


# -- the byte count of a layout ------------------------------------------------------------------
def test_nbytes_of_a_layout() -> None:
    assert nbytes_of((2, 3, 4), torch.bfloat16) == 48
    assert nbytes_of((), torch.float32) == 4
    assert nbytes_of((5, 0), torch.float32) == 0


# -- a file tier's directory ----------------------------------------------------------------------
def test_a_tier_directory_is_created_or_refused_with_the_reason(tmp_path: Path) -> None:
    ensure_writable_dir(str(tmp_path / "a" / "b"), "tiers[1].path")
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"tiers\[1\].path: cannot create directory .*file"):
        ensure_writable_dir(str(tmp_path / "file"), "tiers[1].path")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable by this process"):
            ensure_writable_dir(str(locked), "tiers[1].path")


# -- the slab arena -------------------------------------------------------------------------------
def test_slab_arena_reuses_released_space_and_gives_back_empty_segments() -> None:
    arena = SlabArena(1 << 20, torch.device("cpu"), pinned=False)
    assert arena.allocated == 1 << 20
    slabs = []
    while (slab := arena.allocate(64 << 10)) is not None:
        slabs.append(slab)
    assert len(slabs) == 16, "the whole limit, in 64 KiB slabs"
    starts = {(arena.segment_of(s), s.storage_offset()) for s in slabs}
    assert len(starts) == 16, "no two slabs share memory"
    arena.release(slabs.pop())
    again = arena.allocate(64 << 10)
    assert again is not None and arena.allocate(64 << 10) is None
    slabs.append(again)
    for slab in slabs:
        arena.release(slab)
    assert arena.trim(0) == 1 << 20 and arena.allocated == 0
    assert arena.allocate(64 << 10) is not None, "it grows back after pressure gave memory back"
