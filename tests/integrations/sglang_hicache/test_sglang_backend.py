"""TierKVStorage against SGLang's real host KV pools (no SGLang engine): every layout, every
local tier, one copy per byte, prefixes from the indexes, damage and failures as misses."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is installed only in the tox 'sglang' env (tox -e sglang)")

import torch  # noqa: E402
from conftest import damage_page, tier_entry  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

from tierkv.errors import ConfigError  # noqa: E402
from tierkv.integrations.sglang import BACKEND_CLASS, BACKEND_MODULE  # noqa: E402
from tierkv.integrations.sglang.backend import TierKVStorage  # noqa: E402
from tierkv.integrations.sglang.keys import NAMESPACE  # noqa: E402
from tierkv.testing.faults import FaultyBackend  # noqa: E402

PAGE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def host_pool(layout: str, layers: int = LAYERS, heads: int = HEADS) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(64, PAGE, torch.float16, head_num=heads, head_dim=HEAD_DIM, layer_num=layers,
                              device="cpu", enable_memory_saver=False)
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, write_back_staging=device.hicache_write_back_staging)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(torch.float16))
    return pool


def mla_host_pool(layout: str) -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(64, PAGE, torch.float16, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=LAYERS,
                              device="cpu", enable_memory_saver=False)
    pool = MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, target_layer_num=LAYERS)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(torch.float16))
    return pool


def storage_config(tiers: list[dict[str, Any]], model: str = "org/model", tp_rank: int = 0, tp_size: int = 1,
                   engine: dict[str, Any] | None = None, mla: bool = False, **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=model,
        extra_config={"backend_name": "tierkv", "module_path": BACKEND_MODULE, "class_name": BACKEND_CLASS,
                      "interface_v1": 1, "config": {"tiers": tiers, **(engine or {})}, **extra})


def backend(tiers: list[dict[str, Any]], pool: MHATokenToKVPoolHost, **kwargs: Any) -> TierKVStorage:
    storage = TierKVStorage(storage_config(tiers, **kwargs), {})
    storage.register_mem_pool_host(pool)
    return storage


def page_tokens(pool: MHATokenToKVPoolHost, index: int) -> torch.Tensor:
    """One page as [token, layer, K/V, head, dim], whatever the pool's layout."""
    page = pool.get_data_page(index, flat=False)
    if pool.layout == "layer_first":  # [2, L, page, H, D]
        return page.permute(2, 1, 0, 3, 4)
    if pool.layout == "page_first":  # [2, page, L, H, D]
        return page.permute(1, 2, 0, 3, 4)
    return page[:, 0].permute(2, 1, 0, 3, 4)  # page_first_direct [2, 1, L, page, H, D]


