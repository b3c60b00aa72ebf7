"""Write-back keeps what ``flush()`` acknowledged: dirty chunks of the memory tiers are written
down by ``flush()`` and ``close()``, found by a new process, and survive a SIGKILL after the
flush returned (real cpu over lmdb and fs tiers; the writer is a process of its own)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tierkv import Engine

CHUNK, PROMPTS, TOKENS = 16, 8, 40


def config(tmp_path: Path, lower: str) -> dict[str, object]:
    below = {"lmdb": {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "256MiB"},
             "fs": {"name": "files", "backend": "fs", "path": str(tmp_path / "fs")}}[lower]
    return {"model": "m", "chunk_size": CHUNK, "cost_aware": False, "write_policy": "write_back",
            "tiers": [{"name": "host", "backend": "cpu", "capacity": "64MiB"}, below]}


def prompt(index: int) -> torch.Tensor:
    return torch.arange(TOKENS) + 1000 * index


def kv(index: int) -> torch.Tensor:
    return torch.randn(2, 2, TOKENS, 2, 4, generator=torch.Generator().manual_seed(index))


WRITER = """
import json, sys, torch
from tierkv import Engine
sys.path.insert(0, {tests!r})
from test_write_back_flush import kv, prompt
engine = Engine(json.loads({config!r}))
for index in range({count}):
    engine.store(prompt(index), kv(index))
    if {flush}:
        engine.flush()
    print("stored", index, flush=True)
mode = {mode!r}
if mode == "close":
    engine.close()
elif mode == "close-no-flush":
    engine.close(flush=False)
print("done", flush=True)
if mode == "wait":
    import time
    time.sleep(600)
