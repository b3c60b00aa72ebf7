"""Coded byte tiers (``codec:``) on a real LMDB tier: lossless frames read back bit-exact,
lossy (fp8) chunks keyed apart and bounded in error per head, damaged frames refused
before a destination is written, ``auto`` coding only where the tier is slower than
decoding, and the plan costing a coded tier at the bytes it moves plus the decode."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv import Engine
from tierkv.backend import codecs
from tierkv.backend.coded import CodedBackend
from tierkv.chunks import copies
from tierkv.chunks.keys import CacheKey
from tierkv.config import load_config
from tierkv.errors import ChunkFormatError, ConfigError
from tierkv_backends.lmdb import LMDBBackend

CHUNK = 32
SHAPE = (2, 2, CHUNK, 4, 16)  # vllm: layers, K/V, tokens, heads, head_size


def tokens_of(index: int, chunks: int = 2) -> torch.Tensor:
    return torch.arange(chunks * CHUNK, dtype=torch.int64) + 10_000 * (index + 1)


def kv_like(tokens: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """bf16 KV with a trained model's kind of redundancy (few exponents, per-head magnitudes):
    values are multiples of 1/8, each head at its own scale."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn((2, 2, len(tokens), 4, 16), generator=generator)
    head_scale = torch.tensor([0.5, 1.0, 2.0, 4.0]).reshape(1, 1, 1, 4, 1)
    return ((base * head_scale * 8).round() / 8).to(torch.bfloat16)


def config(tmp_path: Path, codec: str, *, above: list[dict[str, Any]] | None = None, db: str = "db",
           **top: Any) -> dict[str, Any]:
    return {"model": "codecs", "chunk_size": CHUNK, "kv_format": "vllm", **top,
            "tiers": [*(above or []),
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / db), "capacity": "256MiB",
                       "codec": codec}]}


