"""Reuse-aware admission on real tiers: what a lower tier takes under ``all``, ``reused(n)`` and
``tinylfu``, through write-through fills (and the late fill once a chunk is reused),
write-back demotions and flushes, and promotions; the sketch's counts and ageing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv import Engine
from tierkv.config import load_config
from tierkv.errors import ConfigError
from tierkv.policy.admission import Admission, FrequencySketch, parse_admission

CHUNK = 16
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 8 * 4  # float32 vllm chunk: 2 layers, K and V, 2 heads x 8


def prompt(index: int, chunks: int = 1) -> torch.Tensor:
    return torch.arange(chunks * CHUNK, dtype=torch.int64) + 100_000 * (index + 1)


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(16, dtype=torch.float32).reshape(1, 1, 1, 2, 8)).expand(2, 2, -1, 2, 8).contiguous()


def config(tmp_path: Path, admission: str, policy: str = "write_through", cpu: str = "64MiB",
           disk: str = "64MiB") -> dict[str, Any]:
    return {"model": "admission", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": policy,
            "tiers": [{"name": "host", "backend": "cpu", "capacity": cpu},
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": disk,
                       "admission": admission}]}


def on_disk(eng: Engine, tokens: torch.Tensor) -> list[bool]:
    disk = eng.tiers[1]
    return [eng.run(disk.contains(key)) for key in eng.keys_for(tokens)]


# -- the sketch -----------------------------------------------------------------------------------
def test_sketch_counts_saturate_age_and_take_fixed_memory() -> None:
    sketch = FrequencySketch(width=1024, sample=10_000)
    keys = [f"chunk-{i}" for i in range(200)]
    for times, key in enumerate(keys[:20]):
        sketch.add([key] * times)
    counts = sketch.estimate(keys[:20])
    assert all(count >= min(times, 15) for times, count in enumerate(counts)), "a count-min never under-counts"
    assert sum(count != min(times, 15) for times, count in enumerate(counts)) <= 2, "few collisions at this load"
    assert sketch.estimate([keys[19]]) == [15], "4-bit counters saturate"
    before = sketch.nbytes
    sketch.add([f"other-{i}" for i in range(10_000)])  # the sample is reached: every counter halves
    assert sketch.resets == 1 and sketch.nbytes == before == 4 * 1024
    assert sketch.estimate([keys[19]])[0] <= 8, "old popularity fades"
    with pytest.raises(ValueError, match="power of two"):
        FrequencySketch(width=1000)


def test_admission_rules_and_their_spelling(tmp_path: Path) -> None:
    assert parse_admission("all", "x") == Admission()
    assert parse_admission("reused", "x") == Admission("reused", 2)
    assert parse_admission(" Reused(3) ", "x") == Admission("reused", 3)
    assert parse_admission("tinylfu", "x").policy == "tinylfu"
    for bad in ("reused(0)", "sometimes", 2, "reused(2"):
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.admission: expected all, reused, reused\(n\)"):
            parse_admission(bad, "tiers[1].admission")
    assert Admission("reused", 2).admits([0, 1, 2, 5]) == [False, False, True, True]
    assert Admission("reused", 2).just_reached([1, 2, 3]) == [False, True, False]
    assert Admission("tinylfu").admits([3, 1], [2, 2]) == [True, False]
    assert Admission("tinylfu").admits([0], None) == [True], "room left: nothing is displaced"
    cfg = config(tmp_path, "tinylfu")
    cfg["tiers"][1] = {"name": "disk", "backend": "s3", "bucket": "kv-cache", "endpoint_url": "http://127.0.0.1:9",
                       "admission": "tinylfu"}
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.admission: tinylfu .* backend 's3' cannot name it"):
        load_config(cfg)
    assert "admission='reused(2)'" in repr(load_config(config(tmp_path, "reused")).tiers[1])


# -- write-through ---------------------------------------------------------------------------------
def test_write_through_copies_a_chunk_down_only_once_it_is_reused(tmp_path: Path) -> None:
    with Engine(config(tmp_path, "reused(2)")) as eng:
        once, twice = prompt(0, 3), prompt(1, 3)
        eng.store(once, kv_of(once))
        eng.store(twice, kv_of(twice))
        eng.flush()
        assert on_disk(eng, once) == [False] * 3 and on_disk(eng, twice) == [False] * 3
        disk = eng.stats()["tiers"]["disk"]
        assert disk["rejected"] == 6 and disk["admitted"] == 0 and disk["admission"] == "reused(2)"
        out, mask = eng.retrieve(twice, return_tuple=False)  # a hit in the host tier: the second sighting
        assert mask.all() and torch.equal(out, kv_of(twice))
        eng.flush()
        assert on_disk(eng, twice) == [True] * 3, "filled down once reused"
        assert on_disk(eng, once) == [False] * 3
        eng.retrieve(twice)
        eng.flush()
        assert eng.stats()["tiers"]["disk"]["puts"] == 3, "a third sighting writes nothing again"
        # what was filled down late is the same bytes
        eng.run(eng.tiers[0].delete(eng.keys_for(twice)[0]))
        out, mask = eng.retrieve(twice, return_tuple=False)
        assert mask.all() and torch.equal(out, kv_of(twice))


def test_a_reader_that_never_stored_fills_late_and_flushes(tmp_path: Path) -> None:
    """A process that only reads (its chunks stored by another, promoted from a tier below into
    its memory) owes the late fill too: its fill worker runs, and flush returns once it landed."""
    shared = {"name": "shared", "backend": "lmdb", "path": str(tmp_path / "shared"), "capacity": "64MiB"}
    tokens = prompt(7, 2)
    writer = load_config({"model": "admission", "chunk_size": CHUNK, "kv_format": "vllm", "tiers": [shared]})
    with Engine(writer) as eng:
        eng.store(tokens, kv_of(tokens))
    reader = config(tmp_path, "reused(2)")
    reader["tiers"].append(shared)
    with Engine(reader) as eng:
        for _ in range(2):  # promoted into host from shared, then a hit there: the second sighting
            out, mask = eng.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens))
        eng.flush()
        assert on_disk(eng, tokens) == [True] * 2, "filled down from memory once reused"


def test_write_through_with_all_admits_every_chunk(tmp_path: Path) -> None:
    with Engine(config(tmp_path, "all")) as eng:
        tokens = prompt(2, 2)
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        assert on_disk(eng, tokens) == [True, True]
        assert eng.stats()["tiers"]["disk"]["admitted"] == 2 and eng.stats()["tiers"]["disk"]["rejected"] == 0


# -- write-back -----------------------------------------------------------------------------------
def test_write_back_writes_every_dirty_chunk_down_whatever_the_rule(tmp_path: Path) -> None:
    """Under write-back the tier below a memory tier is where its chunks are kept: a flush (and
    a demotion) writes every dirty chunk there, and once that tier is full it evicts its own
    least-recently-used chunks instead of turning the newest away. A rule on the last tier
    could only filter promotions, and there are none into it: the config says so."""
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.admission: under write_back every chunk"):
        load_config(config(tmp_path, "reused(2)", policy="write_back"))
    cfg = config(tmp_path, "all", policy="write_back", cpu=f"{4 * CHUNK_BYTES}B", disk=f"{24 * CHUNK_BYTES}B")
    del cfg["tiers"][1]["admission"]  # the default under write_back: all
    with Engine(cfg) as eng:
        assert eng.stats()["tiers"]["disk"]["admission"] == "all"
        prompts = [prompt(i) for i in range(40)]  # more than the disk holds
        for tokens in prompts:
            eng.store(tokens, kv_of(tokens))
            eng.flush()
            assert on_disk(eng, tokens) == [True], "what a flush returned for is on disk"
        held = [on_disk(eng, tokens)[0] for tokens in prompts]
        assert held[-10:] == [True] * 10 and not all(held), "the disk evicted its oldest, never the newest"
        assert eng.stats()["tiers"]["disk"]["rejected"] == 0


# -- tinylfu ----------------------------------------------------------------------------------------
def test_tinylfu_keeps_popular_chunks_against_one_hit_ones_once_the_tier_is_full(tmp_path: Path) -> None:
    cfg = config(tmp_path, "tinylfu", disk="256KiB")
    with Engine(cfg) as eng:
        popular = [prompt(i) for i in range(12)]
        for tokens in popular:
            eng.store(tokens, kv_of(tokens))
            for _ in range(3):
                eng.retrieve(tokens)
        eng.flush()
        assert all(on_disk(eng, tokens)[0] for tokens in popular), "room left: every chunk is admitted"
        held_before = sum(on_disk(eng, tokens)[0] for tokens in popular)
        for index in range(100, 160):  # one-hit chunks, more than the disk holds
            tokens = prompt(index)
            eng.store(tokens, kv_of(tokens))
        eng.flush()
        disk = eng.stats()["tiers"]["disk"]
        assert disk["rejected"] > 0, "a one-hit chunk does not displace a popular one"
        assert sum(on_disk(eng, tokens)[0] for tokens in popular) == held_before


# -- promotion -------------------------------------------------------------------------------------
def test_promotion_into_a_filtering_tier_takes_only_reused_chunks(tmp_path: Path) -> None:
    cfg = config(tmp_path, "all")
    cfg["tiers"][0]["admission"] = "reused(3)"
    with Engine(cfg) as eng:
        tokens = prompt(5)
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        eng.run(eng.tiers[0].delete(eng.keys_for(tokens)[0]))  # only on disk now; seen once
        eng.retrieve(tokens)  # seen twice: not promoted
        assert eng.locate(tokens) == ["disk"]
        eng.retrieve(tokens)  # three times: promoted into host
        eng.flush()
        assert eng.locate(tokens) == ["host"]
        assert eng.stats()["tiers"]["host"]["promotions"] == 1
