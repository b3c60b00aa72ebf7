"""Processes for the ``shm`` tier's hostile-conditions tests (test_shm_hostile.py): a process that
stops itself inside the pool's lock, one that stops in the middle of a write in another pid
namespace and resumes after the others took its holds back, busy processes that time each failed
store, another user's pool, and an engine whose pool file is truncated under it. Every chunk's
bytes are a function of its key (shm_workers), so any read anywhere is checked against the truth.

Run as a script (``python shm_hostile_workers.py resume ...``) for the process started in a pid
namespace of its own with ``unshare``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shm_workers as workers  # noqa: E402

from tierkv import Engine  # noqa: E402
from tierkv.chunks.keys import CacheKey  # noqa: E402

CHUNK = 16


def prompt(index: int, chunks: int = 4) -> torch.Tensor:
    return torch.arange(chunks * CHUNK) + 10_000 * (index + 1)


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8) / 64).contiguous()


def engine_config(pool_path: Path, disk: Path, **pool_options: Any) -> dict[str, Any]:
    """The pool over an lmdb tier (write-through): what the pool cannot serve, the disk does."""
    return {"model": "hostile", "chunk_size": CHUNK, "cost_aware": False,
            "tiers": [{"name": "node", "backend": "shm", "path": str(pool_path), "capacity": "16MiB", **pool_options},
                      {"name": "disk", "backend": "lmdb", "path": str(disk), "capacity": "64MiB"}]}


def run_state(pid: int) -> str:
    """A process's state letter from /proc ("T": stopped), "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


