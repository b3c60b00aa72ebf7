"""Tier benchmark matrix: tiers x chunk sizes x batch sizes x concurrency, each cell timed
against baselines measured in the same process, interleaved with ours so noise hits both.

Model shape: 8 layers, 8 KV heads, head size 128, bfloat16 (32 KiB per token), so chunks
of 64 / 256 / 1024 tokens are 2 / 8 / 32 MiB. Baselines per tier:

- cpu: a plain torch copy of the same bytes into preallocated tensors (memory bandwidth).
- lmdb: raw py-lmdb, one write transaction per batch; reads ``txn.get`` + ``torch.frombuffer``.
- fs: raw files, ``write_bytes`` to a temporary name + ``os.replace``; ``read_bytes``.
- s3: raw boto3 ``put_object`` / ``get_object().read()`` one after the other (sequential),
  and the same requests from a thread pool of the same concurrency as our tier (parallel),
  on the same server with the same client settings (botocore's optional CRC32 off on both:
  chunks carry their own XXH3 checksum). The parallel numbers are the server's own ceiling.

A ratio is baseline time / our time: above 1 we are faster than the baseline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import statistics
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import torch

from tierkv import CacheKey
from tierkv.backend import StorageBackend

LAYERS, HEADS, HEAD_SIZE = 8, 8, 128
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_SIZE * 2
# (tier, op, baseline) -> minimum ratio the issue asks for
TARGETS = {("s3", "batched_get", "raw boto3 parallel"): 0.9, ("s3", "batched_put", "raw boto3 parallel"): 0.9,
           ("s3", "batched_get", "raw boto3 sequential"): 2.0, ("s3", "batched_put", "raw boto3 sequential"): 2.0}


@dataclass(frozen=True)
class Cell:
    tier: str
    chunk_tokens: int
    batch: int
    concurrency: int

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * TOKEN_BYTES


def chunk_shape(tokens: int) -> tuple[int, ...]:
    return (LAYERS, 2, tokens, HEADS, HEAD_SIZE)


def interleaved(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Median seconds of each function, running them in turn ``repeats`` times after a warm-up."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def bench_keys(count: int, salt: str) -> list[CacheKey]:
    return [CacheKey("vllm", "bench-matrix", 1, 0, f"{salt}-{i:030x}") for i in range(count)]


class Runner:
    """Runs ``ours`` on a private event loop (the backends are async; baselines are not)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def __call__(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.close()


# -- per-tier setups: (our backend, baseline put/get functions) ------------------------------------------
@contextmanager
def cpu_setup(cell: Cell, chunks: list[torch.Tensor], workdir: Path, **_: Any) -> Iterator[tuple[StorageBackend, dict]]:
    from tierkv_backends.cpu import CPUBackend

    backend = CPUBackend("host", capacity=cell.chunk_bytes * cell.batch * 2 + (1 << 20))
    targets = [torch.empty_like(c) for c in chunks]

    def copy() -> None:
        for dst, src in zip(targets, chunks):
            dst.copy_(src)
    yield backend, {"put": {"memory copy": copy}, "get": {"memory copy": copy}}


@contextmanager
def lmdb_setup(cell: Cell, chunks: list[torch.Tensor], workdir: Path, **_: Any) -> Iterator[tuple[StorageBackend, dict]]:
    from tierkv_backends.lmdb import LMDBBackend

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    capacity = cell.chunk_bytes * cell.batch * 3
    backend = LMDBBackend("disk", capacity=capacity, path=str(workdir / "ours"))
    env = lmdb.open(str(workdir / "raw"), map_size=capacity + capacity // 8 + (64 << 20), sync=False,
                    metasync=False, max_dbs=2)
    db = env.open_db(b"data")
    names = [k.to_string().encode() for k in bench_keys(cell.batch, "raw")]
    payloads = [c.view(-1).view(torch.uint8).numpy() for c in chunks]

    def put() -> None:
        with env.begin(write=True) as txn:
            for name, payload in zip(names, payloads):
                txn.put(name, payload, db=db)

    def get() -> None:
        with env.begin() as txn:
            for name in names:
                torch.frombuffer(bytearray(txn.get(name, db=db)), dtype=torch.bfloat16)

    try:
        yield backend, {"put": {"raw lmdb": put}, "get": {"raw lmdb": get}}
    finally:
        env.close()


@contextmanager
def fs_setup(cell: Cell, chunks: list[torch.Tensor], workdir: Path, **_: Any) -> Iterator[tuple[StorageBackend, dict]]:
    from tierkv_backends.fs import FSBackend

    backend = FSBackend("files", path=str(workdir / "ours"))
    raw = workdir / "raw"
    raw.mkdir()
    payloads = [c.view(-1).view(torch.uint8).numpy().tobytes() for c in chunks]
    paths = [raw / f"{i}.bin" for i in range(cell.batch)]

    def put() -> None:
        for path, payload in zip(paths, payloads):
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(payload)
            os.replace(tmp, path)

    def get() -> None:
        for path in paths:
            torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.bfloat16)

    yield backend, {"put": {"raw files": put}, "get": {"raw files": get}}


