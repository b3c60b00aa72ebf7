"""The price of a miss: two ``vllm serve`` replicas, one core each, a multi-user chat whose every
next round goes to the other replica (``tox -e bench-replicas``; a short form runs in ``tox -e bench``).

Configurations, each two replicas (the baseline of every ratio is the first):

- ``vllm``: vLLM alone, prefix caching on;
- ``tierkv-private``: each replica with its own ``cpu`` tier. A round's prefix was computed on
  the other replica, so all a private tier can hit is what vLLM's own cache drops of the
  replica's own round before last: its end past vLLM's last whole block (64 tokens a user here,
  found by the continuation tails' probes). tierkv mostly saves, and what it costs is overhead;
- ``tierkv-shm``: both replicas on one node cache (the ``shm`` tier): the other replica's
  prefixes hit;
- ``lmcache-mp``: both replicas on one LMCache server (its multiprocess mode, 1 GiB, the same
  chunk size; LMCache 0.5.6 installed without its CUDA dependencies, `tox -e bench-replicas`
  does it): the anchor the pool is compared with, in the same run;
- ``vllm-control`` (not run by default): a second pair of vLLM alone, whose ratio to the first
  is the spread of the benchmark itself (an A/A test).

Each replica's vLLM compute thread is bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``),
as vLLM's CPU build is deployed (one instance per socket or NUMA node). All servers start once
and stay up where they fit in memory together (``replica_memory``: else each configuration's
start for its replay, after the last one's stopped); each run replays a fresh chat (a new seed:
no run hits an earlier run's prompts) against every configuration, in an order that rotates from run to run, so every ratio compares
two configurations timed minutes apart on the same servers. Per run and configuration: the
later rounds' time (the summed latency of every request after a user's first), their TTFT p90,
the prompt tokens tierkv loaded and how long its loads held vLLM's batch (``tierkv_load_s``,
vLLM's ``vllm:tierkv_load_seconds`` over the replay, both replicas). The verdict takes the median of the runs' ratios.

``--profile DIR``: after the measured runs, one more chat per configuration of
``--profile-configs``, recorded with py-spy (if on PATH), and where each replica's processes
and threads spent their CPU (benchmarks/replicas_profile.py).

``--shapes``: the model shapes, each a benchmark of its own (``SHAPES``; default ``small`` and
``served``: where recomputing costs milliseconds, and where it costs seconds). The main job runs
``mid`` alone.

    python benchmarks/replicas_nohit.py [--runs 3] [--shapes small,served] [--out DIR] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_dtype import CHOICES, model_dtype  # noqa: E402
from lmcache_server import LMCACHE_ENV, start_lmcache_server  # noqa: E402
from replica_memory import replicas_at_once  # noqa: E402
from replica_servers import Servers, ServersOf, replica_kv_bytes, settle  # noqa: E402
from replicas_profile import summarize_profile, thread_times  # noqa: E402
from serving import CHUNK, Config, percentile, route_for  # noqa: E402
from serving_client import Result, counters, replay  # noqa: E402
from serving_workloads import Trace, chat  # noqa: E402
from tables import print_table  # noqa: E402

from tierkv.testing.mooncake_server import free_port  # noqa: E402
from tierkv.testing.processes import stop_group  # noqa: E402

_NO_HIT = {("tierkv-private", "later_s"): 1.03, ("tierkv-private", "later_ttft_p90_s"): 1.03}
TARGETS: dict[str, dict[tuple[str, str], float]] = {
    # where recomputing costs milliseconds the pool must stand aside: never slower than vLLM alone
    "small": {**_NO_HIT, ("tierkv-shm", "later_s"): 1.03},
    "mid": {**_NO_HIT, ("tierkv-shm", "later_s"): 0.46},
    "served": {**_NO_HIT, ("tierkv-shm", "later_s"): 0.5},
}
"""Per model shape, the median ratio to vLLM alone each (configuration, metric) must stay under."""
COLUMNS = ["run", "config", "later_s", "later_ttft_p90_s", "wall_s", "tierkv_loaded_tok", "tierkv_load_s", "external_tok",
           "vllm_cached_tok", "later_s_vs_vllm", "later_ttft_p90_s_vs_vllm"]


def configurations(pool: str, lmcache_port: int = 0) -> dict[str, Config]:
    return {
        # LMCache's multiprocess mode: one server per node (1 GiB of host memory, as the pool),
        # each replica's connector sends its blocks there (engine-driven: the CPU path)
        "lmcache-mp": Config("lmcache-mp", None, servers=2, env=LMCACHE_ENV, kv_transfer={
            "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache_port}}),
        "vllm": Config("vllm", None, servers=2),
        # a second pair of vLLM alone: its ratio to the first is the benchmark's own noise (an A/A test)
        "vllm-control": Config("vllm-control", None, servers=2),
        "tierkv-private": Config("tierkv-private", [{"name": "host", "backend": "cpu", "capacity": "1GiB"}], servers=2),
        "tierkv-shm": Config("tierkv-shm", [{"name": "node", "backend": "shm", "path": pool, "capacity": "1GiB"}],
                             servers=2),
    }


SHAPES: dict[str, dict[str, int]] = {
    # prefill FLOPs per KV byte decide whether a load can beat recomputing: a small model
    # recomputes 768 tokens in milliseconds, a served one (a 1B Llama's shape) in seconds
    "small": {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 4},
    "mid": {"num_layers": 8, "hidden_size": 1024, "num_heads": 8, "num_kv_heads": 4},
    "served": {"num_layers": 16, "hidden_size": 2048, "num_heads": 32, "num_kv_heads": 8},
}
"""Model shapes: ``small`` (8 x 512, 8 KiB of KV per token in bf16), ``mid`` (8 x 1024, 16 KiB:
the main job's), ``served`` (16 x 2048, 8 KV heads of 64, 32 KiB: a 1B Llama)."""


def replica_model(work: Path, shape: str = "mid") -> Path:
    """The replicas' model of ``shape`` (``SHAPES``), saved under ``work``: a random Llama,
    context-dependent (``initializer_range`` 0.15, as in the tests)."""
    from tierkv.testing.vllm_runner import save_random_llama

    return save_random_llama(work / f"model-{shape}", **SHAPES[shape], initializer_range=0.15)


def later_rounds(results: list[Result]) -> list[Result]:
    return [r for r in results if r.group != "round 0"]


def measure(servers: Servers, trace: Trace, model: Path, max_tokens: int
            ) -> tuple[list[Result], dict[str, float], Counter[tuple[str, str]]]:
    """Replay ``trace``; its results, the servers' counter deltas and the CPU seconds each
    (process, thread) of the replicas used meanwhile."""
    before = asyncio.run(counters(servers.urls))
    cpu_before = sum((thread_times(process.pid) for process in servers.processes), Counter())
    began = time.perf_counter()
    # a chat's rounds alternate between the replicas (trace order: user by user, round by round)
    results = asyncio.run(replay(trace, servers.urls, str(model), max_tokens, route_for(servers.config)))
    wall = time.perf_counter() - began
    cpu = sum((thread_times(process.pid) for process in servers.processes), Counter())
    cpu.subtract(cpu_before)
    after = asyncio.run(counters(servers.urls))
    return results, {**{key: after[key] - before[key] for key in after}, "wall_s": wall}, cpu


def print_cpu(cpu: dict[str, Counter[tuple[str, str]]], runs: int) -> None:
    """CPU seconds per replay (both replicas), by process and thread, per configuration."""
    keys = sorted({key for per in cpu.values() for key, seconds in per.items() if seconds / runs >= 0.05})
    rows = [{"process": process, "thread": thread,
             **{name: round(per[(process, thread)] / runs, 2) for name, per in cpu.items()}}
            for process, thread in keys]
    rows.append({"process": "tierkv's threads", "thread": "tierkv-*", **{
        name: round(sum(v for (_, thread), v in per.items() if thread.startswith("tierkv")) / runs, 3)
        for name, per in cpu.items()}})
    rows.append({"process": "all", "thread": "", **{name: round(sum(per.values()) / runs, 2)
                                                     for name, per in cpu.items()}})
    print("\n-- CPU seconds per replay, both replicas (from /proc: time on a core, not time waiting) --")
    print_table(rows, ["process", "thread", *cpu])


def row_for(run: int, name: str, results: list[Result], delta: dict[str, float]) -> dict[str, Any]:
    later = later_rounds(results)
    return {"run": run, "config": name, "later_s": round(sum(r.latency for r in later), 3),
            "later_ttft_p90_s": round(percentile([r.ttft for r in later], 0.9), 3),
            "wall_s": round(delta["wall_s"], 2), "tierkv_loaded_tok": int(delta["tierkv_tokens_loaded"]),
            "tierkv_load_s": round(delta["tierkv_load_s"], 3), "vllm_cached_tok": int(delta["prompt_tokens_cached"]), "external_tok": int(delta["external_loaded"]),
            "later_s_vs_vllm": "",
            "later_ttft_p90_s_vs_vllm": ""}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if row["config"] == "vllm":
            continue
        base = next(r for r in rows if r["run"] == row["run"] and r["config"] == "vllm")
        for metric in ("later_s", "later_ttft_p90_s"):
            row[f"{metric}_vs_vllm"] = round(row[metric] / base[metric], 3)


def verdicts(rows: list[dict[str, Any]], shape: str = "mid") -> list[dict[str, Any]]:
    """The median over runs of each targeted ratio of ``shape``, and whether it is met."""
    found = []
    for (config, metric), limit in TARGETS[shape].items():
        ratios = [row[f"{metric}_vs_vllm"] for row in rows if row["config"] == config]
        if ratios:
            median = statistics.median(ratios)
            found.append({"config": config, "metric": metric, "median_vs_vllm": round(median, 3),
                          "runs": ratios, "target": limit, "met": median <= limit})
    pairs = [(row["later_s"], other["later_s"]) for row in rows if row["config"] == "tierkv-shm"
             for other in rows if other["config"] == "lmcache-mp" and other["run"] == row["run"]]
    if pairs and shape != "small":  # where loads pay, the pool is to lead LMCache's server in the same run
        ratios = [round(ours / theirs, 3) for ours, theirs in pairs]
        median = statistics.median(ratios)
        found.append({"config": "tierkv-shm", "metric": "later_s", "against": "lmcache-mp",
                      "median_vs_vllm": round(median, 3), "runs": ratios, "target": 1.0, "met": median < 1.0})
    return found


def profile_start(out: Path, servers: Servers, seconds: int) -> list[subprocess.Popen[bytes]]:
    """py-spy on each replica's process group (its API server, engine core and worker)."""
    spy = shutil.which("py-spy")
    if spy is None:
        print("  --profile: py-spy is not on PATH (pip install py-spy); not profiling", flush=True)
        return []
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([spy, "record", "--pid", str(process.pid), "--subprocesses", "--threads",
                              "--nonblocking", "--rate", "100", "--duration", str(seconds), "--format", "raw",
                              "--output", str(out / f"{servers.config.name}-{index}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for index, process in enumerate(servers.processes)]


def run_replicas(names: Sequence[str], runs: int = 5, users: int = 6, rounds: int = 3, max_tokens: int = 8,
                 out: Path = Path("bench-results/replicas"), profile: Path | None = None,
                 profile_configs: Sequence[str] = (), dtype: str = "auto", shape: str = "mid",
                 chunk_tokens: int = CHUNK) -> dict[str, Any]:
    """The whole benchmark: start every configuration's replicas, ``runs`` rounds of replays,
    stop them; the rows, verdicts and CPU table, written to ``out/replicas.json``. ``dtype``:
    the model's (``auto``: bf16 where the CPU computes it natively, else float32); ``shape``:
    the model's (``SHAPES``); ``chunk_tokens``: the chunk size of tierkv and LMCache alike."""
    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {list(SHAPES)}, got {shape!r}")
    dtype = model_dtype(dtype)
    pool = f"/dev/shm/tierkv-replicas-{uuid.uuid4().hex[:8]}.pool"
    lmcache_port = free_port()
    available = configurations(pool, lmcache_port)
    if not names or names[0] != "vllm" or any(name.partition("@")[0] not in available for name in names):
        raise ValueError(f"configs: expected 'vllm' first, then any of {list(available)[1:]}; got {list(names)}")
    work = Path(tempfile.mkdtemp(prefix="tierkv-replicas-"))
    model = replica_model(work, shape)
    print(f"== the price of a miss: 2 replicas, one core each, x {len(names)} configs, {users} users x {rounds} "
          f"rounds, {runs} runs, {dtype}, {shape} model, {chunk_tokens}-token chunks ==", flush=True)
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    cpu: dict[str, Counter[tuple[str, str]]] = {}
    started = time.perf_counter()
    lmcache = (start_lmcache_server(lmcache_port, free_port(), work / "lmcache-server.log", chunk_tokens)
               if any(name.partition("@")[0] == "lmcache-mp" for name in names) else None)
    servers_of: ServersOf | None = None
    try:
        at_once = replicas_at_once(len(names), 2, model, dtype, replica_kv_bytes(model, dtype))
        if not at_once:
            print("  memory: every configuration's replicas at once would not fit here; "
                  "one configuration's at a time, started anew for each replay", flush=True)
        servers_of = ServersOf(names, available, model, work, dtype, at_once, chunk_tokens)
        for run in range(runs):
            trace = chat(users=users, rounds=rounds, system=256, context=768, seed=run + 1)
            order = list(names[run % len(names):]) + list(names[: run % len(names)])
            for name in order:
                running, floor = servers_of.take(name)
                waited = settle(running, floor)
                began = time.perf_counter()
                replies, delta, used = measure(running[name], trace, model, max_tokens)
                cpu.setdefault(name, Counter()).update(used)
                rows.append(row_for(run + 1, name, replies, delta))
                results[f"{run + 1}/{name}"] = [asdict(r) for r in replies]
                print(f"  run {run + 1}/{runs} {name}: later rounds {rows[-1]['later_s']:.1f} s "
                      f"({time.perf_counter() - began:.0f} s, after {waited:.0f} s for the servers to idle)", flush=True)
        if profile is not None:  # one more chat per profiled configuration, not measured
            trace = chat(users=users, rounds=rounds, system=256, context=768, seed=runs + 1)
            for name in profile_configs:
                running, _ = servers_of.take(name)
                spies = profile_start(profile, running[name], 600)
                measure(running[name], trace, model, max_tokens)
                for spy in spies:
                    spy.send_signal(2)  # SIGINT: py-spy writes what it has
                    spy.wait(timeout=60)
    finally:
        if servers_of is not None:
            servers_of.stop()
        if lmcache is not None:
            stop_group(lmcache)
        Path(pool).unlink(missing_ok=True)
    add_ratios(rows)
    # a small model recomputes faster than any tier loads: there the pool may rightly load nothing
    if "tierkv-shm" in names and shape != "small" and not all(
            row["tierkv_loaded_tok"] for row in rows if row["config"] == "tierkv-shm"):
        raise RuntimeError(f"tierkv-shm loaded nothing in some run: see {work}/tierkv-shm-*.log")
    shutil.rmtree(work, ignore_errors=True)
    report = {"rows": rows, "verdicts": verdicts(rows, shape), "requests": results, "runs": runs, "dtype": dtype,
              "chunk_tokens": chunk_tokens, "shape": {"name": shape, **SHAPES[shape]},
              "cpu_s": {name: {f"{p}/{t}": v for (p, t), v in per.items()} for name, per in cpu.items()},
              "seconds": round(time.perf_counter() - started)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(report, indent=1))
    report["cpu"] = cpu
    return report


def print_replicas(report: dict[str, Any]) -> None:
    print_table(report["rows"], COLUMNS)
    print_cpu(report["cpu"], report["runs"])
    private = [row["tierkv_loaded_tok"] for row in report["rows"] if row["config"] == "tierkv-private"]
    if any(private):
        print(f"note: tierkv-private loaded {max(private)} tokens a run at most: on a private tier only a replica's "
              "own earlier prompts' ends past vLLM's last whole block can hit")
    for verdict in report["verdicts"]:
        print(f"{verdict['config']} {verdict['metric']} vs {verdict.get('against', 'vllm')}: median {verdict['median_vs_vllm']:.3f}x of "
              f"{verdict['runs']} (<= {verdict['target']}x) {'met' if verdict['met'] else 'MISSED'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="vllm,tierkv-private,tierkv-shm,lmcache-mp",
                        help="comma-separated, vllm first; NAME@PLACE runs NAME with transfer_cpus PLACE (spare, own)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", choices=CHOICES, default="auto",
                        help="the model's dtype (auto: bf16 where the CPU computes it natively, else float32)")
    parser.add_argument("--shapes", default="small,served",
                        help=f"comma-separated model shapes, each a benchmark of its own: {', '.join(SHAPES)}")
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK,
                        help="the chunk size of tierkv and LMCache alike (both default to 256; a chat turn's "
                             "tail shorter than a chunk is recomputed: docs/benchmarks.md)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/replicas"))
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw profiles of --profile-configs here")
    parser.add_argument("--profile-configs", default="vllm,tierkv-private")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        out = args.out / shape
        profile = args.profile / shape if args.profile is not None else None
        report = run_replicas(args.configs.split(","), args.runs, args.users, args.rounds, args.max_tokens, out,
                              profile, args.profile_configs.split(","), args.dtype, shape, args.chunk_tokens)
        print_replicas(report)
        if profile is not None:
            for path in sorted(profile.glob("*.txt")):
                summarize_profile(path)
        print(f"results in {out}/replicas.json ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
