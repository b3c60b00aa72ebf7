"""Prompt-level benchmark: whole prompts through what a user calls, against same-run baselines.

Workload: the Llama-3-8B KV shape (32 layers x 8 KV heads x 128, bfloat16, 128 KiB per token),
256-token chunks, prompts of 4,096 tokens (512 MiB of KV each), one tier at a time, every pass
on an empty cache. The reference workload is 16 prompts (8.6 GB); the default here is 4 (2.1 GB)
so that source KV, outputs, baselines and the tier fit 24 GiB next to other work.

Over 400 lines (about 500) by choice: each row's baseline (memcpy, raw files, every raw
py-lmdb configuration) is timed beside it in this one file, so what is compared is visible together.

Per tier (cpu; lmdb as configured by default; ``lmdb-trusted``: lmdb with ``writemap: true`` and
``verify: false``, for a trusted local disk; fs), for the first pass after start-up and for the median of the passes
after it (steady state):

- ``store`` (+flush) of every prompt with ``Engine.store``;
- ``retrieve`` without ``out`` (the output allocated by tierkv) and ``retrieve(out=...)`` into
  memory the caller allocated and touched once (fs: both also from a cold page cache, and the
  cold ``retrieve(out=...)``, one copy per byte, must be at least as fast as the cold fresh one);
- ``lookup`` from the blocking Engine of 4,096-token prompts, each asked once: fully cached
  (hit) and new (miss) ones, and hits under a request identity (a tenant's salt and a LoRA
  adapter; an image in the prompt), beside the bare SHA-256 chain over the same chunks
  (``sha256 chain``: the floor of any content-addressed lookup; a miss hashes one chunk);
- bytes copied per byte delivered, from ``Engine.stats()["copies"]``;
- long prompts (``long_prompt.py``): one store of 512 to 4,096 chunks, microseconds per chunk
  beside a memcpy of the same bytes, and the per-chunk cost at 4,096 chunks over that at 512.

Baselines, interleaved with our passes so noise hits both (who goes first alternates from pass to
pass; a steady ratio is the median of each pass's own ratio, and ``ratio_range`` shows their spread):

- ``memcpy``: ``dst.copy_(kv)`` of each prompt's KV into memory allocated and touched once;
- ``empty+copy``: ``torch.empty`` + ``copy_`` of the same size (what a fresh output costs);
- ``raw files`` (fs): one file per chunk, ``writev`` of the chunk's bytes straight from the KV
  (``raw files (tmp+rename)``: the same, each file renamed into place as the tier does);
  read back with ``preadv`` into touched memory after the page cache of the files is dropped
  (``fdatasync`` + ``POSIX_FADV_DONTNEED``, applied to tierkv's files alike: "cold");
- ``raw lmdb``: py-lmdb puts of the same chunk bytes (one write transaction per prompt) and
  ``txn.get`` + copy into touched memory (``raw lmdb + XXH3``, for the lmdb tier, which checks
  each chunk as it reads it: the same read, each value's XXH3 checked against the digest of what
  was stored before it is copied -- what a straightforward verifying reader costs); the lmdb
  tiers' store is also timed against raw puts with and without ``writemap``, ``sync`` /
  ``metasync``, ``map_async``, a transaction per chunk, and raw files (``RAW_LMDB_PUTS``). Its target is the configuration that keeps the
  guarantees tierkv relies on (no writemap, no fsync per commit: a crashed process keeps every
  committed batch, a full disk is an error); ``lmdb-trusted`` (writemap) is held to raw
  writemap puts. Without writemap LMDB copies each value twice (into dirty pages it
  allocates per transaction, then into the page cache at commit), so it cannot reach the fs
  tier's one-copy ``writev``; the rows show by how much;
- ``paged kernels``: the bare ``ops.paged_gather`` + ``ops.paged_scatter`` of the same tokens,
  the floor of the ``PagedConnector`` round trip (a CPU paged cache -> cpu tier -> another
  paged cache with a different slot mapping).

Run: ``python benchmarks/prompt.py [--prompts N] [--passes N] [--tiers cpu,lmdb,fs]``; from code:
``run_prompt(...) -> list[dict]``.

Over 400 lines (about 600) by choice: the prompt-level benchmark and its same-run baselines
(raw files, raw py-lmdb, memcpy), which copy exactly the byte layout tierkv's tiers use and
serve no other benchmark; the shared table helpers are imported.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import torch
import xxhash

from tierkv import Engine, MediaSpan, RequestIdentity, ops
from tierkv.chunks.identity import PLAIN
from tierkv.connectors import PagedConnector, retrieve_paged, store_paged

LAYERS, HEADS, HEAD_SIZE, CHUNK, BLOCK_SIZE = 32, 8, 128, 256, 16
DTYPE = torch.bfloat16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_SIZE * DTYPE.itemsize
REFERENCE_PROMPTS = 16
LOOKUP_CALLS = 200

# (op, baseline, target ratio) per tier; a target on GB/s is checked apart (FS_FLOORS)
TARGETS: dict[str, list[tuple[str, str, float]]] = {
    "cpu": [("store", "memcpy", 0.85), ("retrieve out=", "memcpy", 0.85), ("retrieve", "empty+copy", 0.85),
            ("connector round trip", "paged kernels", 0.7)],
    "fs": [("store", "raw files", 0.9), ("retrieve out= (cold)", "raw files (cold)", 0.9),
           ("retrieve out= (cold)", "retrieve (cold)", 1.0)],
    "lmdb": [("store", "raw lmdb put", 0.9), ("retrieve out=", "raw lmdb", 0.9)],
    "lmdb-trusted": [("store", "raw lmdb put (writemap)", 0.9), ("retrieve out=", "raw lmdb", 0.9)],
}
FS_FLOORS = {"store": 2.3, "retrieve out= (cold)": 2.0}  # GB/s on the reference workload's disk
LOOKUP_TARGET_US = 50.0


def _timed_write(fn: Callable[[], Any]) -> float:
    """A write timed from a quiet disk: what earlier writes left dirty is flushed first (not
    timed), so each store pays for its own writeback throttling, not for the one before it."""
    os.sync()
    return _timed(fn)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _random_kv(num_tokens: int) -> torch.Tensor:
    """A vllm-layout KV blob of random bits (every page touched)."""
    kv = torch.empty(LAYERS, 2, num_tokens, HEADS, HEAD_SIZE, dtype=DTYPE)
    kv.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return kv


def _touched(shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(shape, dtype=DTYPE)
    out.view(torch.int16).fill_(0)
    return out


def _drop_page_cache(root: Path) -> None:
    """Write back and drop the page cache of every file under ``root`` ("cold" reads)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDWR)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _byte_runs(chunk: torch.Tensor) -> list[memoryview]:
    """The chunk's bytes straight out of the prompt's KV: one run per (layer, K/V) slice,
    each contiguous in a vllm-layout blob."""
    return [chunk[layer, kv].view(torch.uint8).numpy().reshape(-1).data
            for layer in range(chunk.shape[0]) for kv in range(2)]


