#!/usr/bin/env python
"""One prepared check of every CUDA path of tierkv (issue 36), under 10 minutes on one H100.

    python benchmarks/gpu_check.py --out DIR [--dry-run] [--quick]

On a CUDA machine it builds ``cuda_ext`` for the device's architecture, runs every CUDA test of the
suite (a CUDA test that skips there is a failure), runs a memory-pressure scenario on the real
device (NVML readings, a second process allocating device memory), runs compute-sanitizer over
the kernel tests, and times the kernels, the connectors and a matmul beside a store copy as
ratios. Without CUDA (or with ``--dry-run``) it runs the CPU parts and reports every CUDA part as
skipped with the reason ("no CUDA device"), so CI keeps the script honest.

Each part runs in its own process group with its own timeout, all under one budget (570 s by
default); the results go to ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` (the table is printed
too), each part's output to ``DIR/logs/``. Exit code 0 when no part failed; on a CUDA machine a
CUDA part that was skipped counts as failed unless ``--quick`` skipped it.

The GPU machine has no network. What tierkv needs beyond its image (only ``lmdb``) travels as
wheels in ``benchmarks/gpu_wheels/`` (``scripts/gpu_wheels.sh``) and is installed from there with
pip, or unpacked into a private directory when pip cannot install. tierkv itself runs from this
checkout (``PYTHONPATH``); its backends are found through entry points, so when the checkout is
not installed a minimal ``tierkv-*.dist-info`` declaring them is written to that directory.

Over 400 lines (about 1,670) for now: one script that a bare GPU machine runs from the
checkout, each part re-running this file as a subprocess (``--part``), so the parts share its
context and helpers without an install. Splitting it into a package (build, suite, pressure,
sanitizers, timings) is planned with the restructuring of issue 49.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import itertools
import json
import logging
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from tierkv import Engine
    from tierkv.policy.pressure import MemoryReading

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "benchmarks" / "gpu_wheels"
NO_CUDA = "no CUDA device"
DEFAULT_BUDGET_S = 570.0
MiB = 1 << 20
GiB = 1 << 30

# Every test of the suite that needs a GPU (found by reading tests/ for cuda: test_ops' CUDA
# kernels, the device connector round trip, the gpu tier's streams and pinned staging, the pinned
# host tier, the NVML state in stats) and the nvcc compile test. Node ids, so that a renamed test
# fails the dry run's selection part instead of silently dropping out.
KERNEL_TESTS = (
    "tests/ops/test_ops.py::test_cuda_paged_gather_scatter_bit_exact",
    "tests/ops/test_ops.py::test_cuda_blend_ops",
)
DEVICE_TESTS = (
    "tests/connectors/test_connectors.py::test_cuda_paged_round_trip",
    "tests/engine/test_tiering.py::test_gpu_tier_on_cuda_round_trips_through_streams_and_pinned_staging",
    "tests/engine/test_tiering.py::test_host_tier_is_pinned_when_cuda_is_present",
    "tests/engine/test_tiering.py::test_stats_report_nvml_state_and_per_tier_counters",
)
NVCC_TESTS = ("tests/ops/test_cuda_ext_build.py::test_cuda_source_compiles_with_nvcc",)
RACECHECK_TESTS = ("tests/ops/test_ops.py::test_cuda_blend_ops",)  # kv_deviation is the kernel with shared memory
CPU_OPS_TESTS = ("tests/ops/test_ops.py",)
CPU_OPS_FILTER = "not extension and not cuda and not opcheck"  # the reference ops: no build needed
KERNEL_NAMES = ("paged_copy_kernel", "kv_deviation_kernel", "blend_scatter_kernel", "rope_rerotate_kernel")
SHARED_MEMORY_KERNELS = ("kv_deviation_kernel",)

# import name -> distribution, for tierkv's runtime dependencies (pyproject.toml)
RUNTIME_MODULES = {"torch": "torch", "numpy": "numpy", "yaml": "pyyaml", "lmdb": "lmdb", "aiofiles": "aiofiles",
                   "xxhash": "xxhash"}
TEST_MODULES = {"pytest": "pytest", "pytest_timeout": "pytest-timeout", "pynvml": "nvidia-ml-py"}
REQUIRED_BACKENDS = ("cpu", "gpu", "lmdb")


# ---------------------------------------------------------------------------- results


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


# ---------------------------------------------------------------------------- processes


@dataclass
class Finished:
    """A finished (or killed) process: its exit code, whether it ran out of time, its output's end."""

    returncode: int
    timed_out: bool
    seconds: float
    tail: str


