"""One host cache per node through the engine: engines in different processes over one ``shm``
pool see each other's prompts, hold them once, and count what each scope holds; the pool sits
under a small private cpu tier and above lmdb with write-through fills, and a connector moves
KV between a paged cache and the pool in place."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import torch

from tierkv import Engine
from tierkv.chunks.identity import RequestIdentity

CHUNK = 16
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "tierkv", "tierkv_backends.shm"])


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8) / 64).contiguous()


def prompt(index: int, chunks: int = 4) -> torch.Tensor:
    return torch.arange(chunks * CHUNK) + 10_000 * (index + 1)


def config(pool_path: Path, tmp_path: Path | None = None, host: str | None = None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"name": "node", "backend": "shm", "path": str(pool_path), "capacity": "16MiB"}]
    if host is not None:
        tiers.insert(0, {"name": "host", "backend": "cpu", "capacity": host})
    if tmp_path is not None:
        tiers.append({"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"})
    return {"model": "node", "chunk_size": CHUNK, "cost_aware": False, "tiers": tiers}


def replica(cfg: dict[str, Any], indices: list[int], results: Any) -> None:
    """Another serving process: where each prompt is, what a retrieve finds, and what a store
    of it again writes."""
    with Engine(cfg) as engine:
        found = []
        for index in indices:
            where = engine.locate(prompt(index))
            kv, mask = engine.retrieve(prompt(index), return_tuple=False)
            hits = int(mask.sum())
            found.append((hits, hits > 0 and torch.equal(kv, kv_of(prompt(index))[:, :, :hits]), where))
        written = [engine.store(prompt(index), kv_of(prompt(index))) for index in indices]
        results.put((found, written))


def run_replica(cfg: dict[str, Any], indices: list[int]) -> tuple[list[Any], list[int]]:
    results = CONTEXT.Queue()
    process = CONTEXT.Process(target=replica, args=(cfg, indices, results))
    process.start()
    outcome = results.get(timeout=120)
    process.join(60)
    assert process.exitcode == 0
    return outcome  # type: ignore[no-any-return]


def test_a_prompt_one_process_stored_is_a_hit_in_another_held_once(pool_path: Path) -> None:
    with Engine(config(pool_path)) as first:
        for index in range(3):
            assert first.store(prompt(index), kv_of(prompt(index))) == 4
        found, written = run_replica(config(pool_path), [0, 1, 2])
        assert found == [(4 * CHUNK, True, ["node"] * 4)] * 3, "whole, exact, from the pool"
        assert written == [0, 0, 0], "the other process stores nothing again: one copy on the node"
        assert first.stats()["tiers"]["node"]["pool_chunks"] == 12


def test_under_a_private_cpu_tier_and_over_lmdb(pool_path: Path, tmp_path: Path) -> None:
    cfg = config(pool_path, tmp_path, host="8KiB")  # the private tier holds one prompt (4 chunks of 2 KiB)
    with Engine(cfg) as first:
        for index in range(4):
            first.store(prompt(index), kv_of(prompt(index)))
        first.flush()
        assert first.locate(prompt(0)) == ["node"] * 4, "evicted from host, still in the pool"
        stats = first.stats()["tiers"]
        assert stats["disk"]["chunks"] == 16, "write-through fills reach lmdb below the pool"
    found, _ = run_replica(cfg, [0, 3])
    assert [(hits, exact) for hits, exact, _ in found] == [(4 * CHUNK, True)] * 2
    assert found[0][2] == ["node"] * 4


def test_occupancy_counts_each_scope_every_process_stored(pool_path: Path) -> None:
    with Engine(config(pool_path)) as engine:
        engine.store(prompt(0), kv_of(prompt(0)))
        engine.store(prompt(1, chunks=2), kv_of(prompt(1, chunks=2)), identity=RequestIdentity(salt="tenant-b"))
        usage = engine.occupancy()["tiers"]["node"]
        assert sorted(entry["chunks"] for entry in usage.values()) == [2, 4]
        assert all(entry["bytes"] > 0 for entry in usage.values())
        assert "tenant-b" not in str(engine.occupancy()), "a salt is never shown"


def test_a_connector_moves_kv_between_a_paged_cache_and_the_pool_in_place(pool_path: Path) -> None:
    from paged_caches import make_cache, same_bytes

    from tierkv.connectors import PagedConnector, retrieve_paged, store_paged

    layers, blocks, block_size, heads, head_size = 2, 8, 16, 2, 8
    source = make_cache("pairs", layers, blocks, block_size, heads, head_size, torch.float32)
    target = make_cache("pairs", layers, blocks, block_size, heads, head_size, torch.float32)
    connector = PagedConnector(num_layers=layers, num_kv_heads=heads, head_size=head_size)
    tokens = prompt(0, chunks=3)
    slots = torch.arange(len(tokens))
    with Engine(config(pool_path)) as engine:
        assert store_paged(engine, connector, tokens, kvcaches=source, slot_mapping=slots) == 3
        mask = retrieve_paged(engine, connector, tokens, kvcaches=target, slot_mapping=slots)
        assert bool(mask.all())
        for layer in range(layers):
            for kv in range(2):
                assert same_bytes(target[layer][kv][:3], source[layer][kv][:3])
        copies = engine.stats()["copies"]
        assert copies["store"]["copies_per_byte"] == 1.0, "gathered straight into the pool"
        assert copies["retrieve"]["copies_per_byte"] == 1.0, "scattered straight out of the pool"
