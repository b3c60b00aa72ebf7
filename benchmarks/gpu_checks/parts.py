"""The list of parts, in the order they run, and the worker that runs one part in its own process.

Each part is a function ``(Context) -> figures`` in the module of its job; here they get their
names, titles, timeouts and rules (CUDA or not, left out by ``--quick``, needs the build).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .context import Context, PartFailed, PartSkipped
from .environment import part_environment
from .ext_build import part_build
from .pressure import part_pressure, part_pressure_rehearsal
from .sanitizers import part_memcheck, part_racecheck
from .suite import part_cpu_ops_tests, part_cuda_tests, part_nvcc_compile, part_test_selection
from .timings import part_timings


@dataclass(frozen=True)
class Part:
    """One step of the check: CPU or CUDA, its timeout, and the function a part process runs."""

    name: str
    title: str
    cuda: bool
    timeout_s: float
    run: Callable[[Context], dict[str, Any]]
    quick_skips: bool = False  # --quick leaves it out
    needs_build: bool = False  # meaningless without the extension: not run when the build failed


PARTS = (
    Part("environment", "Python, torch, CUDA, tools, dependencies, backends", False, 180, part_environment),
    Part("nvcc_compile", "nvcc compile test (in the background)", True, 430, part_nvcc_compile, quick_skips=True),
    Part("test_selection", "CUDA test ids still collect", False, 240, part_test_selection),
    Part("cpu_ops_tests", "reference ops tests (CPU)", False, 240, part_cpu_ops_tests),
    Part("pressure_rehearsal", "pressure scenario logic (CPU, modelled device)", False, 180, part_pressure_rehearsal),
    Part("build", "build cuda_ext for the device's arch", True, 340, part_build),
    Part("cuda_tests", "every CUDA test of the suite", True, 250, part_cuda_tests),
    Part("pressure", "NVML pressure scenario on the device", True, 180, part_pressure),
    Part("timings", "gather/scatter, connectors, matmul overlap ratios", True, 240, part_timings, needs_build=True),
    Part("memcheck", "compute-sanitizer memcheck over the kernel tests", True, 250, part_memcheck, needs_build=True),
    Part("racecheck", "compute-sanitizer racecheck (shared memory kernel)", True, 160, part_racecheck,
         quick_skips=True, needs_build=True),
)
BACKGROUND = ("nvcc_compile",)  # started right after the environment part (beside the build), collected last
PART_BY_NAME = {part.name: part for part in PARTS}


def worker(name: str, context: Path) -> int:
    """Run one part in this process and write its outcome to ``DIR/parts/NAME.json``."""
    ctx = Context.load(context)
    part = PART_BY_NAME[name]
    outcome: dict[str, Any]
    try:
        outcome = {"status": "passed", "reason": "", "figures": part.run(ctx)}
    except PartSkipped as exc:
        outcome = {"status": "skipped", "reason": str(exc), "figures": exc.figures}
    except PartFailed as exc:
        outcome = {"status": "failed", "reason": str(exc), "figures": exc.figures}
    except Exception as exc:  # a bug or an unexpected error is a failed part, with its traceback in the log
        import traceback

        traceback.print_exc()
        outcome = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "figures": {}}
    path = ctx.out / "parts" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(outcome, indent=2, default=str))
    return 0
