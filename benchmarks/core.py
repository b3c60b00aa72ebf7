"""Core tier benchmark: cpu and lmdb tiers against baselines measured in the same run.

Shape: 32 layers, 8 KV heads, head size 128, bfloat16, 256-token chunks (32 MiB each),
the Llama-3-8B chunk of ANCHORS.md. Every figure is a ratio against a baseline timed in
this process, interleaved with ours, so machine noise hits both alike:

- cpu tier: batched_put / batched_get vs a plain torch copy of the same bytes into a
  preallocated tensor (``dst.copy_(src)``): the memory-bandwidth ceiling.
- lmdb tier: batched_put / batched_get vs raw py-lmdb doing the same puts (one write
  transaction per batch) and gets (``txn.get`` then ``torch.frombuffer``).
- lookup of a 131,072-token prompt in a warm cache, and hashing throughput.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lmdb
import torch

from tierkv import AsyncEngine, CacheKey, ChunkHasher
from tierkv_backends.cpu import CPUBackend
from tierkv_backends.lmdb import LMDBBackend

LAYERS, HEADS, HEAD_SIZE, CHUNK_TOKENS = 32, 8, 128, 256
CHUNK_SHAPE = (LAYERS, 2, CHUNK_TOKENS, HEADS, HEAD_SIZE)
CHUNK_BYTES = LAYERS * 2 * CHUNK_TOKENS * HEADS * HEAD_SIZE * 2


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, pool fill, LMDB map growth
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved(ours: Callable[[], Any], baseline: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds of ``ours`` and ``baseline``, alternating runs so noise hits both."""
    ours(), baseline()
    a, b = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ours()
        a.append(time.perf_counter() - start)
        start = time.perf_counter()
        baseline()
        b.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def keys(count: int, salt: str) -> list[CacheKey]:
    return [CacheKey("vllm", "bench", 1, 0, f"{salt}{i:030x}") for i in range(count)]


def bench_cpu(batch: int, repeats: int) -> list[dict[str, Any]]:
    chunks = [torch.randn(CHUNK_SHAPE, dtype=torch.bfloat16) for _ in range(batch)]
    targets = [torch.empty_like(c) for c in chunks]
    loop = asyncio.new_event_loop()
    backend = CPUBackend("host", capacity=CHUNK_BYTES * batch * 2)
    ks = keys(batch, "c")

    def baseline() -> None:
        for dst, src in zip(targets, chunks):
            dst.copy_(src)

    def put() -> None:
        loop.run_until_complete(backend.batched_put(ks, chunks))

    def get() -> None:
        out = loop.run_until_complete(backend.batched_get(ks))
        assert all(o is not None for o in out)

    put()
    rows = []
    for op, fn in (("batched_put", put), ("batched_get", get)):
        ours, base = interleaved(fn, baseline, repeats)
        rows.append(row("cpu", op, batch, ours, base, "torch copy_ into preallocated"))
    loop.run_until_complete(backend.close())
    loop.close()
    return rows


