"""The command line of ``benchmarks/gpu_check.py``: the whole run, or one part in a worker process.

The same command serves both: a person (or CI) runs ``--out DIR``, the runner re-runs the script
with ``--part NAME --context FILE`` for each part, so every part gets a process of its own and a
timeout that can kill it without losing the rest of the run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .context import DEFAULT_BUDGET_S, Context
from .dependencies import prepare
from .parts import worker
from .report import write_report
from .runner import Runner

DESCRIPTION = "One prepared check of every CUDA path of tierkv (issue 36), under 10 minutes on one H100."


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The options; ``--part`` and ``--context`` are the worker's, hidden from ``--help``."""
    parser = argparse.ArgumentParser(description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output folder (gpu_check.json, gpu_check.md, logs/)")
    parser.add_argument("--dry-run", action="store_true", help="CPU parts only; CUDA parts reported as skipped")
    parser.add_argument("--quick", action="store_true", help="fewer timing reps; no racecheck, no nvcc compile test")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time for the whole run")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tierkv-gpu-check",
                        help="extension build cache and private imports (kept: a rerun does not recompile)")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part is None and args.out is None:
        parser.error("--out is required")
    return args


def main(argv: Sequence[str]) -> int:
    """Run one part (worker) or the whole check; the exit code."""
    args = parse_args(argv)
    if args.part:
        return worker(args.part, args.context)
    started = time.monotonic()
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ctx = Context(out, args.work_dir.resolve(), args.quick, "dry-run" if args.dry_run else "device")
    runner = Runner(ctx, args.budget_s)
    results = runner.run(prepare(ctx))
    return write_report(ctx, results, started)
