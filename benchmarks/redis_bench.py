"""Redis tier benchmark (``bench-redis``): the tierkv-redis backend against raw redis-py.

Both sides talk to the same throwaway ``redis-server`` on 127.0.0.1 (started here, on a
free port, persistence off) from the same event loop, runs interleaved so machine noise
hits both alike. Figures are MB/s of KV payload and the ratio ours / baseline.

- batched_put: ``RedisBackend.batched_put`` of bf16 chunks (serialization, checksum,
  pipelined ``SET``) vs a raw redis-py pipeline of ``SET`` of the same tensors' bytes,
  already serialized before the clock starts.
- batched_get: ``RedisBackend.batched_get`` (``MGET``, checksum, copy into tensors the
  caller owns) vs a raw ``MGET`` of the same values wrapped with ``torch.frombuffer``
  (zero-copy, no check).

Target: ratio >= 0.9 for both. Needs ``pip install ./examples/tierkv-redis`` and
``redis-server`` on PATH; otherwise ``run_redis`` returns a row saying why it skipped.

    python benchmarks/redis_bench.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from tierkv.chunks.keys import CacheKey

TARGET = 0.9
#: (label, tokens per chunk, chunks per batch): 32 layers x 8 KV heads x 128 dims, bf16
CASES = ((256, 4), (16, 32))
LAYERS, HEADS, HEAD_SIZE = 32, 8, 128


def chunk_of(tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((LAYERS, 2, tokens, HEADS, HEAD_SIZE), generator=generator).to(torch.bfloat16)


async def interleaved(ours: Callable[[], Awaitable[Any]], baseline: Callable[[], Awaitable[Any]],
                      repeats: int) -> tuple[float, float]:
    """Median seconds of ``ours`` and ``baseline``, alternating so noise hits both."""
    await ours(), await baseline()  # warm-up: connections, server allocations, pools
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        await ours()
        a.append(time.perf_counter() - start)
        start = time.perf_counter()
        await baseline()
        b.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def row(op: str, tokens: int, batch: int, nbytes: int, ours: float, base: float) -> dict[str, Any]:
    ratio = base / ours
    return {"tier": "redis", "op": op, "batch": batch, "chunk_MiB": round(nbytes / batch / 2**20, 2),
            "ours_ms": ours * 1e3, "baseline_ms": base * 1e3,
            "ours_MBps": nbytes / ours / 1e6, "baseline_MBps": nbytes / base / 1e6, "ratio": ratio,
            "target": f">= {TARGET}x", "meets": ratio >= TARGET,
            "baseline": "raw redis-py pipeline" if op == "batched_put" else "raw redis-py MGET + torch.frombuffer"}


async def bench_case(url: str, tokens: int, batch: int, repeats: int) -> list[dict[str, Any]]:
    from redis.asyncio import Redis
    from tierkv_redis import RedisBackend

    chunks = [chunk_of(tokens, seed) for seed in range(batch)]
    keys = [CacheKey("vllm", "bench", 1, 0, f"{tokens:08x}{i:024x}") for i in range(batch)]
    payloads = [chunk.view(torch.uint8).numpy().tobytes() for chunk in chunks]
    raw_names = [f"raw:{key.to_string()}" for key in keys]
    nbytes = sum(len(p) for p in payloads)

    backend = RedisBackend("bench", url=url, key_prefix="ours:", max_connections=4)
    raw = Redis.from_url(url, max_connections=4)
    try:
        async def ours_put() -> None:
            await backend.batched_put(keys, chunks)

        async def raw_put() -> None:
            pipe = raw.pipeline(transaction=False)
            for name, payload in zip(raw_names, payloads):
                pipe.set(name, payload)
            await pipe.execute()

        async def ours_get() -> None:
            got = await backend.batched_get(keys)
            assert all(chunk is not None for chunk in got)

        async def raw_get() -> None:
            values = await raw.mget(raw_names)
            with warnings.catch_warnings():  # read-only bytes: fine for a baseline that never writes
                warnings.simplefilter("ignore", UserWarning)
                tensors = [torch.frombuffer(value, dtype=torch.bfloat16) for value in values]
            assert len(tensors) == batch

        put = await interleaved(ours_put, raw_put, repeats)
        get = await interleaved(ours_get, raw_get, repeats)
        assert torch.equal(chunks[0].view(torch.int16), (await backend.get(keys[0])).view(torch.int16))  # type: ignore[union-attr]
    finally:
        await backend.close()
        await raw.aclose()
    return [row("batched_put", tokens, batch, nbytes, *put), row("batched_get", tokens, batch, nbytes, *get)]


def run_redis(repeats: int = 7) -> list[dict[str, Any]]:
    """Rows for the benchmark table; one explanatory row if Redis or the plugin is missing."""
    try:
        from tierkv_redis.testing import RedisServer, server_binary
    except ImportError:
        return [{"tier": "redis", "op": "skipped", "baseline": "tierkv-redis not installed: pip install ./examples/tierkv-redis"}]
    if server_binary() is None:
        return [{"tier": "redis", "op": "skipped", "baseline": "redis-server not on PATH (apt-get install redis-server)"}]
    rows: list[dict[str, Any]] = []
    with RedisServer() as server:
        for tokens, batch in CASES:
            rows.extend(asyncio.run(bench_case(server.url, tokens, batch, repeats)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    rows = run_redis(args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        if "ratio" not in r:
            print(f"redis: {r['op']}: {r['baseline']}")
            continue
        print(f"{r['op']:<12} {r['batch']:>3} x {r['chunk_MiB']:>5} MiB  ours {r['ours_MBps']:8.0f} MB/s  "
              f"raw {r['baseline_MBps']:8.0f} MB/s  ratio {r['ratio']:.2f} (target {r['target']})"
              f"{'' if r['meets'] else '  MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
