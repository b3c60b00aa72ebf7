"""What a lookup costs the s3 tier in requests, and what a read stall costs its writes.

A local SeaweedFS behind the project's fault proxy (which counts requests by method and can
hold GETs unanswered). A 4,096-token prompt in 256-token chunks (16 chunks), stored once.

- Requests per lookup: HEADs and GETs the proxy saw for a first and a repeated ``lookup`` of
  the stored prompt, in the process that stored it and in a second engine (another replica,
  which has not seen the chunks), and for a prompt no one stored.
- Writes during a read stall: ``Engine.store`` of new prompts (16 PUTs each) while every GET
  is held and ``--readers`` retrieves wait on them, against the same stores with nothing
  stalled, timed in the same run: the latency ratio and how many stores failed.

    python benchmarks/s3_stalls.py [--stores 6] [--readers 8]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch

from tierkv import Engine
from tierkv.testing.faultproxy import FaultProxy
from tierkv.testing.s3server import S3Server

CHUNK, TOKENS = 256, 4096
SHAPE = (2, 2, TOKENS, 2, 64)  # a small KV per token: the requests are what is measured


def prompt(index: int) -> torch.Tensor:
    return torch.arange(TOKENS) + 100_000 * (index + 1)


def kv(index: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(index))


def config(proxy: FaultProxy, server: S3Server, bucket: str, prefix: str) -> dict[str, Any]:
    return {"model": "s3-stalls", "chunk_size": CHUNK, "cost_aware": False,
            "health": {"failure_threshold": 1000},
            "tiers": [{"name": "shared", "backend": "s3", "bucket": bucket, "prefix": prefix,
                       **{**server.client_options(inline=False), "endpoint_url": proxy.url},
                       "max_concurrency": 4, "timeout_s": 2.0, "failure_threshold": 1000}]}


def counted(proxy: FaultProxy, call: Any) -> dict[str, int]:
    proxy.reset_counts()
    call()
    return {method: proxy.counts[method] for method in ("HEAD", "GET") if proxy.counts[method]}


def lookups(proxy: FaultProxy, cfg: dict[str, Any]) -> list[tuple[str, dict[str, int]]]:
    rows = []
    with Engine(cfg) as writer:
        writer.store(prompt(0), kv(0))
        writer.flush()
        rows.append(("storing process, 1st lookup", counted(proxy, lambda: writer.lookup(prompt(0)))))
        rows.append(("storing process, repeated lookup", counted(proxy, lambda: writer.lookup(prompt(0)))))
    with Engine(cfg) as replica:
        rows.append(("another replica, 1st lookup", counted(proxy, lambda: replica.lookup(prompt(0)))))
        rows.append(("another replica, repeated lookup", counted(proxy, lambda: replica.lookup(prompt(0)))))
        rows.append(("a prompt no one stored", counted(proxy, lambda: replica.lookup(prompt(99)))))
    return rows


def stores_under_stall(proxy: FaultProxy, cfg: dict[str, Any], stores: int, readers: int
                       ) -> tuple[list[float], list[float], int]:
    """Store latencies with nothing stalled, then while every GET is held; failed stores."""
    with Engine(cfg) as engine:
        engine.store(prompt(0), kv(0))
        quiet, stalled, failed = [], [], 0
        for index in range(1, stores + 1):
            started = time.perf_counter()
            engine.store(prompt(index), kv(index))
            quiet.append(time.perf_counter() - started)
        proxy.fault = "stall"
        waiting = [threading.Thread(target=engine.retrieve, args=(prompt(0),)) for _ in range(readers)]
        for thread in waiting:
            thread.start()
        time.sleep(0.3)
        for index in range(stores + 1, 2 * stores + 1):
            started = time.perf_counter()
            try:
                engine.store(prompt(index), kv(index))
            except Exception:  # noqa: BLE001 - a failed store is what is counted
                failed += 1
            stalled.append(time.perf_counter() - started)
        proxy.heal()
        for thread in waiting:
            thread.join(120)
    return quiet, stalled, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stores", type=int, default=6)
    parser.add_argument("--readers", type=int, default=8)
    args = parser.parse_args()
    with S3Server() as server, FaultProxy(server.endpoint_url) as proxy:
        proxy.stall_max_s = 30.0
        bucket = server.new_bucket()["bucket"]
        rows = lookups(proxy, config(proxy, server, bucket, "lookups"))
        print(f"requests per lookup of a {TOKENS}-token prompt ({TOKENS // CHUNK} chunks of {CHUNK}):")
        print("| lookup | requests |\n|---|---|")
        for what, count in rows:
            print(f"| {what} | {', '.join(f'{n} {m}' for m, n in count.items()) or '0'} |")
        quiet, stalled, failed = stores_under_stall(proxy, config(proxy, server, bucket, "stalls"), args.stores,
                                                    args.readers)
        q, s = statistics.median(quiet), statistics.median(stalled)
        print(f"\nstores of {TOKENS // CHUNK} chunks while {args.readers} retrieves wait on held GETs "
              "(max_concurrency 4, timeout_s 2):")
        print("| | median store | max | failed |\n|---|---|---|---|")
        print(f"| nothing stalled | {1000 * q:.0f} ms | {1000 * max(quiet):.0f} ms | 0 |")
        print(f"| reads stalled | {1000 * s:.0f} ms | {1000 * max(stalled):.0f} ms | {failed} of {len(stalled)} |")
        print(f"stalled / quiet: {s / q:.2f}x")


if __name__ == "__main__":
    main()