@contextmanager
def s3_setup(cell: Cell, chunks: list[torch.Tensor], workdir: Path, server: Any = None, bucket: str = "",
             **_: Any) -> Iterator[tuple[StorageBackend, dict]]:
    from tierkv_backends.s3 import S3Backend

    prefix = f"bench/{uuid.uuid4().hex[:8]}"
    backend = S3Backend("shared", bucket=bucket, prefix=f"{prefix}/ours", max_concurrency=cell.concurrency,
                        **server.client_options(inline=False))
    client = server.boto3_client(max_pool_connections=2 * cell.concurrency, retries={"total_max_attempts": 1},
                                 request_checksum_calculation="when_required",
                                 response_checksum_validation="when_required")
    pool = concurrent.futures.ThreadPoolExecutor(cell.concurrency)
    names = [f"{prefix}/raw/{k.to_string()}" for k in bench_keys(cell.batch, "raw")]
    payloads = [c.view(-1).view(torch.uint8).numpy().tobytes() for c in chunks]

    def put_one(name: str, payload: bytes) -> None:
        client.put_object(Bucket=bucket, Key=name, Body=payload)

    def get_one(name: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(client.get_object(Bucket=bucket, Key=name)["Body"].read()),
                                dtype=torch.bfloat16)

    def put_sequential() -> None:
        for name, payload in zip(names, payloads):
            put_one(name, payload)

    def put_parallel() -> None:
        list(pool.map(put_one, names, payloads))

    def get_sequential() -> None:
        for name in names:
            get_one(name)

    def get_parallel() -> None:
        list(pool.map(get_one, names))

    try:
        yield backend, {"put": {"raw boto3 parallel": put_parallel, "raw boto3 sequential": put_sequential},
                        "get": {"raw boto3 parallel": get_parallel, "raw boto3 sequential": get_sequential}}
    finally:
        pool.shutdown()
        client.close()


SETUPS = {"cpu": cpu_setup, "lmdb": lmdb_setup, "fs": fs_setup, "s3": s3_setup}


