"""The serving benchmark: tierkv under load, through ``vllm serve`` and its OpenAI-compatible API
(``tox -e bench-serving``; the short form runs in ``tox -e bench``).

Every configuration serves the same fixed traces (benchmarks/serving_workloads.py: multi-round
chat, long-document QA, no reuse, a hot prefix) with the same server flags and vLLM's own KV
space set below the traces' working set, so vLLM's prefix cache cannot keep everything:

- ``vllm``: vLLM alone, prefix caching on (the baseline of every ratio);
- ``tierkv-cpu``: plus tierkv with a cpu tier; ``tierkv-cpu-lmdb`` (full form): a small cpu tier
  over lmdb;
- ``replicas-shm``: two ``vllm serve`` replicas sharing one node cache (the ``shm`` tier), the
  trace split between them (a chat's rounds and a document's questions alternate), so most hits
  are on the other replica's prefixes.

The model is a saved random-weight Llama (8 layers x 1024, context-dependent as in the tests;
``--model DIR`` serves any local model). Per configuration and workload: TTFT p50 / p90 / p99,
requests/s and prompt tokens/s over the trace's wall time, the prompt tokens vLLM's prefix cache
and tierkv supplied (from each server's ``/metrics``), and the share of requests whose first
generated token equals vLLM alone's. Ratios against ``vllm`` from the same run; JSON and PNG
plots under ``--out``. A tierkv configuration that loaded nothing stops the run with an error.

    python benchmarks/serving.py [--short] [--model DIR] [--configs vllm,tierkv-cpu,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_dtype import element_bytes  # noqa: E402
from serving_client import Result, counters, replay  # noqa: E402
from serving_workloads import Request, Trace, traces  # noqa: E402
from tables import print_table  # noqa: E402

from tierkv.testing.mooncake_server import free_port  # noqa: E402  (one loopback port, free now)
from tierkv.testing.processes import start_group, stop_group  # noqa: E402

CHUNK = 256
MAX_MODEL_LEN = 2304
KV_TOKENS = 2560  # vLLM's own KV space: one longest prompt, far below every trace's working set
COLUMNS = ["config", "workload", "requests", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "req_per_s", "prompt_tok_per_s",
           "vllm_cached_tok", "tierkv_loaded_tok", "same_first_token", "ttft_p50_vs_vllm", "req_per_s_vs_vllm"]


@dataclass(frozen=True)
class Config:
    """A serving configuration: its servers' tierkv tiers (None: vLLM alone), how many servers;
    ``kv_transfer``: another connector's ``--kv-transfer-config`` instead (a baseline such as
    LMCache), with ``env`` for its servers."""

    name: str
    tiers: list[dict[str, Any]] | None
    servers: int = 1
    kv_transfer: dict[str, Any] | None = None
    env: dict[str, str] | None = None


def configurations(work: Path) -> dict[str, Config]:
    pool = f"/dev/shm/tierkv-serving-{uuid.uuid4().hex[:8]}.pool" if Path("/dev/shm").is_dir() else str(work / "pool")
    return {
        "vllm": Config("vllm", None),
        "tierkv-cpu": Config("tierkv-cpu", [{"name": "host", "backend": "cpu", "capacity": "2GiB"}]),
        "tierkv-cpu-lmdb": Config("tierkv-cpu-lmdb", [{"name": "host", "backend": "cpu", "capacity": "128MiB"},
                                                      {"name": "disk", "backend": "lmdb", "path": str(work / "lmdb"),
                                                       "capacity": "2GiB"}]),
        "replicas-shm": Config("replicas-shm", [{"name": "node", "backend": "shm", "path": pool, "capacity": "2GiB"}],
                               servers=2),
    }


# -- servers -----------------------------------------------------------------------------------------
def model_kv_bytes_per_token(model: Path, dtype: str = "bfloat16") -> int:
    """Bytes of vLLM's KV cache per token of ``model`` served in ``dtype`` (its cache takes the
    model's dtype: float32 on a CPU without native bf16 doubles it)."""
    config = json.loads((model / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"]) * 2 * heads * head_size * element_bytes(dtype)


def start_server(model: Path, port: int, config: Config, log: Path, kv_cache_bytes: int | None = None,
                 env_extra: dict[str, str] | None = None,
                 connector_extra: dict[str, Any] | None = None, dtype: str = "bfloat16",
                 kv_events_port: int | None = None, chunk_tokens: int = CHUNK) -> subprocess.Popen[bytes]:
    """``vllm serve`` (its OpenAI API server module: the ``vllm`` script needs a dist named vllm).
    ``kv_cache_bytes``: vLLM's own KV space (default: ``KV_TOKENS`` tokens); ``env_extra``: more
    environment (a core to bind its compute thread to, ``VLLM_CPU_OMP_THREADS_BIND``);
    ``connector_extra``: more ``kv_connector_extra_config`` keys; ``dtype``: the model's;
    ``kv_events_port``: publish vLLM's KV events (ZMQ) on this port (bound: a wildcard endpoint is
    what vLLM binds; any other it connects to); ``chunk_tokens``: tierkv's chunk size."""
    kv_cache_bytes = kv_cache_bytes or KV_TOKENS * model_kv_bytes_per_token(model, dtype)
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            "--skip-tokenizer-init", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--dtype", dtype,
            "--enable-prefix-caching", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--max-num-batched-tokens", str(MAX_MODEL_LEN)]
    if kv_events_port is not None:
        args += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                   "endpoint": f"tcp://*:{kv_events_port}", "topic": "kv"})]
    if config.kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(config.kv_transfer)]
    elif config.tiers is not None:
        extra = {"config": {"chunk_size": chunk_tokens, "tiers": config.tiers}, **(connector_extra or {})}
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.integrations.vllm_v1",
            "kv_role": "kv_both", "kv_connector_extra_config": extra})]
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
           "TOKENIZERS_PARALLELISM": "false", **(config.env or {}), **(env_extra or {})}
    with open(log, "wb") as handle:  # a process group of its own: the API server, its engine core and worker
        return start_group(args, stdout=handle, stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vllm serve did not answer within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """Stop the server's whole process group (TERM, 30 s, KILL), even when the API server has
    exited already: its engine core and worker may not have."""
    stop_group(process, grace_s=30.0)


# -- one configuration -----------------------------------------------------------------------------
def route_for(config: Config) -> Callable[[int, Request], int]:
    """Which server a request goes to: replicas alternate a chat's rounds and a document's
    questions (each request's prefix was most often stored by the other one)."""
    if config.servers == 1:
        return lambda index, request: 0
    return lambda index, request: index % config.servers


def run_config(config: Config, model: Path, workloads: Sequence[Trace], work: Path, max_tokens: int,
               progress: Any = None) -> tuple[dict[str, list[Result]], dict[str, dict[str, float]], float]:
    """Start the configuration's servers, replay every trace, stop them; per workload the
    results and the counter deltas, and the seconds the servers took to start."""
    ports = [free_port() for _ in range(config.servers)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    logs = [work / f"{config.name}-{index}.log" for index in range(config.servers)]
    started = time.perf_counter()
    processes = []
    try:
        for port, log in zip(ports, logs):  # one at a time: they would fight over the cores while loading
            processes.append(start_server(model, port, config, log))
            wait_ready(f"http://127.0.0.1:{port}", processes[-1], log)
        startup = time.perf_counter() - started
        results: dict[str, list[Result]] = {}
        deltas: dict[str, dict[str, float]] = {}
        for trace in workloads:
            before = asyncio.run(counters(urls))
            wall = time.perf_counter()
            results[trace.workload] = asyncio.run(replay(trace, urls, str(model), max_tokens, route_for(config),
                                                         progress.update if progress is not None else None))
            after = asyncio.run(counters(urls))
            deltas[trace.workload] = {**{key: after[key] - before[key] for key in after},
                                      "wall_s": time.perf_counter() - wall}
        return results, deltas, startup
    finally:
        for process in processes:
            stop_server(process)


# -- the table -------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def summarize(name: str, workload: str, results: list[Result], delta: dict[str, float],
              baseline: dict[str, Any] | None, truth: dict[str, int | None]) -> dict[str, Any]:
    measured = [r for r in results if r.group not in ("warm", "filler")]
    if workload == "hot":  # the convoy probe: the concurrent requests against the one alone
        measured = [r for r in measured if r.group == "concurrent"]
    ttfts = [r.ttft for r in measured]
    same = [truth.get(r.name) == r.first_token for r in results if r.name in truth]
    row: dict[str, Any] = {
        "config": name, "workload": workload, "requests": len(results),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3), "ttft_p90_s": round(percentile(ttfts, 0.9), 3),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "req_per_s": round(len(results) / delta["wall_s"], 3),
        "prompt_tok_per_s": round(sum(r.prompt_tokens for r in results) / delta["wall_s"]),
        "vllm_cached_tok": int(delta["prompt_tokens_cached"]), "tierkv_loaded_tok": int(delta["tierkv_tokens_loaded"]),
        "same_first_token": f"{sum(same)}/{len(same)}" if same else "",
        "ttft_p50_vs_vllm": "", "req_per_s_vs_vllm": "",
    }
    if workload == "hot":
        alone = [r.ttft for r in results if r.group == "alone"]
        row["hot_alone_ttft_s"] = round(alone[0], 3) if alone else None
    if baseline is not None:
        row["ttft_p50_vs_vllm"] = round(row["ttft_p50_s"] / baseline["ttft_p50_s"], 3)
        row["req_per_s_vs_vllm"] = round(row["req_per_s"] / baseline["req_per_s"], 3)
    return row