class RawFiles:
    """The raw-files baseline: one file per chunk, writev out of the KV, preadv into ``out``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def store(self, prompt: int, kv: torch.Tensor, publish: bool = False) -> None:
        """``publish``: write each file under a temporary name and rename it into place, as
        the fs tier does so that no reader sees a half-written chunk (the bare baseline lacks that)."""
        for index, start in enumerate(range(0, kv.shape[2], CHUNK)):
            runs = _byte_runs(kv.narrow(2, start, min(CHUNK, kv.shape[2] - start)))
            final = self.root / f"{prompt}-{index}"
            path = final.with_name(f".{final.name}.tmp") if publish else final
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, runs)
            finally:
                os.close(fd)
            if publish:
                os.replace(path, final)

    def read(self, prompt: int, out: torch.Tensor) -> None:
        for index, start in enumerate(range(0, out.shape[2], CHUNK)):
            runs = _byte_runs(out.narrow(2, start, min(CHUNK, out.shape[2] - start)))
            fd = os.open(self.root / f"{prompt}-{index}", os.O_RDONLY)
            try:
                os.preadv(fd, runs, 0)
            finally:
                os.close(fd)

    def clear(self) -> None:
        for path in self.root.iterdir():
            path.unlink()


RAW_LMDB_PUTS: dict[str, dict[str, Any]] = {
    # name -> (py-lmdb open flags); "raw lmdb put" is the configuration that keeps LMDB's crash
    # guarantees as tierkv uses them (a crashed process leaves the last committed batches
    # intact; a full disk is an error): no writemap, no fsync per commit -- tierkv's default
    "raw lmdb put": {"sync": False, "metasync": False, "writemap": False},
    # + power loss loses at most the last commits, never the environment (ACI kept)
    "raw lmdb put (sync, nometasync)": {"sync": True, "metasync": False, "writemap": False},
    # + durable on power loss
    "raw lmdb put (sync)": {"sync": True, "metasync": True, "writemap": False},
    # values written straight into the shared map: one copy, but the map file is sparse (a
    # full disk is a SIGBUS, not an error) and a stray write in the process reaches the data
    "raw lmdb put (writemap)": {"sync": False, "metasync": False, "writemap": True},
    "raw lmdb put (writemap, map_async)": {"sync": True, "metasync": True, "writemap": True, "map_async": True},
}
"""Raw py-lmdb put configurations timed next to the lmdb tiers' store (one transaction per prompt,
i.e. per batch; ``raw lmdb put (txn per chunk)`` is the first one committing every chunk)."""
RAW_LMDB_BASELINE = {"lmdb": "raw lmdb put", "lmdb-trusted": "raw lmdb put (writemap)"}


class RawLMDB:
    """The raw py-lmdb baseline: one write transaction per prompt (or per chunk); reads copy into ``out``."""

    def __init__(self, root: Path, map_size: int, **flags: Any) -> None:
        self.env = lmdb.open(str(root), map_size=map_size, **flags)

    def store(self, prompt: int, kv: torch.Tensor, txn_per_chunk: bool = False) -> None:
        starts = list(range(0, kv.shape[2], CHUNK))
        batches = [[s] for s in starts] if txn_per_chunk else [starts]
        for batch in batches:
            with self.env.begin(write=True) as txn:
                for start in batch:
                    chunk = kv.narrow(2, start, min(CHUNK, kv.shape[2] - start)).contiguous()
                    txn.put(f"{prompt}-{start // CHUNK}".encode(), chunk.view(torch.uint8).numpy().data)

    def read(self, prompt: int, out: torch.Tensor, digests: list[int] | None = None) -> None:
        """Copy the prompt's chunks into ``out``; with ``digests`` (one XXH3 per chunk), each
        value is checked against its digest before it is copied."""
        with self.env.begin(buffers=True) as txn:
            for index, start in enumerate(range(0, out.shape[2], CHUNK)):
                target = out.narrow(2, start, min(CHUNK, out.shape[2] - start))
                value = txn.get(f"{prompt}-{index}".encode())
                if digests is not None and xxhash.xxh3_64_intdigest(value) != digests[index]:
                    raise RuntimeError(f"raw lmdb: chunk {index} of prompt {prompt} does not match its digest")
                flat = torch.frombuffer(value, dtype=DTYPE).view(target.shape)
                target.view(torch.int16).copy_(flat.view(torch.int16))

    def clear(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.drop(self.env.open_db(), delete=False)

    def close(self) -> None:
        self.env.close()


def _chunk_digests(kv: torch.Tensor) -> list[int]:
    """The XXH3 of each chunk's bytes as stored (the ``raw lmdb + XXH3`` reader checks them)."""
    return [xxhash.xxh3_64_intdigest(kv.narrow(2, start, min(CHUNK, kv.shape[2] - start)).contiguous()
                                     .view(torch.uint8).numpy().data)
            for start in range(0, kv.shape[2], CHUNK)]


