"""The runner: every part in order, each in a process of its own with its own timeout, in one budget.

The environment part runs first and decides the mode (device or dry run); a CUDA part is
skipped in a dry run, a part that needs the extension is not run when the build failed, and the
nvcc compile test runs in the background beside the build and is collected last.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from .context import NO_CUDA, SCRIPT, Context, PartResult, child_env
from .parts import BACKGROUND, PART_BY_NAME, PARTS, Part
from .processes import finish, start


class Runner:
    """Runs the parts in order, each in a process of its own, within one budget."""

    def __init__(self, ctx: Context, budget_s: float) -> None:
        self.ctx = ctx
        self.deadline = time.monotonic() + budget_s
        self.results: dict[str, PartResult] = {}
        self.background: dict[str, tuple[subprocess.Popen[bytes], float, float]] = {}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def command(self, part: Part) -> list[str]:
        return [sys.executable, str(SCRIPT), "--part", part.name, "--context", str(self.ctx.save())]

    def skip_reason(self, part: Part) -> str | None:
        """Why ``part`` does not run in this mode, or None when it does."""
        if part.cuda and self.ctx.mode != "device":
            return "dry run (--dry-run)" if self.ctx.arch else NO_CUDA
        if part.quick_skips and self.ctx.quick:
            return "left out by --quick"
        return None

    def skip(self, part: Part, reason: str) -> PartResult:
        result = PartResult(part.name, part.title, part.cuda, "skipped", reason,
                            skip_allowed=self.ctx.mode != "device" or reason.startswith("left out by --quick"))
        self.results[part.name] = result
        return result

    def launch(self, part: Part) -> tuple[subprocess.Popen[bytes], float, float] | None:
        """Start a part's process with the time it may take; None when the budget is spent."""
        timeout = min(part.timeout_s, self.remaining() - 5)
        if timeout < 10:
            self.results[part.name] = PartResult(part.name, part.title, part.cuda, "failed",
                                                 f"not run: the {self.remaining():.0f} s left of the budget "
                                                 "are too few")
            return None
        (self.ctx.out / "parts" / f"{part.name}.json").unlink(missing_ok=True)
        return start(self.command(part), self.ctx.logs / f"part_{part.name}.log", child_env(self.ctx)), \
            time.monotonic(), timeout

    def collect(self, part: Part, process: subprocess.Popen[bytes], started: float, timeout: float) -> PartResult:
        """Wait for a part's process and turn what it wrote into a result."""
        log = self.ctx.logs / f"part_{part.name}.log"
        finished = finish(process, log, timeout - (time.monotonic() - started), started)
        path = self.ctx.out / "parts" / f"{part.name}.json"
        if finished.timed_out:
            result = PartResult(part.name, part.title, part.cuda, "failed",
                                f"timed out after {finished.seconds:.0f} s:\n{finished.tail}")
        elif not path.is_file():
            result = PartResult(part.name, part.title, part.cuda, "failed",
                                f"the part's process ended with {finished.returncode} and no result:\n{finished.tail}")
        else:
            outcome = json.loads(path.read_text())
            result = PartResult(part.name, part.title, part.cuda, outcome["status"], outcome["reason"],
                                figures=outcome["figures"])
        result.duration_s = round(finished.seconds, 1)
        result.skip_allowed = result.status == "skipped" and self.ctx.mode != "device"
        self.results[part.name] = result
        print(f"[gpu_check] {part.name}: {result.status} in {result.duration_s} s", flush=True)
        return result

    def run_part(self, part: Part) -> PartResult | None:
        reason = self.skip_reason(part)
        if reason:
            return self.skip(part, reason)
        if part.needs_build and self.ctx.build_ok is False:
            result = PartResult(part.name, part.title, part.cuda, "failed", "not run: the extension build failed")
            self.results[part.name] = result
            return result
        launched = self.launch(part)
        result = self.collect(part, *launched) if launched else self.results[part.name]
        if part.name == "build":
            self.ctx.build_ok = result.status == "passed"
        return result

    def start_background(self, part: Part) -> None:
        reason = self.skip_reason(part)
        if reason:
            self.skip(part, reason)
            return
        launched = self.launch(part)
        if launched:
            self.background[part.name] = launched

    def finish_background(self) -> None:
        for name, launched in self.background.items():
            self.collect(PART_BY_NAME[name], *launched)

    def run(self, prepare: dict[str, Any]) -> list[PartResult]:
        """Environment first (it decides the mode), then the rest in order."""
        env = self.run_part(PARTS[0])
        cuda = (env.figures.get("cuda") or {}) if env else {}
        if env is not None:
            env.figures["prepare"] = prepare
        if cuda.get("available"):
            self.ctx.arch = cuda["capability"]
        elif self.ctx.mode == "device":
            self.ctx.mode = "dry-run"
        for part in PARTS[1:]:
            if part.name in BACKGROUND:
                self.start_background(part)
            else:
                self.run_part(part)
        self.finish_background()
        return [self.results[part.name] for part in PARTS]