def retrieved(eng: Engine, tokens: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    out = torch.zeros_like(like)
    _, mask = eng.retrieve(tokens, out=out)
    return out, int(mask.sum())


def coding(eng: Engine, tier: str = "disk") -> dict[str, Any]:
    return eng.stats()["tiers"][tier]["codec"]


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_lossless_codecs_store_frames_and_read_back_exact(tmp_path: Path, codec: str) -> None:
    tokens = tokens_of(0)
    kv = kv_like(tokens)
    with Engine(load_config(config(tmp_path, codec))) as eng:
        eng.store(tokens, kv)
        out, hit = retrieved(eng, tokens, kv)
        assert hit == len(tokens) and torch.equal(out, kv)
        stats = coding(eng)
        assert stats["frames_written"] == 2 and stats["raw_written"] == 0
        assert stats["frames_read"] == 2 and stats["write_ratio"] > 1.5, stats
        assert not stats["lossy"]


def copied_while(work: Any) -> int:
    """Bytes :mod:`tierkv.chunks.copies` counted while ``work()`` ran on the retrieve path."""
    counter = copies.CopyCounter()
    with copies.on_path(counter, "retrieve"):
        work()
    return int(counter.copied["retrieve"])


@pytest.mark.parametrize("kv_format", ["vllm", "huggingface"])
def test_frames_decode_straight_into_a_token_slice_of_a_cache(kv_format: str) -> None:
    """A token slice of a larger cache is contiguous within each slab of the frame, so each
    slab is decompressed into its place: the destination is written once, nothing staged."""
    chunk = kv_like(tokens_of(1, chunks=1), seed=1)
    if kv_format == "huggingface":
        chunk = chunk.transpose(2, 3).contiguous()  # [layers, 2, heads, tokens, head_size]
    frame = codecs.codec("lz4").encode(chunk, kv_format)
    assert frame is not None and codecs.is_frame(frame)
    token_dim = 2 if kv_format == "vllm" else 3
    wide = torch.zeros(chunk.shape[:token_dim] + (CHUNK * 2,) + chunk.shape[token_dim + 1 :], dtype=torch.bfloat16)
    view = wide.narrow(token_dim, CHUNK, CHUNK)  # a token slice of a larger cache: not contiguous
    assert not view.is_contiguous()
    assert copied_while(lambda: codecs.decode_into(frame, view)) == chunk.nbytes, "one write, no staging"
    assert torch.equal(view, chunk) and not wide.narrow(token_dim, 0, CHUNK).any()
    assert not codecs.decode_into(frame, torch.zeros(chunk.shape, dtype=torch.float16)), "another dtype is a miss"


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_large_chunk_codes_its_slabs_in_parallel_exactly(codec: str) -> None:
    """Chunks of 1 MiB and more are encoded and decoded a run of slabs per worker thread."""
    generator = torch.Generator().manual_seed(8)
    chunk = ((torch.randn((4, 2, 256, 8, 64), generator=generator) * 8).round() / 8).to(torch.bfloat16)
    assert chunk.nbytes >= 1 << 20
    frame = codecs.codec(codec).encode(chunk, "vllm")
    assert frame is not None and frame.numel() < chunk.nbytes
    wide = torch.zeros((4, 2, 512, 8, 64), dtype=torch.bfloat16)
    assert codecs.decode_into(frame, wide[:, :, 256:])
    assert torch.equal(wide[:, :, 256:], chunk) and not wide[:, :, :256].any()


def test_a_destination_whose_slabs_are_scattered_is_staged_and_still_exact() -> None:
    chunk = kv_like(tokens_of(1, chunks=1), seed=5)
    frame = codecs.codec("zstd").encode(chunk, "vllm")
    assert frame is not None
    backing = torch.zeros(SHAPE[:3] + (SHAPE[4], SHAPE[3]), dtype=torch.bfloat16)
    out = backing.transpose(3, 4)  # heads and head_size swapped in memory: no slab is contiguous
    assert copied_while(lambda: codecs.decode_into(frame, out)) == 2 * chunk.nbytes, "decoded, then copied in"
    assert torch.equal(out, chunk)


def test_single_buffer_frames_of_the_first_format_still_decode() -> None:
    """Codec id 1 (one Blosc buffer for the whole chunk) was written before slabs; a tier may hold it."""
    import blosc

    chunk = kv_like(tokens_of(1, chunks=1), seed=6)
    body = blosc.compress(chunk.view(torch.int16).numpy().tobytes(), typesize=2, clevel=1, shuffle=blosc.BITSHUFFLE,
                          cname="lz4")
    frame = codecs._frame(1, chunk, [body])
    out = torch.zeros_like(chunk)
    assert codecs.decode_into(frame, out) and torch.equal(out, chunk)


@pytest.mark.parametrize("damage", ["magic", "codec", "shape", "truncated", "slab table", "slab header", "body"])
def test_a_damaged_frame_is_refused_before_the_destination_is_written(damage: str) -> None:
    chunk = kv_like(tokens_of(2, chunks=1), seed=2)
    frame = codecs.codec("lz4").encode(chunk, "vllm")
    assert frame is not None
    raw = bytearray(frame.numpy().tobytes())
    body = codecs.read_header(frame).header_len
    slabs = SHAPE[0] * SHAPE[1]
    first_slab = body + 5 + 4 * slabs
    if damage == "magic":
        raw[0:4] = b"NOPE"
    elif damage == "codec":
        raw[5] = 99
    elif damage == "shape":
        struct.pack_into("<Q", raw, 24, SHAPE[0] + 1)  # first shape entry: no longer the stored size
    elif damage == "truncated":
        raw = raw[:-10]
    elif damage == "slab table":  # two slab lengths swapped for wrong ones, the total kept
        first, second = struct.unpack_from("<II", raw, body + 5)
        struct.pack_into("<II", raw, body + 5, first + 3, second - 3)
    elif damage == "slab header":  # the last slab's Blosc header says another size
        last = len(raw) - struct.unpack_from("<I", raw, body + 5 + 4 * (slabs - 1))[0]
        struct.pack_into("<I", raw, last + 4, 12345)
    else:  # the first slab's compressed blocks overwritten: only Blosc can tell
        raw[first_slab + 64 : first_slab + 96] = bytes(range(32))
    broken = torch.frombuffer(raw, dtype=torch.uint8)
    out = torch.full(SHAPE, 7.0, dtype=torch.bfloat16)
    with pytest.raises(ChunkFormatError):
        codecs.decode_into(broken, out)
    if damage != "body":  # blocks are checked as they are decoded: sound slabs may be in out by then
        assert bool((out == 7).all()), "nothing written before the frame was checked"


def test_a_damaged_frame_in_the_tier_is_a_miss_counted_and_dropped(tmp_path: Path) -> None:
    tokens = tokens_of(3, chunks=1)
    kv = kv_like(tokens, seed=3)
    with Engine(load_config(config(tmp_path, "lz4"))) as eng:
        eng.store(tokens, kv)
        key = eng.keys_for(tokens)[0]
        inner = eng.tiers[0].inner  # type: ignore[attr-defined]
        frame = eng.run(inner.get(key))
        bogus = frame.clone()  # well-formed for the tier (its checksum is over these bytes), not for Blosc:
        start = codecs.read_header(frame).header_len + 1  # the slab table's count of slabs
        bogus[start : start + 4] = torch.frombuffer(bytearray(struct.pack("<I", 1 << 30)), dtype=torch.uint8)
        eng.run(inner.put(key, bogus))
        out, hit = retrieved(eng, tokens, kv)
        assert hit == 0 and not out.any()
        assert eng.stats()["tiers"]["disk"]["corrupt_chunks"] == 1
        assert not eng.run(inner.contains(key)), "the damaged frame is deleted"


def test_readers_share_lossless_frames_and_never_take_lossy_ones(tmp_path: Path) -> None:
    tokens = tokens_of(4)
    kv = kv_like(tokens, seed=4)
    with Engine(load_config(config(tmp_path, "lz4"))) as writer:
        writer.store(tokens, kv)
    with Engine(load_config(config(tmp_path, "zstd"))) as other_codec:
        out, hit = retrieved(other_codec, tokens, kv)
        assert hit == len(tokens) and torch.equal(out, kv), "a frame names its compressor"
    with Engine(load_config(config(tmp_path, "none"))) as plain:
        out, hit = retrieved(plain, tokens, kv)
        assert hit == 0 and not out.any(), "without a codec a frame is a miss, never other bytes"
    with Engine(load_config(config(tmp_path, "fp8"))) as lossy:
        out, hit = retrieved(lossy, tokens, kv)
        assert hit == 0, "an fp8 reader does not take exact chunks for its own (nor the reverse)"
        lossy.store(tokens, kv)
        out, hit = retrieved(lossy, tokens, kv)
        assert hit == len(tokens) and not torch.equal(out, kv)
        keys = lossy.keys_for(tokens)
        assert all(key.chunk_hash.endswith(".fp8") for key in lossy.run(_stored_keys(lossy, keys)))
    with Engine(load_config(config(tmp_path, "lz4"))) as exact:
        out, hit = retrieved(exact, tokens, kv)
        assert hit == len(tokens) and torch.equal(out, kv), "the exact chunks are untouched"


async def _stored_keys(eng: Engine, keys: list[CacheKey]) -> list[CacheKey]:
    coded = eng.tiers[0]
    assert isinstance(coded, CodedBackend)
    stored = [coded._stored_key(key) for key in keys]
    assert all(await coded.inner.batched_contains(stored))
    return stored


def test_fp8_scales_each_head_so_small_heads_keep_their_precision() -> None:
    chunk = kv_like(tokens_of(5, chunks=1), seed=5).float()
    chunk[:, :, :, 0] *= 1e-3  # one head a thousand times smaller than the others
    chunk = chunk.to(torch.bfloat16)
    frame = codecs.codec("fp8").encode(chunk, "vllm")
    assert frame is not None and frame.numel() < chunk.nbytes * 0.55
    out = torch.empty_like(chunk)
    assert codecs.decode_into(frame, out)
    for head in range(4):
        exact, approx = chunk[:, :, :, head].float(), out[:, :, :, head].float()
        error = (approx - exact).norm() / exact.norm()
        assert error < 0.05, f"head {head}: relative error {error:.4f}"


def test_auto_codes_only_where_the_tier_is_slower_than_decoding(tmp_path: Path) -> None:
    chunk = kv_like(tokens_of(6, chunks=16), seed=6)  # 512 tokens, 256 KiB: decoding it is not all overhead
    key = CacheKey("vllm", "codecs", 1, 0, "ab" * 16)

    async def round_trip(coded: CodedBackend) -> bool:
        try:
            await coded.put(key, chunk)
            out = torch.zeros_like(chunk)
            return await coded.batched_get_into([key], [out]) == [True] and torch.equal(out, chunk)
        finally:
            await coded.close()

    results = {}
    for name, bytes_per_s in (("slow", 20e6), ("fast", 50e9)):
        inner = LMDBBackend(name="disk", capacity=1 << 28, path=str(tmp_path / name))
        coded = CodedBackend(inner, "auto", transfer_seconds=lambda n, bps=bytes_per_s: 1e-4 + n / bps)
        assert asyncio.run(round_trip(coded))
        results[name] = dict(coded.coding)
        assert set(coded.trials) == {"lz4", "zstd"}
    assert results["slow"]["frames_written"] == 1, "behind 20 MB/s, fewer bytes beat the decode"
    assert results["fast"]["raw_written"] == 1, "at 50 GB/s decoding costs more than it saves"


def test_the_plan_costs_a_coded_tier_at_its_stored_bytes_and_decode_time(tmp_path: Path) -> None:
    tokens = tokens_of(7, chunks=4)
    kv = kv_like(tokens, seed=7)
    with Engine(load_config(config(tmp_path, "lz4", cost_aware=True, recompute={"tokens_per_s": 2000}))) as eng:
        eng.store(tokens, kv)
        retrieved(eng, tokens, kv)  # one read: the estimate of stored bytes and decode time
        summary = eng.plan(tokens).summary()
        share = summary["coded_per_tier"]["disk"]  # type: ignore[index]
        raw = kv[:, :, : summary["planned_tokens"]].nbytes  # type: ignore[misc]
        assert 0 < share["stored_bytes"] < raw * 0.8, (share, raw)
        assert share["decode_ms"] > 0
        expected = summary["expected_fetch_ms_per_tier"]["disk"]  # type: ignore[index]
        assert expected == pytest.approx(share["transfer_ms"] + share["decode_ms"], abs=0.01)


def test_config_names_the_codecs_and_refuses_them_where_they_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.codec: expected one of .*'lz4'"):
        load_config(config(tmp_path, "snappy"))
    with pytest.raises(ConfigError, match="memory tier keeps chunks in place"):
        load_config({"model": "m", "tiers": [{"name": "host", "backend": "cpu", "capacity": "1GiB", "codec": "lz4"}]})
    files = {"name": "files", "backend": "fs", "path": str(tmp_path / "fs")}
    with pytest.raises(ConfigError, match="could be demoted into the exact tier 'files'"):
        load_config(config(tmp_path, "fp8", above=[{"name": "host", "backend": "cpu", "capacity": "1GiB"}, files],
                           write_policy="write_back"))
    load_config(config(tmp_path, "fp8", above=[files]))  # write-through: nothing is demoted


def test_a_hit_from_a_lossy_tier_is_promoted_into_memory_only(tmp_path: Path) -> None:
    tokens = tokens_of(8)
    kv = kv_like(tokens, seed=8)
    with Engine(load_config(config(tmp_path, "fp8"))) as writer:
        writer.store(tokens, kv)
    stack = [{"name": "host", "backend": "cpu", "capacity": "64MiB"},
             {"name": "files", "backend": "fs", "path": str(tmp_path / "fs")}]
    with Engine(load_config(config(tmp_path, "fp8", above=stack))) as eng:
        out, hit = retrieved(eng, tokens, kv)
        assert hit == len(tokens)
        eng.flush()
        keys = eng.keys_for(tokens)
        host, files = eng.tiers[0], eng.tiers[1]
        assert all(eng.run(host.batched_contains(keys))), "promoted into this process's memory"
        assert not any(eng.run(files.batched_contains(keys))), "never under the exact key of a shared tier"


def test_a_lossy_hit_never_reaches_an_exact_tier_through_a_late_fill(tmp_path: Path) -> None:
    """Under write-through, ``reused(n)`` on a byte tier copies a chunk down from memory once it
    is read n times: a chunk promoted into memory from an fp8 tier would reach that exact tier
    under its exact key. The config refuses the stack instead."""
    files = {"name": "files", "backend": "fs", "path": str(tmp_path / "fs"), "admission": "reused(2)"}
    stack = [{"name": "host", "backend": "cpu", "capacity": "64MiB"}, files]
    with pytest.raises(ConfigError, match=r"could be copied \(a late fill .*\) into the exact tier 'files'"):
        load_config(config(tmp_path, "fp8", above=stack))
    load_config(config(tmp_path, "fp8", above=[stack[0], {**files, "admission": "all"}]))
