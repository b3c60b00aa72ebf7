"""What every part shares: the results a part reports, the run's context, the child environment.

A part runs in a process of its own (``gpu_check.py --part NAME``), so the context it needs is
written to ``DIR/context.json`` and read back there; a part reports by returning its figures or
raising ``PartFailed`` / ``PartSkipped``, which the worker turns into a
``PartResult``. Every process the check starts gets ``child_env``: this checkout and the
private import directory on PYTHONPATH, the extension cache shared, the device's architecture.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"  # the entry script each part process re-runs (--part)
NO_CUDA = "no CUDA device"
DEFAULT_BUDGET_S = 570.0
MiB = 1 << 20
GiB = 1 << 30


class PartFailed(Exception):
    """A part ran and found a problem; ``figures`` says what it measured before that."""

    def __init__(self, reason: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.figures = figures or {}


class PartSkipped(Exception):
    """A part could not run here, for ``reason``."""

    def __init__(self, reason: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.figures = figures or {}


@dataclass
class PartResult:
    """What one part reports: status passed / failed / skipped, why, and what it measured."""

    name: str
    title: str
    cuda: bool
    status: str
    reason: str = ""
    duration_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    skip_allowed: bool = False  # a skip that does not fail a device run (asked for with --quick)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Context:
    """What every part needs to know; written to ``DIR/context.json`` for the part processes."""

    out: Path
    work: Path
    quick: bool
    mode: str  # "device" or "dry-run"
    arch: str | None = None  # "9.0" on an H100
    build_ok: bool | None = None  # None until the build part ran

    @property
    def site(self) -> Path:
        """Private import directory: unpacked wheels and the entry-point dist-info."""
        return self.work / "site"

    @property
    def build_dir(self) -> Path:
        """The extension's build cache (kept across reruns on a warm machine: a rerun does not recompile)."""
        return self.work / "ext"

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def save(self) -> Path:
        path = self.out / "context.json"
        path.write_text(json.dumps({"out": str(self.out), "work": str(self.work), "quick": self.quick,
                                    "mode": self.mode, "arch": self.arch, "build_ok": self.build_ok}))
        return path

    @classmethod
    def load(cls, path: Path) -> Context:
        raw = json.loads(path.read_text())
        return cls(Path(raw["out"]), Path(raw["work"]), raw["quick"], raw["mode"], raw["arch"], raw["build_ok"])


def child_env(ctx: Context, **extra: str) -> dict[str, str]:
    """Environment of every process the check starts: this checkout and the private directory
    importable, the extension cache shared, the build pinned to the device's architecture."""
    env = dict(os.environ)
    paths = [str(ctx.site), str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["TORCH_EXTENSIONS_DIR"] = str(ctx.build_dir)
    env["MAX_JOBS"] = str(os.cpu_count() or 4)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if ctx.arch:
        env["TORCH_CUDA_ARCH_LIST"] = ctx.arch
    env.update(extra)
    return env