"""


def writer(tmp_path: Path, lower: str, count: int, flush: bool, mode: str) -> subprocess.Popen[str]:
    script = WRITER.format(tests=str(Path(__file__).parent), config=json.dumps(config(tmp_path, lower)), count=count,
                           flush=flush, mode=mode)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def found(tmp_path: Path, lower: str, count: int) -> list[bool]:
    """Which prompts a fresh engine over the same tiers holds whole, with their own KV."""
    with Engine(config(tmp_path, lower)) as engine:
        result = []
        for index in range(count):
            kv_read, mask = engine.retrieve(prompt(index), return_tuple=False)
            whole = bool(mask.all())
            assert not whole or torch.equal(kv_read, kv(index)), f"prompt {index}: wrong bytes"
            result.append(whole)
        return result


@pytest.mark.parametrize("lower", ["lmdb", "fs"])
def test_flush_then_close_keeps_every_prompt_for_a_new_process(lower: str, tmp_path: Path) -> None:
    process = writer(tmp_path, lower, PROMPTS, flush=True, mode="close")
    assert process.wait(120) == 0
    assert found(tmp_path, lower, PROMPTS) == [True] * PROMPTS


@pytest.mark.parametrize("lower", ["lmdb", "fs"])
def test_close_flushes_unless_told_not_to(lower: str, tmp_path: Path) -> None:
    process = writer(tmp_path / "flushing", lower, PROMPTS, flush=False, mode="close")
    assert process.wait(120) == 0
    assert found(tmp_path / "flushing", lower, PROMPTS) == [True] * PROMPTS, "close() writes the dirty chunks"
    process = writer(tmp_path / "not", lower, PROMPTS, flush=False, mode="close-no-flush")
    assert process.wait(120) == 0
    assert found(tmp_path / "not", lower, PROMPTS) == [False] * PROMPTS, "close(flush=False) leaves them in memory"


@pytest.mark.parametrize("lower", ["lmdb", "fs"])
def test_a_prompt_whose_flush_returned_survives_sigkill(lower: str, tmp_path: Path) -> None:
    for round_, kill_after in enumerate((1, 3, 6)):
        root = tmp_path / str(round_)
        process = writer(root, lower, PROMPTS, flush=True, mode="wait")
        try:
            assert process.stdout is not None
            acknowledged = 0
            deadline = time.monotonic() + 120
            while acknowledged < kill_after and time.monotonic() < deadline:
                line = process.stdout.readline()
                if line.startswith("stored"):
                    acknowledged += 1
        finally:  # killed however the loop ends: the writer would otherwise wait 600 s
            os.kill(process.pid, signal.SIGKILL)
            process.wait(60)
        held = found(root, lower, PROMPTS)
        assert held[:acknowledged] == [True] * acknowledged, f"round {round_}: flushed prompts lost: {held}"


def test_flush_counts_what_it_wrote_down(tmp_path: Path) -> None:
    with Engine(config(tmp_path, "lmdb")) as engine:
        for index in range(3):
            engine.store(prompt(index), kv(index))
        before = engine.stats()["tiers"]["disk"]["chunks"]
        engine.flush()
        stats = engine.stats()["tiers"]
        assert before == 0 and stats["disk"]["chunks"] == 9, "3 prompts x 3 chunks written down by flush()"
        assert stats["host"]["flushed"] == 9
        engine.flush()
        assert engine.stats()["tiers"]["host"]["flushed"] == 9, "a second flush has nothing left to write"


def test_a_flush_no_tier_below_can_take_says_so_and_close_still_closes(tmp_path: Path) -> None:
    from tierkv import TierUnavailableError

    config = {"model": "m", "chunk_size": CHUNK, "cost_aware": False, "write_policy": "write_back",
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "64MiB"},
                        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "1MiB"}]}
    big = torch.randn(2, 2, TOKENS, 64, 128)  # 2 MiB chunks: the 1 MiB disk tier can take none
    engine = Engine(config)
    engine.store(prompt(0), big)
    with pytest.raises(TierUnavailableError, match="no tier below took 3 of tier 'host' dirty chunk"):
        engine.flush()
    assert engine.lookup(prompt(0)) == TOKENS, "the chunks stay, dirty, in the memory tier"
    with pytest.raises(TierUnavailableError):
        engine.flush()  # a later flush tries again
    engine.close()  # logs what is lost, closes anyway
    with pytest.raises(Exception, match="closed"):
        engine.lookup(prompt(0))


def test_dirty_chunks_forced_out_by_pressure_are_reported_by_the_next_flush(tmp_path: Path) -> None:
    """Memory pressure must free memory even when the tier below refuses the demotion: the
    dirty chunks it drops then are in no tier, and the next flush says so instead of returning
    as if it had written them (a flush that returns has written every chunk stored before it)."""
    from tierkv import TierUnavailableError
    from tierkv.policy.pressure import ScriptedProbe
    from tierkv.testing.faults import FaultyBackend

    cfg = {**config(tmp_path, "lmdb"), "pressure": {"poll_interval_ms": 2, "host_high_watermark": 0.9,
                                                      "host_low_watermark": 0.8}}
    gib = 1 << 30
    probe = ScriptedProbe([(10 * gib, 100 * gib)])
    with Engine(cfg, probes={"host": probe}) as engine:
        disk = engine.wrap_tier("disk", FaultyBackend)
        engine.store(prompt(0), kv(0))
        engine.flush()  # prompt 0 is on disk: clean
        engine.store(prompt(1), kv(1))  # dirty
        disk.failing = True
        probe.push(99 * gib, 100 * gib)  # the serving engine takes the host's memory: the tier must shrink
        deadline = time.monotonic() + 30
        while engine.stats()["tiers"]["host"]["used_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["tiers"]["host"]["used_bytes"] == 0
        disk.failing = False
        probe.push(10 * gib, 100 * gib)
        with pytest.raises(TierUnavailableError, match="3 dirty chunk\\(s\\) of tier 'host' left it before"):
            engine.flush()
        assert engine.stats()["tiers"]["host"]["dirty_lost"] == 3
        engine.flush()  # reported once; nothing is dirty now
        assert engine.lookup(prompt(0)) == TOKENS and engine.lookup(prompt(1)) == 0