def _config(tier: str, root: Path, pass_bytes: int) -> dict[str, Any]:
    capacity = f"{int(pass_bytes * 1.25) // 2**20}MiB"
    tiers = {"cpu": {"name": "host", "backend": "cpu", "capacity": capacity},
             "lmdb": {"name": "disk", "backend": "lmdb", "path": str(root / "lmdb"), "capacity": "64GiB"},
             "lmdb-trusted": {"name": "disk", "backend": "lmdb", "path": str(root / "lmdb-trusted"),
                              "capacity": "64GiB", "writemap": True, "verify": False},
             "fs": {"name": "files", "backend": "fs", "path": str(root / "fs"), "capacity": "64GiB"}}
    return {"model": "bench-prompt", "chunk_size": CHUNK, "kv_format": "vllm", "tiers": [tiers[tier]]}


def _copies(engine: Engine) -> dict[str, tuple[int, int]]:
    return {path: (int(v["copied_bytes"]), int(v["delivered_bytes"])) for path, v in engine.stats()["copies"].items()}


def _per_byte(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], path: str) -> float | None:
    copied = after[path][0] - before[path][0]
    delivered = after[path][1] - before[path][1]
    return copied / delivered if delivered else None


def _hash_chain(tokens: torch.Tensor) -> list[bytes]:
    """The lookups' floor: the SHA-256 chain over the prompt's 256-token chunks (int32 ids),
    which any content-addressed prefix cache computes, in a bare loop."""
    data = tokens.to(torch.int32).numpy().tobytes()
    step, previous, digests = CHUNK * 4, b"", []
    for start in range(0, len(data), step):
        previous = hashlib.sha256(previous + data[start : start + step]).digest()
        digests.append(previous)
    return digests


