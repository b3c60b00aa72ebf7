"""Counts that say what happened when the tier below a memory tier cannot take writes.

- A store of chunks a read-only disk tier already holds (its writes fail, so the engine has
  marked it unhealthy) is not a failed store: nothing needed saving.
- Fills to a tier below that takes nothing now never hold the memory tier hostage: a store the
  memory tier has room for lands, and the fills are dropped and counted (``dropped_fills``).

Real fs tiers: a read-only tmpfs (remounted ``ro``: EROFS from the kernel) and a real
directory behind the fault wrapper, whose puts hang while its reads fail.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from tmpfs import small_tmpfs
from waiting import wait_until

from tierkv import Engine
from tierkv.testing.faults import FaultyBackend

CHUNK = 16
TOKENS = 8 * CHUNK  # 8 chunks of 64 KiB: 512 KiB a prompt
PROMPT_BYTES = 8 * (64 << 10)


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 4 * 64, dtype=torch.float32).reshape(2, 2, 1, 4, 64) / 1024).contiguous()


def prompt(index: int) -> torch.Tensor:
    return torch.arange(TOKENS) + 10_000 * (index + 1)


def config(host: str, disk: Path, **health: Any) -> dict[str, Any]:
    return {"model": "honest", "chunk_size": CHUNK, "kv_format": "vllm", "cost_aware": False,
            "write_policy": "write_through", "health": {"failure_threshold": 2, "retry_after_s": 60, **health},
            "tiers": [{"name": "host", "backend": "cpu", "capacity": host},
                      {"name": "disk", "backend": "fs", "path": str(disk)}]}


def test_a_store_of_chunks_a_read_only_disk_holds_is_not_a_failure(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "16m") as mount:
        with Engine(config("64MiB", mount / "kv")) as writer:
            writer.store(prompt(0), kv_of(prompt(0)))
            writer.flush()
        # a host tier too small for a whole prompt: the chunks can only be where they are, on disk
        with Engine(config("256KiB", mount / "kv")) as engine:
            done = subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            for index in (1, 2):  # new prompts: their fills hit the read-only disk, which turns unhealthy
                engine.store(prompt(index)[: 2 * CHUNK], kv_of(prompt(index)[: 2 * CHUNK]))
            wait_until(lambda: not engine.stats()["tiers"]["disk"]["health"]["healthy"], "the disk to turn unhealthy")
            assert engine.store(prompt(0), kv_of(prompt(0))) == 0, "already cached: nothing to save, no error"
            with pytest.raises(Exception, match=r"no tier took the 8 chunk\(s\) \(8 of them cached nowhere\)"):
                engine.store(prompt(3), kv_of(prompt(3)))  # a new prompt that cannot be saved is a failure


def test_fills_to_a_tier_that_takes_nothing_do_not_make_the_memory_tier_refuse_stores(tmp_path: Path) -> None:
    cfg = config(f"{2 * PROMPT_BYTES}B", tmp_path / "kv")
    with Engine(cfg) as engine:
        disk = engine.wrap_tier("disk", FaultyBackend)
        disk.stall_s, disk.stall_ops = 60.0, {"batched_put"}  # a disk whose writes hang
        engine.store(prompt(0), kv_of(prompt(0)))  # its fill runs and hangs: it holds half the host tier
        wait_until(lambda: disk.calls_by_op["batched_put"] == 1, "the first fill to start")
        engine.store(prompt(1), kv_of(prompt(1)))  # its fill waits behind it, holding the other half
        disk.failing = True  # and the disk's reads fail: the engine stops sending it anything
        for index in (0, 1):
            engine.run(engine.core.router.get_from(1, engine.keys_for(prompt(index))))
        assert not engine.stats()["tiers"]["disk"]["health"]["healthy"]
        for index in (2, 3, 4):  # the host tier's memory is all held by fills no tier will take
            assert engine.store(prompt(index), kv_of(prompt(index))) == 8, "a store the host has room for failed"
        kv, mask = engine.retrieve(prompt(4), return_tuple=False)
        assert mask.all() and torch.equal(kv, kv_of(prompt(4)))
        dropped = engine.stats()["tiers"]["disk"]["dropped_fills"]
        assert dropped >= 8 * 3, "the queued fill and the new ones are dropped and counted"
        disk.stall_s = 0  # the hung write ends (and fails): nothing is left held
        engine.flush()
