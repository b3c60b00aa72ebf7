"""vLLM lookup/store buffer semantics over a real engine (host tier + LMDB)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tierkv import Engine
from tierkv.integrations.vllm import KVLookupBufferBase, KVStoreBufferBase, TierKVLookupBuffer, TierKVStoreBuffer


def _config(tmp_path: Path) -> dict:
    return {
        "model": "tiny",
        "chunk_size": 16,
        "tiers": [
            {"name": "host", "backend": "cpu", "capacity": "64MiB"},
            {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
        ],
    }


@pytest.fixture
def engine(tmp_path: Path):
    with Engine(_config(tmp_path)) as eng:
        yield eng


def _kv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(2, num_tokens, 4, 8, generator=gen)  # [layers, tokens, heads, head_size]
    return key, key + 1, torch.randn(num_tokens, 32, generator=gen)


def test_insert_then_drop_select_returns_the_entry_once(engine: Engine) -> None:
    buffer = TierKVLookupBuffer(engine)
    assert isinstance(buffer, KVLookupBufferBase)
    tokens = torch.arange(100, 140)
    roi = torch.ones(40, dtype=torch.bool)
    key, value, hidden = _kv(40, 1)
    buffer.insert(tokens, roi, key, value, hidden)
    got_tokens, got_roi, got_key, got_value, got_hidden = buffer.drop_select(tokens, roi)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_roi, roi)
    assert torch.equal(got_key, key) and torch.equal(got_value, value) and torch.equal(got_hidden, hidden)
    assert buffer.drop_select(tokens, roi) == [None] * 5, "the entry must be gone after drop_select"


def test_roi_selects_the_subset(engine: Engine) -> None:
    buffer = TierKVLookupBuffer(engine)
    tokens = torch.arange(0, 32)
    first_half = torch.arange(32) < 16
    second_half = ~first_half
    k1, v1, h1 = _kv(16, 1)
    k2, v2, h2 = _kv(16, 2)
    buffer.insert(tokens, first_half, k1, v1, h1)
    buffer.insert(tokens, second_half, k2, v2, h2)
    _, roi, key, _, _ = buffer.drop_select(tokens, second_half)
    assert torch.equal(roi, second_half) and torch.equal(key, k2)
    # A different prompt whose masked tokens are the same ids finds the same KV.
    other = torch.cat([torch.arange(0, 16), torch.tensor([999])])
    _, _, key, _, _ = buffer.drop_select(other, torch.arange(17) < 16)
    assert torch.equal(key, k1)
    assert buffer.drop_select(tokens, first_half)[2] is None


def test_drop_select_none_pops_any_entry_until_empty(engine: Engine) -> None:
    buffer = TierKVLookupBuffer(engine)
    inserted = {}
    for seed in range(3):
        tokens = torch.arange(seed * 10, seed * 10 + 8)
        key, value, _ = _kv(8, seed)
        buffer.insert(tokens, torch.ones(8, dtype=torch.bool), key, value, None)
        inserted[tuple(tokens.tolist())] = key
    for _ in range(3):
        tokens, _, key, _, hidden = buffer.drop_select(None, None)
        assert torch.equal(inserted.pop(tuple(tokens.tolist())), key)
        assert hidden is None
    assert not inserted
    assert buffer.drop_select(None, None) == [None] * 5


def test_concurrent_drop_select_hands_an_entry_to_one_caller(engine: Engine) -> None:
    buffer = TierKVLookupBuffer(engine)
    tokens = torch.arange(50)
    key, value, hidden = _kv(50, 3)
    buffer.insert(tokens, None, key, value, hidden)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(buffer.drop_select(tokens, None)[2])) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(r is not None for r in results) == 1


def test_lookup_buffer_rejects_bad_roi(engine: Engine) -> None:
    buffer = TierKVLookupBuffer(engine)
    key, value, hidden = _kv(4, 0)
    with pytest.raises(ValueError, match="one entry per input token"):
        buffer.insert(torch.arange(4), torch.ones(3, dtype=torch.bool), key, value, hidden)
    with pytest.raises(ValueError, match="boolean"):
        buffer.insert(torch.arange(4), torch.full((4,), 0.5), key, value, hidden)
    with pytest.raises(ValueError, match="pass both or neither"):
        buffer.drop_select(None, torch.ones(4, dtype=torch.bool))


def test_store_buffer_put_get_none(engine: Engine) -> None:
    buffer = TierKVStoreBuffer(engine)
    assert isinstance(buffer, KVStoreBufferBase)
    assert buffer.get("req-1/layer-0/k") is None
    tensor = torch.randn(3, 16, 4, 8, dtype=torch.float16)
    buffer.put("req-1/layer-0/k", tensor)
    assert torch.equal(buffer.get("req-1/layer-0/k"), tensor)
    assert buffer.get("req-1/layer-0/v") is None
    buffer.put("req-1/layer-0/k", None)
    assert buffer.get("req-1/layer-0/k") is None
    with pytest.raises(ValueError, match="must be str"):
        buffer.put(7, tensor)  # type: ignore[arg-type]


def test_store_buffer_is_shared_through_a_disk_tier(tmp_path: Path) -> None:
    """A second engine (another process's view) over the same LMDB sees what the first put."""
    tensor = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)
    cfg = _config(tmp_path)
    with Engine(cfg) as first:
        TierKVStoreBuffer(first).put("shared", tensor)
        first.flush()
    cfg["tiers"] = cfg["tiers"][1:]
    with Engine(cfg) as second:
        assert torch.equal(TierKVStoreBuffer(second).get("shared"), tensor)


def test_dropped_entries_and_deleted_keys_leave_nothing_in_any_tier(engine: Engine) -> None:
    """Dropping and putting None delete (no tombstone stays behind in a tier)."""
    lookup, store = TierKVLookupBuffer(engine), TierKVStoreBuffer(engine)
    tokens = torch.arange(8)
    key, value, hidden = _kv(8, 7)
    lookup.insert(tokens, torch.ones(8, dtype=torch.bool), key, value, hidden)
    store.put("req-2/k", key)
    engine.flush()
    assert all(tier["chunks"] > 0 for tier in engine.stats()["tiers"].values() if "chunks" in tier)
    assert lookup.drop_select(tokens, None)[3] is not None
    store.put("req-2/k", None)
    engine.flush()
    for name, tier in engine.stats()["tiers"].items():
        assert tier.get("chunks", tier.get("used_bytes")) == 0, f"tier {name} still holds something: {tier}"
    # an entry inserted without hidden after one with it has no hidden part
    lookup.insert(tokens, None, key, value, hidden)
    lookup.insert(tokens, None, key, value, None)
    assert lookup.drop_select(tokens, None)[4] is None
