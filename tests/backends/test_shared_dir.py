"""Several processes on one fs directory: an engine that only calls lookup and retrieve sees
the prompts another process stores, through ``rescan_interval_s``, without scanning the
directory on the caller's thread.

Two real processes: this one reads; a subprocess (a small script) writes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from tierkv import Engine

CHUNK = 16
PROMPTS = 12
TOKENS = 4 * CHUNK
ROOT = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent("""
    import sys, time, torch
    from tierkv import Engine
    path, prompts, tokens, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    def kv_of(t):
        t = t.to(torch.float32)[None, None, :, None, None]
        return (t + torch.arange(2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 1, 8) / 16).contiguous()

    config = {"model": "shared-dir", "chunk_size": chunk, "kv_format": "vllm",
              "tiers": [{"name": "disk", "backend": "fs", "path": path}]}
    with Engine(config) as eng:
        for i in range(prompts):
            t = torch.arange(tokens) + 1000 * (i + 1)
            assert eng.store(t, kv_of(t)) == tokens // chunk
            time.sleep(0.02)
    print("stored", prompts, flush=True)
""")


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 1, 8) / 16).contiguous()


def prompt(i: int) -> torch.Tensor:
    return torch.arange(TOKENS) + 1000 * (i + 1)


def reader_config(path: Path, **fs: Any) -> dict[str, Any]:
    return {"model": "shared-dir", "chunk_size": CHUNK, "kv_format": "vllm",
            "tiers": [{"name": "disk", "backend": "fs", "path": str(path), **fs}]}


def test_a_reader_that_only_looks_up_and_retrieves_sees_another_process_s_prompts(tmp_path: Path) -> None:
    shared = tmp_path / "kv"
    with Engine(reader_config(shared, rescan_interval_s=0.3)) as reader:
        assert all(reader.lookup(prompt(i)) == 0 for i in range(PROMPTS))  # nothing there yet
        done = subprocess.run([sys.executable, "-c", WRITER, str(shared), str(PROMPTS), str(TOKENS), str(CHUNK)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        seen: set[int] = set()
        end = time.monotonic() + 60  # generous: the interval is 0.3 s
        while len(seen) < PROMPTS and time.monotonic() < end:
            for i in range(PROMPTS):
                if i not in seen and reader.lookup(prompt(i)) == TOKENS:
                    seen.add(i)
            time.sleep(0.05)
        assert len(seen) == PROMPTS, f"lookup saw {len(seen)} of {PROMPTS} prompts stored by another process"
        for i in range(PROMPTS):
            kv, mask = reader.retrieve(prompt(i), return_tuple=False)
            assert bool(mask.all()) and torch.equal(kv, kv_of(prompt(i)))

        # and what another process deletes is forgotten (a miss, not an error)
        for path in shared.rglob("*.tkv"):
            path.unlink()
        end = time.monotonic() + 60
        while reader.lookup(prompt(0)) and time.monotonic() < end:
            time.sleep(0.05)
        assert reader.lookup(prompt(0)) == 0
        kv, mask = reader.retrieve(prompt(0), return_tuple=False)
        assert not bool(mask.any())


def test_without_rescan_interval_the_index_is_the_start_up_scan(tmp_path: Path) -> None:
    """The default stays: no rescans, so a reader sees only what was there when it started."""
    shared = tmp_path / "kv"
    with Engine(reader_config(shared)) as reader:
        done = subprocess.run([sys.executable, "-c", WRITER, str(shared), "2", str(TOKENS), str(CHUNK)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        time.sleep(0.5)
        assert reader.lookup(prompt(0)) == 0
    with Engine(reader_config(shared)) as fresh:
        assert fresh.lookup(prompt(0)) == TOKENS
