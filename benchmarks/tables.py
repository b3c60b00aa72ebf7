"""Printing and writing benchmark rows, shared by every benchmark script (run.py, prompt.py,
vllm_ttft.py, ...): a leaf module, so the scripts import it and never each other."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """The rows as an aligned text table, with only the ``columns`` some row has."""
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


def write_results(out: Path, name: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``<name>.json`` (rows and ``meta``) and ``<name>.csv`` under ``out``."""
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    with open(out / f"{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
