"""The build part: ``cuda_ext`` compiled for the device's architecture, timed, its SASS checked.

Named ext_build, not build, so that it can never be taken for the PyPI ``build`` package.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from .context import Context, PartFailed, child_env
from .processes import run_bounded, tail_of


def status_json(log: Path) -> dict[str, Any]:
    """The JSON status ``python -m tierkv.ops build`` prints last."""
    text = log.read_text(errors="replace")
    start_at = text.rfind("\n{")
    try:
        return json.loads(text[start_at + 1:]) if start_at >= 0 else {}
    except json.JSONDecodeError:
        return {}


def elf_archs(library: str) -> list[str]:
    """The SASS architectures in a built library (``cuobjdump --list-elf``), when cuobjdump exists."""
    if shutil.which("cuobjdump") is None:
        return []
    result = subprocess.run(["cuobjdump", "--list-elf", library], capture_output=True, text=True, timeout=120)
    return sorted(set(re.findall(r"sm_\d+a?", result.stdout)))


def part_build(ctx: Context) -> dict[str, Any]:
    """``python -m tierkv.ops build`` for the device's architecture (TORCH_CUDA_ARCH_LIST), timed."""
    if not ctx.arch:
        raise PartFailed("no device architecture known (the environment part found none)")
    arch = "sm_" + ctx.arch.replace(".", "")
    log = ctx.logs / "build.log"
    command = [sys.executable, "-m", "tierkv.ops", "build", "--build-dir", str(ctx.build_dir), "--verbose"]
    finished = run_bounded(command, log, child_env(ctx), 330)
    status = status_json(log)
    figures: dict[str, Any] = {"arch": arch, "TORCH_CUDA_ARCH_LIST": ctx.arch, "build_s": round(finished.seconds, 1),
                               "library": status.get("library"), "cuda_kernels": status.get("cuda_kernels")}
    if finished.timed_out or finished.returncode != 0 or not status.get("cuda_kernels"):
        reason = (f"built without CUDA kernels: {status.get('cuda_reason')}" if status.get("loaded")
                  else f"build failed: {status.get('reason') or 'no status printed'}")
        raise PartFailed(f"{reason}; the compiler's last lines:\n{tail_of(log, 60)}", figures)
    figures["sass"] = elf_archs(status["library"])
    if figures["sass"] and arch not in figures["sass"]:
        raise PartFailed(f"the library has SASS for {figures['sass']}, not for {arch}", figures)
    return figures
