"""Cluster-wide tiers benchmark (``bench-cluster``): prompts through the mooncake and Redis Cluster
tiers, beside the raw clients doing the same batched puts and gets of the same bytes, in one run.

Workload: the Llama-3-8B KV shape (32 layers x 8 KV heads x 128, bfloat16, 128 KiB per token),
256-token chunks (32 MiB each), ``--prompts`` prompts of ``--tokens`` tokens (default 2 x 1,024:
256 MiB), scaled to fit a small machine next to a Mooncake pool and a 3-node Redis Cluster,
all on 127.0.0.1.

Per shared tier (an Engine whose only tier is the shared one), interleaved with the raw
client so noise hits both, each pass on an emptied store:

- ``store`` (+flush): ``Engine.store`` of every prompt vs the raw batched put of the same
  chunks' bytes, serialized before the clock starts (Mooncake ``put_batch``; a redis-py
  cluster pipeline of ``SET`` per node);
- ``retrieve out=``: ``Engine.retrieve(out=...)`` (verified, copied into the caller's memory)
  vs the raw batched get (Mooncake ``get_batch``; redis-py ``mget_nonatomic``), which neither
  verifies nor copies the bytes anywhere;
- ``lookup``: ``Engine.lookup`` of a stored prompt vs the raw batched existence check of its
  chunk keys (``batch_is_exist``; pipelined ``EXISTS``), median of 20 calls per pass. The
  engine asks a tier without an in-memory index twice (the first chunk alone, then the
  rest) from its own loop; the raw client asks once from the caller's thread.

Node B vs node A: a second Engine opened after A stored (fresh clients, nothing cached), its
first ``retrieve(out=)`` of A's prompts against A's warm ``retrieve(out=)`` of the same from
the shared tier. The s3 tier on a local object store gives the scale (no raw baseline).

Targets: ours >= 0.9x the raw client's throughput; B's first retrieve >= 0.8x A's warm one.

    python benchmarks/cluster.py [--prompts 2] [--tokens 1024] [--repeats 3] [--no-s3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any

import torch

from tierkv import Engine
from tierkv.chunks import serde

LAYERS, HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_SIZE * DTYPE.itemsize
RAW_TARGET, NODE_B_TARGET = 0.9, 0.8
LOOKUPS_PER_PASS = 20


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prompts(count: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for index in range(count):
        ids = torch.arange(tokens) + 1_000_000 * (index + 1)
        kv = torch.randint(-30000, 30000, (LAYERS, 2, tokens, HEADS, HEAD_SIZE), dtype=torch.int16).view(DTYPE)
        out.append((ids, kv))
    return out


def _raw_values(prompts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bytes]:
    """Every chunk of every prompt in tierkv's format: the same bytes the tier stores."""
    return [bytes(serde.encode(kv[:, :, start : start + CHUNK].contiguous(), "vllm"))
            for _, kv in prompts for start in range(0, kv.shape[2], CHUNK)]


def _retrieve_all(engine: Engine, prompts: list[tuple[torch.Tensor, torch.Tensor]], outs: list[torch.Tensor],
                  label: str) -> None:
    for (tokens, _), out in zip(prompts, outs):
        _, mask = engine.retrieve(tokens, out=out, return_tuple=False)
        assert bool(mask.all()), f"{label}: a stored prompt missed: {engine.stats()['tiers']}"


def _config(tier: dict[str, Any]) -> dict[str, Any]:
    return {"model": "bench-cluster", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_through",
            "cost_aware": False,
            "tiers": [{"name": "shared", **tier}]}


class Side:
    """One store's raw client: clear, batched put, batched get, existence check of ``keys``."""

    def __init__(self, clear: Callable[[], None], put: Callable[[list[str], list[bytes]], None],
                 get: Callable[[list[str]], list[Any]], exists: Callable[[list[str]], list[Any]]) -> None:
        self.clear, self.put, self.get, self.exists = clear, put, get, exists