def _lookup_us(tier: str, root: Path, prompt_tokens: int) -> dict[str, tuple[float, float]]:
    """Median microseconds of one blocking ``Engine.lookup`` of a 4,096-token prompt, each
    prompt asked once (a scheduler sees each request once): ``hit`` = fully cached prompts,
    ``miss`` = new prompts; ``hit, tenant+adapter`` and ``hit, one image`` = the cached
    prompts stored and looked up under a request identity (a salt and a LoRA adapter; a media
    input over tokens 1,024-1,599): what binding the identity adds to a lookup is their
    difference from ``hit``. Beside each, the bare hash chain of the same prompts (a miss
    hashes the first chunk only), timed in turns with the lookups. The KV stored is tiny:
    what a lookup costs does not depend on it."""
    config = _config(tier, root / "lookup", 2**30)
    cached = [torch.randint(0, 32_000, (prompt_tokens,)) for _ in range(LOOKUP_CALLS)]
    new = [torch.randint(0, 32_000, (prompt_tokens,)) for _ in range(LOOKUP_CALLS)]
    kv = torch.zeros(1, 2, prompt_tokens, 1, 8, dtype=DTYPE)
    tenant = RequestIdentity(adapter="adapter:" + "ab" * 16, salt="tenant-a")
    image = RequestIdentity(media=(MediaSpan("image:" + "cd" * 16, min(1024, prompt_tokens - 1), 576),))
    kinds = (("hit", cached, PLAIN), ("miss", new, PLAIN), ("hit, tenant+adapter", cached, tenant),
             ("hit, one image", cached, image))
    result = {}
    with Engine(config) as engine:
        for identity in (PLAIN, tenant, image):
            for tokens in cached:
                engine.store(tokens, kv, identity=identity)
        engine.flush()
        for kind, prompts, identity in kinds:
            samples, floor = [], []
            for tokens in prompts:
                start = time.perf_counter()
                engine.lookup(tokens, identity=identity)
                samples.append(time.perf_counter() - start)
                start = time.perf_counter()
                _hash_chain(tokens if kind == "hit" else tokens[:CHUNK])
                floor.append(time.perf_counter() - start)
            result[kind] = (statistics.median(samples) * 1e6, statistics.median(floor) * 1e6)
        if (engine.lookup(cached[0]) != prompt_tokens or engine.lookup(new[0]) != 0
                or engine.lookup(cached[0], identity=tenant) != prompt_tokens
                or engine.lookup(cached[0], identity=image) != prompt_tokens):
            raise RuntimeError("lookup benchmark: the cached prompt must hit and the new one miss")
    return result