def run_cell(cell: Cell, repeats: int, **context: Any) -> list[dict[str, Any]]:
    """Time our batched_put / batched_get against each baseline for one cell."""
    chunks = [torch.randn(chunk_shape(cell.chunk_tokens), dtype=torch.bfloat16) for _ in range(cell.batch)]
    keys = bench_keys(cell.batch, "ours")
    run = Runner()
    workdir = Path(tempfile.mkdtemp(prefix="tierkv-matrix-"))
    rows = []
    try:
        with SETUPS[cell.tier](cell, chunks, workdir, **context) as (backend, baselines):
            def put() -> None:
                run(backend.batched_put(keys, chunks))

            def get() -> None:
                got = run(backend.batched_get(keys))
                if any(g is None for g in got):
                    raise RuntimeError(f"{cell.tier}: a chunk went missing during the benchmark")

            for op, ours in (("batched_put", put), ("batched_get", get)):
                names = list(baselines[op.split("_")[1]])
                times = interleaved([ours, *(baselines[op.split("_")[1]][n] for n in names)], repeats)
                for name, base in zip(names, times[1:]):
                    rows.append(make_row(cell, op, times[0], base, name))
            run(backend.close())
    finally:
        run.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def make_row(cell: Cell, op: str, ours: float, base: float, baseline: str) -> dict[str, Any]:
    nbytes = cell.batch * cell.chunk_bytes
    target = TARGETS.get((cell.tier, op, baseline))
    if target == 2.0 and min(cell.batch, cell.concurrency) < 2:
        target = None  # nothing to overlap: parallel cannot beat sequential
    ratio = base / ours
    return {"tier": cell.tier, "op": op, "chunk_tokens": cell.chunk_tokens, "chunk_MiB": cell.chunk_bytes / 2**20,
            "batch": cell.batch, "concurrency": cell.concurrency, "ours_ms": ours * 1e3, "baseline_ms": base * 1e3,
            "ours_MBps": nbytes / ours / 1e6, "baseline_MBps": nbytes / base / 1e6, "ratio": ratio,
            "baseline": baseline, "target": f">= {target}x" if target else "",
            "meets": (ratio >= target) if target else None}


def plan(tiers: list[str], chunk_tokens: list[int], batches: list[int], concurrency: list[int],
         max_batch_mib: float) -> list[Cell]:
    """The cells to run; concurrency applies to s3 only, and batches above ``max_batch_mib`` are skipped."""
    cells = []
    for tier in tiers:
        for tokens in chunk_tokens:
            for batch in batches:
                if batch * tokens * TOKEN_BYTES > max_batch_mib * 2**20 and batch != min(batches):
                    continue
                for conc in (concurrency if tier == "s3" else [1]):
                    cells.append(Cell(tier, tokens, batch, conc))
    return cells


def plot_points(rows: list[dict[str, Any]], tier: str, op: str, baseline: str) -> list[tuple[int, float, float]]:
    """(chunk tokens, our MB/s, baseline MB/s) at the largest batch and concurrency run for each size."""
    mine = [r for r in rows if r["tier"] == tier and r["op"] == op and r["baseline"] == baseline]
    points = []
    for tokens in sorted({r["chunk_tokens"] for r in mine}):
        at_size = [r for r in mine if r["chunk_tokens"] == tokens]
        best = max(at_size, key=lambda r: (r["batch"], r["concurrency"]))
        points.append((tokens, best["ours_MBps"], best["baseline_MBps"]))
    return points


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Throughput per tier and chunk size, ours (solid) vs each same-run baseline (dashed);
    False (no picture) without matplotlib, which the tables do not need."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, op in zip(axes, ("batched_put", "batched_get")):
        for tier in dict.fromkeys(r["tier"] for r in rows):
            baselines = list(dict.fromkeys(r["baseline"] for r in rows if r["tier"] == tier and r["op"] == op))
            for index, baseline in enumerate(baselines):
                points = plot_points(rows, tier, op, baseline)
                xs = [p[0] for p in points]
                if index == 0:
                    ax.plot(xs, [p[1] for p in points], marker="o", label=f"{tier} (tierkv)")
                ax.plot(xs, [p[2] for p in points], linestyle="--", marker="x", alpha=0.7, label=f"{tier}: {baseline}")
        sizes = sorted({r["chunk_tokens"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(t) for t in sizes])
        ax.set_yscale("log")
        ax.set_xlabel("chunk size (tokens; 32 KiB per token)")
        ax.set_ylabel("MB/s")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("tierkv tiers vs same-run baselines (largest batch and concurrency per size)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