def tail_of(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log (a compiler's or pytest's verdict is at the end)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def start(command: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own process group (so a timeout ends it and everything it started),
    its output going to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as handle:
        handle.write(f"$ {' '.join(command)}\n".encode())
        handle.flush()
        return subprocess.Popen(list(command), stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)


def finish(process: subprocess.Popen[bytes], log: Path, timeout_s: float, started: float) -> Finished:
    """Wait for a process started by :func:`start`; past ``timeout_s`` kill its process group."""
    timed_out = False
    try:
        process.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the group this check created for it
        except ProcessLookupError:
            pass
        process.wait()
    return Finished(process.returncode, timed_out, time.monotonic() - started, tail_of(log))


def run_bounded(command: Sequence[str], log: Path, env: dict[str, str], timeout_s: float) -> Finished:
    """Run ``command`` to the end or to ``timeout_s``, whichever comes first."""
    started = time.monotonic()
    return finish(start(command, log, env), log, timeout_s, started)


# ---------------------------------------------------------------------------- dependencies


def wheel_for_this_python(dist: str, directory: Path = WHEELS) -> Path | None:
    """The wheel of ``dist`` in ``directory`` built for this interpreter and machine, if any."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = platform.machine()
    prefix = dist.replace("-", "_").lower() + "-"
    for wheel in sorted(directory.glob("*.whl")):
        name = wheel.name.lower()
        if name.startswith(prefix) and f"-{tag}-" in name and (machine in name or name.endswith("-any.whl")):
            return wheel
    return None


def importable(module: str, env: dict[str, str]) -> bool:
    """Whether a fresh interpreter with ``env`` imports ``module`` (a pip install is not visible
    to this process's import caches)."""
    result = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, cwd=REPO, capture_output=True,
                            timeout=120)
    return result.returncode == 0


def extract_wheel(wheel: Path, site: Path) -> None:
    """Unpack a wheel into ``site``: a wheel is a zip of what goes into site-packages, so an
    extension module imports straight from there."""
    site.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)


def install_from_wheels(module: str, dist: str, site: Path, env: dict[str, str], log: Path) -> str:
    """Make ``module`` importable from the shipped wheels: pip first (offline), else unpack."""
    wheel = wheel_for_this_python(dist)
    if wheel is None:
        return f"missing: no {dist} wheel for cp{sys.version_info.major}{sys.version_info.minor} in {WHEELS}"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--find-links", str(WHEELS), dist]
    finished = run_bounded(pip, log, env, 180)
    if finished.returncode == 0 and importable(module, env):
        return f"installed {wheel.name} with pip"
    extract_wheel(wheel, site)
    if importable(module, env):
        return f"unpacked {wheel.name} into {site} (pip could not install it)"
    return f"missing: {wheel.name} neither installs nor imports here"


def ensure_dependencies(ctx: Context) -> dict[str, str]:
    """Each runtime and test dependency: already there, installed from the shipped wheels, or missing."""
    env = child_env(ctx)
    sys.path[:0] = [p for p in (str(ctx.site), str(REPO)) if p not in sys.path]
    found: dict[str, str] = {}
    for module, dist in {**RUNTIME_MODULES, **TEST_MODULES}.items():
        if importlib.util.find_spec(module) is not None:
            found[dist] = "present"
        else:
            found[dist] = install_from_wheels(module, dist, ctx.site, env, ctx.logs / "wheels.log")
    return found


def pyproject_entry_points(pyproject: Path = REPO / "pyproject.toml") -> tuple[str, dict[str, str]]:
    """tierkv's version and its ``tierkv.backends`` entry points, read from pyproject.toml."""
    text = pyproject.read_text()
    version_match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    section = re.search(r'^\[project\.entry-points\."tierkv\.backends"\]\s*$(.*?)(?=^\[|\Z)', text,
                        re.MULTILINE | re.DOTALL)
    if version_match is None or section is None:
        raise ValueError(f"{pyproject}: no version or no [project.entry-points.\"tierkv.backends\"] table")
    points = dict(re.findall(r'^\s*([\w-]+)\s*=\s*"([^"]+)"', section.group(1), re.MULTILINE))
    return version_match.group(1), points


def installed_backends(env: dict[str, str]) -> list[str]:
    """Backend names a fresh interpreter finds through entry points (as the registry does)."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps(sorted({e.name for e in m.entry_points(group='tierkv.backends')})))")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    return json.loads(result.stdout) if result.returncode == 0 else []


def write_dist_info(site: Path) -> Path:
    """A minimal ``tierkv-<version>.dist-info`` in ``site`` declaring the built-in backends: the
    registry finds backends only through entry points, and a checkout on PYTHONPATH has none
    (an editable install needs setuptools >= 70.1 or ``wheel``, which the image may lack)."""
    version, points = pyproject_entry_points()
    dist_info = site / f"tierkv-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tierkv\nVersion: {version}\n")
    lines = ["[tierkv.backends]", *(f"{name} = {target}" for name, target in points.items()), ""]
    (dist_info / "entry_points.txt").write_text("\n".join(lines))
    return dist_info


def ensure_entry_points(ctx: Context) -> str:
    """Make the built-in backends discoverable; say how."""
    env = child_env(ctx)
    if set(REQUIRED_BACKENDS) <= set(installed_backends(env)):
        return "tierkv's entry points are installed"
    path = write_dist_info(ctx.site)
    if set(REQUIRED_BACKENDS) <= set(installed_backends(env)):
        return f"declared by {path}"
    return f"missing: backends {REQUIRED_BACKENDS} not found even with {path}"


# ---------------------------------------------------------------------------- pytest


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


# ---------------------------------------------------------------------------- CPU parts


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


def collected_ids(output: str) -> list[str]:
    """Test ids in ``pytest --collect-only -q`` output."""
    return [line.strip() for line in output.splitlines() if "::" in line and not line.startswith(" ")]


def part_test_selection(ctx: Context) -> dict[str, Any]:
    """Every node id the device runs still names at least one test (a renamed test would
    otherwise silently drop out of the GPU check)."""
    ids = (*KERNEL_TESTS, *DEVICE_TESTS, *NVCC_TESTS, *RACECHECK_TESTS)
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *dict.fromkeys(ids)]
    result = subprocess.run(command, cwd=REPO, env=child_env(ctx), capture_output=True, text=True, timeout=240)
    found = collected_ids(result.stdout)
    per_id = {node: sum(1 for item in found if item == node or item.startswith(node + "[")) for node in ids}
    figures = {"collected": len(set(found)), "per_id": per_id}
    empty = [node for node, count in per_id.items() if count == 0]
    if result.returncode != 0 or empty:
        raise PartFailed(f"collection failed (exit {result.returncode}); no tests for {empty}:\n"
                         f"{result.stdout[-2000:]}{result.stderr[-2000:]}", figures)
    return figures


def part_cpu_ops_tests(ctx: Context) -> dict[str, Any]:
    """The pure-torch reference ops against independent math: cheap, and no build."""
    finished, run = run_tests(ctx, "cpu_ops_tests", CPU_OPS_TESTS, 240, "-k", CPU_OPS_FILTER,
                              env=child_env(ctx, TIERKV_NO_EXT="1"))
    return require_clean_run(finished, run, device=False)


# ---------------------------------------------------------------------------- build


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


# ---------------------------------------------------------------------------- tests on the device


def part_cuda_tests(ctx: Context) -> dict[str, Any]:
    """Every CUDA test of the suite: kernels bit-exact for each layout, dtype and order, blend and
    RoPE, the device connector round trip, the gpu tier and pinned host tier, NVML in stats.

    When the build failed the extension is disabled here (TIERKV_NO_EXT=1): the kernel tests then
    fail at once instead of each recompiling it, and the others run on the reference."""
    extra = {} if ctx.build_ok is not False else {"TIERKV_NO_EXT": "1"}
    finished, run = run_tests(ctx, "cuda_tests", (*KERNEL_TESTS, *DEVICE_TESTS), 240, env=child_env(ctx, **extra))
    figures = {"node_ids": [*KERNEL_TESTS, *DEVICE_TESTS], "extension": "built" if not extra else "build failed"}
    try:
        figures.update(require_clean_run(finished, run, device=True))
    except PartFailed as exc:
        raise PartFailed(str(exc), {**figures, **exc.figures}) from exc
    return figures


def part_nvcc_compile(ctx: Context) -> dict[str, Any]:
    """The suite's nvcc compile test (every .cu file compiles for sm_80); run beside the build."""
    finished, run = run_tests(ctx, "nvcc_compile", NVCC_TESTS, 420)
    return {"node_ids": list(NVCC_TESTS), **require_clean_run(finished, run, device=True)}


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


# ---------------------------------------------------------------------------- memory pressure


class Probe(Protocol):
    """A reading of device memory in use (tierkv.policy.pressure's probe protocol)."""

    name: str

    def read(self) -> MemoryReading: ...


class Squeezer(Protocol):
    """Something that takes device memory away from tierkv, the way a serving engine does."""

    def allocate(self, nbytes: int) -> int:
        """Take ``nbytes`` more; returns the bytes held."""

    def release(self) -> None:
        """Give everything back."""

    def close(self) -> None:
        """Stop."""


@dataclass(frozen=True)
class PressureSizes:
    """Geometry of the pressure scenario: chunks, the gpu tier, the watermarks above the start."""

    layers: int
    heads: int
    head_size: int
    chunk_tokens: int
    chunks_per_prompt: int
    prompts: int
    tier_bytes: int
    host_bytes: int
    low_over: int  # low watermark: this many bytes above the memory in use once the tier is allocated
    high_over: int  # high watermark: this many bytes above the low one
    step: int  # the second process allocates in steps of this many bytes
    max_squeeze: int
    check_hottest: bool  # the hottest chunks must stay (needs a tier of several slab segments)
    poll_ms: int = 5
    settle_s: float = 5.0  # how long the freed memory may take to show in the readings

    @property
    def chunk_bytes(self) -> int:
        return self.layers * 2 * self.chunk_tokens * self.heads * self.head_size * 2  # bfloat16

    @property
    def prompt_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.chunk_tokens * self.chunks_per_prompt, self.heads, self.head_size)