def _bench_tier(tier: str, prompts: list[tuple[torch.Tensor, torch.Tensor]], outs: list[torch.Tensor],
                passes: int, root: Path) -> list[dict[str, Any]]:
    pass_bytes = sum(kv.numel() * kv.element_size() for _, kv in prompts)
    memcpy_dst = outs  # the baseline copies into the same touched memory retrieve(out=) fills
    lmdb_tier = tier.startswith("lmdb")
    raw_files = RawFiles(root / "raw-files") if tier == "fs" or lmdb_tier else None  # lmdb: how fast files are
    raw_lmdbs: dict[str, RawLMDB] = {}
    if lmdb_tier:
        for number, (name, flags) in enumerate(RAW_LMDB_PUTS.items()):
            (root / f"raw-lmdb-{number}").mkdir()
            raw_lmdbs[name] = RawLMDB(root / f"raw-lmdb-{number}", 4 * pass_bytes, **flags)
    raw_lmdb = raw_lmdbs.get(RAW_LMDB_BASELINE.get(tier, ""))
    digests = [_chunk_digests(kv) for _, kv in prompts] if tier == "lmdb" else None
    if raw_files is not None:
        raw_files.root.mkdir()
    started = time.perf_counter()
    engine = Engine(_config(tier, root, pass_bytes))
    startup_s = time.perf_counter() - started
    samples: dict[tuple[str, str], list[float]] = {}
    per_byte: dict[str, list[float]] = {}

    def record(op: str, phase: str, seconds: float) -> None:
        samples.setdefault((op, phase), []).append(seconds)

    def retrieve(op: str, phase: str, into_outs: bool) -> None:
        """Time one retrieve of every prompt (into ``outs`` or fresh), from a cold page cache for a "(cold)" op."""
        if op.endswith("(cold)"):
            _drop_page_cache(root / tier)
        record(op, phase, _timed(lambda: [engine.retrieve(t, out=o if into_outs else None)
                                          for (t, _), o in zip(prompts, outs)]))

    def ours_pass(phase: str, number: int) -> None:
        before = _copies(engine)
        record("store", phase, _timed_write(lambda: ([engine.store(t, kv) for t, kv in prompts], engine.flush())))
        per_byte.setdefault("store", []).append(_per_byte(before, _copies(engine), "store") or 0.0)
        # fs: the fresh output from a cold page cache too (what retrieve(out=) must match); the
        # two cold reads take turns going first
        fresh_cold_first = tier == "fs" and number % 2 == 1
        if fresh_cold_first:
            retrieve("retrieve (cold)", phase, into_outs=False)
        before_out = _copies(engine)
        retrieve("retrieve out= (cold)" if tier == "fs" else "retrieve out=", phase, into_outs=True)
        after_out = _copies(engine)
        if tier == "fs" and not fresh_cold_first:
            retrieve("retrieve (cold)", phase, into_outs=False)
        retrieve("retrieve", phase, into_outs=False)
        per_byte.setdefault("retrieve out=", []).append(_per_byte(before_out, after_out, "retrieve") or 0.0)
        per_byte.setdefault("retrieve", []).append(_per_byte(after_out, _copies(engine), "retrieve") or 0.0)
        for tokens, _ in prompts:  # the next pass starts on an empty cache
            engine.batched_delete(engine.keys_for(tokens))

    def baselines_pass(phase: str) -> None:
        record("memcpy", phase, _timed(lambda: [d.copy_(kv) for (_, kv), d in zip(prompts, memcpy_dst)]))
        record("empty+copy", phase,
               _timed(lambda: [torch.empty_like(kv).copy_(kv) for _, kv in prompts]))
        if raw_files is not None:
            record("raw files", phase,
                   _timed_write(lambda: [raw_files.store(i, kv) for i, (_, kv) in enumerate(prompts)]))
            if tier == "fs":
                _drop_page_cache(raw_files.root)
                record("raw files (cold)", phase,
                       _timed(lambda: [raw_files.read(i, o) for i, o in enumerate(outs)]))
            raw_files.clear()
            if tier == "fs":  # with the tier's atomic publish: what crash safety costs the bare files
                record("raw files (tmp+rename)", phase, _timed_write(
                    lambda: [raw_files.store(i, kv, publish=True) for i, (_, kv) in enumerate(prompts)]))
                raw_files.clear()
        for name, raw in raw_lmdbs.items():
            record(name, phase, _timed_write(lambda raw=raw: [raw.store(i, kv) for i, (_, kv) in enumerate(prompts)]))
            if raw is raw_lmdb:
                record("raw lmdb", phase, _timed(lambda: [raw_lmdb.read(i, o) for i, o in enumerate(outs)]))
                if digests is not None:
                    record("raw lmdb + XXH3", phase,
                           _timed(lambda: [raw_lmdb.read(i, o, digests[i]) for i, o in enumerate(outs)]))
            raw.clear()
            if name == "raw lmdb put":
                record("raw lmdb put (txn per chunk)", phase,
                       _timed_write(lambda raw=raw: [raw.store(i, kv, txn_per_chunk=True) for i, (_, kv) in enumerate(prompts)]))
                raw.clear()

    try:
        for number in range(passes + 1):
            phase = "first" if number == 0 else "steady"
            # who goes first alternates: the disk's writeback and the page cache's state after
            # one side's run then hit each side alike
            ours_first = number % 2 == 0
            if ours_first:
                ours_pass(phase, number)
            baselines_pass(phase)
            if not ours_first:
                ours_pass(phase, number)
        rows = _rows(tier, samples, per_byte, pass_bytes, startup_s)
        if tier != "lmdb-trusted":  # the same index as lmdb
            rows += _lookup_rows(tier, _lookup_us(tier, root, prompts[0][0].numel()))
        if tier == "cpu":
            rows += _connector_rows(engine, prompts[0][0], passes)
    finally:
        engine.close()
        for raw in raw_lmdbs.values():
            raw.close()
    return rows