def keys(count: int, prefix: str = "p") -> list[str]:
    return [f"{prefix}{i:04d}" + "ab" * 12 for i in range(count)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", ["cpu", "lmdb", "fs"])
def test_pages_round_trip_through_the_host_pool_once(tmp_path: Path, layout: str, tier: str) -> None:
    pool = host_pool(layout)
    storage = backend([tier_entry(tier, tmp_path)], pool)
    try:
        source = pool.alloc(3 * PAGE)
        names = keys(3)
        assert storage.batch_exists(names) == 0
        assert storage.batch_set_v1(names, source) == [True] * 3
        assert storage.batch_exists(names) == 3
        assert storage.batch_exists(names[:2] + ["other" * 8]) == 2
        expected = [page_tokens(pool, int(source[i * PAGE])).clone() for i in range(3)]
        target = pool.alloc(3 * PAGE)
        for i in range(3):
            pool.get_data_page(int(target[i * PAGE]), flat=False).zero_()
        assert storage.batch_get_v1(names, target) == [True] * 3
        for i in range(3):
            assert torch.equal(page_tokens(pool, int(target[i * PAGE])), expected[i]), f"page {i} differs"
        stats = storage.stats()
        assert stats["counters"]["pages_stored"] == 3 and stats["counters"]["pages_loaded"] == 3
        # time spent inside tierkv, so SGLang's wait for its L3 can be split into ours and the rest
        assert stats["counters"]["load_us"] > 0 and stats["counters"]["store_us"] > 0, stats["counters"]
        copies = stats["engine"]["copies"]
        # LMDB takes one contiguous buffer per value: a page that is not contiguous in the pool
        # (every layout but page_first_direct's K/V halves) is gathered once before the put
        store_copies = 2.0 if tier == "lmdb" else 1.0
        assert copies["store"]["copies_per_byte"] == store_copies, copies
        assert copies["retrieve"]["copies_per_byte"] == 1.0, copies
        # the engine counts the pages' tokens as hits, like a prompt retrieve
        assert stats["engine"]["hit_tokens"] == 3 * PAGE and stats["engine"]["miss_tokens"] == 0, stats["engine"]
        # a second store of the same pages writes nothing
        assert storage.batch_set_v1(names, source) == [True] * 3
        assert storage.stats()["counters"]["pages_already_stored"] == 3
    finally:
        storage.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pages_one_copy_for_all_ranks_written_by_one(tmp_path: Path, layout: str) -> None:
    tiers = [tier_entry("fs", tmp_path)]
    pool = mla_host_pool(layout)
    follower = backend(tiers, pool, mla=True, tp_rank=1, tp_size=2)  # MLA KV is the same on every rank
    source = pool.alloc(2 * PAGE)
    assert follower.batch_set_v1(keys(2), source) == [True, True]
    assert follower.batch_exists(keys(2)) == 0, "only the writer rank stores replicated MLA pages"
    follower.close()
    writer = backend(tiers, pool, mla=True, tp_rank=0, tp_size=2)
    assert writer.batch_set_v1(keys(2), source) == [True, True]
    writer.close()
    reader_pool = mla_host_pool("page_first" if layout != "page_first" else "layer_first")
    reader = backend(tiers, reader_pool, mla=True, tp_rank=1, tp_size=2)
    try:
        target = reader_pool.alloc(2 * PAGE)
        assert reader.batch_get_v1(keys(2), target) == [True, True]
        for i in range(2):
            want = pool.get_data_page(int(source[i * PAGE]), flat=False)
            got = reader_pool.get_data_page(int(target[i * PAGE]), flat=False)
            assert torch.equal(_mla_tokens(reader_pool, got), _mla_tokens(pool, want)), f"page {i} differs"
    finally:
        reader.close()


def _mla_tokens(pool: MLATokenToKVPoolHost, page: torch.Tensor) -> torch.Tensor:
    """An MLA page as [token, layer, dim]."""
    if pool.layout == "layer_first":  # [L, page, 1, D]
        return page[:, :, 0].transpose(0, 1)
    if pool.layout == "page_first":  # [page, L, 1, D]
        return page[:, :, 0]
    return page[0, :, :, 0].transpose(0, 1)  # [1, L, page, 1, D]


def test_a_page_written_in_one_layout_reads_in_another(tmp_path: Path) -> None:
    tiers = [tier_entry("lmdb", tmp_path)]
    writer_pool = host_pool("page_first")
    writer = backend(tiers, writer_pool)
    source = writer_pool.alloc(2 * PAGE)
    writer.batch_set_v1(keys(2), source)
    expected = [page_tokens(writer_pool, int(source[i * PAGE])).clone() for i in range(2)]
    writer.close()
    for layout in ("layer_first", "page_first_direct"):
        pool = host_pool(layout)
        reader = backend(tiers, pool)
        target = pool.alloc(2 * PAGE)
        assert reader.batch_exists(keys(2)) == 2
        assert reader.batch_get_v1(keys(2), target) == [True, True]
        for i in range(2):
            assert torch.equal(page_tokens(pool, int(target[i * PAGE])), expected[i]), layout
        reader.close()


def test_models_ranks_and_shapes_never_mix(tmp_path: Path) -> None:
    tiers = [tier_entry("lmdb", tmp_path)]
    pool = host_pool("layer_first")
    first = backend(tiers, pool, model="org/model-a")
    first.batch_set_v1(keys(2), pool.alloc(2 * PAGE))
    first.close()
    same = backend(tiers, pool, model="org/model-a")
    assert same.batch_exists(keys(2)) == 2
    same.close()
    others = [({"model": "org/model-b"}, pool), ({"model": "org/model-a", "tp_rank": 1, "tp_size": 2}, pool),
              ({"model": "org/model-a"}, host_pool("layer_first", layers=LAYERS + 1))]
    for kwargs, other_pool in others:  # another model, another TP rank, another shape: one at a time (one LMDB env)
        other = backend(tiers, other_pool, **kwargs)
        assert other.batch_exists(keys(2)) == 0, kwargs
        assert other.batch_get_v1(keys(2), other_pool.alloc(2 * PAGE)) == [False, False], kwargs
        other.close()


def test_page_keys_live_in_their_own_namespace(tmp_path: Path) -> None:
    pool = host_pool("layer_first")
    storage = backend([tier_entry("cpu", tmp_path)], pool)
    try:
        key = storage.keyspace.key(keys(1)[0])
        assert key.model_name == f"org/model::{NAMESPACE}"
        assert (key.world_size, key.worker_id) == (1, 0)
        # an engine prefix-chunk key of the same model is in another namespace
        assert storage.engine.keys_for(list(range(PAGE)))[0].model_name == "org/model"
    finally:
        storage.close()


@pytest.mark.parametrize("tier", ["lmdb", "fs"])
def test_a_damaged_page_is_a_miss(tmp_path: Path, tier: str) -> None:
    pool = host_pool("layer_first")
    storage = backend([tier_entry(tier, tmp_path)], pool)
    names = keys(3)
    storage.batch_set_v1(names, pool.alloc(3 * PAGE))
    storage.close()
    damage_page(tmp_path, tier, storage.keyspace.key(names[1]))
    reader = backend([tier_entry(tier, tmp_path)], pool)
    try:
        target = pool.alloc(3 * PAGE)
        assert reader.batch_get_v1(names, target) == [True, False, False]
        assert reader.stats()["counters"]["pages_missed"] == 2
        engine_stats = reader.stats()["engine"]
        assert (engine_stats["hit_tokens"], engine_stats["miss_tokens"]) == (PAGE, 2 * PAGE), engine_stats
        assert reader.batch_exists(names) == 1, "the damaged page was dropped from the index"
    finally:
        reader.close()


def test_a_failing_tier_is_a_miss_never_an_exception(tmp_path: Path) -> None:
    pool = host_pool("layer_first")
    storage = backend([tier_entry("lmdb", tmp_path)], pool, engine={"health": {"retry_after_s": 0.05}})
    try:
        names = keys(2)
        storage.batch_set_v1(names, pool.alloc(2 * PAGE))
        faulty = storage.engine.wrap_tier(storage.engine.tiers[0].name, FaultyBackend)
        faulty.failing = True
        target = pool.alloc(2 * PAGE)
        assert storage.batch_get_v1(names, target) == [False, False]
        assert storage.batch_set_v1(keys(2, "q"), pool.alloc(2 * PAGE)) == [False, False]
        assert storage.batch_get(names, [pool.get_dummy_flat_data_page() for _ in names]) == [None, None]
        assert storage.batch_set(keys(1, "r"), [pool.get_data_page(0)]) is False
        assert faulty.calls > 0
        faulty.failing = False
        time.sleep(0.1)  # the tier's breaker lets it be tried again
        assert storage.batch_get_v1(names, target) == [True, True]
    finally:
        storage.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_generic_page_path(tmp_path: Path, layout: str) -> None:
    pool = host_pool(layout)
    storage = backend([tier_entry("cpu", tmp_path)], pool)
    try:
        source = pool.alloc(2 * PAGE)
        names = keys(2)
        assert storage.batch_set(names, [pool.get_data_page(int(source[i * PAGE])) for i in range(2)]) is True
        assert storage.exists(names[0]) and not storage.exists("missing" * 4)
        targets = [pool.get_dummy_flat_data_page() for _ in names]
        got = storage.batch_get(names + ["missing" * 4], targets + [pool.get_dummy_flat_data_page()])
        assert got[2] is None
        for i in range(2):
            assert got[i] is targets[i]
            assert torch.equal(got[i], pool.get_data_page(int(source[i * PAGE]))), f"page {i} differs"
        # the v1 path reads what the generic path wrote
        target = pool.alloc(2 * PAGE)
        assert storage.batch_get_v1(names, target) == [True, True]
        assert torch.equal(pool.get_data_page(int(target[0])), pool.get_data_page(int(source[0])))
        assert storage.get("missing" * 4, pool.get_dummy_flat_data_page()) is None
    finally:
        storage.close()


def test_cost_aware_exists_answers_only_the_prefix_worth_loading(tmp_path: Path) -> None:
    pool = host_pool("layer_first")
    # a recompute so fast that no stored page is worth reading from a tier throttled to 1 KB/s
    tiers = [tier_entry("lmdb", tmp_path)]
    storage = TierKVStorage(storage_config(tiers, engine={"cost_aware": True, "recompute": {"tokens_per_s": 1e9}}),
                            {})
    storage.register_mem_pool_host(pool)
    try:
        names = keys(4)
        storage.batch_set_v1(names, pool.alloc(4 * PAGE))
        slow = storage.engine.wrap_tier(storage.engine.tiers[0].name, FaultyBackend)
        slow.bytes_per_s = 1000.0
        target = pool.alloc(4 * PAGE)
        storage.batch_get_v1(names, target)  # measures the tier's speed
        held = storage.batch_exists(names, HiCacheStorageExtraInfo(prefix_keys=[]))
        counters = storage.stats()["counters"]
        assert held < 4 and counters["exists_pages_declined"] >= 4 - held, counters
    finally:
        storage.close()


def test_bad_extra_config_is_a_named_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERKV_CONFIG", raising=False)
    config = storage_config([tier_entry("cpu", tmp_path)], load_deadline_s=-1)
    with pytest.raises(ConfigError, match="load_deadline_s"):
        TierKVStorage(config, {})
    config = storage_config([tier_entry("cpu", tmp_path)], surprise=1)
    with pytest.raises(ConfigError, match="unknown key.*surprise"):
        TierKVStorage(config, {})
    config = storage_config([])
    config.extra_config.pop("config")
    with pytest.raises(ConfigError, match="TIERKV_CONFIG"):
        TierKVStorage(config, {})
    yaml_path = tmp_path / "tierkv.yaml"
    yaml_path.write_text(f"tiers:\n  - name: host\n    backend: cpu\n    capacity: 8MiB\n# {tmp_path}\n")
    monkeypatch.setenv("TIERKV_CONFIG", str(yaml_path))
    storage = TierKVStorage(config, {})
    storage.register_mem_pool_host(host_pool("layer_first"))
    assert [tier.name for tier in storage.engine.tiers] == ["host"]
    assert storage.engine.config.chunk_size == PAGE
    storage.close()


def test_unsupported_pool_layout_is_refused(tmp_path: Path) -> None:
    pool = host_pool("layer_first")
    pool.layout = "page_head"
    storage = TierKVStorage(storage_config([tier_entry("cpu", tmp_path)]), {})
    with pytest.raises(ValueError, match="page_head"):
        storage.register_mem_pool_host(pool)
