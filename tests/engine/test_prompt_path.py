"""The prompt path's smaller pieces: lookups that stop at the first missing chunk, key identity,
deletes across tiers, and LMDB reads split over two threads or trusting the disk."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv import CacheKey, Engine
from tierkv_backends.lmdb import LMDBBackend, encode_key

LAYERS, HEADS, HEAD, CHUNK = 2, 2, 8, 16


def two_tiers(tmp_path: Path, **lmdb: Any) -> dict[str, Any]:
    return {"model": "prompt-path", "chunk_size": CHUNK,
            "tiers": [{"name": "host", "backend": "cpu", "capacity": "8MiB"},
                      {"name": "disk", "backend": "lmdb", "capacity": "256MiB", "path": str(tmp_path / "db"), **lmdb}]}


def kv_for(num_tokens: int, seed: int = 0, heads: int = HEADS, head: int = HEAD) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15 - 1, (LAYERS, 2, num_tokens, heads, head), dtype=torch.int16,
                         generator=generator).view(torch.bfloat16)


def test_cache_key_identity_survives_the_cached_hash() -> None:
    a = CacheKey("vllm", "m", 2, 1, "ab" * 16)
    b = CacheKey("vllm", "m", 2, 1, "ab" * 16)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a.to_bytes() == a.to_string().encode()
    for other in (CacheKey("vllm", "m", 2, 0, "ab" * 16), CacheKey("huggingface", "m", 2, 1, "ab" * 16),
                  dataclasses.replace(a, model_name="m2")):
        assert other != a and hash(other) != hash(a)
    assert a != "vllm@m@2@1@" + "ab" * 16


def test_lookup_stops_at_the_first_chunk_no_tier_holds(tmp_path: Path) -> None:
    tokens = torch.arange(4 * CHUNK)
    with Engine(two_tiers(tmp_path)) as engine:
        engine.store(tokens, kv_for(len(tokens)))
        engine.flush()
        assert engine.lookup(tokens) == 4 * CHUNK
        keys = engine.keys_for(tokens)
        assert engine.batched_delete(keys[:1]) == 2, "the first chunk was in both tiers"
        assert engine.lookup(tokens) == 0, "a prompt whose first chunk is gone has no cached prefix"
        assert engine.stats()["last_lookup"]["cached_tokens"] == 0
        engine.batched_delete(keys[2:3])
        engine.store(tokens[:CHUNK], kv_for(CHUNK))
        assert engine.lookup(tokens) == 2 * CHUNK
        summary = engine.stats()["last_lookup"]
        assert summary["tokens"] == 4 * CHUNK and sum(summary["chunks_per_tier"].values()) == 2


def test_lookup_of_new_prompts_hashes_only_the_first_chunk(tmp_path: Path) -> None:
    """A miss must not cost the whole prompt: only one key is made (keys are reused per hash)."""
    with Engine(two_tiers(tmp_path)) as engine:
        core = engine.core
        before = len(core.key_maker.recent)
        assert engine.lookup(torch.arange(64 * CHUNK) + 7) == 0
        assert len(core.key_maker.recent) == before + 1


def test_batched_delete_removes_from_every_tier_and_counts(tmp_path: Path) -> None:
    tokens = torch.arange(3 * CHUNK)
    with Engine(two_tiers(tmp_path)) as engine:
        engine.store(tokens, kv_for(len(tokens)))
        keys = engine.keys_for(tokens)
        assert engine.batched_delete(keys) == 6  # write-through: each chunk in host and disk
        assert engine.batched_contains(keys) == [False] * 3
        assert engine.batched_delete(keys) == 0


@pytest.mark.parametrize("options", [{}, {"writemap": True}, {"verify": False}], ids=["default", "writemap", "trusted"])
def test_lmdb_reads_split_over_two_threads_are_bit_exact(tmp_path: Path, options: dict[str, Any]) -> None:
    """Batches above 8 MiB are read by two threads (even and odd chunks): order and bytes hold."""
    tokens = torch.arange(8 * CHUNK)
    kv = kv_for(len(tokens), heads=8, head=128)  # 64 KiB per token: 8 MiB for the prompt
    config = {"model": "split", "chunk_size": CHUNK,
              "tiers": [{"name": "disk", "backend": "lmdb", "capacity": "256MiB", "path": str(tmp_path / "db"),
                         **options}]}
    with Engine(config) as engine:
        engine.store(tokens, kv)
        out = torch.zeros_like(kv)
        _, mask = engine.retrieve(tokens, out=out)
        assert bool(mask.all()) and torch.equal(out.view(torch.int16), kv.view(torch.int16))
        copies = engine.stats()["copies"]["retrieve"]
        assert copies["copied_bytes"] == copies["delivered_bytes"] == kv.numel() * kv.element_size()


def test_lmdb_corrupt_chunk_in_the_second_thread_is_a_miss(tmp_path: Path) -> None:
    tokens = torch.arange(8 * CHUNK)
    kv = kv_for(len(tokens), heads=8, head=128)
    config = {"model": "split", "chunk_size": CHUNK,
              "tiers": [{"name": "disk", "backend": "lmdb", "capacity": "256MiB", "path": str(tmp_path / "db")}]}
    with Engine(config) as engine:
        engine.store(tokens, kv)
        tier = engine.tiers[0]
        assert isinstance(tier, LMDBBackend)
        key = encode_key(engine.keys_for(tokens)[5])  # odd: read by the helper thread
        with tier._env.begin(write=True, db=tier._data) as txn:
            value = bytearray(txn.get(key))
            value[len(value) // 2] ^= 0xFF
            txn.put(key, bytes(value))
        out = torch.zeros_like(kv)
        _, mask = engine.retrieve(tokens, out=out)
        assert int(mask.sum()) == 5 * CHUNK
        assert torch.equal(out[:, :, : 5 * CHUNK].view(torch.int16), kv[:, :, : 5 * CHUNK].view(torch.int16))
        # the corrupt chunk is checksummed as it lands, so its slice may hold its bytes (the mask
        # is the contract); the chunks after it hold their own KV or nothing, never another's
        for index in (6, 7):
            got = out[:, :, index * CHUNK : (index + 1) * CHUNK].view(torch.int16)
            assert not bool(got.any()) or torch.equal(got, kv[:, :, index * CHUNK : (index + 1) * CHUNK].view(torch.int16))
        assert engine.stats()["tiers"]["disk"]["corrupt_chunks"] == 1
        assert engine.lookup(tokens) == 5 * CHUNK, "the corrupt chunk was dropped"


def test_lmdb_options_are_validated(tmp_path: Path) -> None:
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match="writemap"):
        Engine(two_tiers(tmp_path, writemap="sometimes"))


def test_huge_page_advice_keeps_the_tensor_and_its_bytes() -> None:
    """Advisory only (THP may be off on this machine): the same tensor comes back, usable, and
    small or odd-sized buffers are left alone without error."""
    from tierkv.chunks.memory import allocate_bytes, huge_pages

    big = torch.empty(4 << 20, dtype=torch.uint8)
    assert huge_pages(big) is big
    big.fill_(7)
    assert int(big.sum()) == 7 * (4 << 20)
    small = torch.ones(100, dtype=torch.uint8)
    assert huge_pages(small) is small and int(small.sum()) == 100
    odd = torch.empty((3 << 20) + 5, dtype=torch.uint8)[1:]
    assert huge_pages(odd) is odd
    fresh = allocate_bytes(8 << 20, pinned=False)
    assert fresh.numel() == 8 << 20 and fresh.dtype == torch.uint8