def wait_until_stopped(pid: int, seconds: float = 120.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        state = run_state(pid)
        if state in ("T", "", "Z"):
            return state == "T"
        time.sleep(0.01)
    return False


# -- 1: stopped inside the lock ------------------------------------------------------------------
def stop_inside_the_lock(path: str, capacity: int) -> None:
    """Attach (as the engine's tier does: its default geometry), take the pool's lock and stop
    there (SIGSTOP to itself); once continued, leave."""
    from tierkv_backends.shm import SharedMemoryBackend

    tier = SharedMemoryBackend("node", capacity, path=path, lease_s=1.0)
    with tier.pool.lock():
        os.kill(os.getpid(), signal.SIGSTOP)
    asyncio.run(tier.close())


# -- 2: stopped mid-write in another pid namespace, taken for stopped, resumed ----------------------
# The busy and resumed processes wait this long for the pool's lock (the default is 1 s): on a
# machine as busy as CI's (three test workers on two cores, next to these four processes) a
# lock holder descheduled for a second made a store give up, which is the scheduler's doing,
# not the resumed process's. A resumed process that wedged the lock would still fail them.
LOCK_TIMEOUT_S = 30.0


def busy(path: str, capacity: int, seed: int, keyspace: int, stop: str, out: str) -> None:
    """Store and read random chunks until the file ``stop`` exists: the instant of each failed
    store (CLOCK_MONOTONIC, one clock for every process) and its exception, and how many reads
    were wrong, go to ``out`` as JSON."""
    import random

    async def main() -> dict[str, Any]:
        tier = workers.backend(path, capacity, lease_s=1.0, lock_timeout_s=LOCK_TIMEOUT_S)
        rng = random.Random(seed)
        failed: list[float] = []
        failures: list[str] = []
        wrong = stores = reads = hits = 0
        try:
            while not os.path.exists(stop):
                batch = [rng.randrange(keyspace) for _ in range(rng.randint(1, 4))]
                keys = [workers.key_of(i) for i in batch]
                try:
                    await tier.batched_put(keys, [workers.chunk_of(i) for i in batch])
                    stores += 1
                except Exception as exc:  # noqa: BLE001 - every failed store is the measure
                    failed.append(time.monotonic())
                    failures.append(f"{type(exc).__name__}: {exc}")
                found = await tier.batched_get(keys)
                reads += len(found)
                hits += sum(c is not None for c in found)
                wrong += sum(not workers.exact(i, c) for i, c in zip(batch, found))
                await asyncio.sleep(0.002)
        finally:
            await tier.close()
        return {"failed": failed, "failures": failures, "wrong": wrong, "stores": stores, "reads": reads,
                "hits": hits}

    Path(out).write_text(json.dumps(asyncio.run(main())))


def resume(path: str, capacity: int, keyspace: int, marker: str, out: str) -> None:
    """In a pid namespace of its own: hold chunks (reads in flight), start a write and stop
    (SIGSTOP to itself) halfway through its copy, saying so in ``marker`` (with this process's
    pid as the parent sees it). Once continued, finish the write, release the holds, then for
    3 s store and read chunks of its own and read everyone's, and write what happened to ``out``."""

    async def main() -> dict[str, Any]:
        tier = workers.backend(path, capacity, lease_s=1.0, lock_timeout_s=LOCK_TIMEOUT_S)
        try:
            holds = tier.hold([workers.key_of(i) for i in range(keyspace - 8, keyspace)])  # the newest
            mine = [workers.key_of(50_000 + i) for i in range(4)]
            truth = [workers.chunk_of(50_000 + i) for i in range(4)]

            async def write(views: dict[CacheKey, torch.Tensor]) -> None:
                halves = [(view.view(-1), chunk.reshape(-1)) for view, chunk in zip(views.values(), truth)]
                for view, chunk in halves:
                    view[: len(chunk) // 2].copy_(chunk[: len(chunk) // 2])
                # Written whole under another name, then renamed: the test polls for the marker and
                # must never read it half written (seen on a busy CI machine: an empty file).
                staged = Path(f"{marker}.partial")
                staged.write_text(json.dumps({"pid": int(os.readlink("/proc/self"))}))
                os.replace(staged, marker)
                os.kill(os.getpid(), signal.SIGSTOP)
                for view, chunk in halves:
                    view[len(chunk) // 2 :].copy_(chunk[len(chunk) // 2 :])

            resumed = None
            try:
                await tier.put_with(mine, [(tuple(c.shape), c.dtype) for c in truth], write)
                stopped_write = "committed"
            except Exception as exc:  # noqa: BLE001 - reported
                stopped_write = f"{type(exc).__name__}: {exc}"
            resumed = time.monotonic()
            written = await tier.batched_get(mine)  # at once: a full pool evicts it soon
            held_valid = [h.release() for h in holds if h is not None]
            failed: list[float] = []
            wrong = own_hits = own_reads = everyone_hits = 0
            round_ = 0
            while time.monotonic() < resumed + 3.0:
                batch = [60_000 + 4 * round_ + i for i in range(4)]
                round_ += 1
                try:
                    await tier.batched_put([workers.key_of(i) for i in batch], [workers.chunk_of(i) for i in batch])
                except Exception:  # noqa: BLE001 - every failed store is the measure
                    failed.append(time.monotonic())
                found = await tier.batched_get([workers.key_of(i) for i in batch])
                own_reads += len(found)
                own_hits += sum(c is not None for c in found)
                wrong += sum(not workers.exact(i, c) for i, c in zip(batch, found))
                everyone = list(range(keyspace)) if round_ % 10 == 0 else []
                if everyone:
                    got = await tier.batched_get([workers.key_of(i) for i in everyone])
                    everyone_hits += sum(c is not None for c in got)
                    wrong += sum(not workers.exact(i, c) for i, c in zip(everyone, got))
                await asyncio.sleep(0.002)
            stats = tier.stats()
            return {"resumed": resumed, "stopped_write": stopped_write, "held": len([h for h in holds if h]),
                    "held_valid": sum(held_valid), "failed": failed, "wrong": wrong, "own_hits": own_hits,
                    "own_reads": own_reads, "everyone_hits": everyone_hits, "stale_reads": stats["stale_reads"],
                    "own_write_exact": sum(c is not None and workers.exact(50_000 + i, c) for i, c in enumerate(written))}
        finally:
            await tier.close()

    Path(out).write_text(json.dumps(asyncio.run(main())))


# -- 3: another user's pool -------------------------------------------------------------------------
def plant_a_pool(path: str, mode: str, ready_fd: int, leave_fd: int) -> None:
    """As whoever this process runs as: create a pool at ``path`` of ``mode`` holding bytes that
    are not the truth for key 1 (chunk 2's), say so on ``ready_fd`` and stay attached until
    ``leave_fd`` closes; then report on ``ready_fd`` what it read of the others' keys."""
    async def main() -> None:
        tier = workers.backend(path, 64 << 20, mode=mode)
        try:
            await tier.put(workers.key_of(1), workers.chunk_of(2))
            os.write(ready_fd, b"ready\n")
            os.read(leave_fd, 1)
            found = await tier.batched_get([workers.key_of(i) for i in range(3, 8)])
            os.write(ready_fd, f"read {sum(c is not None for c in found)}\n".encode())
        finally:
            await tier.close()
    asyncio.run(main())


# -- 4: a truncated pool file --------------------------------------------------------------------------
def serve_through_a_truncation(cfg: dict[str, Any], ready: Any, truncated: Any, idle: bool, results: Any) -> None:
    """Store two prompts (the pool, and the disk below it), say so, wait for the parent to
    truncate the pool file; then (after idling through several heartbeats, when ``idle``) look
    up, read and store as a serving process does, and report what it got."""
    with Engine(cfg) as engine:
        for index in range(2):
            engine.store(prompt(index), kv_of(prompt(index)))
        engine.flush()
        before = engine.locate(prompt(0))
        ready.set()
        truncated.wait(120)
        if idle:
            time.sleep(1.5)  # lease_s 0.4: six heartbeats, each of which used to touch the mapping
        where = engine.locate(prompt(0))
        kv, mask = engine.retrieve(prompt(0), return_tuple=False)
        hits = int(mask.sum())
        exact = hits == len(prompt(0)) and torch.equal(kv, kv_of(prompt(0)))
        stored = engine.store(prompt(2), kv_of(prompt(2)))
        engine.flush()
        kv2, mask2 = engine.retrieve(prompt(2), return_tuple=False)
        node = engine.stats()["tiers"]["node"]
        results.put({"before": before, "where": where, "hits": hits, "exact": exact, "stored": stored,
                     "stored_where": engine.locate(prompt(2)),
                     "read_back": bool(mask2.all()) and torch.equal(kv2, kv_of(prompt(2))),
                     "broken": node.get("broken"), "errors": node.get("errors", 0)})


if __name__ == "__main__":
    role, *arguments = sys.argv[1:]
    if role == "resume":
        resume(arguments[0], int(arguments[1]), int(arguments[2]), arguments[3], arguments[4])
    else:
        raise SystemExit(f"unknown role {role!r}")
