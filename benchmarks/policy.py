"""Tier-policy benchmarks (issue 3): trace replay, policy overhead, memory pressure.

* **Trace replay.** Multi-turn conversations over shared system prompts, with Zipf
  popularity, replayed against a cpu+lmdb hierarchy at several host capacities, for each
  write policy and eviction policy. Each request does what a serving engine does: look up
  the cached prefix, retrieve it, store the KV of the rest. Reported: token hit rate per
  tier, bytes moved between tiers, retrieve latency p50/p99.
* **Policy overhead.** Bookkeeping only (index add/touch/victims/remove for 512-chunk
  batches, no data), in microseconds per chunk; target <= 20 us. Beside it, the whole
  engine path (tier lookups, health, metrics, fill queue) with 64-byte chunks, so the
  data movement is negligible and what is left is the engine's own cost.
* **Pressure.** A gpu-kind tier (``device: cpu`` where there is no GPU) full of chunks;
  a probe that models the device (the serving engine's usage plus the tier's own) jumps
  past the high watermark. Reported: time until the device is back under the low
  watermark and the bytes demoted to the host tier.

Run: ``python benchmarks/policy.py`` (or as part of ``python benchmarks/run.py``).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tierkv.chunks.keys import CacheKey  # noqa: E402
from tierkv.engine import AsyncEngine  # noqa: E402
from tierkv.policy.pressure import MemoryReading  # noqa: E402
from tierkv.policy.residency import make_index  # noqa: E402

CHUNK = 64
LAYERS, HEADS, HEAD_DIM = 4, 4, 64
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HEAD_DIM * 2  # bf16: 256 KiB


# -- trace ------------------------------------------------------------------------------------
@dataclass
class Trace:
    """Requests as token arrays: each is a conversation's history so far plus a new turn."""

    requests: list[np.ndarray]
    unique_chunks: int


def zipf_weights(count: int, s: float) -> np.ndarray:
    """Probabilities of ``count`` items by Zipf popularity of exponent ``s`` (rank 1 first)."""
    ranks = np.arange(1, count + 1, dtype=np.float64)
    return ranks ** -s / (ranks ** -s).sum()