def _bench_tier(label: str, tier: dict[str, Any], raw: Side | None, prompts: list[tuple[torch.Tensor, torch.Tensor]],
                values: list[bytes], repeats: int, clear: Callable[[], None]) -> list[dict[str, Any]]:
    """Rows for one shared tier; ``clear`` empties its store before each store pass."""
    outs = [torch.zeros_like(kv) for _, kv in prompts]
    total = sum(kv.numel() * kv.element_size() for _, kv in prompts)
    keys = [f"raw/{i}" for i in range(len(values))]
    per_prompt = len(values) // len(prompts)
    samples: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(seconds)

    with Engine(_config(tier)) as engine:
        def store() -> None:
            for tokens, kv in prompts:
                engine.store(tokens, kv)
            engine.flush()

        retrieve = partial(_retrieve_all, engine, prompts, outs, label)

        for index in range(repeats + 1):  # the first pass warms up both sides and is not counted
            clear()
            seconds = _timed(store)
            if raw is not None:
                raw_seconds = _timed(lambda: raw.put(keys, values))
            if index:
                add("store", seconds)
                if raw is not None:
                    add("raw put", raw_seconds)
            seconds = _timed(retrieve)
            if raw is not None:
                raw_seconds = _timed(lambda: raw.get(keys))
            if index:
                add("retrieve out=", seconds)
                if raw is not None:
                    add("raw get", raw_seconds)
            for _ in range(LOOKUPS_PER_PASS):  # small calls: many samples, alternating
                lookup = _timed(lambda: engine.lookup(prompts[0][0]))
                if raw is not None:
                    raw_lookup = _timed(lambda: raw.exists(keys[:per_prompt]))
                if index:
                    add("lookup", lookup)
                    if raw is not None:
                        add("raw exists", raw_lookup)
        assert all(torch.equal(o.view(torch.int16), kv.view(torch.int16)) for o, (_, kv) in zip(outs, prompts)), \
            f"{label}: wrong bytes"
        for _ in range(repeats):  # node B: a fresh engine each time (new clients, nothing of its own)
            with Engine(_config(tier)) as node_b:
                b_out = [torch.ones_like(kv) for _, kv in prompts]  # memory B allocated and touched
                add("node B first", _timed(partial(_retrieve_all, node_b, prompts, b_out, label)))
                assert all(torch.equal(o.view(torch.int16), kv.view(torch.int16)) for o, (_, kv) in zip(b_out, prompts))
            add("node A warm", _timed(retrieve))
        a_warm = statistics.median(samples["node A warm"])
        b_first = statistics.median(samples["node B first"])

    def gbps(name: str) -> float:
        return total / statistics.median(samples[name]) / 1e9

    rows: list[dict[str, Any]] = [
        {"tier": label, "op": "store", "GB/s": gbps("store")},
        {"tier": label, "op": "retrieve out=", "GB/s": gbps("retrieve out=")},
        {"tier": label, "op": "lookup", "us": statistics.median(samples["lookup"]) * 1e6}]
    if raw is not None:
        rows[0].update(baseline="raw put", base=gbps("raw put"))
        rows[1].update(baseline="raw get", base=gbps("raw get"))
        rows[2].update(baseline="raw exists", base_us=statistics.median(samples["raw exists"]) * 1e6)
        for row in rows[:2]:
            row["ratio"] = row["GB/s"] / row["base"]
            row["target"] = RAW_TARGET
        rows[2]["ratio"] = rows[2]["base_us"] / rows[2]["us"]
        rows[2]["target"] = RAW_TARGET
    rows.append({"tier": label, "op": "node B first retrieve", "GB/s": total / b_first / 1e9,
                 "baseline": "node A warm retrieve", "base": total / a_warm / 1e9, "ratio": a_warm / b_first,
                 "target": NODE_B_TARGET})
    return rows


def _mooncake(stack: ExitStack, pool: int) -> tuple[dict[str, Any], Side] | str:
    from tierkv.testing.mooncake_server import MooncakeCluster, MooncakeServerError, mooncake_importable
    reason = mooncake_importable()
    if reason:
        return reason
    try:
        cluster = stack.enter_context(MooncakeCluster(pool_size=pool))
    except MooncakeServerError as exc:
        return str(exc)
    from mooncake.store import MooncakeDistributedStore
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", cluster.metadata_server, 0, 512 << 20, "tcp", "", cluster.master_address) == 0
    stack.callback(client.close)

    def put(keys: list[str], values: list[bytes]) -> None:
        assert client.put_batch(keys, values) == 0

    tier = {"backend": "mooncake", **cluster.tier_options(buffer_size="512MiB", timeout_s=60.0)}
    return tier, Side(lambda: client.remove_all(True), put, client.get_batch, client.batch_is_exist)


