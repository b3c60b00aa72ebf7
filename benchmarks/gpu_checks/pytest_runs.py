"""Runs of the test suite in a subprocess, counted from their JUnit XML, with the device's rules.

On a CUDA machine every selected test must really run: ``require_clean_run`` fails a run
with a failure, a timeout, no test passed, or (on the device) any skip.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .context import Context, PartFailed, child_env
from .processes import Finished, run_bounded


@dataclass
class PytestRun:
    """Counts and details of one pytest run, from its JUnit XML."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {"passed": self.passed, "failed": self.failed, "skipped": self.skipped,
                "skip_reasons": sorted(set(self.skip_reasons))[:10], "failures": self.failures[:10]}


def parse_junit(path: Path) -> PytestRun:
    """Count passed / failed (errors included) / skipped test cases in a JUnit XML report."""
    run = PytestRun()
    if not path.is_file():
        return run
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            run.failed += 1
            run.failures.append(f"{name}: {(problem.get('message') or '').strip()[:300]}")
        elif skipped is not None:
            run.skipped += 1
            run.skip_reasons.append((skipped.get("message") or "").strip()[:300])
        else:
            run.passed += 1
    return run


def pytest_command(node_ids: Sequence[str], junit: Path, *options: str, python: Sequence[str] = ()) -> list[str]:
    """``python -m pytest`` over ``node_ids`` with skips shown (-rs) and a JUnit report."""
    return [*(python or [sys.executable]), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
            "--junitxml", str(junit), "-o", "timeout=240", *options, *node_ids]


def run_tests(ctx: Context, name: str, node_ids: Sequence[str], timeout_s: float, *options: str,
              env: dict[str, str] | None = None) -> tuple[Finished, PytestRun]:
    """Run tests in a subprocess; return how it ended and the counts."""
    junit = ctx.logs / f"{name}.xml"
    junit.unlink(missing_ok=True)
    finished = run_bounded(pytest_command(node_ids, junit, *options), ctx.logs / f"{name}.log",
                           env or child_env(ctx), timeout_s)
    return finished, parse_junit(junit)


def require_clean_run(finished: Finished, run: PytestRun, device: bool) -> dict[str, Any]:
    """Figures of a test run, or PartFailed when a test failed, it timed out, or (on a CUDA
    machine) a test skipped: there every selected test must really run."""
    figures = run.figures()
    if finished.timed_out:
        raise PartFailed(f"timed out after {finished.seconds:.0f} s:\n{finished.tail}", figures)
    if run.failed or finished.returncode not in (0,) or run.passed == 0:
        raise PartFailed(f"pytest exit {finished.returncode}, {run.failed} failed, {run.passed} passed:\n"
                         f"{finished.tail}", figures)
    if device and run.skipped:
        raise PartFailed(f"{run.skipped} CUDA tests skipped on a CUDA machine: {figures['skip_reasons']}", figures)
    return figures