# 4 MiB chunks, 56 prompts of 4 chunks (896 MiB) in a 1 GiB tier of 8 slab segments of 128 MiB. Low
# watermark 1.5 GiB above the start (the tier's capacity is capped by the headroom under it, so the
# whole GiB must fit, with room for the engine's own start-up), high 0.5 GiB above that: the second
# process takes about 2 GiB of the H100's 80 GB, and the tier must shed 0.5 to 0.6 GiB of its coldest
# chunks, keeping the hottest.
DEVICE_PRESSURE = PressureSizes(layers=4, heads=8, head_size=128, chunk_tokens=256, chunks_per_prompt=4, prompts=56,
                                tier_bytes=GiB, host_bytes=2 * GiB, low_over=GiB + 512 * MiB, high_over=512 * MiB,
                                step=128 * MiB, max_squeeze=8 * GiB, check_hottest=True)
# the same logic in a few MiB, on a gpu tier with device: cpu and a modelled device
REHEARSAL_PRESSURE = PressureSizes(layers=2, heads=2, head_size=64, chunk_tokens=128, chunks_per_prompt=2,
                                   prompts=24, tier_bytes=8 * MiB, host_bytes=32 * MiB, low_over=10 * MiB,
                                   high_over=4 * MiB, step=MiB, max_squeeze=64 * MiB, check_hottest=False,
                                   poll_ms=2, settle_s=2.0)

SQUEEZER_CODE = r"""
import sys
import torch

device = sys.argv[1]
cuda = device.startswith("cuda")
torch.empty(1, device=device)
held = []
print("held 0", flush=True)
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "exit":
        break
    if words[0] == "alloc":
        held.append(torch.empty(int(words[1]), dtype=torch.uint8, device=device))
    elif words[0] == "free":
        held.clear()
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        torch.cuda.synchronize()
    print("held", sum(t.numel() for t in held), flush=True)
"""