def _rows(tier: str, samples: dict[tuple[str, str], list[float]], per_byte: dict[str, list[float]],
          pass_bytes: int, startup_s: float) -> list[dict[str, Any]]:
    rows = []
    lmdb = tier.startswith("lmdb")
    baselines_of = {"store": ["raw files", "raw files (tmp+rename)"] if tier == "fs" else
                    [RAW_LMDB_BASELINE[tier], *RAW_LMDB_PUTS, "raw lmdb put (txn per chunk)", "raw files"] if lmdb
                    else ["memcpy"],
                    "retrieve out=": ["raw lmdb", "raw lmdb + XXH3"] if tier == "lmdb" else
                                     ["raw lmdb"] if lmdb else ["memcpy"],
                    "retrieve out= (cold)": ["raw files (cold)", "retrieve (cold)"],
                    "retrieve (cold)": ["raw files (cold)"], "retrieve": ["empty+copy"]}
    targets = {(op, base): target for op, base, target in TARGETS.get(tier, [])}
    for (op, phase), times in samples.items():
        if op not in baselines_of:
            continue
        for baseline in dict.fromkeys([*baselines_of[op], "memcpy"]):
            ours = statistics.median(times)
            base = statistics.median(samples[(baseline, phase)])
            # each pass's pair, then their median: the disk's drift between passes cancels
            pass_ratios = [b / o for o, b in zip(times, samples[(baseline, phase)])]
            ratio = statistics.median(pass_ratios)
            target = targets.get((op, baseline))
            row: dict[str, Any] = {
                "tier": tier, "op": op, "pass": phase, "ours_GBps": pass_bytes / ours / 1e9,
                "baseline": baseline, "baseline_GBps": pass_bytes / base / 1e9, "ratio": ratio,
                "ratio_range": f"{min(pass_ratios):.2f}-{max(pass_ratios):.2f}",
                "copies_per_byte": per_byte[op.replace(" (cold)", "")][0 if phase == "first" else -1],
            }
            if phase == "first" and op == "store":
                row["startup_s"] = startup_s
            if target is not None and phase == "steady":
                floor = FS_FLOORS.get(op) if tier == "fs" and baseline.startswith("raw") else None
                # a floor in GB/s is the reference machine's disk: on a disk where the raw
                # baseline itself stays under it, only the ratio can be judged (the row says so)
                judged_floor = floor if floor is not None and row["baseline_GBps"] >= floor else None
                row["target"] = f">= {target}" + (f" and >= {floor} GB/s" if judged_floor else
                                                  f" (the {floor} GB/s floor: raw is slower here)" if floor else "")
                row["meets"] = ratio >= target and (judged_floor is None or row["ours_GBps"] >= judged_floor)
            rows.append(row)
    return rows