def _redis_cluster(stack: ExitStack) -> tuple[dict[str, Any], Side] | str:
    try:
        import redis
        from tierkv_redis.testing import RedisClusterServers
    except ImportError as exc:
        return f"the redis example plugin is not installed (pip install ./examples/tierkv-redis): {exc}"
    try:
        servers = stack.enter_context(RedisClusterServers(nodes=3))
    except FileNotFoundError as exc:
        return str(exc)
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    client = redis.asyncio.RedisCluster.from_url(servers.url)
    stack.callback(lambda: loop.run_until_complete(client.aclose()))

    async def put(keys: list[str], values: list[bytes]) -> None:
        pipe = client.pipeline()
        for key, value in zip(keys, values):
            pipe.set(key, value)
        await pipe.execute()

    async def exists(keys: list[str]) -> list[Any]:
        pipe = client.pipeline()
        for key in keys:
            pipe.exists(key)
        return await pipe.execute()  # type: ignore[no-any-return]

    def clear() -> None:
        for port in servers.ports:
            node = redis.Redis(port=port)
            node.flushall()
            node.close()

    tier = {"backend": "redis", "url": servers.url, "cluster": True, "socket_timeout": 60.0}
    return tier, Side(clear, lambda k, v: loop.run_until_complete(put(k, v)),
                      lambda k: loop.run_until_complete(client.mget_nonatomic(k)),
                      lambda k: loop.run_until_complete(exists(k)))


def _s3(stack: ExitStack) -> tuple[dict[str, Any], Callable[[], None]] | str:
    try:
        from tierkv.testing.s3server import S3Server
        server = stack.enter_context(S3Server())
    except Exception as exc:  # noqa: BLE001 - reported as a skipped row
        return f"no local object store: {exc}"
    client = server.boto3_client()
    client.create_bucket(Bucket="bench-cluster")

    def clear() -> None:  # every pass stores into an empty bucket, like the other tiers
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench-cluster"):
            objects = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if objects:
                client.delete_objects(Bucket="bench-cluster", Delete={"Objects": objects})

    return {"backend": "s3", "bucket": "bench-cluster", **server.client_options(inline=False)}, clear


def run_cluster(prompts: int = 2, tokens: int = 1024, repeats: int = 3, s3: bool = True) -> list[dict[str, Any]]:
    if tokens % CHUNK:
        raise ValueError(f"--tokens must be a multiple of the {CHUNK}-token chunk, got {tokens}")
    work = _prompts(prompts, tokens)
    values = _raw_values(work)
    rows: list[dict[str, Any]] = []
    pool = 4 * len(values) * len(values[0]) + (256 << 20)  # ours and raw side by side, far below eviction
    for label, make in (("mooncake", lambda st: _mooncake(st, pool)), ("redis-cluster", _redis_cluster)):
        with ExitStack() as stack:
            made = make(stack)
            if isinstance(made, str):
                rows.append({"tier": label, "op": "skipped", "why": made})
                continue
            tier, raw = made
            rows.extend(_bench_tier(label, tier, raw, work, values, repeats, raw.clear))
    if s3:
        with ExitStack() as stack:
            made_s3 = _s3(stack)
            if isinstance(made_s3, str):
                rows.append({"tier": "s3", "op": "skipped", "why": made_s3})
            else:
                tier_s3, clear_s3 = made_s3
                rows.extend(_bench_tier("s3", tier_s3, None, work, values, repeats, clear_s3))
    return rows


def summarize(rows: list[dict[str, Any]]) -> None:
    print(f"{'tier':<14} {'op':<22} {'ours':>14} {'baseline':<22} {'base':>12} {'ratio':>7}  target")
    for row in rows:
        if row["op"] == "skipped":
            print(f"{row['tier']:<14} skipped: {row['why']}")
            continue
        ours = f"{row['us']:.0f} us" if "us" in row else f"{row['GB/s']:.2f} GB/s"
        base = (f"{row['base_us']:.0f} us" if "base_us" in row else
                f"{row['base']:.2f} GB/s" if "base" in row else "")
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
        target = (f">= {row['target']}x {'met' if row['ratio'] >= row['target'] else 'NOT met'}"
                  if "target" in row else "(scale)")
        print(f"{row['tier']:<14} {row['op']:<22} {ours:>14} {row.get('baseline', ''):<22} {base:>12} {ratio:>7}  "
              f"{target}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()
    print(f"workload: {args.prompts} prompt(s) x {args.tokens} tokens of Llama-3-8B KV "
          f"({args.prompts * args.tokens * TOKEN_BYTES / 2**20:.0f} MiB), {CHUNK}-token chunks")
    summarize(run_cluster(args.prompts, args.tokens, args.repeats, not args.no_s3))
    return 0  # like the other benchmarks: prints each target and whether it is met


if __name__ == "__main__":
    sys.exit(main())