class DeviceSqueezer:
    """A second process that allocates device memory on command (``torch.empty`` on cuda) and
    frees it: the serving engine growing into, then leaving, the GPU tierkv shares."""

    def __init__(self, device: str = "cuda:0") -> None:
        self._process = subprocess.Popen([sys.executable, "-c", SQUEEZER_CODE, device], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self._answer()  # its CUDA context exists before the baseline is read

    def _answer(self) -> int:
        assert self._process.stdout is not None
        line = self._process.stdout.readline().split()
        if len(line) != 2 or line[0] != "held":
            raise PartFailed(f"the allocating process stopped answering (exit {self._process.poll()})")
        return int(line[1])

    def _ask(self, command: str) -> int:
        assert self._process.stdin is not None
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        return self._answer()

    def allocate(self, nbytes: int) -> int:
        return self._ask(f"alloc {nbytes}")

    def release(self) -> None:
        self._ask("free")

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.write("exit\n")
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


class ModelledDevice:
    """A device for the CPU rehearsal: memory in use is a baseline, what the squeezer holds, and
    the gpu tier's allocated bytes; freed tier memory goes straight back (the ideal driver)."""

    name = "modelled"

    def __init__(self, total: int, base: int) -> None:
        self.total = total
        self.base = base
        self.held = 0
        self.tier: Any = None

    def read(self) -> MemoryReading:
        from tierkv.policy.pressure import MemoryReading

        tier_bytes = int(self.tier.stats()["allocated_bytes"]) if self.tier is not None else 0
        return MemoryReading(self.base + self.held + tier_bytes, self.total, time.monotonic())

    def allocate(self, nbytes: int) -> int:
        self.held += nbytes
        return self.held

    def release(self) -> None:
        self.held = 0

    def close(self) -> None:
        self.held = 0


def wait_for(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; whether it held."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(interval_s)
    return bool(condition())


class PressureLog(logging.Handler):
    """Collects the gpu tier's pressure transitions from tierkv's log ("memory pressure ...: not
    admitting"): proof that admission stopped even when relief follows within a poll or two."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "memory pressure" in message and "not admitting" in message:
            self.messages.append(message)

    def __enter__(self) -> PressureLog:
        logger = logging.getLogger("tierkv.engine")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("tierkv.engine")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def wait_for_stats(read: Callable[[], dict[str, Any]], condition: Callable[[dict[str, Any]], bool],
                   timeout_s: float) -> tuple[bool, dict[str, Any]]:
    """Poll ``read()`` until ``condition`` holds on a snapshot; whether it did and that snapshot
    (the state can move on right after: pressure relieved by the demotion it caused)."""
    end = time.monotonic() + timeout_s
    snapshot = read()
    while not condition(snapshot) and time.monotonic() < end:
        time.sleep(0.002)
        snapshot = read()
    return condition(snapshot), snapshot


class PressureScenario:
    """A gpu tier filled with chunks, then memory pressure from outside and its relief.

    Watermarks are set relative to the memory in use at the start (low: ``low_over`` above it
    once the tier is allocated, enough that the tier first gets its whole capacity; high:
    ``high_over`` above low), so the scenario takes a couple of GB of an 80 GB device, not tens.
    Every check is recorded (name, ok, detail) and all run even when one fails.
    """

    def __init__(self, sizes: PressureSizes, device: str, probe: Probe, squeezer: Squeezer,
                 engine_probes: dict[str, Any] | None = None) -> None:
        import torch

        self.sizes = sizes
        self.device = device
        self.probe = probe
        self.squeezer = squeezer
        self.engine_probes = engine_probes
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.log = PressureLog()
        generator = torch.Generator().manual_seed(36)
        self._pattern = torch.randint(-(1 << 15), 1 << 15, sizes.prompt_shape, dtype=torch.int16, generator=generator)

    # -- data -------------------------------------------------------------------------------
    def tokens(self, index: int) -> torch.Tensor:
        import torch

        count = self.sizes.chunk_tokens * self.sizes.chunks_per_prompt
        return torch.arange(count, dtype=torch.int64) + 1_000_000 * (index + 1)

    def kv(self, index: int) -> torch.Tensor:
        """The KV of prompt ``index``: random bits, different for every prompt and every chunk."""
        import torch

        return (self._pattern ^ index).view(torch.bfloat16)

    # -- bookkeeping ------------------------------------------------------------------------
    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def config(self, high: float, low: float) -> dict[str, Any]:
        sizes = self.sizes
        return {"model": "gpu-check-pressure", "chunk_size": sizes.chunk_tokens, "kv_format": "vllm",
                "write_policy": "write_back",
                "pressure": {"poll_interval_ms": sizes.poll_ms, "gpu_high_watermark": high, "gpu_low_watermark": low,
                             "host_high_watermark": 1.0, "host_low_watermark": 0.99},
                "tiers": [{"name": "gpu", "backend": "gpu", "device": self.device, "capacity": f"{sizes.tier_bytes}B"},
                          {"name": "host", "backend": "cpu", "capacity": f"{sizes.host_bytes}B"}]}

    @staticmethod
    def gpu(engine: Engine) -> dict[str, Any]:
        stats: dict[str, Any] = engine.stats()["tiers"]["gpu"]
        return stats

    def read_back(self, engine: Engine, prompts: Sequence[int]) -> list[int]:
        """The prompts whose KV does not come back whole and bit-exact."""
        import torch

        wrong = []
        for index in prompts:
            out, mask = engine.retrieve(self.tokens(index), return_tuple=False)
            expected = self.kv(index)
            if not bool(mask.all()) or not torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16)):
                wrong.append(index)
        return wrong

    def located(self, engine: Engine, index: int) -> list[str | None]:
        return engine.locate(self.tokens(index))

    # -- phases -----------------------------------------------------------------------------
    def watermarks(self) -> tuple[float, float, int]:
        """(high, low, total) from the memory in use now plus the tier about to be allocated."""
        reading = self.probe.read()
        start = reading.used + self.sizes.tier_bytes
        low = (start + self.sizes.low_over) / reading.total
        high = (start + self.sizes.low_over + self.sizes.high_over) / reading.total
        self.figures.update(baseline_used_gib=round(reading.used / GiB, 3), total_gib=round(reading.total / GiB, 3),
                            low_watermark=round(low, 5), high_watermark=round(high, 5))
        if high > 1.0:
            raise PartFailed(f"too little free device memory for the scenario (high watermark {high:.3f})",
                             self.figures)
        return high, low, reading.total

    def fill(self, engine: Engine) -> None:
        for index in range(self.sizes.prompts):
            engine.store(self.tokens(index), self.kv(index))
        on_gpu = sum(self.located(engine, i) == ["gpu"] * self.sizes.chunks_per_prompt
                     for i in range(self.sizes.prompts))
        self.figures["filled_bytes"] = self.gpu(engine)["used_bytes"]
        self.check("filled: every chunk in the gpu tier", on_gpu == self.sizes.prompts,
                   f"{on_gpu}/{self.sizes.prompts} prompts on gpu")

    def squeeze(self, high: float, total: int) -> None:
        """Allocate in steps until the probe reads at least the high watermark."""
        held = 0
        while self.probe.read().used < high * total:
            if held >= self.sizes.max_squeeze:
                raise PartFailed(f"{held / GiB:.2f} GiB allocated and still under the high watermark", self.figures)
            held = self.squeezer.allocate(self.sizes.step)
        self.figures.update(squeezed_gib=round(held / GiB, 3),
                            used_fraction_at_crossing=round(self.probe.read().used / total, 5))

    def under_pressure(self, engine: Engine, low: float, total: int) -> None:
        """Stops admitting, demotes the coldest chunks, gives the memory back, loses nothing."""
        sizes = self.sizes
        pressured, stats = wait_for_stats(lambda: self.gpu(engine), lambda s: s["pressure"]["pressured"]
                                          or bool(self.log.messages), 15)
        seen = (pressured and not stats["pressure"]["admitting"]) or bool(self.log.messages)
        self.check("stops admitting above the high watermark", seen,
                   f"logged: {self.log.messages[:1]}; pressure state {stats['pressure']}")
        shrunk, stats = wait_for_stats(lambda: self.gpu(engine), lambda s: s["pressure"]["shrinks"] >= 1
                                       and s["used_bytes"] <= s["capacity_bytes"], 20)
        self.figures.update(demotions=stats["demotions"], freed_mib=round(stats["pressure"]["freed_bytes"] / MiB, 1),
                            capacity_under_pressure_mib=round(stats["capacity_bytes"] / MiB, 1),
                            used_under_pressure_mib=round(stats["used_bytes"] / MiB, 1))
        self.check("demotes down to its limit", shrunk and stats["demotions"] > 0,
                   f"demotions {stats['demotions']}, used {stats['used_bytes']}, limit {stats['capacity_bytes']}")
        coldest = self.located(engine, 0)
        self.check("the coldest chunks went to the host tier", coldest == ["host"] * sizes.chunks_per_prompt,
                   f"coldest prompt in {coldest}")
        if sizes.check_hottest:
            hottest = self.located(engine, sizes.prompts - 1)
            self.check("the hottest chunks stayed in the gpu tier", hottest == ["gpu"] * sizes.chunks_per_prompt,
                       f"hottest prompt in {hottest}")
        back = wait_for(lambda: self.probe.read().used <= low * total, self.sizes.settle_s, 0.05)
        after = self.probe.read().used / total
        self.figures["used_fraction_after_demotion"] = round(after, 5)
        self.check("the demoted chunks' device memory went back (NVML at or below the low watermark)", back,
                   f"used fraction {after:.5f} vs low {low:.5f}" + ("" if back else
                   ": the tier freed its chunks but the memory stayed with this process (e.g. cached by "
                   "torch's allocator, no empty_cache), so the other process cannot have it"))
        self.store_under_pressure(engine)
        wrong = self.read_back(engine, [*range(sizes.prompts), sizes.prompts])
        self.check("no acknowledged chunk lost under pressure (all read back exact)", not wrong,
                   f"wrong prompts {wrong[:10]}")

    def store_under_pressure(self, engine: Engine) -> None:
        """A chunk stored while the tier is pressured goes to the host tier."""
        index = self.sizes.prompts
        before = self.gpu(engine)
        engine.store(self.tokens(index), self.kv(index))
        after = self.gpu(engine)
        where = self.located(engine, index)
        if before["pressure"]["pressured"] and after["pressure"]["pressured"]:
            self.check("not admitted under pressure", where == ["host"] * self.sizes.chunks_per_prompt
                       and after["skipped_pressure"] > before["skipped_pressure"], f"stored under pressure into {where}")
        else:  # relieved meanwhile (the demoted memory went back): admitting again is right
            self.figures["store_under_pressure"] = f"pressure relieved before the store; stored into {where}"

    def relief(self, engine: Engine, capacity_under_pressure: int) -> None:
        """After the other process frees its memory the tier admits and grows back."""
        self.squeezer.release()
        admitting, stats = wait_for_stats(lambda: self.gpu(engine), lambda s: not s["pressure"]["pressured"]
                                          and s["pressure"]["admitting"], 15)
        grew, stats = wait_for_stats(lambda: self.gpu(engine), lambda s: s["capacity_bytes"] > capacity_under_pressure,
                                     10)
        self.figures.update(capacity_after_relief_mib=round(stats["capacity_bytes"] / MiB, 1),
                            last_relief_s=stats["pressure"]["last_relief_s"])
        self.check("admits again once the memory is freed", admitting and grew, f"pressure state {stats['pressure']}")
        index = self.sizes.prompts + 1
        engine.store(self.tokens(index), self.kv(index))
        where = self.located(engine, index)
        self.check("grows back: a new chunk lands in the gpu tier", where == ["gpu"] * self.sizes.chunks_per_prompt,
                   f"stored into {where}")
        wrong = self.read_back(engine, range(self.sizes.prompts + 2))
        self.check("no acknowledged chunk lost after relief (all read back exact)", not wrong,
                   f"wrong prompts {wrong[:10]}")

    def run(self) -> dict[str, Any]:
        """All phases; PartFailed (with every check's outcome) when any check failed."""
        from tierkv import Engine

        try:
            high, low, total = self.watermarks()
            with self.log, Engine(self.config(high, low), probes=self.engine_probes) as engine:
                if isinstance(self.probe, ModelledDevice):
                    self.probe.tier = next(t for t in engine.tiers if t.name == "gpu")
                started = self.probe.read().used
                self.figures["start_used_fraction"] = round(started / total, 5)
                if not self.check("start-up stays below the low watermark", started < low * total,
                                  f"{started / total:.5f} vs {low:.5f}"):
                    raise PartFailed("the engine's start used more device memory than planned", self.figures)
                self.fill(engine)
                self.squeeze(high, total)
                self.under_pressure(engine, low, total)
                self.relief(engine, self.gpu(engine)["capacity_bytes"])
        finally:
            self.squeezer.close()
        self.figures["checks"] = self.checks
        failed = [c["check"] for c in self.checks if not c["ok"]]
        if failed:
            raise PartFailed(f"{len(failed)} of {len(self.checks)} checks failed: {'; '.join(failed)}", self.figures)
        return self.figures


def rehearsal_scenario(sizes: PressureSizes = REHEARSAL_PRESSURE) -> PressureScenario:
    """The scenario on a gpu tier with device: cpu, driven by a modelled device."""
    device = ModelledDevice(total=64 * sizes.tier_bytes, base=16 * sizes.tier_bytes)
    return PressureScenario(sizes, "cpu", device, device, engine_probes={"gpu": device})


def part_pressure_rehearsal(ctx: Context) -> dict[str, Any]:
    """The pressure scenario's logic on the CPU (gpu tier with device: cpu, a modelled device):
    the same code the device runs with NVML and a second process."""
    return rehearsal_scenario().run()


def part_pressure(ctx: Context) -> dict[str, Any]:
    """The pressure scenario on the real device: NVML readings, a second process allocating."""
    import torch

    from tierkv.policy.pressure import NVMLProbe, ProbeUnavailable

    torch.empty(1, device="cuda")  # this process's context is part of the baseline
    try:
        probe = NVMLProbe(0)
    except ProbeUnavailable as exc:
        raise PartFailed(f"NVML: {exc}") from exc
    return PressureScenario(DEVICE_PRESSURE, "cuda:0", probe, DeviceSqueezer()).run()


# ---------------------------------------------------------------------------- timings


@dataclass(frozen=True)
class TimingSizes:
    """Shapes of the timings: a 32-layer, 8-KV-head, 128-dim bfloat16 prompt of 4,096 tokens."""

    layers: int = 32
    heads: int = 8
    head_size: int = 128
    tokens: int = 4096
    block_size: int = 16
    chunk_tokens: int = 256
    overlap_tokens: int = 8192  # the store copied beside the matmuls (1 GiB: longer than them)
    matmul: tuple[int, int, int] = (8192, 4096, 4096)
    matmuls: int = 20
    reps: int = 7
    warmup: int = 2

    @property
    def prompt_bytes(self) -> int:
        return self.layers * 2 * self.tokens * self.heads * self.head_size * 2


QUICK_TIMINGS = dataclasses.replace(TimingSizes(), reps=3, warmup=1)


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_once(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call of ``fn``: CUDA events on the current stream on a GPU (a call that
    blocks until its copies are done is timed to its return), perf_counter elsewhere."""
    import torch

    if not device.startswith("cuda"):
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def timed(fn: Callable[[], object], device: str, reps: int, warmup: int,
          setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call of ``fn`` over ``reps`` calls after ``warmup`` (see :func:`time_once`);
    ``setup`` runs before each call, untimed."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    seconds = []
    for _ in range(reps):
        if setup:
            setup()
        synchronize(device)
        seconds.append(time_once(fn, device))
    return seconds


def ratio(name: str, baseline_s: float, measured_s: float, target: float, higher_is_better: bool = True
          ) -> dict[str, Any]:
    """A ratio of the project's path to the raw one, its target and whether it was met."""
    value = baseline_s / measured_s if measured_s > 0 else 0.0
    return {"name": name, "value": round(value, 3), "target": f">= {target}", "met": value >= target,
            "baseline_ms": round(baseline_s * 1e3, 3), "measured_ms": round(measured_s * 1e3, 3)}


def paged_cache(sizes: TimingSizes, device: str, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A paged bf16 cache, per layer (K, V) of ``[blocks, block_size, heads, head_size]``."""
    import torch

    shape = (blocks, sizes.block_size, sizes.heads, sizes.head_size)
    return [(torch.randn(shape, device=device).to(torch.bfloat16), torch.randn(shape, device=device).to(torch.bfloat16))
            for _ in range(sizes.layers)]


def block_slots(sizes: TimingSizes, blocks: int, seed: int, device: str) -> torch.Tensor:
    """A serving engine's slot mapping: whole blocks in shuffled order, tokens in order within one."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(blocks, generator=generator)[: -(-sizes.tokens // sizes.block_size)]
    slots = (chosen[:, None] * sizes.block_size + torch.arange(sizes.block_size)).reshape(-1)[: sizes.tokens]
    return slots.to(device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def time_gather_scatter(sizes: TimingSizes, device: str) -> dict[str, Any]:
    """tierkv.ops.paged_gather / paged_scatter of one prompt vs a device-to-device copy of its bytes."""
    import torch

    from tierkv import ops

    blocks = 2 * sizes.tokens // sizes.block_size
    cache = paged_cache(sizes, device, blocks)
    slots = block_slots(sizes, blocks, 1, device)
    chunk = torch.empty((sizes.layers, 2, sizes.tokens, sizes.heads, sizes.head_size), dtype=torch.bfloat16,
                        device=device)
    ops.paged_gather(cache, slots, out=chunk)
    exact = same_bytes(chunk, ops.paged_gather_reference(cache, slots))
    source, target = torch.empty_like(chunk), torch.empty_like(chunk)
    copy_s = statistics.median(timed(lambda: target.copy_(source), device, sizes.reps, sizes.warmup))
    gather_s = statistics.median(timed(lambda: ops.paged_gather(cache, slots, out=chunk), device, sizes.reps,
                                       sizes.warmup))
    scatter_s = statistics.median(timed(lambda: ops.paged_scatter(chunk, cache, slots), device, sizes.reps,
                                        sizes.warmup))
    return {"bytes": chunk.numel() * 2, "gather_exact": exact, "ratios": [
        ratio("paged_gather vs device copy", copy_s, gather_s, 0.8),
        ratio("paged_scatter vs device copy", copy_s, scatter_s, 0.8)]}


def host_tier_engine(sizes: TimingSizes) -> Engine:
    """An engine whose only tier is host memory (pinned when CUDA is present) for one prompt."""
    from tierkv import Engine

    capacity = sizes.prompt_bytes + sizes.prompt_bytes // 2
    return Engine({"model": "gpu-check-connectors", "chunk_size": sizes.chunk_tokens, "kv_format": "vllm",
                   "tiers": [{"name": "host", "backend": "cpu", "capacity": f"{capacity}B"}]})


def raw_copies(sizes: TimingSizes, device: str) -> tuple[float, float]:
    """Median seconds of a raw device -> pinned host copy and back (``copy_(non_blocking=True)``)."""
    import torch

    pinned = device.startswith("cuda")
    host = torch.empty(sizes.prompt_bytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(sizes.prompt_bytes, dtype=torch.uint8, device=device)
    d2h = statistics.median(timed(lambda: host.copy_(dev, non_blocking=pinned), device, sizes.reps, sizes.warmup))
    h2d = statistics.median(timed(lambda: dev.copy_(host, non_blocking=pinned), device, sizes.reps, sizes.warmup))
    return d2h, h2d


def time_connector(engine: Engine, connector: Any, sizes: TimingSizes, device: str) -> dict[str, Any]:
    """Store a prompt from a paged cache through ``connector`` into the host tier, and retrieve it
    into another cache with another slot mapping: median seconds, and whether it came back exact."""
    import torch

    from tierkv import ops
    from tierkv.connectors import retrieve_paged, store_paged

    blocks = 2 * sizes.tokens // sizes.block_size
    source, target = paged_cache(sizes, device, blocks), paged_cache(sizes, device, blocks)
    slots, target_slots = block_slots(sizes, blocks, 2, device), block_slots(sizes, blocks, 3, device)
    counter = itertools.count()
    current: list[torch.Tensor] = []
    chunks = sizes.tokens // sizes.chunk_tokens

    def next_prompt() -> None:
        if current:
            engine.batched_delete(engine.keys_for(current.pop()))
        current.append(torch.arange(sizes.tokens, dtype=torch.int64) + 10_000_000 * (next(counter) + 1))

    def store() -> None:
        written = store_paged(engine, connector, current[0], kvcaches=source, slot_mapping=slots)
        if written != chunks:
            raise PartFailed(f"{type(connector).__name__} stored {written} chunks, expected {chunks}")

    def retrieve() -> None:
        if not bool(retrieve_paged(engine, connector, current[0], kvcaches=target, slot_mapping=target_slots).all()):
            raise PartFailed(f"{type(connector).__name__}: the stored prompt did not come back whole")

    store_s = statistics.median(timed(store, device, sizes.reps, sizes.warmup, setup=next_prompt))
    retrieve_s = statistics.median(timed(retrieve, device, sizes.reps, sizes.warmup))
    exact = same_bytes(ops.paged_gather_reference(target, target_slots), ops.paged_gather_reference(source, slots))
    engine.batched_delete(engine.keys_for(current[0]))
    return {"store_s": store_s, "retrieve_s": retrieve_s, "exact": exact}


def time_connectors(sizes: TimingSizes, device: str) -> dict[str, Any]:
    """Both paged connectors (GPU cache <-> host tier) vs raw pinned copies of the same bytes."""
    from tierkv.connectors import PagedConnector, PagedConnectorV2

    d2h, h2d = raw_copies(sizes, device)
    figures: dict[str, Any] = {"bytes": sizes.prompt_bytes, "raw_d2h_GBps": round(sizes.prompt_bytes / d2h / 1e9, 2),
                               "raw_h2d_GBps": round(sizes.prompt_bytes / h2d / 1e9, 2), "exact": {}, "ratios": []}
    with host_tier_engine(sizes) as engine:
        figures["host_tier_pinned"] = engine.tiers[0].stats()["pinned"]
        for connector_class in (PagedConnector, PagedConnectorV2):
            name = connector_class.__name__
            measured = time_connector(engine, connector_class(sizes.layers, sizes.heads, sizes.head_size), sizes,
                                      device)
            figures["exact"][name] = measured["exact"]
            figures["ratios"] += [ratio(f"{name} store (GPU cache -> host tier) vs raw pinned copy", d2h,
                                        measured["store_s"], 0.9),
                                  ratio(f"{name} retrieve (host tier -> GPU cache) vs raw pinned copy", h2d,
                                        measured["retrieve_s"], 0.9)]
    return figures


def store_stream(engine: Engine) -> Any:
    """The gpu tier's copy stream (private: the only way to see whether a store's copies use it)."""
    tier = next(t for t in engine.tiers if t.name == "gpu")
    return getattr(tier, "_stream", None)


def matmuls_during(work: Callable[[], object], matmuls: Callable[[], None], stream: Any, device: str
                   ) -> tuple[list[float], bool]:
    """Seconds of each batch of matmuls that ran entirely while ``work`` (a store) ran on another
    thread, and whether tierkv's copy stream was ever seen busy meanwhile."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    synchronize(device)
    thread = threading.Thread(target=run, name="gpu-check-store")
    batches: list[float] = []
    stream_busy = False
    thread.start()
    while thread.is_alive():
        stream_busy = stream_busy or (stream is not None and not stream.query())
        seconds = time_once(matmuls, device)
        if thread.is_alive():
            batches.append(seconds)
    thread.join()
    if errors:
        raise PartFailed(f"the store beside the matmuls failed: {errors[0]!r}") from errors[0]
    return batches, stream_busy


def overlap_ratio(name: str, alone: float, batches: list[float], stream_busy: bool) -> dict[str, Any]:
    """The matmuls' slowdown beside a store, its target (<= 10%) and whether it was met."""
    entry: dict[str, Any] = {"name": name, "target": "<= 0.10", "batches": len(batches),
                             "copy_on_tierkv_stream": stream_busy, "baseline_ms": round(alone * 1e3, 3)}
    if not batches:
        return {**entry, "value": None, "met": False, "note": "no batch of matmuls ran while the store copied"}
    beside = statistics.median(batches)
    slowdown = beside / alone - 1
    return {**entry, "value": round(slowdown, 4), "met": slowdown <= 0.10, "measured_ms": round(beside * 1e3, 3)}


def time_matmul_overlap(sizes: TimingSizes, device: str = "cuda") -> dict[str, Any]:
    """A prefill-sized bf16 matmul (batches of ``matmuls`` on the current stream) alone vs while a
    store into the gpu tier copies: ``Engine.batched_put`` of pinned chunks (the tier's own copy,
    on its copy stream) and ``Engine.store`` of a pinned KV blob (copied in place into the tier's
    slabs); each says whether tierkv's copy stream was seen busy."""
    import torch

    from tierkv import Engine

    m, k, n = sizes.matmul
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    pinned = device.startswith("cuda")

    def matmuls() -> None:
        for _ in range(sizes.matmuls):
            torch.matmul(a, b, out=c)

    shape = (sizes.layers, 2, sizes.overlap_tokens, sizes.heads, sizes.head_size)
    blob = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pinned)
    chunk_shape = (sizes.layers, 2, sizes.chunk_tokens, sizes.heads, sizes.head_size)
    chunks = [torch.empty(chunk_shape, dtype=torch.bfloat16, pin_memory=pinned)
              for _ in range(sizes.overlap_tokens // sizes.chunk_tokens)]
    capacity = blob.numel() * 2 + 64 * MiB
    tier_device = "cuda:0" if pinned else "cpu"
    config = {"model": "gpu-check-overlap", "chunk_size": sizes.chunk_tokens, "kv_format": "vllm",
              "tiers": [{"name": "gpu", "backend": "gpu", "device": tier_device, "capacity": f"{capacity}B"}]}
    alone = statistics.median(timed(matmuls, device, sizes.reps, sizes.warmup))
    counter = itertools.count(1)
    found: dict[str, tuple[list[float], bool]] = {"batched_put": ([], False), "store": ([], False)}
    with Engine(config) as engine:
        stream = store_stream(engine)
        for rep in range(sizes.warmup + sizes.reps):
            for how in found:
                tokens = torch.arange(sizes.overlap_tokens, dtype=torch.int64) + 100_000_000 * next(counter)
                keys = engine.keys_for(tokens)
                work = (functools.partial(engine.batched_put, keys, chunks) if how == "batched_put"
                        else functools.partial(engine.store, tokens, blob))
                batches, busy = matmuls_during(work, matmuls, stream, device)
                engine.batched_delete(keys)
                if rep >= sizes.warmup:
                    found[how] = (found[how][0] + batches, found[how][1] or busy)
    return {"matmul": f"{m}x{k} @ {k}x{n} bf16, batches of {sizes.matmuls}", "store_bytes": blob.numel() * 2,
            "ratios": [overlap_ratio("matmul slowdown beside Engine.batched_put into the gpu tier", alone,
                                     *found["batched_put"]),
                       overlap_ratio("matmul slowdown beside Engine.store into the gpu tier", alone,
                                     *found["store"])]}


def run_timings(sizes: TimingSizes, device: str, overlap: bool) -> dict[str, Any]:
    """All timings; PartFailed when a path is not exact (a missed target is reported, not failed)."""
    figures = {"gather_scatter": time_gather_scatter(sizes, device), "connectors": time_connectors(sizes, device)}
    if overlap:
        figures["matmul_overlap"] = time_matmul_overlap(sizes, device)
    ratios = [r for section in figures.values() for r in section["ratios"]]
    figures["ratios"] = ratios
    inexact = [name for name, ok in {"paged_gather": figures["gather_scatter"]["gather_exact"],
                                     **figures["connectors"]["exact"]}.items() if not ok]
    if inexact:
        raise PartFailed(f"not bit-exact: {inexact}", figures)
    return figures


def part_timings(ctx: Context) -> dict[str, Any]:
    """The three ratios of issue 36 on the device (CUDA events, warmup, median)."""
    from tierkv import ops

    status = ops.extension_status()
    if not status["cuda_kernels"]:
        raise PartFailed(f"the extension's CUDA kernels are not loaded ({status['reason']}; {status['cuda_reason']}):"
                         " the timings would measure the pure-torch reference")
    figures = run_timings(QUICK_TIMINGS if ctx.quick else TimingSizes(), "cuda", overlap=True)
    missed = [r["name"] for r in figures["ratios"] if not r["met"]]
    figures["targets_met"] = f"{len(figures['ratios']) - len(missed)}/{len(figures['ratios'])}"
    figures["missed"] = missed
    return figures


# ---------------------------------------------------------------------------- the parts


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
        return [sys.executable, str(Path(__file__).resolve()), "--part", part.name, "--context", str(self.ctx.save())]

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


# ---------------------------------------------------------------------------- report


def summary_of(result: PartResult) -> str:
    """One short cell: the part's key figures or the first line of its reason."""
    figures = result.figures
    if result.status != "passed":
        return result.reason.splitlines()[0][:160] if result.reason else ""
    if "ratios" in figures:
        return "; ".join(f"{r['name']}: {r['value']} ({r['target']}, {'met' if r['met'] else 'MISSED'})"
                         for r in figures["ratios"])
    if "verdict" in figures:
        return figures["verdict"]
    if "passed" in figures:
        return f"{figures['passed']} passed, {figures['failed']} failed, {figures['skipped']} skipped"
    if "checks" in figures:
        return f"{sum(c['ok'] for c in figures['checks'])}/{len(figures['checks'])} checks"
    if "build_s" in figures:
        return f"{figures['arch']} in {figures['build_s']} s"
    if "cuda" in figures:
        cuda = figures["cuda"]
        return f"{cuda.get('name', NO_CUDA)}; torch {figures['modules'].get('torch')}; python {figures['python']}"
    if "collected" in figures:
        return f"{figures['collected']} tests collected"
    return ""


def markdown(results: Sequence[PartResult], report: dict[str, Any]) -> str:
    """The short table of ``gpu_check.md``."""
    lines = [f"# tierkv GPU check ({report['mode']}, exit {report['exit_code']}, {report['duration_s']} s)", "",
             "| part | CUDA | status | s | result |", "|---|---|---|---|---|"]
    for result in results:
        cell = summary_of(result).replace("|", "/").replace("\n", " ")
        lines.append(f"| {result.name} | {'yes' if result.cuda else 'no'} | {result.status} | {result.duration_s} "
                     f"| {cell} |")
    return "\n".join(lines) + "\n"


def exit_code(results: Sequence[PartResult]) -> int:
    """0 when nothing failed and every skip was allowed (dry run, or left out by --quick)."""
    bad = [r for r in results if r.status == "failed" or (r.status == "skipped" and not r.skip_allowed)]
    return 1 if bad else 0


def write_report(ctx: Context, results: Sequence[PartResult], started: float) -> int:
    """Write gpu_check.json and gpu_check.md, print the table, return the exit code."""
    code = exit_code(results)
    counts = {status: sum(r.status == status for r in results) for status in ("passed", "failed", "skipped")}
    report = {"tool": "benchmarks/gpu_check.py", "mode": ctx.mode, "quick": ctx.quick, "exit_code": code,
              "duration_s": round(time.monotonic() - started, 1), "arch": ctx.arch, "summary": counts,
              "parts": {r.name: r.to_dict() for r in results}}
    (ctx.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(results, report)
    (ctx.out / "gpu_check.md").write_text(table)
    print(table, flush=True)
    return code


def prepare(ctx: Context) -> dict[str, Any]:
    """Dependencies from the shipped wheels and tierkv's entry points, before any part runs."""
    ctx.site.mkdir(parents=True, exist_ok=True)
    return {"dependencies": ensure_dependencies(ctx), "entry_points": ensure_entry_points(ctx),
            "site": str(ctx.site), "pythonpath": child_env(ctx)["PYTHONPATH"]}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output folder (gpu_check.json, gpu_check.md, logs/)")
    parser.add_argument("--dry-run", action="store_true", help="CPU parts only; CUDA parts reported as skipped")
    parser.add_argument("--quick", action="store_true", help="fewer timing reps; no racecheck, no nvcc compile test")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time for the whole run")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tierkv-gpu-check",
                        help="extension build cache and private imports (kept: a rerun does not recompile)")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part is None and args.out is None:
        parser.error("--out is required")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.part:
        return worker(args.part, args.context)
    started = time.monotonic()
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ctx = Context(out, args.work_dir.resolve(), args.quick, "dry-run" if args.dry_run else "device")
    runner = Runner(ctx, args.budget_s)
    results = runner.run(prepare(ctx))
    return write_report(ctx, results, started)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
