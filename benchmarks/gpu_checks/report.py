"""The report: ``gpu_check.json`` (every part's status, reason, figures), ``gpu_check.md``, exit code.

Exit code 0 when no part failed and every skip was allowed: a dry run, or a part left out by
``--quick``; on a CUDA machine any other skipped CUDA part counts as failed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from .context import NO_CUDA, Context, PartResult


def summary_of(result: PartResult) -> str:
    """One short cell: the part's key figures or the first line of its reason."""
    figures = result.figures
    if result.status != "passed":
        return result.reason.splitlines()[0][:160] if result.reason else ""
    if "ratios" in figures:
        return "; ".join(f"{r['name']}: {r['value']} ({r['target']}, {'met' if r['met'] else 'MISSED'})"
                         for r in figures["ratios"])
    if "verdict" in figures:
        return figures["verdict"]
    if "passed" in figures:
        return f"{figures['passed']} passed, {figures['failed']} failed, {figures['skipped']} skipped"
    if "checks" in figures:
        return f"{sum(c['ok'] for c in figures['checks'])}/{len(figures['checks'])} checks"
    if "build_s" in figures:
        return f"{figures['arch']} in {figures['build_s']} s"
    if "cuda" in figures:
        cuda = figures["cuda"]
        return f"{cuda.get('name', NO_CUDA)}; torch {figures['modules'].get('torch')}; python {figures['python']}"
    if "collected" in figures:
        return f"{figures['collected']} tests collected"
    return ""


def markdown(results: Sequence[PartResult], report: dict[str, Any]) -> str:
    """The short table of ``gpu_check.md``."""
    lines = [f"# tierkv GPU check ({report['mode']}, exit {report['exit_code']}, {report['duration_s']} s)", "",
             "| part | CUDA | status | s | result |", "|---|---|---|---|---|"]
    for result in results:
        cell = summary_of(result).replace("|", "/").replace("\n", " ")
        lines.append(f"| {result.name} | {'yes' if result.cuda else 'no'} | {result.status} | {result.duration_s} "
                     f"| {cell} |")
    return "\n".join(lines) + "\n"


def exit_code(results: Sequence[PartResult]) -> int:
    """0 when nothing failed and every skip was allowed (dry run, or left out by --quick)."""
    bad = [r for r in results if r.status == "failed" or (r.status == "skipped" and not r.skip_allowed)]
    return 1 if bad else 0


def write_report(ctx: Context, results: Sequence[PartResult], started: float) -> int:
    """Write gpu_check.json and gpu_check.md, print the table, return the exit code."""
    code = exit_code(results)
    counts = {status: sum(r.status == status for r in results) for status in ("passed", "failed", "skipped")}
    report = {"tool": "benchmarks/gpu_check.py", "mode": ctx.mode, "quick": ctx.quick, "exit_code": code,
              "duration_s": round(time.monotonic() - started, 1), "arch": ctx.arch, "summary": counts,
              "parts": {r.name: r.to_dict() for r in results}}
    (ctx.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(results, report)
    (ctx.out / "gpu_check.md").write_text(table)
    print(table, flush=True)
    return code