def distinct_chunks(requests: list[np.ndarray]) -> int:
    """Distinct chunk prefixes among ``requests``: the KV a cache of all of them holds."""
    return len({tuple(r[: (i + 1) * CHUNK]) for r in requests for i in range(len(r) // CHUNK)})


def make_trace(num_systems: int = 16, num_conversations: int = 48, turns: int = 4, seed: int = 0,
               zipf_s: float = 1.1) -> Trace:
    """Conversations pick a system prompt by Zipf popularity and are interleaved at random
    (requests of popular conversations arrive more often, as in a chat service)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 30_000, size=4 * CHUNK, dtype=np.int64) for _ in range(num_systems)]
    popularity = zipf_weights(num_systems, zipf_s)
    histories = []
    for _ in range(num_conversations):
        system = systems[rng.choice(num_systems, p=popularity)]
        turns_tokens = [rng.integers(0, 30_000, size=2 * CHUNK, dtype=np.int64) for _ in range(turns)]
        histories.append([np.concatenate([system, *turns_tokens[: t + 1]]) for t in range(turns)])
    order = [c for c in range(num_conversations) for _ in range(turns)]
    rng.shuffle(order)
    position = [0] * num_conversations
    requests = []
    for conversation in order:
        requests.append(histories[conversation][position[conversation]])
        position[conversation] += 1
    return Trace(requests, distinct_chunks(requests))


def kv_for(num_tokens: int) -> torch.Tensor:
    return torch.ones(LAYERS, 2, num_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)


async def replay(trace: Trace, write_policy: str, eviction: str, host_bytes: int, root: Path) -> dict[str, Any]:
    config = {"model": "bench-policy", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": write_policy,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": f"{host_bytes}B", "eviction": eviction},
                        {"name": "disk", "backend": "lmdb", "path": str(root / "db"), "capacity": "4GiB"}]}
    engine = AsyncEngine(config)
    tier_tokens = {"host": 0, "disk": 0}
    total_tokens = 0
    latencies = []
    stored_bytes = 0
    try:
        for tokens in trace.requests:
            cached = await engine.lookup(tokens)
            for tier, chunks in engine.stats()["last_lookup"]["chunks_per_tier"].items():
                tier_tokens[tier] += chunks * CHUNK
            total_tokens += len(tokens)
            if cached:
                started = time.perf_counter()
                _, mask = await engine.retrieve(tokens, return_tuple=False)
                latencies.append(time.perf_counter() - started)
            new = len(tokens) - cached
            if new:
                mask = torch.zeros(len(tokens), dtype=torch.bool)
                mask[cached:] = True
                stored_bytes += new * CHUNK_BYTES // CHUNK
                await engine.store(tokens, kv_for(new), mask=mask, skip_existing=False)
        await engine.flush()
        stats = engine.stats()
    finally:
        await engine.close()
    moved = sum(t["bytes_in"] for t in stats["tiers"].values()) - stored_bytes
    lat = np.array(latencies) * 1e3 if latencies else np.array([float("nan")])
    return {
        "write_policy": write_policy, "eviction": eviction, "host_MiB": host_bytes >> 20,
        "working_set_MiB": trace.unique_chunks * CHUNK_BYTES >> 20,
        "hit_rate_host": tier_tokens["host"] / total_tokens, "hit_rate_disk": tier_tokens["disk"] / total_tokens,
        "hit_rate": (tier_tokens["host"] + tier_tokens["disk"]) / total_tokens,
        "moved_MiB": round(moved / 2**20, 1),
        "evictions": stats["tiers"]["host"]["evictions"], "demotions": stats["tiers"]["host"]["demotions"],
        "promotions": stats["tiers"]["host"]["promotions"],
        "retrieve_p50_ms": float(np.percentile(lat, 50)), "retrieve_p99_ms": float(np.percentile(lat, 99)),
    }


def bench_trace(capacity_fractions: tuple[float, ...] = (0.1, 0.3)) -> list[dict[str, Any]]:
    trace = make_trace()
    working_set = trace.unique_chunks * CHUNK_BYTES
    rows = []
    for fraction in capacity_fractions:
        host = max(CHUNK_BYTES * 4, int(working_set * fraction))
        for write_policy in ("write_through", "write_back"):
            for eviction in ("lru", "s3fifo"):
                with tempfile.TemporaryDirectory(prefix="tierkv-bench-") as tmp:
                    rows.append(asyncio.run(replay(trace, write_policy, eviction, host, Path(tmp))))
    return rows


# -- overhead ---------------------------------------------------------------------------------
def bench_policy_overhead(batch: int = 512, rounds: int = 20) -> list[dict[str, Any]]:
    """Microseconds per chunk of index bookkeeping: admit a batch (evicting to make room),
    then touch it as a read would, as a capacity-bound tier does per batched put and get."""
    rows = []
    keys = [CacheKey("vllm", "m", 1, 0, f"{i:032x}") for i in range(batch * (rounds + 1))]
    for eviction in ("lru", "s3fifo"):
        index = make_index(eviction)
        capacity = batch * 2 * CHUNK_BYTES  # holds two batches: every round evicts one
        started = time.perf_counter()
        for r in range(rounds):
            batch_keys = keys[r * batch:(r + 1) * batch]
            victims = index.victims(batch * CHUNK_BYTES, capacity, protect=())
            for victim in victims or ():
                index.remove(victim)
            for key in batch_keys:
                index.add(key, CHUNK_BYTES)
            for key in batch_keys:  # the read that follows
                index.pin(key)
                index.touch(key)
                index.unpin(key)
        per_chunk_us = (time.perf_counter() - started) / (rounds * batch) * 1e6
        rows.append({"suite": "policy", "what": f"bookkeeping {eviction}", "batch": batch,
                     "us_per_chunk": round(per_chunk_us, 2), "target_us": 20.0, "meets": per_chunk_us <= 20.0})
    rows.append(asyncio.run(_engine_overhead(batch)))
    return rows


async def _engine_overhead(batch: int, rounds: int = 10) -> dict[str, Any]:
    """The engine's put+get path for tiny chunks: its cost per chunk with no data to move."""
    config = {"model": "bench-overhead", "chunk_size": 1, "kv_format": "vllm",
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "256MiB"}]}
    engine = AsyncEngine(config)
    chunk = torch.zeros(1, 2, 1, 1, 16, dtype=torch.bfloat16)  # 64 bytes
    try:
        started = time.perf_counter()
        for r in range(rounds):
            keys = [CacheKey("vllm", "bench-overhead", 1, 0, f"{r:08x}{i:024x}") for i in range(batch)]
            await engine.batched_put(keys, [chunk] * batch)
            await engine.batched_get(keys)
        per_chunk_us = (time.perf_counter() - started) / (rounds * batch * 2) * 1e6
    finally:
        await engine.close()
    return {"suite": "policy", "what": "engine put+get path, 64 B chunks (per op)", "batch": batch,
            "us_per_chunk": round(per_chunk_us, 2), "target_us": None, "meets": None}


# -- pressure ---------------------------------------------------------------------------------
class DeviceModel:
    """A device whose usage is the serving engine's allocation plus the tier's own pool."""

    name = "device-model"

    def __init__(self, total: int, serving: int) -> None:
        self.total = total
        self.serving = serving
        self.tier: Any = None

    def read(self) -> MemoryReading:
        used = self.serving + (self.tier.used_bytes if self.tier is not None else 0)
        return MemoryReading(used, self.total, time.monotonic())


async def pressure_scenario(tier_bytes: int = 256 << 20, root: Path | None = None) -> dict[str, Any]:
    total = 4 * tier_bytes
    high, low = 0.92, 0.85
    device = DeviceModel(total, serving=total // 4)
    config = {"model": "bench-pressure", "chunk_size": 256, "kv_format": "vllm", "write_policy": "write_back",
              "pressure": {"poll_interval_ms": 5, "gpu_high_watermark": high, "gpu_low_watermark": low},
              "tiers": [{"name": "gpu", "backend": "gpu", "device": "cuda:0" if torch.cuda.is_available() else "cpu",
                         "capacity": f"{tier_bytes}B"},
                        {"name": "host", "backend": "cpu", "capacity": f"{2 * tier_bytes}B"}]}
    engine = AsyncEngine(config, probes={"gpu": device})
    device.tier = engine.tiers[0]
    chunk = torch.ones(8, 2, 256, 8, 128, dtype=torch.bfloat16)  # 8 MiB
    try:
        count = tier_bytes // (chunk.numel() * 2)
        keys = [CacheKey("vllm", "bench-pressure", 1, 0, f"{i:032x}") for i in range(count)]
        for start in range(0, count, 8):
            await engine.batched_put(keys[start:start + 8], [chunk] * len(keys[start:start + 8]))
        filled = engine.tiers[0].used_bytes
        # the serving engine allocates: the device goes to 97% in use
        device.serving = int(0.97 * total) - filled
        started = time.perf_counter()
        while device.read().used_fraction > low:
            await asyncio.sleep(0.001)
        relief_s = time.perf_counter() - started
        stats = engine.stats()["tiers"]["gpu"]
    finally:
        await engine.close()
    return {"suite": "pressure", "what": "used 97% -> under low watermark 85%", "tier_MiB": tier_bytes >> 20,
            "time_to_low_ms": round(relief_s * 1e3, 1), "demoted_MiB": round(stats["pressure"]["freed_bytes"] / 2**20, 1),
            "demoted_chunks": stats["demotions"], "poll_interval_ms": 5,
            "demote_GBps": round(stats["pressure"]["freed_bytes"] / relief_s / 1e9, 2)}


def run_policy() -> list[dict[str, Any]]:
    """All three suites; rows for the benchmark table and JSON."""
    rows = [{"suite": "trace", **r} for r in bench_trace()]
    rows += bench_policy_overhead()
    rows.append(asyncio.run(pressure_scenario()))
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for suite in dict.fromkeys(r["suite"] for r in rows):
        group = [r for r in rows if r["suite"] == suite]
        columns = list(dict.fromkeys(k for r in group for k in r if k != "suite"))

        def cell(value: Any) -> str:
            return f"{value:.3f}" if isinstance(value, float) else ("" if value is None else str(value))

        table = [[cell(r.get(c)) for c in columns] for r in group]
        widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(columns)]
        print(f"\n[{suite}]")
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for t in table:
            print("  ".join(v.ljust(w) for v, w in zip(t, widths)))


if __name__ == "__main__":
    print_rows(run_policy())
