"""The replica benchmarks' servers: two ``vllm serve`` replicas per configuration, one core each,
started, measured at rest and stopped (benchmarks/replicas_nohit.py, benchmarks/routing.py).

``ServersOf`` keeps every configuration's replicas up for a whole benchmark where they fit in
memory together, and otherwise starts each configuration's for its replay (``replica_memory``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from replicas_profile import thread_times
from serving import CHUNK, Config, model_kv_bytes_per_token, start_server, stop_server, wait_ready

from tierkv.testing.mooncake_server import free_port

KV_CACHE_TOKENS = 16_384
"""vLLM's own KV space per replica, in tokens of the model served (bytes differ by shape and
dtype): room for a replica's running requests and every user's earlier rounds, so vLLM alone
keeps the prefixes it computed itself and a private tier has nothing of its own to add."""


def replica_kv_bytes(model: Path, dtype: str) -> int:
    """vLLM's KV space per replica in bytes: ``KV_CACHE_TOKENS`` of ``model`` in ``dtype``."""
    return KV_CACHE_TOKENS * model_kv_bytes_per_token(model, dtype)


def replica_cores() -> list[int]:
    """Two cores this process may use, one per replica (the first two of its affinity)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("replicas_nohit: needs two cores (one per replica)")
    return cores[:2]



@dataclass
class Servers:
    """One configuration's running replicas."""

    config: Config
    urls: list[str]
    processes: list[subprocess.Popen[bytes]]


def start_all(names: Sequence[str], available: dict[str, Config], model: Path, work: Path,
              dtype: str, chunk_tokens: int = CHUNK) -> dict[str, Servers]:
    """Every configuration's replicas, one configuration at a time (more would fight over the
    cores while loading), its two replicas together, replica ``i`` bound to the ``i``-th core."""
    cores = replica_cores()
    running: dict[str, Servers] = {}
    try:
        for name in names:
            config = available[name.partition("@")[0]]
            placement = {"transfer_cpus": name.partition("@")[2]} if "@" in name else {}
            servers = Servers(config, [], [])
            running[name] = servers
            began = time.perf_counter()
            print(f"  starting {name}: {config.servers} replicas on cores {cores[:config.servers]} ...", flush=True)
            for index in range(config.servers):
                port = free_port()
                servers.processes.append(start_server(model, port, config, work / f"{name}-{index}.log",
                                                      replica_kv_bytes(model, dtype), {"VLLM_CPU_OMP_THREADS_BIND": str(cores[index])},
                                                      placement, dtype, chunk_tokens=chunk_tokens))
                servers.urls.append(f"http://127.0.0.1:{port}")
            for index, (url, process) in enumerate(zip(servers.urls, servers.processes)):
                wait_ready(url, process, work / f"{name}-{index}.log")
            print(f"  ... up in {time.perf_counter() - began:.0f} s", flush=True)
    except BaseException:
        stop_all(running)
        raise
    return running


def stop_all(running: dict[str, Servers]) -> None:
    for servers in running.values():
        for process in servers.processes:
            stop_server(process)


class ServersOf:
    """The running replicas a replay of a configuration uses: every configuration's, started
    once (``at_once``), or only its own, started for it after the last one's stopped (where
    all of them would not fit in memory, ``replica_memory``); with the servers' idle draw."""

    def __init__(self, names: Sequence[str], available: dict[str, Config], model: Path, work: Path, dtype: str,
                 at_once: bool, chunk_tokens: int = CHUNK) -> None:
        self._start = functools.partial(start_all, available=available, model=model, work=work, dtype=dtype,
                                        chunk_tokens=chunk_tokens)
        self.running: dict[str, Servers] = {}
        self.floor = 0.0
        if at_once:
            self._started(names)

    def _started(self, names: Sequence[str]) -> None:
        self.running = self._start(names)
        self.floor = idle_draw(self.running)
        print(f"  the servers' idle draw: {self.floor:.3f} cores", flush=True)

    def take(self, name: str) -> tuple[dict[str, Servers], float]:
        """The running servers (``name``'s among them) and their idle draw."""
        if name not in self.running:
            self.stop()
            self._started([name])
        return self.running, self.floor

    def stop(self) -> None:
        stop_all(self.running)
        self.running = {}



def draw(running: dict[str, Servers], window_s: float = 1.0) -> float:
    """Cores every server uses together, over ``window_s``."""
    pids = [process.pid for servers in running.values() for process in servers.processes]
    before = sum(sum(thread_times(pid).values()) for pid in pids)
    time.sleep(window_s)
    return (sum(sum(thread_times(pid).values()) for pid in pids) - before) / window_s


def idle_draw(running: dict[str, Servers], windows: int = 3) -> float:
    """What the servers use with nothing to do (their pollers and heartbeats: about 1.5% of a
    core per vLLM worker here, so six servers never fall under a fixed few percent): the
    least of a few windows."""
    return min(draw(running) for _ in range(windows))


def settle(running: dict[str, Servers], floor: float, quiet_cpu: float = 0.05, limit_s: float = 60.0) -> float:
    """Wait until the servers are back to their idle ``floor`` (within ``quiet_cpu`` of a core),
    so no configuration's replay shares the cores with another's leftover work (a save still
    running uses a good part of a core); the seconds waited."""
    began = time.perf_counter()
    while time.perf_counter() - began < limit_s:
        if draw(running) < floor + quiet_cpu:
            break
    return time.perf_counter() - began

