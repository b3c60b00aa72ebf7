"""The environment part: Python, torch, the CUDA device, tools, dependencies, tierkv's backends.

It runs first and decides the mode: without a CUDA device the run becomes a dry run and every
CUDA part is reported skipped; with one, the device's capability pins the extension's build.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from .context import NO_CUDA, Context, GiB, PartFailed
from .dependencies import REQUIRED_BACKENDS, RUNTIME_MODULES, TEST_MODULES


def module_versions(modules: dict[str, str]) -> dict[str, str]:
    """Version (or import error) of each module, imported in this process."""
    versions: dict[str, str] = {}
    for module, dist in modules.items():
        try:
            imported = __import__(module)
            versions[dist] = str(getattr(imported, "__version__", "imported"))
        except Exception as exc:  # report every missing piece, not the first
            versions[dist] = f"missing: {type(exc).__name__}: {exc}"
    return versions


def tool_version(command: Sequence[str]) -> str | None:
    """The last line of a tool's ``--version`` (None when it is not on PATH)."""
    if shutil.which(command[0]) is None:
        return None
    try:
        result = subprocess.run(list(command), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[-1] if lines else ""


def cuda_device() -> dict[str, Any]:
    """The CUDA device torch sees (``available`` False and why, without one)."""
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "reason": NO_CUDA, "torch_cuda": torch.version.cuda}
    major, minor = torch.cuda.get_device_capability(0)
    props = torch.cuda.get_device_properties(0)
    return {"available": True, "name": torch.cuda.get_device_name(0), "capability": f"{major}.{minor}",
            "arch": f"sm_{major}{minor}", "total_memory_gib": round(props.total_memory / GiB, 2),
            "count": torch.cuda.device_count(), "torch_cuda": torch.version.cuda,
            "multiprocessors": props.multi_processor_count}


def part_environment(ctx: Context) -> dict[str, Any]:
    """Python, torch, CUDA device, tools, dependencies and tierkv's backends: what the rest relies on."""
    figures: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                               "cpus": os.cpu_count(), "modules": module_versions({**RUNTIME_MODULES, **TEST_MODULES})}
    figures["cuda"] = cuda_device()
    figures["tools"] = {"nvcc": tool_version(["nvcc", "--version"]),
                        "compute-sanitizer": tool_version(["compute-sanitizer", "--version"]),
                        "ninja": tool_version(["ninja", "--version"]), "cuobjdump": shutil.which("cuobjdump")}
    try:
        from tierkv import ops
        from tierkv.backend import registry
        from tierkv.tiers.tier_pressure import nvml_status
    except Exception as exc:
        raise PartFailed(f"tierkv does not import: {type(exc).__name__}: {exc}", figures) from exc
    figures["backends"] = sorted(registry.installed())
    figures["nvml"] = nvml_status()
    figures["extension"] = ops.extension_status()["reason"]
    missing = [dist for dist, version in figures["modules"].items() if version.startswith("missing")]
    if missing:
        raise PartFailed(f"missing modules: {', '.join(missing)}", figures)
    absent = sorted(set(REQUIRED_BACKENDS) - set(figures["backends"]))
    if absent:
        raise PartFailed(f"tierkv backends not found through entry points: {absent}", figures)
    return figures
