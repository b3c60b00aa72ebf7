"""Hints through the engine over a real node pool (``shm``): a retained prefix survives a flood
that evicts everything else, a lease past the pool's cap is refused whole, a pool of nothing
but retained chunks still makes room (a bias, never a deadlock), a lease ends, another process
sees the lease, a dropped prefix misses while others hit, a prefetch brings a prefix up from
disk, and each hint's outcome is counted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hint_prompts import CHUNK, CHUNK_BYTES, kv_of, prompt, store

from tierkv import Engine, RequestIdentity, RetentionRefusedError
from tierkv_backends.shm import SharedMemoryBackend


def config(pool_path: Path, disk: Path | None = None, retain_share: float = 0.5) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"name": "node", "backend": "shm", "path": str(pool_path),
                                    "capacity": 16 * CHUNK_BYTES, "retain_share": retain_share}]
    if disk is not None:
        tiers.append({"name": "disk", "backend": "lmdb", "path": str(disk), "capacity": "64MiB"})
    return {"model": "hints", "chunk_size": CHUNK, "cost_aware": False, "write_policy": "write_through",
            "tiers": tiers}


def test_a_retained_prefix_survives_a_flood_and_a_dropped_one_misses(pool_path: Path) -> None:
    with Engine(config(pool_path)) as engine:
        store(engine, 0, 1)
        assert engine.retain(prompt(0), 600) == 4 * CHUNK
        store(engine, *range(2, 12))  # 40 chunks through a 16-chunk pool
        assert engine.lookup(prompt(0)) == 4 * CHUNK, "retained: kept through the flood"
        assert engine.lookup(prompt(1)) == 0, "not retained: evicted (least recently used)"
        kv, mask = engine.retrieve(prompt(0), return_tuple=False)
        assert bool(mask.all()) and torch.equal(kv, kv_of(prompt(0)))
        assert engine.drop(prompt(0)) == 4 * CHUNK
        assert engine.lookup(prompt(0)) == 0 and engine.lookup(prompt(11)) == 4 * CHUNK
        hints = engine.stats()["hints"]
        assert hints["retained_tokens"] == 4 * CHUNK and hints["dropped_tokens"] == 4 * CHUNK
        assert hints["retained_by_tier"] == {"node": 4 * CHUNK}


def test_a_retained_prompts_continuation_tail_is_leased_with_it(pool_path: Path) -> None:
    """``cut_at``: the partial chunk a save of the prompt cut inside its last chunk stored (what
    the vLLM connector stores for a chat's next turn) is leased with the prompt's chunks and
    survives the flood; a cut outside the last chunk is refused by name, and nothing is leased."""
    with Engine(config(pool_path)) as engine:
        tokens = torch.arange(3 * CHUNK + 10) + 700_000  # 3 chunks and a 10-token tail
        cut = 3 * CHUNK + 8
        for stored in (tokens, tokens[:cut]):
            engine.store(stored, kv_of(stored))
        engine.flush()
        for bad in (3 * CHUNK, len(tokens), 2 * CHUNK + 8, 0):
            with pytest.raises(ValueError, match="cut_at must end inside the prompt's last chunk"):
                engine.retain(tokens, 600, cut_at=bad)
        assert engine.stats()["tiers"]["node"]["pool_retained_bytes"] == 0, "a refused cut leases nothing"
        assert engine.retain(tokens, 600, cut_at=cut) == len(tokens)
        store(engine, *range(0, 10))  # 40 chunks through a 16-chunk pool
        assert engine.lookup(tokens) == len(tokens), "the prompt, retained"
        assert engine.lookup(tokens[:cut]) == cut, "and its cut"
        kv, mask = engine.retrieve(tokens[:cut], return_tuple=False)
        assert bool(mask.all()) and torch.equal(kv, kv_of(tokens[:cut]))


def test_a_lease_past_the_cap_is_refused_whole(pool_path: Path) -> None:
    with Engine(config(pool_path, retain_share=0.5)) as engine:  # 8 of 16 chunks may be retained
        store(engine, 0, 1, 2)
        assert engine.retain(prompt(0), 600) == 4 * CHUNK
        assert engine.retain(prompt(0), 900) == 4 * CHUNK, "a longer lease on held chunks takes no more room"
        assert engine.retain(prompt(1), 600) == 4 * CHUNK
        with pytest.raises(RetentionRefusedError, match="retain_share"):
            engine.retain(prompt(2), 600)
        assert engine.stats()["hints"]["retain_refused"] == 1
        store(engine, *range(3, 12))
        assert engine.lookup(prompt(2)) == 0, "the refused lease retained nothing"
        assert engine.lookup(prompt(0)) == engine.lookup(prompt(1)) == 4 * CHUNK
        assert engine.retain(prompt(1), 0) == 4 * CHUNK, "released"
        assert engine.retain(prompt(3) if engine.lookup(prompt(3)) else prompt(11), 600) == 4 * CHUNK, \
            "room under the cap again"


def test_a_pool_of_only_retained_chunks_still_makes_room(pool_path: Path) -> None:
    with Engine(config(pool_path, retain_share=1.0)) as engine:
        store(engine, 0, 1, 2, 3)  # the whole pool
        for index in range(4):
            engine.retain(prompt(index), 600)
        store(engine, 4)  # must evict a retained chunk: nothing else is left
        assert engine.lookup(prompt(4)) == 4 * CHUNK
        node = engine.tiers[0]
        assert node.stats()["pool_retained_evictions"] >= 4
        assert engine.lookup(prompt(0)) == 0, "the least recently used retained prefix went first"


def test_a_lease_ends(pool_path: Path) -> None:
    with Engine(config(pool_path)) as engine:
        store(engine, 0, 1)
        engine.retain(prompt(0), 0.2)
        time.sleep(0.3)  # past the lease (CLOCK_MONOTONIC): no longer retained
        assert engine.tiers[0].stats()["pool_retained_bytes"] == 0
        store(engine, *range(2, 6))
        assert engine.lookup(prompt(0)) == 0, "after its lease, the prefix is evicted as any other"


def test_another_process_evicts_around_a_lease(pool_path: Path) -> None:
    with Engine(config(pool_path)) as engine:
        store(engine, 0)
        engine.retain(prompt(0), 600)
        other = SharedMemoryBackend("node", 16 * CHUNK_BYTES, path=str(pool_path))
        try:
            for index in range(40):
                asyncio.run(other.batched_put([engine.keys_for(prompt(100 + index))[0]],
                                              [torch.zeros(CHUNK_BYTES // 4)]))
        finally:
            asyncio.run(other.close())
        assert engine.lookup(prompt(0)) == 4 * CHUNK


def test_a_prefetch_brings_a_prefix_up_from_disk(pool_path: Path, tmp_path: Path) -> None:
    with Engine(config(pool_path, disk=tmp_path / "disk")) as engine:
        store(engine, 0)
        for key in engine.keys_for(prompt(0)):
            asyncio.run(engine.tiers[0].delete(key))
        assert engine.locate(prompt(0)) == ["disk"] * 4
        assert engine.prefetch(prompt(0)) == 4 * CHUNK
        engine.flush()
        assert engine.locate(prompt(0)) == ["node"] * 4
        assert engine.stats()["hints"]["prefetched_tokens"] == 4 * CHUNK


def test_bad_seconds_are_refused_by_name(pool_path: Path) -> None:
    with Engine(config(pool_path)) as engine:
        store(engine, 0)
        for seconds in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="seconds"):
                engine.retain(prompt(0), seconds)


def test_a_dropped_tenants_prompts_miss_while_anothers_hit(pool_path: Path, tmp_path: Path) -> None:
    cfg = config(pool_path, disk=tmp_path / "disk")  # written through to lmdb as well
    cfg["tiers"].insert(0, {"name": "host", "backend": "cpu", "capacity": 4 * CHUNK_BYTES})  # a memory tier too
    tenant_a, tenant_b = RequestIdentity(salt="tenant-a"), RequestIdentity(salt="tenant-b")
    with Engine(cfg) as engine:
        for index, identity in ((0, tenant_a), (1, tenant_a), (0, tenant_b)):
            engine.store(prompt(index), kv_of(prompt(index)), identity=identity)
        engine.flush()
        assert engine.lookup(prompt(0), tenant_a) == engine.lookup(prompt(0), tenant_b) == 4 * CHUNK
        assert engine.drop_identity(tenant_a) >= 16, "both of tenant A's prompts, from the pool and from lmdb"
        assert engine.lookup(prompt(0), tenant_a) == engine.lookup(prompt(1), tenant_a) == 0
        assert engine.lookup(prompt(0), tenant_b) == 4 * CHUNK, "the other tenant's prompt still hits"
        assert engine.stats()["hints"]["dropped_scope_chunks"] >= 16
    disk_only = {"model": "hints", "chunk_size": CHUNK,
                 "tiers": [{"name": "disk", "backend": "lmdb", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}
    with Engine(disk_only) as reopened:  # what lmdb itself kept: B's prompt, none of A's
        assert reopened.lookup(prompt(0), tenant_a) == reopened.lookup(prompt(1), tenant_a) == 0
        assert reopened.lookup(prompt(0), tenant_b) == 4 * CHUNK
