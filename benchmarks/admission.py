"""Reuse-aware admission (issue 38): bytes written to the lower tiers and hit rate, with
admission against writing every chunk, at the same capacities, in one run.

Two traces, each replayed as a serving engine would (look the prompt up, load what is
cached, store the rest):

* **multi-turn**: the policy benchmark's conversations over Zipf-popular system prompts
  (every turn re-sends the history: much of the KV is reused);
* **skewed**: a trace shaped like production serving traces, where most KV is never asked
  for again: 70% of requests are one-off prompts, the rest share one of a few documents
  (Zipf popularity: a small head reused often).

The hierarchy is a small cpu tier (5% of the trace's distinct KV) above one lower tier: lmdb
or fs capped at 30% of it, or s3 (SeaweedFS on the loopback; S3 has no capacity, so only
the bytes written can differ). Each lower tier runs with ``admission: all`` (the baseline),
``reused(2)`` and, where the tier can name its victims, ``tinylfu``. Reported: MiB written to
the lower tier, the token-weighted hit rate (tokens the lookup found cached / prompt
tokens), and each against the ``all`` row of the same trace and tier.

Run: ``python benchmarks/admission.py`` (``tox -e bench`` runs it with the other suites).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy import CHUNK, CHUNK_BYTES, Trace, distinct_chunks, kv_for, make_trace, zipf_weights  # noqa: E402
from tables import print_table  # noqa: E402

from tierkv.engine import AsyncEngine  # noqa: E402

CPU_FRACTION, LOWER_FRACTION = 0.05, 0.30
COLUMNS = ["trace", "lower", "admission", "distinct_MiB", "written_MiB", "written_vs_all", "hit_rate",
           "hit_points_vs_all", "rejected"]
POLICIES = {"lmdb": ("all", "reused(2)", "tinylfu"), "fs": ("all", "reused(2)", "tinylfu"), "s3": ("all", "reused(2)")}


def make_skewed_trace(num_requests: int = 400, num_documents: int = 12, one_off: float = 0.7,
                      seed: int = 1, zipf_s: float = 1.2) -> Trace:
    """Most requests are prompts nobody sends again; the rest open with one of a few shared
    documents (Zipf: the first few take most of the reuse) and end with their own question."""
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, 30_000, size=6 * CHUNK, dtype=np.int64) for _ in range(num_documents)]
    popularity = zipf_weights(num_documents, zipf_s)
    requests = []
    for _ in range(num_requests):
        question = rng.integers(0, 30_000, size=2 * CHUNK, dtype=np.int64)
        if rng.random() < one_off:
            requests.append(np.concatenate([rng.integers(0, 30_000, size=6 * CHUNK, dtype=np.int64), question]))
        else:
            requests.append(np.concatenate([documents[rng.choice(num_documents, p=popularity)], question]))
    return Trace(requests, distinct_chunks(requests))


@contextlib.contextmanager
def lower_tier(kind: str, capacity: int, root: Path, s3: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """The lower tier's config entry (a fresh directory or bucket prefix per run)."""
    if kind == "s3":
        assert s3 is not None
        yield {"name": "lower", "backend": "s3", **s3, "prefix": f"admission-{uuid.uuid4().hex[:8]}"}
        return
    yield {"name": "lower", "backend": kind, "path": str(root / kind), "capacity": f"{capacity}B"}


async def replay(trace: Trace, lower: dict[str, Any], cpu_bytes: int) -> dict[str, Any]:
    config = {"model": "bench-admission", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_through",
              "tiers": [{"name": "host", "backend": "cpu", "capacity": f"{cpu_bytes}B"}, lower]}
    engine = AsyncEngine(config)
    hit_tokens = total_tokens = 0
    try:
        for tokens in trace.requests:
            cached = await engine.lookup(tokens)
            hit_tokens += cached
            total_tokens += len(tokens)
            if cached:
                await engine.retrieve(tokens, return_tuple=False)
            if len(tokens) > cached:
                mask = torch.zeros(len(tokens), dtype=torch.bool)
                mask[cached:] = True
                await engine.store(tokens, kv_for(len(tokens) - cached), mask=mask, skip_existing=False)
        await engine.flush()
        stats = engine.stats()["tiers"]["lower"]
    finally:
        await engine.close()
    return {"written_MiB": stats["bytes_in"] / 2**20, "hit_rate": hit_tokens / total_tokens,
            "admitted": stats["admitted"], "rejected": stats["rejected"]}


@contextlib.contextmanager
def object_store(wanted: bool) -> Iterator[dict[str, Any] | None]:
    if not wanted:
        yield None
        return
    from tierkv.testing.s3server import S3Server

    with S3Server() as server:
        yield server.new_bucket("tierkv-admission", inline=False)


def run_admission(tiers: tuple[str, ...] = ("lmdb", "fs", "s3")) -> list[dict[str, Any]]:
    """Every (trace, lower tier, admission) point; rows with ratios against ``all``."""
    rows = []
    with object_store("s3" in tiers) as s3:
        for trace_name, trace in (("multi-turn", make_trace()), ("skewed", make_skewed_trace())):
            distinct = trace.unique_chunks * CHUNK_BYTES
            cpu = max(4 * CHUNK_BYTES, int(distinct * CPU_FRACTION))
            for kind in tiers:
                baseline: dict[str, Any] | None = None
                for admission in POLICIES[kind]:
                    with tempfile.TemporaryDirectory(prefix="tierkv-admission-") as tmp:
                        with lower_tier(kind, int(distinct * LOWER_FRACTION), Path(tmp), s3) as lower:
                            result = asyncio.run(replay(trace, {**lower, "admission": admission}, cpu))
                    baseline = baseline or result
                    rows.append({
                        "trace": trace_name, "lower": kind, "admission": admission,
                        "distinct_MiB": round(distinct / 2**20), "written_MiB": round(result["written_MiB"], 1),
                        "written_vs_all": round(result["written_MiB"] / max(baseline["written_MiB"], 1e-9), 3),
                        "hit_rate": round(result["hit_rate"], 4),
                        "hit_points_vs_all": round(100 * (result["hit_rate"] - baseline["hit_rate"]), 2),
                        "rejected": result["rejected"],
                    })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", nargs="+", default=["lmdb", "fs", "s3"], choices=sorted(POLICIES))
    args = parser.parse_args()
    print("admission: MiB written to the lower tier and token hit rate, against admission: all (same run)")
    print_table(run_admission(tuple(args.tiers)), COLUMNS)


if __name__ == "__main__":
    main()
