"""KV-aware routing over two ``vllm serve`` replicas, one core each (``tox -e bench-routing``):
a router that reads the replicas' KV event streams (benchmarks/kv_router.py) against round
robin, with and without tierkv's node pool.

Server pairs (started once, each replica bound to its own core, vLLM's own KV space below the
trace's working set), each with vLLM's KV events on:

- ``vllm``: vLLM alone, prefix caching on (its events: its own cache);
- ``tierkv-private``: a private ``cpu`` tier per replica (its events add that tier's blocks);
- ``tierkv-shm``: one node pool (``shm``) for both: every replica announces every pool block.

Each pair serves the multi-round chat (as ``tox -e bench-serving``'s, more users) once per
policy, a fresh chat each time (no replay hits an earlier one's prompts):

- ``round-robin``: request ``i`` to replica ``i % 2`` (a user's rounds alternate);
- ``events``: the replica that announced the longest prefix of the prompt, ties to the less
  loaded one.

Per (pair, policy): the hit rate (prompt tokens vLLM's prefix cache or tierkv supplied, over
all prompt tokens, from the servers' ``/metrics``), TTFT p50 / p90 of every request, and the
TTFT ratios against round robin on the same pair, from the same run.

    python benchmarks/routing.py [--users 10] [--rounds 4] [--runs 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_dtype import CHOICES, model_dtype  # noqa: E402
from kv_router import KVRouter  # noqa: E402
from replica_servers import Servers, idle_draw, replica_cores, settle, stop_all  # noqa: E402
from replicas_nohit import replica_model  # noqa: E402
from serving import Config, percentile, start_server, wait_ready  # noqa: E402
from serving_client import Result, counters, replay  # noqa: E402
from serving_workloads import Trace, chat  # noqa: E402
from tables import print_table  # noqa: E402

from tierkv.testing.mooncake_server import free_port  # noqa: E402

KV_CACHE_BYTES = 1 << 27  # vLLM's own KV space per replica: 0.125 GiB (8,192 tokens of this model)
POLICIES = ("round-robin", "events")
COLUMNS = ["run", "pair", "policy", "hit_rate", "ttft_p50_s", "ttft_p90_s", "wall_s", "vllm_cached_tok",
           "tierkv_loaded_tok", "ttft_p50_vs_rr", "ttft_p90_vs_rr"]


def pairs(pool: str) -> dict[str, Config]:
    return {"vllm": Config("vllm", None, servers=2),
            "tierkv-private": Config("tierkv-private", [{"name": "host", "backend": "cpu", "capacity": "1GiB"}],
                                     servers=2),
            "tierkv-shm": Config("tierkv-shm", [{"name": "node", "backend": "shm", "path": pool, "capacity": "1GiB"}],
                                 servers=2)}


def start_pairs(names: list[str], available: dict[str, Config], model: Path, work: Path,
                dtype: str) -> tuple[dict[str, Servers], dict[str, list[str]]]:
    """Every pair's replicas, one at a time, replica ``i`` on core ``i``, each publishing KV
    events; the servers and each pair's event endpoints."""
    cores = replica_cores()
    running: dict[str, Servers] = {}
    endpoints: dict[str, list[str]] = {}
    try:
        for name in names:
            servers = running[name] = Servers(available[name], [], [])
            endpoints[name] = []
            for index in range(2):
                port, events = free_port(), free_port()
                log = work / f"{name}-{index}.log"
                print(f"  starting {name} replica {index} on core {cores[index]} ...", flush=True)
                servers.processes.append(start_server(model, port, servers.config, log, KV_CACHE_BYTES,
                                                      {"VLLM_CPU_OMP_THREADS_BIND": str(cores[index])},
                                                      dtype=dtype, kv_events_port=events))
                servers.urls.append(f"http://127.0.0.1:{port}")
                endpoints[name].append(f"tcp://127.0.0.1:{events}")
                wait_ready(servers.urls[-1], servers.processes[-1], log)
    except BaseException:
        stop_all(running)
        raise
    return running, endpoints


def serve(servers: Servers, router: KVRouter, policy: str, trace: Trace, model: Path,
          max_tokens: int) -> tuple[list[Result], dict[str, float]]:
    """Replay ``trace`` under ``policy``; the results and the servers' counter deltas."""
    before = asyncio.run(counters(servers.urls))
    began = time.perf_counter()
    if policy == "events":
        results = asyncio.run(replay(trace, servers.urls, str(model), max_tokens,
                                     lambda index, request: router.route(request.prompt), answered=router.done))
    else:
        results = asyncio.run(replay(trace, servers.urls, str(model), max_tokens, lambda index, request: index % 2))
    after = asyncio.run(counters(servers.urls))
    return results, {**{key: after[key] - before[key] for key in after}, "wall_s": time.perf_counter() - began}


