"""compute-sanitizer over the kernel tests: memcheck on every tierkv kernel, racecheck on shared memory.

Each run wraps pytest over the kernel tests' node ids (see ``suite``) and reads the sanitizer's
summary line as well as the tests' JUnit counts: both must be clean.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .context import Context, PartFailed, PartSkipped, child_env
from .processes import Finished, run_bounded
from .pytest_runs import parse_junit, pytest_command, require_clean_run
from .suite import KERNEL_TESTS, RACECHECK_TESTS

KERNEL_NAMES = ("paged_copy_kernel", "kv_deviation_kernel", "blend_scatter_kernel", "rope_rerotate_kernel")
SHARED_MEMORY_KERNELS = ("kv_deviation_kernel",)


def sanitizer_path() -> str | None:
    """compute-sanitizer on PATH, else in the CUDA toolkit nvcc belongs to."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "compute-sanitizer").is_file():
            return str(Path(root) / "bin" / "compute-sanitizer")
    return None


def sanitizer_verdict(text: str) -> tuple[int | None, str]:
    """Errors counted by the sanitizer's summary line, and that line."""
    matches = re.findall(r"(ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: .*?\((\d+) errors?.*?\))", text)
    if not matches:
        return None, "no summary line"
    line, errors, race_errors = matches[-1]
    return int(errors or race_errors), line


def sanitize(ctx: Context, tool: str, kernels: Sequence[str], node_ids: Sequence[str], timeout_s: float
             ) -> tuple[Finished, str, list[str]]:
    """One compute-sanitizer run over pytest; how it ended, its log's text and its command."""
    sanitizer = sanitizer_path()
    assert sanitizer is not None
    junit = ctx.logs / f"sanitizer_{tool}.xml"
    junit.unlink(missing_ok=True)
    filters = [option for kernel in kernels for option in ("--kernel-name", f"kns={kernel}")]
    command = [sanitizer, "--tool", tool, "--error-exitcode", "86", "--report-api-errors", "no",
               "--print-limit", "100", *filters, *pytest_command(node_ids, junit)]
    log = ctx.logs / f"sanitizer_{tool}.log"
    finished = run_bounded(command, log, child_env(ctx, PYTORCH_NO_CUDA_MEMORY_CACHING="1"), timeout_s)
    return finished, log.read_text(errors="replace"), command


def run_sanitizer(ctx: Context, tool: str, kernels: Sequence[str], node_ids: Sequence[str], timeout_s: float
                  ) -> dict[str, Any]:
    """compute-sanitizer ``tool`` over pytest running ``node_ids``, checking tierkv's kernels.

    The caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so every tensor is its own
    allocation and an out-of-bounds access cannot land silently in a neighbour's cached block.
    CUDA API errors are not counted (--report-api-errors no): torch probes the driver in ways
    that fail by design, and an API error of tierkv's own surfaces as a test failure anyway.
    Only tierkv's kernels are instrumented (--kernel-name kns=...); if this sanitizer rejects the
    filters (no summary, no test ran) it runs once more over every kernel.
    """
    if sanitizer_path() is None:
        raise PartSkipped("compute-sanitizer is not on PATH")
    started = time.monotonic()
    finished, text, command = sanitize(ctx, tool, kernels, node_ids, timeout_s)
    errors, line = sanitizer_verdict(text)
    run = parse_junit(ctx.logs / f"sanitizer_{tool}.xml")
    if errors is None and run.passed + run.failed == 0 and not finished.timed_out:
        kernels = ()
        finished, text, command = sanitize(ctx, tool, kernels, node_ids, timeout_s - (time.monotonic() - started))
        errors, line = sanitizer_verdict(text)
        run = parse_junit(ctx.logs / f"sanitizer_{tool}.xml")
    figures = {"tool": tool, "verdict": line, "errors": errors, "kernels": list(kernels) or "all",
               "node_ids": list(node_ids), "command": " ".join(command[: command.index("-m")]),
               "seconds": round(time.monotonic() - started, 1), **run.figures()}
    if finished.timed_out:
        raise PartFailed(f"{tool} timed out after {finished.seconds:.0f} s:\n{finished.tail}", figures)
    if errors != 0 or finished.returncode != 0:
        raise PartFailed(f"{tool}: {line}; exit {finished.returncode}:\n{finished.tail}", figures)
    require_clean_run(finished, run, device=True)
    return figures


def part_memcheck(ctx: Context) -> dict[str, Any]:
    """compute-sanitizer memcheck over the kernel tests."""
    return run_sanitizer(ctx, "memcheck", KERNEL_NAMES, KERNEL_TESTS, 240)


def part_racecheck(ctx: Context) -> dict[str, Any]:
    """compute-sanitizer racecheck over the kernel with shared memory (kv_deviation)."""
    return run_sanitizer(ctx, "racecheck", SHARED_MEMORY_KERNELS, RACECHECK_TESTS, 150)
