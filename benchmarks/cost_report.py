"""The cost-aware benchmark's output: its table, its verdict on the targets, cost.json, cost.csv, cost.png.

Made of the rows ``cost.py`` measures, and nothing else: the sweep (the throttled tiers, the three
policies timed at each point) stays there, what is printed and written of it is here.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

TOLERANCE = 1.05
COLUMNS = ["tier", "tokens", "latency_ms", "bandwidth_MBps", "never_s", "always_s", "cost_aware_s",
           "planned_tokens", "cached_tokens", "hot_tokens", "vs_always", "vs_never", "confirm_rounds", "cost_vs_best",
           "partial_win"]


def summarize_cost(rows: list[dict[str, Any]]) -> bool:
    """Print the targets and whether each is met; True when all are."""
    worst = max(rows, key=lambda r: r["cost_vs_best"])
    within = worst["cost_vs_best"] <= TOLERANCE
    partial = [r for r in rows if r["partial_win"]]
    print(f"cost-aware vs min(always, never), worst point: {worst['cost_vs_best']:.3f}x "
          f"({worst['tier']}, {worst['tokens']} tokens, {worst['latency_ms']:g} ms, {worst['bandwidth_MBps']:g} MB/s)"
          f" -- target <= {TOLERANCE}x: {'met' if within else 'NOT MET'}")
    print(f"points where a partial load beat both always and never: {len(partial)} of {len(rows)}"
          f" -- target >= 1: {'met' if partial else 'NOT MET'}")
    if partial:
        best = min(partial, key=lambda r: r["cost_aware_s"] / min(r["always_s"], r["never_s"]))
        print(f"  best: {best['tier']}, {best['tokens']} tokens, {best['latency_ms']:g} ms, {best['bandwidth_MBps']:g}"
              f" MB/s: cost-aware {best['cost_aware_s']:.3f}s vs always {best['always_s']:.3f}s, never "
              f"{best['never_s']:.3f}s ({best['planned_tokens']} of {best['cached_tokens']} tokens loaded)")
    s3_rows = [r for r in rows if "requests" in r]
    one_pass = all(r["requests"].get("HEAD", 0) == 0 and set(r["requests"]) <= {"GET"} for r in s3_rows)
    if s3_rows:
        heads = sum(r["requests"].get("HEAD", 0) for r in s3_rows)
        gets = sum(r["requests"].get("GET", 0) for r in s3_rows)
        chunks = sum(r["chunks_from_slow"] for r in s3_rows)
        print(f"s3 retrieves: {gets} GETs for {chunks} planned chunks from s3, {heads} HEADs"
              f" -- target: GETs only: {'met' if one_pass else 'NOT MET'}")
    return within and bool(partial) and one_pass


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a plain text table of ``COLUMNS``."""
    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    widths = {c: max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in COLUMNS}
    print("  ".join(c.rjust(widths[c]) for c in COLUMNS))
    for row in rows:
        print("  ".join(cell(row.get(c, "")).rjust(widths[c]) for c in COLUMNS))


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Time vs tier bandwidth, one panel per (tier, length, latency), three lines each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = sorted({(r["tier"], r["tokens"], r["latency_ms"]) for r in rows})
    columns = len({(r["tier"], r["latency_ms"]) for r in rows})
    lengths = sorted({r["tokens"] for r in rows})
    figure, axes = plt.subplots(len(lengths), columns, figsize=(4 * columns, 3.2 * len(lengths)), squeeze=False)
    column_of = {key: i for i, key in enumerate(sorted({(r["tier"], r["latency_ms"]) for r in rows}))}
    for tier, tokens, latency in panels:
        ax = axes[lengths.index(tokens)][column_of[(tier, latency)]]
        points = sorted((r for r in rows if (r["tier"], r["tokens"], r["latency_ms"]) == (tier, tokens, latency)),
                        key=lambda r: r["bandwidth_MBps"])
        x = [r["bandwidth_MBps"] for r in points]
        for key, label, style in (("always_s", "always load", "o--"), ("never_s", "never (recompute)", "s:"),
                                  ("cost_aware_s", "cost-aware", "^-")):
            ax.plot(x, [r[key] for r in points], style, label=label)
        ax.set_xscale("log")
        ax.set_title(f"{tier}, {tokens} tokens, +{latency:g} ms", fontsize=9)
        ax.set_xlabel("tier bandwidth (MB/s)", fontsize=8)
        ax.set_ylabel("time to KV ready (s)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> list[str]:
    """``cost.json``, ``cost.csv`` and (with matplotlib) ``cost.png`` under ``out``; their names."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    with open(out / "cost.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return ["cost.json", "cost.csv"] + (["cost.png"] if plot(rows, out / "cost.png") else [])
