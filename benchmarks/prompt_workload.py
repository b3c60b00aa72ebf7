"""The prompt benchmark's workload and measuring tools: KV shape, random prompts, timers, copy counts.

Shared by every part of the prompt-level benchmark (``prompt.py``): the Llama-3-8B KV shape it
stores, the engine config of each tier it runs, how a pass is timed (a write from a quiet disk, a
read from a cold page cache) and how many bytes tierkv copied per byte it delivered.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierkv import Engine

LAYERS, HEADS, HEAD_SIZE, CHUNK, BLOCK_SIZE = 32, 8, 128, 256, 16
DTYPE = torch.bfloat16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_SIZE * DTYPE.itemsize
REFERENCE_PROMPTS = 16


def timed_write(fn: Callable[[], Any]) -> float:
    """A write timed from a quiet disk: what earlier writes left dirty is flushed first (not
    timed), so each store pays for its own writeback throttling, not for the one before it."""
    os.sync()
    return timed(fn)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def random_kv(num_tokens: int) -> torch.Tensor:
    """A vllm-layout KV blob of random bits (every page touched)."""
    kv = torch.empty(LAYERS, 2, num_tokens, HEADS, HEAD_SIZE, dtype=DTYPE)
    kv.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return kv


def touched(shape: tuple[int, ...]) -> torch.Tensor:
    """Memory of ``shape`` allocated and written once (every page touched), as a caller's output."""
    out = torch.empty(shape, dtype=DTYPE)
    out.view(torch.int16).fill_(0)
    return out


def drop_page_cache(root: Path) -> None:
    """Write back and drop the page cache of every file under ``root`` ("cold" reads)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDWR)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tier_config(tier: str, root: Path, pass_bytes: int) -> dict[str, Any]:
    """An engine config with the one tier of the benchmark, sized for a pass of ``pass_bytes``."""
    capacity = f"{int(pass_bytes * 1.25) // 2**20}MiB"
    tiers = {"cpu": {"name": "host", "backend": "cpu", "capacity": capacity},
             "lmdb": {"name": "disk", "backend": "lmdb", "path": str(root / "lmdb"), "capacity": "64GiB"},
             "lmdb-trusted": {"name": "disk", "backend": "lmdb", "path": str(root / "lmdb-trusted"),
                              "capacity": "64GiB", "writemap": True, "verify": False},
             "fs": {"name": "files", "backend": "fs", "path": str(root / "fs"), "capacity": "64GiB"}}
    return {"model": "bench-prompt", "chunk_size": CHUNK, "kv_format": "vllm", "tiers": [tiers[tier]]}


def copy_counts(engine: Engine) -> dict[str, tuple[int, int]]:
    """Bytes copied and bytes delivered so far, per path (``Engine.stats()["copies"]``)."""
    return {path: (int(v["copied_bytes"]), int(v["delivered_bytes"])) for path, v in engine.stats()["copies"].items()}


def copies_per_byte(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], path: str) -> float | None:
    """Bytes copied per byte delivered on ``path`` between two ``copy_counts``."""
    copied = after[path][0] - before[path][0]
    delivered = after[path][1] - before[path][1]
    return copied / delivered if delivered else None


def workload_text(num_prompts: int, prompt_tokens: int) -> str:
    total = num_prompts * prompt_tokens * TOKEN_BYTES
    scaled = (f"; scaled down from {REFERENCE_PROMPTS} prompts to fit 2 cores / 24 GiB"
              if num_prompts < REFERENCE_PROMPTS else "")
    return (f"{num_prompts} prompts x {prompt_tokens} tokens, {LAYERS} layers x {HEADS} KV heads x {HEAD_SIZE} "
            f"bf16, chunk {CHUNK}: {total / 1e9:.2f} GB per pass{scaled}")
