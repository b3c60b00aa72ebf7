"""Store cost of long prompts: per chunk, flat from 512 to 4,096 chunks (a store of n chunks is O(n)).

For each prompt length, one ``Engine.store`` of the whole prompt into a cpu tier (chunk 256,
small heads: 2 layers x 2 KV heads x 64, bf16, 128 KiB a chunk, so the per-chunk bookkeeping
shows and not the copy), beside a memcpy of the same bytes into touched memory, timed in
turns in the same run (best of ``repeats`` each). Rows: microseconds per chunk for both and
their ratio; the target row compares the per-chunk cost at the longest prompt with the
shortest (the store that grew 11x for 4x the tokens before it was made linear).

Run: ``python benchmarks/long_prompt.py`` (``benchmarks/prompt.py`` runs it too).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from tierkv import Engine

CHUNK, LAYERS, HEADS, HEAD_SIZE = 256, 2, 2, 64
DTYPE = torch.bfloat16
CHUNK_COUNTS = (512, 1024, 2048, 4096)
FLAT_TARGET = 1.25  # per-chunk cost at the longest prompt / at the shortest


def _store_seconds(chunks: int, kv: torch.Tensor, tokens: torch.Tensor) -> float:
    config = {"model": "bench-long", "chunk_size": CHUNK, "cost_aware": False,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": f"{(kv.nbytes >> 20) * 2 + 64}MiB",
                         "preallocate": True}]}
    with Engine(config) as engine:
        engine.store(tokens[:CHUNK] + 1, kv[:, :, :CHUNK])  # the first store of a process pays its set-up
        start = time.perf_counter()
        engine.store(tokens, kv)
        return time.perf_counter() - start


def _memcpy_seconds(kv: torch.Tensor, out: torch.Tensor) -> float:
    start = time.perf_counter()
    out.copy_(kv)
    return time.perf_counter() - start


def run_long_prompt(repeats: int = 3) -> list[dict[str, Any]]:
    """Rows of store cost per chunk at each prompt length, and the flatness target row."""
    rows: list[dict[str, Any]] = []
    per_chunk: dict[int, float] = {}
    for chunks in CHUNK_COUNTS:
        tokens = torch.arange(chunks * CHUNK) % 32_000
        kv = torch.randn(LAYERS, 2, chunks * CHUNK, HEADS, HEAD_SIZE).to(DTYPE)
        out = torch.empty_like(kv)
        out.zero_()  # touched once: the baseline copies into memory that is already there
        ours, memcpy = [], []
        for _ in range(repeats):
            ours.append(_store_seconds(chunks, kv, tokens))
            memcpy.append(_memcpy_seconds(kv, out))
        best, floor = min(ours), min(memcpy)
        per_chunk[chunks] = best / chunks
        rows.append({"tier": "cpu", "op": f"store {chunks} chunks", "pass": "best", "ours_us": best / chunks * 1e6,
                     "baseline": "memcpy", "baseline_us": floor / chunks * 1e6, "ratio": floor / best})
    growth = per_chunk[CHUNK_COUNTS[-1]] / per_chunk[CHUNK_COUNTS[0]]
    rows.append({"tier": "cpu", "op": f"store per chunk, {CHUNK_COUNTS[-1]} vs {CHUNK_COUNTS[0]} chunks",
                 "pass": "best", "ratio": growth, "baseline": "the shortest prompt",
                 "target": f"<= {FLAT_TARGET:.2f}x", "meets": growth <= FLAT_TARGET})
    return rows


def main() -> int:
    for row in run_long_prompt():
        if "ours_us" in row:
            print(f"{row['op']:>20}: {row['ours_us']:7.1f} us/chunk (memcpy {row['baseline_us']:.1f} us/chunk, "
                  f"{row['ratio']:.2f}x memcpy)")
        else:
            print(f"{'met ' if row['meets'] else 'SHORT'} {row['op']}: {row['ratio']:.2f}x, target {row['target']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
