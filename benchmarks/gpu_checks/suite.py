"""The suite's CUDA tests on the device, and the CPU parts that keep their selection honest.

Every test of the suite that needs a GPU (found by reading tests/ for cuda: test_ops' CUDA
kernels, the device connector round trip, the gpu tier's streams and pinned staging, the pinned
host tier, the NVML state in stats) and the nvcc compile test, named by node id, so that a
renamed test fails the dry run's selection part instead of silently dropping out. The CPU side
collects those ids and runs the pure-torch reference ops tests; the device side runs them all.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from .context import REPO, Context, PartFailed, child_env
from .pytest_runs import require_clean_run, run_tests

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