def bench_lmdb(batch: int, repeats: int) -> list[dict[str, Any]]:
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    chunks = [torch.randn(CHUNK_SHAPE, dtype=torch.bfloat16) for _ in range(batch)]
    workdir = tempfile.mkdtemp(prefix="tierkv-bench-")
    capacity = CHUNK_BYTES * batch * 3
    loop = asyncio.new_event_loop()
    backend = LMDBBackend("disk", capacity=capacity, path=f"{workdir}/ours")
    raw_env = lmdb.open(f"{workdir}/raw", map_size=capacity + capacity // 8 + (64 << 20), sync=False,
                        metasync=False, readahead=True, max_dbs=2)
    raw_db = raw_env.open_db(b"data")
    ks = keys(batch, "l")
    raw_keys = [k.to_string().encode() for k in ks]
    payloads = [c.view(-1).view(torch.uint8).numpy() for c in chunks]

    def raw_put() -> None:
        with raw_env.begin(write=True) as txn:
            for key, payload in zip(raw_keys, payloads):
                txn.put(key, payload, db=raw_db)

    def raw_get() -> None:
        with raw_env.begin() as txn:
            out = [torch.frombuffer(txn.get(k, db=raw_db), dtype=torch.bfloat16).view(CHUNK_SHAPE) for k in raw_keys]
        assert len(out) == batch

    targets = [torch.empty(CHUNK_SHAPE, dtype=torch.bfloat16) for _ in range(batch)]

    def raw_get_into_preallocated() -> None:
        with raw_env.begin(buffers=True) as txn:
            for key, dst in zip(raw_keys, targets):
                dst.view(-1).view(torch.uint8).numpy()[:] = txn.get(key, db=raw_db)

    def put() -> None:
        loop.run_until_complete(backend.batched_put(ks, chunks))

    def get() -> None:
        out = loop.run_until_complete(backend.batched_get(ks))
        assert all(o is not None for o in out)

    rows = []
    for op, fn, base_fn, label in (
        ("batched_put", put, raw_put, "raw py-lmdb, one txn per batch"),
        ("batched_get", get, raw_get, "raw py-lmdb txn.get + frombuffer"),
        ("batched_get", get, raw_get_into_preallocated, "raw py-lmdb zero-copy into preallocated"),
    ):
        ours, base = interleaved(fn, base_fn, repeats)
        rows.append(row("lmdb", op, batch, ours, base, label))
    loop.run_until_complete(backend.close())
    loop.close()
    raw_env.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return rows


def bench_lookup(repeats: int) -> list[dict[str, Any]]:
    tokens = torch.randint(0, 128_000, (131_072,))
    config = {"model": "bench", "chunk_size": 256,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "1GiB"}]}

    async def main() -> tuple[float, float]:
        engine = AsyncEngine(config)
        tiny = torch.zeros(1, 2, 131_072, 1, 2, dtype=torch.bfloat16)  # lookup cost does not depend on KV size
        await engine.store(tokens, tiny)
        assert await engine.lookup(tokens) == 131_072
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            await engine.lookup(tokens)
            samples.append(time.perf_counter() - start)
        await engine.close()
        hasher = ChunkHasher(256)
        hash_time = median_time(lambda: hasher.prefix_hashes(tokens), repeats)
        return statistics.median(samples), hash_time

    lookup_time, hash_time = asyncio.run(main())
    return [
        {"tier": "engine", "op": "lookup 131072 tokens", "batch": 512, "ours_ms": lookup_time * 1e3,
         "target": "<= 2 ms", "meets": lookup_time <= 2e-3},
        {"tier": "engine", "op": "hash tokens", "batch": 512, "ours_ms": hash_time * 1e3,
         "tokens_per_s": 131_072 / hash_time, "share_of_lookup": hash_time / lookup_time},
    ]


TARGETS = {("cpu", "batched_get"): 0.7, ("cpu", "batched_put"): 0.5,
           ("lmdb", "batched_get"): 0.8, ("lmdb", "batched_put"): 0.8}


def row(tier: str, op: str, batch: int, ours: float, base: float, baseline: str) -> dict[str, Any]:
    nbytes = batch * CHUNK_BYTES
    ratio = base / ours
    target = TARGETS[(tier, op)]
    return {"tier": tier, "op": op, "batch": batch, "ours_ms": ours * 1e3, "baseline_ms": base * 1e3,
            "ours_GBps": nbytes / ours / 1e9, "baseline_GBps": nbytes / base / 1e9, "ratio": ratio,
            "target": f">= {target}x", "meets": ratio >= target, "baseline": baseline}


def run_core(batch: int = 8, repeats: int = 7) -> list[dict[str, Any]]:
    return [*bench_cpu(batch, repeats), *bench_lmdb(batch, repeats), *bench_lookup(max(repeats, 20))]