def later_rounds_ttft(results: list[Result]) -> float:
    return percentile([r.ttft for r in results if r.group not in ("round 0",)], 0.5)


def verdicts(rows: list[dict[str, Any]], results: dict[str, dict[str, list[Result]]]) -> list[str]:
    """The issue's targets, each met or not, from the rows of one run."""
    found = {(row["config"], row["workload"]): row for row in rows}
    lines = []

    def say(what: str, value: float | None, limit: float, above: bool = False) -> None:
        if value is None:
            return
        met = value >= limit if above else value <= limit
        lines.append(f"{what}: {value:.3f}x ({'>=' if above else '<='} {limit}x) {'met' if met else 'MISSED'}")
    for config in ("tierkv-cpu", "tierkv-cpu-lmdb", "replicas-shm"):
        chat, doc, noreuse = (found.get((config, w)) for w in ("chat", "docqa", "noreuse"))
        if chat:
            say(f"{config} chat TTFT p50 vs vllm", chat["ttft_p50_vs_vllm"], 0.4)
            say(f"{config} chat throughput vs vllm", chat["req_per_s_vs_vllm"], 1.5, above=True)
        if doc:
            say(f"{config} docqa TTFT p50 vs vllm", doc["ttft_p50_vs_vllm"], 0.5)
        if noreuse:
            say(f"{config} no-reuse throughput vs vllm", noreuse["req_per_s_vs_vllm"], 0.97, above=True)
    for (config, workload), row in found.items():
        if workload == "hot" and row.get("hot_alone_ttft_s"):
            say(f"{config} hot prefix p90 of {row['requests'] - 3} concurrent vs alone",
                row["ttft_p90_s"] / row["hot_alone_ttft_s"], 1.3)
    if "replicas-shm" in results and "tierkv-cpu" in results and "chat" in results["replicas-shm"]:
        say("replicas-shm chat later rounds TTFT p50 vs tierkv-cpu",
            later_rounds_ttft(results["replicas-shm"]["chat"]) / later_rounds_ttft(results["tierkv-cpu"]["chat"]), 1.2)
    return lines


