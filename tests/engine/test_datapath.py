"""The prompt-level data path: retrieve into the caller's memory, write once, copies counted.

Round trips through every new path are bit-exact (blob and tuple ``out``, every built-in
tier, dtypes, partial last chunk, suffix masks, both KV formats); bad ``out`` fails before
anything is read; a corrupt chunk is a miss; write-through fills land after the first tier
evicted the chunk; the copy counters say "one copy" on the cpu tier's paths.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_fixtures import s3_tier_options

from tierkv import AsyncEngine, Engine
from tierkv.chunks import kvlayout
from tierkv.testing.faults import FaultyBackend
from tierkv.testing.s3server import S3Server
from tierkv_backends.fs import FSBackend
from tierkv_backends.lmdb import LMDBBackend, encode_key

LAYERS, HEADS, HEAD = 3, 2, 8
CHUNK = 16


def tier_entry(kind: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    if kind == "cpu":
        return {"name": "host", "backend": "cpu", "capacity": "8MiB", **extra}
    if kind == "lmdb":
        return {"name": "disk", "backend": "lmdb", "capacity": "64MiB", "path": str(tmp_path / "lmdb"), **extra}
    if kind == "fs":
        return {"name": "files", "backend": "fs", "path": str(tmp_path / "fs"), **extra}
    raise AssertionError(kind)


def config(tiers: list[dict[str, Any]], fmt: str = "vllm", **top: Any) -> dict[str, Any]:
    return {"model": "datapath", "chunk_size": CHUNK, "kv_format": fmt, "tiers": tiers, **top}


def make_kv(num_tokens: int, fmt: str = "vllm", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """A blob whose every bit pattern differs by token (NaNs and all, for float dtypes)."""
    shape = (LAYERS, 2, num_tokens, HEADS, HEAD) if fmt == "vllm" else (LAYERS, 2, HEADS, num_tokens, HEAD)
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], HEAD * esize), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def token_slice(kv: torch.Tensor, fmt: str, start: int, end: int) -> torch.Tensor:
    return kv.narrow(kvlayout.token_dim(fmt), start, end - start)


# -- round trips -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cpu", "lmdb", "fs"])
@pytest.mark.parametrize("fmt", ["vllm", "huggingface"])
def test_round_trip_into_out_and_fresh_every_local_tier(tmp_path: Path, kind: str, fmt: str) -> None:
    tokens = torch.arange(3 * CHUNK + 5)  # a partial last chunk
    kv = make_kv(len(tokens), fmt)
    with Engine(config([tier_entry(kind, tmp_path)], fmt)) as eng:
        assert eng.store(tokens, kv) == 4
        fresh, mask = eng.retrieve(tokens, return_tuple=False)
        assert bool(mask.all()) and same(fresh, kv)
        out = torch.full_like(kv, 0)
        got, mask = eng.retrieve(tokens, return_tuple=False, out=out)
        assert bool(mask.all()) and same(out, kv)
        assert got.data_ptr() == out.data_ptr(), "the KV returned must be a view of out"
        pairs = kvlayout.as_tuple(torch.zeros_like(kv))  # per-layer views of one buffer
        layers, _ = eng.retrieve(tokens, out=pairs)
        assert all(same(k, kv[i, 0]) and same(v, kv[i, 1]) for i, (k, v) in enumerate(layers))
        separate = [(torch.zeros_like(kv[i, 0]), torch.zeros_like(kv[i, 1])) for i in range(LAYERS)]
        layers, _ = eng.retrieve(tokens, out=separate)  # separately allocated layers: read chunk by chunk
        assert all(same(k, kv[i, 0]) and same(v, kv[i, 1]) for i, (k, v) in enumerate(separate))
        assert layers[0][0].data_ptr() == separate[0][0].data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8,
                                   *([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])], ids=str)
def test_round_trip_dtypes_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    tokens = torch.arange(2 * CHUNK + 3)
    kv = make_kv(len(tokens), dtype=dtype)
    with Engine(config([tier_entry("cpu", tmp_path), tier_entry("fs", tmp_path)])) as eng:
        eng.store(tokens, kv)
        eng.flush()
        out = torch.zeros_like(kv)
        _, mask = eng.retrieve(tokens, out=out)
        assert bool(mask.all()) and same(out, kv)
    with Engine(config([tier_entry("fs", tmp_path)])) as eng:  # a fresh process: the layout is learned
        fresh, mask = eng.retrieve(tokens, return_tuple=False)
        assert bool(mask.all()) and same(fresh, kv)


@pytest.mark.parametrize("kind", ["cpu", "lmdb", "fs"])
def test_suffix_masks_aligned_and_not(tmp_path: Path, kind: str) -> None:
    tokens = torch.arange(4 * CHUNK)
    kv = make_kv(len(tokens))
    with Engine(config([tier_entry(kind, tmp_path)])) as eng:
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:CHUNK] = False  # store only chunks 1..3
        eng.store(tokens, token_slice(kv, "vllm", CHUNK, 4 * CHUNK), mask)
        eng.store(tokens[:CHUNK], token_slice(kv, "vllm", 0, CHUNK))
        for skip in (CHUNK, CHUNK + 5, 2 * CHUNK - 1):
            want = torch.ones(len(tokens), dtype=torch.bool)
            want[:skip] = False
            out = torch.zeros_like(token_slice(kv, "vllm", skip, len(tokens)))
            got, ret = eng.retrieve(tokens, want, return_tuple=False, out=out)
            assert torch.equal(ret, want)
            assert same(out, token_slice(kv, "vllm", skip, len(tokens)))
            fresh, _ = eng.retrieve(tokens, want, return_tuple=False)
            assert same(fresh, out)


def test_partial_prefix_fills_only_the_cached_tokens(tmp_path: Path) -> None:
    tokens = torch.arange(3 * CHUNK)
    kv = make_kv(len(tokens))
    with Engine(config([tier_entry("cpu", tmp_path)])) as eng:
        eng.store(tokens[: 2 * CHUNK], token_slice(kv, "vllm", 0, 2 * CHUNK))
        out = torch.full_like(kv, 7)
        sentinel = out.clone()
        got, mask = eng.retrieve(tokens, return_tuple=False, out=out)
        assert int(mask.sum()) == 2 * CHUNK and got.shape[2] == 2 * CHUNK
        assert same(token_slice(out, "vllm", 0, 2 * CHUNK), token_slice(kv, "vllm", 0, 2 * CHUNK))
        assert same(token_slice(out, "vllm", 2 * CHUNK, 3 * CHUNK), token_slice(sentinel, "vllm", 2 * CHUNK, 3 * CHUNK))


def test_s3_round_trip_into_out(tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    tokens = torch.arange(2 * CHUNK + 1)
    kv = make_kv(len(tokens))
    s3 = {"name": "shared", "backend": "s3", **s3_tier_options(s3_server, s3_bucket, f"datapath/{uuid.uuid4().hex}")}
    with Engine(config([s3])) as eng:
        eng.store(tokens, kv)
        out = torch.zeros_like(kv)
        _, mask = eng.retrieve(tokens, out=out)
        assert bool(mask.all()) and same(out, kv)
        assert eng.lookup(tokens) == len(tokens), "lookup falls back to the loop for a tier without an index"


# -- bad out ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["tokens", "layers", "dtype", "rank", "device", "tuple_blob"])
def test_wrong_out_is_a_value_error_before_anything_is_read(tmp_path: Path, bad: str) -> None:
    tokens = torch.arange(2 * CHUNK)
    kv = make_kv(len(tokens))
    with Engine(config([tier_entry("cpu", tmp_path)])) as eng:
        eng.store(tokens, kv)
        outs = {
            "tokens": torch.zeros((LAYERS, 2, len(tokens) - 1, HEADS, HEAD), dtype=kv.dtype),
            "layers": torch.zeros((LAYERS + 1, 2, len(tokens), HEADS, HEAD), dtype=kv.dtype),
            "dtype": torch.zeros(kv.shape, dtype=torch.float32),
            "rank": torch.zeros((LAYERS, 2, len(tokens), HEADS * HEAD), dtype=kv.dtype),
            "device": torch.zeros(kv.shape, dtype=kv.dtype, device="meta"),
            "tuple_blob": [(torch.zeros_like(kv[i, 0]), torch.zeros_like(kv[i, 1])) for i in range(LAYERS)],
        }
        hits_before = eng.stats()["tiers"]["host"]["hits"]
        with pytest.raises(ValueError, match="out"):
            eng.retrieve(tokens, out=outs[bad], return_tuple=bad != "tuple_blob")
        assert eng.stats()["tiers"]["host"]["hits"] == hits_before, "nothing may be read for a bad out"
        if bad not in ("device", "tuple_blob"):
            assert not bool(outs[bad].view(torch.uint8).any()), "a bad out must be left untouched"


# -- corrupt chunks --------------------------------------------------------------------------------------
def corrupt(eng: Engine, kind: str, key: Any) -> None:
    tier = eng.tiers[0]
    if kind == "lmdb":
        assert isinstance(tier, LMDBBackend)
        with tier._env.begin(write=True, db=tier._data) as txn:
            value = bytearray(txn.get(encode_key(key)))
            value[len(value) // 2] ^= 0xFF
            txn.put(encode_key(key), bytes(value))
    else:
        assert isinstance(tier, FSBackend)
        path = tier._file(tier._digest(key.to_string()))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["lmdb", "fs"])
def test_corrupt_chunk_read_into_out_is_a_miss_and_nothing_past_it_is_used(tmp_path: Path, kind: str) -> None:
    tokens = torch.arange(4 * CHUNK)
    kv = make_kv(len(tokens))
    with Engine(config([tier_entry(kind, tmp_path)])) as eng:
        eng.store(tokens, kv)
        corrupt(eng, kind, eng.keys_for(tokens)[2])
        out = torch.full_like(kv, 3)
        sentinel = out.clone()
        _, mask = eng.retrieve(tokens, out=out)
        assert int(mask.sum()) == 2 * CHUNK, "the prefix stops before the corrupt chunk"
        assert same(token_slice(out, "vllm", 0, 2 * CHUNK), token_slice(kv, "vllm", 0, 2 * CHUNK))
        # both copy into out and verify there (one copy): the corrupt chunk's slice may hold
        # junk, the mask says so
        tail = token_slice(out, "vllm", 3 * CHUNK, 4 * CHUNK)
        assert same(tail, token_slice(sentinel, "vllm", 3 * CHUNK, 4 * CHUNK)) or \
            same(tail, token_slice(kv, "vllm", 3 * CHUNK, 4 * CHUNK)), "past the mask: old bytes or the right KV only"
        assert eng.lookup(tokens) == 2 * CHUNK, "the corrupt chunk was dropped"
        assert eng.stats()["tiers"][eng.tiers[0].name]["corrupt_chunks"] == 1


# -- write once -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preallocate", [True, False])
def test_preallocate_on_and_off(tmp_path: Path, preallocate: bool) -> None:
    tokens = torch.arange(2 * CHUNK)
    kv = make_kv(len(tokens))
    with Engine(config([tier_entry("cpu", tmp_path, capacity="1MiB", preallocate=preallocate)])) as eng:
        host = eng.stats()["tiers"]["host"]
        assert host["preallocated"] is preallocate
        assert host["allocated_bytes"] == (1 << 20 if preallocate else 0)
        eng.store(tokens, kv)
        assert same(eng.retrieve(tokens, return_tuple=False)[0], kv)
        assert eng.stats()["tiers"]["host"]["allocated_bytes"] == (1 << 20 if preallocate else 2 * 4096)


def test_write_through_fill_lands_after_the_first_tier_evicted_the_chunk(tmp_path: Path) -> None:
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * HEAD * 2
    prompts = [torch.arange(CHUNK) + 1000 * i for i in range(4)]
    blobs = [make_kv(CHUNK, seed=i) for i in range(4)]

    async def main() -> None:
        engine = AsyncEngine(config([tier_entry("cpu", tmp_path, capacity=2 * chunk_bytes),
                                     tier_entry("lmdb", tmp_path)]))
        disk = engine.wrap_tier(engine.tiers[1].name, FaultyBackend)
        disk.stall_s = 0.2  # fills wait while the host tier churns
        for tokens, blob in zip(prompts, blobs):
            await engine.store(tokens, blob)
        assert engine.stats()["tiers"]["host"]["evictions"] >= 2, "chunks left the host tier with fills queued"
        await engine.flush()
        disk.stall_s = 0.0
        for tokens, blob in zip(prompts, blobs):
            got = await disk.inner.get(engine.keys_for(tokens)[0])
            assert got is not None and same(got, blob), "a fill wrote bytes other than the stored chunk"
        stats = engine.stats()
        assert stats["fill_queue"]["completed_chunks"] == 4
        assert stats["copies"]["store"]["copies_per_byte"] == 1.0, "fills must read the host tier's copy"
        await engine.close()
    asyncio.run(main())


# -- copies are counted ------------------------------------------------------------------------------------
def test_cpu_tier_paths_copy_each_byte_once(tmp_path: Path) -> None:
    tokens = torch.arange(4 * CHUNK)
    kv = make_kv(len(tokens))
    with Engine(config([tier_entry("cpu", tmp_path)])) as eng:
        eng.store(tokens, kv)
        copies = eng.stats()["copies"]
        assert copies["store"]["delivered_bytes"] == kv.numel() * kv.element_size()
        assert copies["store"]["copies_per_byte"] == 1.0
        eng.retrieve(tokens, out=torch.empty_like(kv))
        eng.retrieve(tokens)
        copies = eng.stats()["copies"]
        assert copies["retrieve"]["delivered_bytes"] == 2 * kv.numel() * kv.element_size()
        assert copies["retrieve"]["copies_per_byte"] == 1.0


@pytest.mark.parametrize("kind", ["lmdb", "fs"])
def test_disk_tier_reads_into_out_copy_each_byte_once(tmp_path: Path, kind: str) -> None:
    """retrieve(out=) from a file tier: each chunk goes straight into its slice of out (fs
    verifies it there), no staging buffer and no second copy."""
    tokens = torch.arange(4 * CHUNK)
    kv = make_kv(len(tokens))
    with Engine(config([tier_entry(kind, tmp_path)])) as eng:
        eng.store(tokens, kv)
        eng.flush()
        before = eng.stats()["copies"]["retrieve"]["copied_bytes"]
        out = torch.full_like(kv, 7)
        _, mask = eng.retrieve(tokens, out=out)
        assert bool(mask.all()) and same(out, kv)
        copies = eng.stats()["copies"]["retrieve"]
        assert copies["copied_bytes"] - before == kv.numel() * kv.element_size(), "one copy per byte into out"


def test_lower_tier_hit_counts_promotion_apart(tmp_path: Path) -> None:
    tokens = torch.arange(2 * CHUNK)
    kv = make_kv(len(tokens))
    with Engine(config([tier_entry("cpu", tmp_path), tier_entry("lmdb", tmp_path)])) as eng:
        eng.store(tokens, kv)
        eng.flush()
        for key in eng.keys_for(tokens):
            eng.run(eng.tiers[0].delete(key))
        _, mask = eng.retrieve(tokens, out=torch.empty_like(kv))
        assert bool(mask.all())
        copies = eng.stats()["copies"]
        nbytes = kv.numel() * kv.element_size()
        assert copies["retrieve"]["copied_bytes"] == nbytes, "lmdb -> out is one copy"
        assert copies["promote"]["copied_bytes"] == nbytes, "out -> host tier is the promotion"
        assert copies["fill"]["copied_bytes"] == nbytes
        assert eng.locate(tokens) == ["host", "host"]


# -- lookup from the caller's thread -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cpu", "lmdb", "fs"])
def test_lookup_answers_from_indexes_without_the_loop(tmp_path: Path, kind: str) -> None:
    tokens = torch.arange(5 * CHUNK)
    with Engine(config([tier_entry(kind, tmp_path)])) as eng:
        eng.store(tokens[: 3 * CHUNK], make_kv(3 * CHUNK))
        assert eng.core.lookup_nowait(tokens) == 3 * CHUNK
        assert eng.core.lookup_nowait(tokens + 100_000) == 0
        assert eng.lookup(tokens) == 3 * CHUNK
        assert eng.stats()["last_lookup"]["chunks_per_tier"][eng.tiers[0].name] == 3


def test_lmdb_lookup_sees_chunks_another_process_wrote(tmp_path: Path) -> None:
    tokens = torch.arange(2 * CHUNK)
    cfg = config([tier_entry("lmdb", tmp_path)])
    writer = textwrap.dedent(f"""
        import torch
        from tierkv import Engine
        with Engine({cfg!r}) as eng:
            eng.store(torch.arange({2 * CHUNK}), torch.zeros({LAYERS}, 2, {2 * CHUNK}, {HEADS}, {HEAD}))
    """)
    with Engine(cfg) as reader:
        assert reader.lookup(tokens) == 0
        subprocess.run([sys.executable, "-c", writer], check=True, timeout=120)
        assert reader.lookup(tokens) == 2 * CHUNK, "the reader's index misses it; its read transaction must not"
        assert reader.retrieve(tokens)[1].all()
