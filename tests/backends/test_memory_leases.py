"""Retention in the memory tiers (``cpu``; the ``gpu`` tier shares the code): a retained prefix
survives a flood that evicts everything else under either eviction policy, a lease past
``retain_share`` is refused whole, a tier of nothing but leased chunks still makes room (a
bias, never a deadlock), a lease ends at its deadline or when released, and a dropped chunk's
lease goes with it. Through the engine, as a hint arrives (``Engine.retain``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hint_prompts import CHUNK, CHUNK_BYTES, kv_of, prompt, store

from tierkv import Engine, RetentionRefusedError
from tierkv_backends.memory.leases import Leases, spare_leased_last


def config(eviction: str = "lru", retain_share: float = 0.5) -> dict[str, Any]:
    return {"model": "leases", "chunk_size": CHUNK, "cost_aware": False,
            "tiers": [{"name": "host", "backend": "cpu", "capacity": 16 * CHUNK_BYTES, "eviction": eviction,
                       "retain_share": retain_share}]}


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_a_retained_prefix_survives_a_flood_that_evicts_everything_else(eviction: str) -> None:
    with Engine(config(eviction)) as engine:
        store(engine, 0, 1)
        assert engine.retain(prompt(0), 600) == 4 * CHUNK
        store(engine, *range(2, 12))  # 40 chunks through a 16-chunk tier
        assert engine.lookup(prompt(0)) == 4 * CHUNK, "retained: kept through the flood"
        assert engine.lookup(prompt(1)) == 0, "not retained: evicted"
        kv, mask = engine.retrieve(prompt(0), return_tuple=False)
        assert bool(mask.all()) and torch.equal(kv, kv_of(prompt(0)))
        host = engine.stats()["tiers"]["host"]
        assert host["retained_bytes"] == 4 * CHUNK_BYTES and host["retained_evictions"] == 0
        assert engine.stats()["hints"]["retained_by_tier"] == {"host": 4 * CHUNK}


def test_a_lease_past_the_cap_is_refused_whole() -> None:
    with Engine(config(retain_share=0.25)) as engine:  # 4 of 16 chunks may be retained
        store(engine, 0, 1)
        assert engine.retain(prompt(0), 600) == 4 * CHUNK
        with pytest.raises(RetentionRefusedError, match=r"retain_share 0.25"):
            engine.retain(prompt(1), 600)
        assert engine.stats()["tiers"]["host"]["retained_bytes"] == 4 * CHUNK_BYTES, "nothing of prompt 1"
        assert engine.retain(prompt(0), 900) == 4 * CHUNK, "renewing a lease adds no bytes"
        assert engine.retain(prompt(0), 0) == 4 * CHUNK  # released
        assert engine.retain(prompt(1), 600) == 4 * CHUNK, "the room the release gave back"


def test_a_tier_of_nothing_but_leased_chunks_still_makes_room() -> None:
    with Engine(config(retain_share=1.0)) as engine:
        for index in range(4):
            store(engine, index)
            engine.retain(prompt(index), 600)
        store(engine, 4)  # 16 leased chunks fill the tier: the newcomer still lands
        assert engine.lookup(prompt(4)) == 4 * CHUNK
        host = engine.stats()["tiers"]["host"]
        assert host["retained_evictions"] == 4 and host["retained_bytes"] == 12 * CHUNK_BYTES
        assert engine.lookup(prompt(0)) == 0, "the least recently used leased chunks went first"


def test_a_dropped_chunk_takes_its_lease_with_it_and_a_newer_copy_keeps_it() -> None:
    with Engine(config()) as engine:
        store(engine, 0)
        engine.retain(prompt(0), 600)
        host = engine.tiers[0]
        keys = engine.keys_for(prompt(0))
        engine.run(host.batched_put(keys, [kv_of(prompt(0))[:, :, :CHUNK].contiguous()] * 4))  # replaced in place
        assert engine.stats()["tiers"]["host"]["retained_bytes"] == 4 * CHUNK_BYTES, "a newer copy keeps the lease"
        assert engine.drop(prompt(0)) == 4 * CHUNK
        assert engine.stats()["tiers"]["host"]["retained_bytes"] == 0
        store(engine, 0)
        assert engine.stats()["tiers"]["host"]["retained_bytes"] == 0, "a chunk stored again is not leased"


def test_leases_end_at_their_deadline_and_are_checked() -> None:
    now = [100.0]
    sizes = {"a": 10, "b": 10, "c": 10}
    leases: Leases[str] = Leases(0.5, clock=lambda: now[0])
    assert leases.retain(["a", "b", "gone"], 5, sizes.get, 40, "tier 't'") == [True, True, False]
    assert leases.live() == {"a", "b"} and leases.retained_bytes(sizes.get) == 20
    with pytest.raises(RetentionRefusedError, match="30B of its 40B, past its cap of 20B"):
        leases.retain(["c"], 5, sizes.get, 40, "tier 't'")
    assert leases.live() == {"a", "b"}, "a refused lease retains nothing"
    leases.retain(["a"], 50, sizes.get, 40, "tier 't'")
    now[0] = 106.0
    assert leases.live() == {"a"}, "b's lease ended; a's longer one holds"
    assert spare_leased_last(["a", "b", "c"], {"a"}) == ["b", "c", "a"]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="seconds"):
            leases.retain(["a"], bad, sizes.get, 40, "tier 't'")
    with pytest.raises(ValueError, match="retain_share"):
        Leases(1.5)