def row_for(run: int, pair: str, policy: str, results: list[Result], delta: dict[str, float]) -> dict[str, Any]:
    ttfts = [r.ttft for r in results]
    prompt = delta["prompt_tokens"] or 1.0
    return {"run": run, "pair": pair, "policy": policy, "hit_rate": round(delta["prompt_tokens_cached"] / prompt, 3),
            "ttft_p50_s": round(percentile(ttfts, 0.5), 3), "ttft_p90_s": round(percentile(ttfts, 0.9), 3),
            "wall_s": round(delta["wall_s"], 2), "vllm_cached_tok": int(delta["prompt_tokens_cached"]),
            "tierkv_loaded_tok": int(delta["tierkv_tokens_loaded"]), "ttft_p50_vs_rr": "", "ttft_p90_vs_rr": ""}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        base = next(r for r in rows if r["run"] == row["run"] and r["pair"] == row["pair"]
                    and r["policy"] == "round-robin")
        for metric in ("ttft_p50_s", "ttft_p90_s"):
            row[f"{metric[:-2]}_vs_rr"] = round(row[metric] / base[metric], 3) if base[metric] else ""


def run_routing(names: list[str], runs: int = 1, users: int = 10, rounds: int = 4, max_tokens: int = 8,
                out: Path = Path("bench-results/routing"), dtype: str = "auto") -> dict[str, Any]:
    """The whole benchmark; the rows, written to ``out/routing.json``."""
    dtype = model_dtype(dtype)
    pool = f"/dev/shm/tierkv-routing-{uuid.uuid4().hex[:8]}.pool"
    available = pairs(pool)
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ValueError(f"pairs: expected any of {list(available)}, got {unknown}")
    work = Path(tempfile.mkdtemp(prefix="tierkv-routing-"))
    model = replica_model(work)
    print(f"== KV-aware routing: {len(names)} pairs of replicas (one core each) x {POLICIES}, chat of {users} users "
          f"x {rounds} rounds, {runs} run(s), {dtype} ==", flush=True)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    running, endpoints = start_pairs(names, available, model, work, dtype)
    routers = {name: KVRouter(endpoints[name]) for name in names}
    try:
        floor = idle_draw(running)
        replay_index = 0
        for run in range(runs):
            for name in names:
                policies = POLICIES if (run + names.index(name)) % 2 == 0 else POLICIES[::-1]
                for policy in policies:
                    replay_index += 1
                    trace = chat(users=users, rounds=rounds, system=256, context=768, seed=1000 + replay_index)
                    waited = settle(running, floor)
                    results, delta = serve(running[name], routers[name], policy, trace, model, max_tokens)
                    rows.append(row_for(run + 1, name, policy, results, delta))
                    print(f"  run {run + 1} {name} {policy}: hit rate {rows[-1]['hit_rate']:.2f}, TTFT p50 "
                          f"{rows[-1]['ttft_p50_s']:.3f} s (after {waited:.0f} s for the servers to idle)", flush=True)
    finally:
        for router in routers.values():
            router.close()
        stop_all(running)
        Path(pool).unlink(missing_ok=True)
    add_ratios(rows)
    events = {name: router.events for name, router in routers.items()}
    if not all(sum(counts) for counts in events.values()):
        raise RuntimeError(f"a pair published no KV events (router counts {events}): see {work}")
    shutil.rmtree(work, ignore_errors=True)
    report = {"rows": rows, "events_seen": events, "users": users, "rounds": rounds, "runs": runs, "dtype": dtype,
              "seconds": round(time.perf_counter() - started)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(report, indent=1))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="vllm,tierkv-private,tierkv-shm")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--users", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", choices=CHOICES, default="auto",
                        help="the model's (auto: bfloat16 where the CPU computes it natively, else float32)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/routing"))
    args = parser.parse_args()
    report = run_routing([name for name in args.pairs.split(",") if name], args.runs, args.users, args.rounds,
                         args.max_tokens, args.out, args.dtype)
    print_table(report["rows"], COLUMNS)
    print(f"KV events seen by the router per replica: {report['events_seen']}; {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