def plot(results: dict[str, dict[str, list[Result]]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    workloads = sorted({w for per in results.values() for w in per})
    figure, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.5), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        names = [name for name in results if workload in results[name]]
        axis.boxplot([[r.ttft for r in results[name][workload] if r.group not in ("filler", "warm")] for name in names],
                     showfliers=True)
        axis.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right", fontsize=7)
        axis.set_title(workload)
        axis.set_ylabel("TTFT (s)")
    figure.tight_layout()
    figure.savefig(out / "serving_ttft.png", dpi=110)
    written.append("serving_ttft.png")
    figure, axis = plt.subplots(figsize=(5, 3.5))
    for name, per in results.items():
        chat = per.get("chat")
        if not chat:
            continue
        rounds = sorted({r.group for r in chat}, key=lambda g: int(g.split()[-1]))
        axis.plot([int(g.split()[-1]) for g in rounds],
                  [statistics.median([r.ttft for r in chat if r.group == g]) for g in rounds], marker="o", label=name)
    axis.set_xlabel("chat round")
    axis.set_ylabel("TTFT p50 (s)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "serving_chat_rounds.png", dpi=110)
    written.append("serving_chat_rounds.png")
    return written


def run_serving(short: bool = True, model: Path | None = None, names: Sequence[str] | None = None,
                out: Path = Path("bench-results"), max_tokens: int = 8) -> dict[str, Any]:
    """The whole benchmark; what it printed, as data."""
    work = Path(tempfile.mkdtemp(prefix="tierkv-serving-"))
    if model is None:
        from tierkv.testing.vllm_runner import save_random_llama

        model = save_random_llama(work / "model", num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=4,
                                  initializer_range=0.15)
    available = configurations(work)
    names = list(names or (["vllm", "tierkv-cpu"] if short else list(available)))
    unknown = [name for name in names if name not in available]
    if unknown or names[0] != "vllm":
        raise ValueError(f"configs: expected 'vllm' first, then any of {list(available)[1:]}; got {names}")
    workloads = traces(short)
    try:
        from tqdm import tqdm
        progress = tqdm(total=len(names) * sum(len(t.requests) for t in workloads), desc="requests", file=sys.stderr)
    except ImportError:
        progress = None
    results: dict[str, dict[str, list[Result]]] = {}
    deltas: dict[str, dict[str, dict[str, float]]] = {}
    startups: dict[str, float] = {}
    started = time.perf_counter()
    try:
        for name in names:
            results[name], deltas[name], startups[name] = run_config(available[name], model, workloads, work,
                                                                     max_tokens, progress)
            config = available[name]
            if config.tiers is not None and not sum(d["tierkv_tokens_loaded"] for d in deltas[name].values()):
                raise RuntimeError(f"{name}: tierkv loaded nothing (the connector turned itself off, or no prompt "
                                   f"was found): see {work}/{name}-0.log")
    finally:
        if progress is not None:
            progress.close()
        for config in available.values():
            for tier in config.tiers or ():
                if tier["backend"] == "shm":
                    Path(tier["path"]).unlink(missing_ok=True)
    truth = {r.name: r.first_token for per in results["vllm"].values() for r in per}
    rows = []
    for name in names:
        for trace in workloads:
            baseline = None if name == "vllm" else next(row for row in rows if row["config"] == "vllm"
                                                        and row["workload"] == trace.workload)
            rows.append(summarize(name, trace.workload, results[name][trace.workload], deltas[name][trace.workload],
                                  baseline, truth))
    lines = verdicts(rows, results)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(results, out)
    report = {"rows": rows, "verdicts": lines, "startup_s": startups, "seconds": round(time.perf_counter() - started),
              "model": str(model), "short": short,
              "requests": {name: {w: [asdict(r) for r in per[w]] for w in per} for name, per in results.items()}}
    (out / "serving.json").write_text(json.dumps(report, indent=1))
    report["plots"] = plots
    return report


def print_report(report: dict[str, Any]) -> None:
    print(f"\n== serving under load through vllm serve ({'short' if report['short'] else 'full'} traces, "
          f"{report['seconds']} s, servers up in {', '.join(f'{k} {v:.0f}s' for k, v in report['startup_s'].items())}) ==")
    print_table(report["rows"], COLUMNS)
    for line in report["verdicts"]:
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="the short traces and vllm / tierkv-cpu only")
    parser.add_argument("--model", type=Path, default=None, help="a local model directory (default: a random Llama)")
    parser.add_argument("--configs", default=None, help="comma-separated, vllm first")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    names = args.configs.split(",") if args.configs else None
    report = run_serving(args.short, args.model, names, args.out, args.max_tokens)
    print_report(report)
    print(f"results in {args.out}/: serving.json" + "".join(f", {p}" for p in report["plots"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