def _lookup_rows(tier: str, lookups: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    return [{"tier": tier, "op": f"lookup {kind}", "pass": "steady", "ours_us": us, "baseline": "sha256 chain",
             "baseline_us": floor, "ratio": floor / us,
             "target": f"<= {LOOKUP_TARGET_US:.0f} us", "meets": us <= LOOKUP_TARGET_US}
            for kind, (us, floor) in lookups.items()]


def _paged_cache(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            block = torch.empty(num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=DTYPE)
            block.view(torch.int16).random_(-(2**15), 2**15 - 1)
            pair.append(block)
        layers.append((pair[0], pair[1]))
    return layers


def _connector_rows(engine: Engine, tokens: torch.Tensor, passes: int) -> list[dict[str, Any]]:
    """PagedConnector: a CPU paged cache -> cpu tier -> another paged cache, vs the bare kernels."""
    num_tokens = tokens.numel()
    num_blocks = num_tokens // BLOCK_SIZE + 8
    source, target = _paged_cache(num_blocks), _paged_cache(num_blocks)

    def slots(seed: int) -> torch.Tensor:
        blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: num_tokens // BLOCK_SIZE]
        return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)[None, :]).flatten()

    source_slots, target_slots = slots(1), slots(2)
    connector = PagedConnector(LAYERS, HEADS, HEAD_SIZE)
    chunk = _touched((LAYERS, 2, CHUNK, HEADS, HEAD_SIZE))

    def kernels() -> None:
        for start in range(0, num_tokens, CHUNK):
            view = chunk.narrow(2, 0, min(CHUNK, num_tokens - start))
            ops.paged_gather(source, source_slots[start:start + CHUNK], out=view)
            ops.paged_scatter(view, target, target_slots[start:start + CHUNK])

    def round_trip() -> None:
        store_paged(engine, connector, tokens, kvcaches=source, slot_mapping=source_slots)
        retrieve_paged(engine, connector, tokens, kvcaches=target, slot_mapping=target_slots)
        engine.batched_delete(engine.keys_for(tokens))

    ours, base, per_byte = [], [], []
    for _ in range(passes + 1):
        before = _copies(engine)
        ours.append(_timed(round_trip))
        after = _copies(engine)
        per_byte.append(((after["store"][0] - before["store"][0]) + (after["retrieve"][0] - before["retrieve"][0]))
                        / max(1, (after["store"][1] - before["store"][1]) + (after["retrieve"][1] - before["retrieve"][1])))
        base.append(_timed(kernels))
    nbytes = 2 * num_tokens * TOKEN_BYTES  # gathered once and scattered once
    rows = []
    for phase, a, b in (("first", ours[:1], base[:1]), ("steady", ours[1:], base[1:])):
        ratio = statistics.median(b) / statistics.median(a)
        row: dict[str, Any] = {"tier": "cpu", "op": "connector round trip", "pass": phase,
                               "ours_GBps": nbytes / statistics.median(a) / 1e9, "baseline": "paged kernels",
                               "baseline_GBps": nbytes / statistics.median(b) / 1e9, "ratio": ratio,
                               "copies_per_byte": per_byte[0 if phase == "first" else -1],
                               "kernels": "extension" if ops.extension_status()["in_use"] else "reference"}
        if phase == "steady":
            row.update(target=">= 0.7", meets=ratio >= 0.7)
        rows.append(row)
    return rows


TIERS = ("cpu", "lmdb", "lmdb-trusted", "fs")


