"""Benchmark entry point (the README's main job): runs the suites, prints a table,
writes JSON and CSV under ``bench-results/``."""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from core import run_core  # noqa: E402


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = ["tier", "op", "batch", "ours_ms", "baseline_ms", "ours_GBps", "baseline_GBps", "ratio", "target", "meets", "baseline"]
    shown = [c for c in columns if any(c in r for r in rows)]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if value < 100 else f"{value:.0f}"
        return "" if value is None else str(value)

    table = [[cell(r.get(c)) for c in shown] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(shown)]
    print("  ".join(c.ljust(w) for c, w in zip(shown, widths)))
    print("  ".join("-" * w for w in widths))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench-results", help="directory for JSON/CSV results")
    parser.add_argument("--batch", type=int, default=8, help="chunks per batch (32 MiB each)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    started = time.time()
    rows = run_core(batch=args.batch, repeats=args.repeats)
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "cpus": __import__("os").cpu_count(), "seconds": round(time.time() - started, 1)}
    (out / "core.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    with open(out / "core.csv", "w", newline="") as handle:
        fields = sorted({k for r in rows for k in r})
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nresults: {out / 'core.json'}, {out / 'core.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
