"""A flush that returned is never lost, on a busy machine: a write-back writer (a small cpu tier
over real lmdb or fs, so every store also demotes) stores chat-like prompts and flushes after
each, and is SIGKILLed at seeded points (after a seeded number of acknowledged flushes, a seeded
few milliseconds into the next store or flush), while every core is kept busy. A new engine
then reads every acknowledged prompt back: whole and exact, or the round fails.

``lmdb-full``: an lmdb tier smaller than what is written, at its default admission. It evicts its
oldest chunks to take the newest (a cache), so only the last prompts are checked: they are
whole. (Before, its tinylfu default turned the newest flushed chunks away once it was full,
and flush() returned anyway.)

Writers are forked from a forkserver that imported torch and tierkv once, so a round costs a
fork, not an interpreter start.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from busy import busy_cores

from tierkv import Engine

CHUNK = 16
ROUNDS = 20  # per lower tier: 60 kill rounds in all
HEADS, HEAD_SIZE = 2, 64


def config(root: Path, lower: str) -> dict[str, Any]:
    below = {"lmdb": {"name": "disk", "backend": "lmdb", "path": str(root / "lmdb"), "capacity": "256MiB"},
             "lmdb-full": {"name": "disk", "backend": "lmdb", "path": str(root / "lmdb"), "capacity": "2MiB"},
             "fs": {"name": "disk", "backend": "fs", "path": str(root / "fs")}}[lower]
    # 8 chunks of host memory: nearly every store evicts (demotes) the chunks of earlier prompts
    return {"model": "durable", "chunk_size": CHUNK, "cost_aware": False, "write_policy": "write_back",
            "tiers": [{"name": "host", "backend": "cpu", "capacity": "256KiB"}, below]}


def chat_prompt(seed: int, index: int, memo: dict[int, torch.Tensor], chat: bool = True) -> torch.Tensor:
    """Prompt ``index`` of a seeded chat: half extend a recent prompt (a later round of the
    same conversation, sharing its chunks), the rest are new; lengths leave partial chunks.
    ``chat=False``: every prompt new."""
    if index in memo:
        return memo[index]
    rng = random.Random(seed * 1_000_003 + index)
    if chat and index and rng.random() < 0.5:
        earlier = chat_prompt(seed, rng.randrange(max(0, index - 12), index), memo, chat)
        tokens = torch.cat([earlier, torch.randint(0, 30_000, (rng.randint(1, 60),),
                                                   generator=torch.Generator().manual_seed(rng.getrandbits(32)))])
    else:
        tokens = torch.randint(0, 30_000, (rng.randint(1, 160),),
                               generator=torch.Generator().manual_seed(rng.getrandbits(32)))
    memo[index] = tokens
    return tokens


def kv_for(tokens: torch.Tensor) -> torch.Tensor:
    """KV in the vllm layout whose token i depends on tokens[: i + 1] only (prompts that share a
    prefix share its KV, as a model's would)."""
    rolling, values = 0, []
    for token in tokens.tolist():
        rolling = (rolling * 1_000_003 + token + 1) % 65_521
        values.append(rolling)
    base = torch.tensor(values, dtype=torch.float32)[None, None, :, None, None]
    spread = torch.arange(HEADS * HEAD_SIZE, dtype=torch.float32).reshape(1, 1, 1, HEADS, HEAD_SIZE) / 1024
    return (base + spread).expand(2, 2, -1, HEADS, HEAD_SIZE).contiguous()


def write_until_killed(cfg: dict[str, Any], seed: int, chat: bool, acks: multiprocessing.connection.Connection
                       ) -> None:
    """The writer: store, flush, acknowledge, forever (the test kills it)."""
    engine = Engine(cfg)
    memo: dict[int, torch.Tensor] = {}
    index = 0
    while True:
        tokens = chat_prompt(seed, index, memo, chat)
        engine.store(tokens, kv_for(tokens))
        engine.flush()
        acks.send(index)
        index += 1


def read_back(cfg: dict[str, Any], seed: int, acknowledged: int, chat: bool, last: int | None) -> list[str]:
    """What a new process finds of the acknowledged prompts (``last``: of the last ones only):
    the problems, if any."""
    memo: dict[int, torch.Tensor] = {}
    problems = []
    with Engine(cfg) as engine:
        for index in range(acknowledged - (last or acknowledged), acknowledged):
            tokens = chat_prompt(seed, index, memo, chat)
            kv, mask = engine.retrieve(tokens, return_tuple=False)
            held = int(mask.sum())
            if held < len(tokens):
                problems.append(f"prompt {index}: {held} of {len(tokens)} tokens")
            elif not torch.equal(kv, kv_for(tokens)):
                problems.append(f"prompt {index}: wrong bytes")
        corrupt = engine.stats()["tiers"]["disk"].get("corrupt_chunks", 0)
        if corrupt:
            problems.append(f"{corrupt} corrupt chunk(s) on disk")
    return problems


@pytest.mark.slow  # 20 writer processes killed under a CPU load
@pytest.mark.parametrize("lower", ["lmdb", "fs", "lmdb-full"])
def test_no_flushed_prompt_is_lost_when_the_writer_is_killed_on_a_busy_machine(lower: str, tmp_path: Path) -> None:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "tierkv", "tierkv_backends.lmdb", "tierkv_backends.fs"])
    lost: dict[int, list[str]] = {}
    total_acknowledged = 0
    with busy_cores():
        for round_ in range(ROUNDS):
            seed = 1000 * ["lmdb", "fs", "lmdb-full"].index(lower) + round_
            chat, last = (False, 3) if lower == "lmdb-full" else (True, None)
            kill_after = random.Random(seed).randint(1, 40) + (40 if lower == "lmdb-full" else 0)  # past full
            kill_delay = random.Random(seed + 1).uniform(0.0, 0.03)
            cfg = config(tmp_path / f"round{round_}", lower)
            receive, send = context.Pipe(duplex=False)
            writer = context.Process(target=write_until_killed, args=(cfg, seed, chat, send), daemon=True)
            writer.start()
            send.close()
            acknowledged = 0
            deadline = time.monotonic() + 240
            while acknowledged < kill_after and time.monotonic() < deadline:
                if receive.poll(1.0):
                    acknowledged = receive.recv() + 1
                elif not writer.is_alive():
                    break
            time.sleep(kill_delay)  # into the next store or flush
            while receive.poll():  # acknowledgements sent before the kill count too
                acknowledged = receive.recv() + 1
            assert writer.pid is not None and writer.is_alive(), f"round {round_}: the writer died: {writer.exitcode}"
            os.kill(writer.pid, signal.SIGKILL)
            writer.join(60)
            while receive.poll():
                try:
                    acknowledged = receive.recv() + 1
                except EOFError:
                    break
            assert acknowledged >= 1, f"round {round_}: no flush was acknowledged within 240 s"
            total_acknowledged += acknowledged
            problems = read_back(cfg, seed, acknowledged, chat, last)
            if problems:
                lost[round_] = problems
    print(f"{lower}: {ROUNDS} kill rounds, {total_acknowledged} acknowledged prompts, "
          f"{sum(len(p) for p in lost.values())} lost")
    assert not lost, f"prompts whose flush() returned came back short after a SIGKILL: {lost}"