def run_prompt(num_prompts: int = 4, prompt_tokens: int = 4096, passes: int = 4,
               tiers: tuple[str, ...] = TIERS, root: str | None = None) -> list[dict[str, Any]]:
    """Every row of the prompt-level benchmark (see the module docstring)."""
    try:
        if not ops.extension_status()["in_use"]:
            ops.build_extension()
    except Exception as exc:  # no compiler: the connector runs the reference kernels, and says so
        print(f"extension unavailable ({type(exc).__name__}: {exc}); connector rows use the reference kernels")
    torch.manual_seed(0)
    prompts = [(torch.randint(0, 32_000, (prompt_tokens,)), _random_kv(prompt_tokens)) for _ in range(num_prompts)]
    outs = [_touched(tuple(kv.shape)) for _, kv in prompts]
    rows: list[dict[str, Any]] = []
    for tier in tiers:
        workdir = Path(tempfile.mkdtemp(prefix=f"tierkv-prompt-{tier}-", dir=root))
        print(f"prompt benchmark: {tier} tier ...", file=sys.stderr)
        try:
            rows += _bench_tier(tier, prompts, outs, passes, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def workload_text(num_prompts: int, prompt_tokens: int) -> str:
    total = num_prompts * prompt_tokens * TOKEN_BYTES
    scaled = (f"; scaled down from {REFERENCE_PROMPTS} prompts to fit 2 cores / 24 GiB"
              if num_prompts < REFERENCE_PROMPTS else "")
    return (f"{num_prompts} prompts x {prompt_tokens} tokens, {LAYERS} layers x {HEADS} KV heads x {HEAD_SIZE} "
            f"bf16, chunk {CHUNK}: {total / 1e9:.2f} GB per pass{scaled}")


COLUMNS = ["tier", "op", "pass", "ours_GBps", "baseline_GBps", "ratio", "ratio_range", "baseline", "copies_per_byte", "ours_us", "baseline_us",
           "startup_s", "target", "meets"]


def summarize_prompt(rows: list[dict[str, Any]]) -> None:
    """One line per target: met or not, and by how much."""
    judged = [r for r in rows if "meets" in r]
    print(f"\n== prompt-level targets: {sum(r['meets'] for r in judged)}/{len(judged)} met ==")
    for r in judged:
        if "ours_us" in r:
            figure = f"{r['ours_us']:.1f} us (the bare sha256 chain: {r['baseline_us']:.1f} us)"
        elif "ours_GBps" in r:
            figure = f"{r['ratio']:.2f}x {r['baseline']} ({r['ours_GBps']:.2f} GB/s)"
        else:
            figure = f"{r['ratio']:.2f}x {r['baseline']}"
        print(f"{'met ' if r['meets'] else 'SHORT'} {r['tier']} {r['op']}: {figure}, target {r['target']}")
    for r in rows:  # what the lmdb tier's checksum costs: the same read by a raw reader that verifies
        if r["baseline"] == "raw lmdb + XXH3" and r["pass"] == "steady":
            print(f"     {r['tier']} {r['op']}: {r['ratio']:.2f}x raw lmdb + XXH3 ({r['baseline_GBps']:.2f} GB/s): "
                  "a raw reader that checks what it reads")


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tables import print_table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--passes", type=int, default=4, help="steady-state passes after the first")
    parser.add_argument("--tiers", default=",".join(TIERS))
    parser.add_argument("--no-long-prompt", action="store_true",
                        help="skip the long-prompt store rows (512 to 4,096 chunks, benchmarks/long_prompt.py)")
    args = parser.parse_args()
    print(workload_text(args.prompts, args.prompt_tokens))
    rows = run_prompt(args.prompts, args.prompt_tokens, args.passes, tuple(t for t in args.tiers.split(",") if t))
    if not args.no_long_prompt:
        from long_prompt import run_long_prompt

        print("prompt benchmark: long prompts (store cost per chunk) ...", file=sys.stderr)
        rows += run_long_prompt()
    print_table(rows, COLUMNS)
    summarize_prompt(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
