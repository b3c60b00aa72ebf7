"""The GPU check (benchmarks/gpu_check.py, issue 36) kept honest on a machine without a GPU: its
dry run reports every CUDA part skipped with the reason and passes the CPU parts, and the pieces
the device relies on (exit-code rules, JUnit counts, the shipped wheels, the entry-point
dist-info, the pressure scenario's checks, the timing ratios) work here. The parts live in the
package benchmarks/gpu_checks/ (issue 49); the script is loaded by path, as a person runs it."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def load_gpu_check() -> ModuleType:
    """The entry script as a module (benchmarks/ is not a package on every sys.path); loading it
    makes its package of parts, gpu_checks, importable."""
    if "gpu_check" in sys.modules:
        return sys.modules["gpu_check"]
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


script = load_gpu_check()

from gpu_checks import (  # noqa: E402  (importable once the script is loaded)
    context,
    dependencies,
    parts,
    pressure,
    pressure_devices,
    processes,
    pytest_runs,
    report,
    runner,
    sanitizers,
    suite,
    timings,
)


def test_the_script_keeps_its_entry_points() -> None:
    """The command users run and the helper benchmarks/node_cache_gpu.py imports from the script."""
    assert script.write_dist_info is dependencies.write_dist_info
    assert callable(script.main)
    assert context.SCRIPT == SCRIPT


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    """One dry run of the script in a subprocess, as CI and a person run it."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out / "report"), "--dry-run",
                             "--work-dir", str(out / "work")], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    report_path = out / "report" / "gpu_check.json"
    assert report_path.is_file(), f"no report; exit {result.returncode}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result, json.loads(report_path.read_text()), out / "report"


def test_dry_run_skips_every_cuda_part_with_the_reason(dry_run: tuple) -> None:
    result, outcome, _ = dry_run
    reported = outcome["parts"]
    assert list(reported) == [part.name for part in parts.PARTS]
    cuda_parts = [part.name for part in parts.PARTS if part.cuda]
    assert set(cuda_parts) >= {"build", "cuda_tests", "pressure", "timings", "memcheck", "racecheck"}
    expected = context.NO_CUDA if not torch.cuda.is_available() else "dry run"
    for name in cuda_parts:
        assert reported[name]["status"] == "skipped", (name, reported[name])
        assert reported[name]["cuda"] is True
        assert expected in reported[name]["reason"], (name, reported[name]["reason"])
    if not torch.cuda.is_available():
        assert all(reported[name]["reason"] == "no CUDA device" for name in cuda_parts)
    assert outcome["mode"] == "dry-run"
    assert outcome["summary"]["skipped"] == len(cuda_parts)


def test_dry_run_passes_the_cpu_parts(dry_run: tuple) -> None:
    result, outcome, out = dry_run
    reported = outcome["parts"]
    cpu_parts = [part.name for part in parts.PARTS if not part.cuda]
    assert cpu_parts == ["environment", "test_selection", "cpu_ops_tests", "pressure_rehearsal"]
    for name in cpu_parts:
        assert reported[name]["status"] == "passed", (name, reported[name]["reason"])
    assert result.returncode == 0 and outcome["exit_code"] == 0, result.stdout[-3000:]
    environment = reported["environment"]["figures"]
    assert environment["cuda"]["available"] is torch.cuda.is_available()
    assert set(dependencies.REQUIRED_BACKENDS) <= set(environment["backends"])
    assert environment["prepare"]["dependencies"]["lmdb"] != "missing"
    # every node id the device runs names at least one test here
    per_id = reported["test_selection"]["figures"]["per_id"]
    assert set(per_id) == {*suite.KERNEL_TESTS, *suite.DEVICE_TESTS, *suite.NVCC_TESTS, *suite.RACECHECK_TESTS}
    assert all(count >= 1 for count in per_id.values()), per_id
    assert per_id["tests/ops/test_ops.py::test_cuda_paged_gather_scatter_bit_exact"] >= 36  # 6 dtypes x 3 layouts x 2 orders
    ops_tests = reported["cpu_ops_tests"]["figures"]
    assert ops_tests["passed"] >= 5 and ops_tests["failed"] == 0 and ops_tests["skipped"] == 0
    checks = {check["check"]: check["ok"] for check in reported["pressure_rehearsal"]["figures"]["checks"]}
    assert all(checks.values()), checks
    assert {"stops admitting above the high watermark", "the coldest chunks went to the host tier",
            "no acknowledged chunk lost under pressure (all read back exact)",
            "grows back: a new chunk lands in the gpu tier"} <= set(checks)


def test_dry_run_writes_and_prints_the_table(dry_run: tuple) -> None:
    result, outcome, out = dry_run
    table = (out / "gpu_check.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| part")]
    assert [row.split("|")[1].strip() for row in rows] == [part.name for part in parts.PARTS]
    assert "| build | yes | skipped |" in table and "| environment | no | passed |" in table
    assert table in result.stdout
    assert (out / "logs" / "cpu_ops_tests.xml").is_file()


def result(name: str, status: str, cuda: bool = True, skip_allowed: bool = False) -> object:
    return context.PartResult(name, name, cuda, status, skip_allowed=skip_allowed)


def test_exit_code_fails_on_a_failure_or_a_cuda_skip_on_the_device() -> None:
    assert report.exit_code([result("a", "passed"), result("b", "skipped", skip_allowed=True)]) == 0
    assert report.exit_code([result("a", "passed"), result("b", "failed")]) == 1
    assert report.exit_code([result("a", "passed"), result("b", "skipped")]) == 1  # a CUDA part skipped on a GPU


def test_skip_rules_per_mode(tmp_path: Path) -> None:
    part = parts.PART_BY_NAME["racecheck"]
    dry = runner.Runner(context.Context(tmp_path, tmp_path, quick=False, mode="dry-run"), 60)
    assert dry.skip_reason(part) == context.NO_CUDA
    assert dry.skip(part, context.NO_CUDA).skip_allowed
    device = runner.Runner(context.Context(tmp_path, tmp_path, quick=True, mode="device", arch="9.0"), 60)
    assert device.skip_reason(part) == "left out by --quick"
    assert device.skip(part, "left out by --quick").skip_allowed
    assert device.skip_reason(parts.PART_BY_NAME["memcheck"]) is None
    assert not device.skip(parts.PART_BY_NAME["memcheck"], "compute-sanitizer is not on PATH").skip_allowed


JUNIT = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="tests.test_ops" name="test_cuda_a[x]"/>
<testcase classname="tests.test_ops" name="test_cuda_b"><skipped message="no CUDA device: needs a GPU"/></testcase>
<testcase classname="tests.test_ops" name="test_cuda_c"><failure message="assert False"/></testcase>
<testcase classname="tests.test_ops" name="test_cuda_d"><error message="fixture broke"/></testcase>
</testsuite></testsuites>"""


def test_junit_counts_and_a_skip_on_the_device_fails(tmp_path: Path) -> None:
    path = tmp_path / "run.xml"
    path.write_text(JUNIT)
    run = pytest_runs.parse_junit(path)
    assert (run.passed, run.failed, run.skipped) == (1, 2, 1)
    assert run.skip_reasons == ["no CUDA device: needs a GPU"]
    assert "tests.test_ops::test_cuda_c: assert False" in run.failures
    clean = processes.Finished(0, False, 1.0, "")
    with pytest.raises(context.PartFailed, match="2 failed"):
        pytest_runs.require_clean_run(clean, run, device=False)
    skipped_only = pytest_runs.PytestRun(passed=3, skipped=1, skip_reasons=["no CUDA device"])
    assert pytest_runs.require_clean_run(clean, skipped_only, device=False)["skipped"] == 1
    with pytest.raises(context.PartFailed, match="1 CUDA tests skipped on a CUDA machine"):
        pytest_runs.require_clean_run(clean, skipped_only, device=True)
    with pytest.raises(context.PartFailed, match="timed out"):
        pytest_runs.require_clean_run(processes.Finished(-9, True, 240.0, "..."), pytest_runs.PytestRun(passed=1), device=True)


def test_sanitizer_verdicts() -> None:
    assert sanitizers.sanitizer_verdict("========= ERROR SUMMARY: 0 errors\n") == (0, "ERROR SUMMARY: 0 errors")
    assert sanitizers.sanitizer_verdict("x\n========= ERROR SUMMARY: 3 errors\n")[0] == 3
    race = "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)"
    assert sanitizers.sanitizer_verdict(race)[0] == 1
    assert sanitizers.sanitizer_verdict("Segmentation fault") == (None, "no summary line")


def test_dist_info_declares_the_backends_of_pyproject(tmp_path: Path) -> None:
    version, points = dependencies.pyproject_entry_points()
    assert {"cpu", "gpu", "lmdb"} <= set(points) and points["gpu"] == "tierkv_backends.gpu:GPUBackend"
    dependencies.write_dist_info(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert dist.metadata["Name"] == "tierkv" and dist.version == version
    declared = {entry.name: entry.value for entry in dist.entry_points if entry.group == "tierkv.backends"}
    assert declared == points


def test_the_shipped_lmdb_wheel_imports_on_this_python(tmp_path: Path) -> None:
    wheel = dependencies.wheel_for_this_python("lmdb")
    if wheel is None:
        pytest.skip(f"no lmdb wheel for this Python in {dependencies.WHEELS}: run scripts/gpu_wheels.sh")
    assert sum(path.stat().st_size for path in dependencies.WHEELS.glob("*.whl")) < 20 << 20
    dependencies.extract_wheel(wheel, tmp_path)
    code = "import sys, lmdb; sys.exit(0 if lmdb.__file__.startswith(sys.argv[1]) else 1)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                   check=True, timeout=60)


def test_pressure_scenario_fails_when_freed_memory_stays_with_the_process() -> None:
    """A device whose used memory never drops (the tier freed its chunks, the allocator kept the
    memory): the scenario must name that check and still pass the others."""
    from tierkv.policy.pressure import MemoryReading

    class KeepsMemory(pressure_devices.ModelledDevice):
        peak = 0

        def read(self) -> MemoryReading:
            allocated = int(self.tier.stats()["allocated_bytes"]) if self.tier is not None else 0
            self.peak = max(self.peak, allocated)
            return MemoryReading(self.base + self.held + self.peak, self.total, time.monotonic())

    sizes = dataclasses.replace(pressure.REHEARSAL_PRESSURE, settle_s=0.3)
    device = KeepsMemory(total=64 * sizes.tier_bytes, base=16 * sizes.tier_bytes)
    with pytest.raises(context.PartFailed, match="1 of 11 checks failed: the demoted chunks' device memory went back"):
        pressure.PressureScenario(sizes, "cpu", device, device, engine_probes={"gpu": device}).run()


def test_timings_report_ratios_with_targets_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timing code end to end at toy sizes (CPU numbers mean nothing; the structure does)."""
    monkeypatch.setenv("TIERKV_NO_EXT", "1")
    sizes = timings.TimingSizes(layers=2, heads=2, head_size=16, tokens=256, block_size=16, chunk_tokens=64,
                           overlap_tokens=1024, matmul=(32, 32, 32), matmuls=2, reps=2, warmup=1)
    figures = timings.run_timings(sizes, "cpu", overlap=True)
    assert figures["gather_scatter"]["gather_exact"]
    assert figures["connectors"]["exact"] == {"PagedConnector": True, "PagedConnectorV2": True}
    names = [entry["name"] for entry in figures["ratios"]]
    assert len(names) == 8 and names[0] == "paged_gather vs device copy"
    for entry in figures["ratios"][:6]:  # rounded to 3 places: a toy copy on a busy CPU can round to 0.0
        assert entry["value"] >= 0 and entry["met"] == (entry["value"] >= float(entry["target"].split()[-1]))
    for entry in figures["matmul_overlap"]["ratios"]:
        assert entry["target"] == "<= 0.10" and entry["copy_on_tierkv_stream"] is False  # no CUDA stream here
        assert entry["met"] == (entry["value"] is not None and entry["value"] <= 0.10)


def test_device_squeezer_protocol_on_the_cpu() -> None:
    """The second process of the pressure scenario: allocates on command, frees, exits."""
    squeezer = pressure_devices.DeviceSqueezer("cpu")
    try:
        assert squeezer.allocate(1 << 20) == 1 << 20
        assert squeezer.allocate(1 << 20) == 2 << 20
        squeezer.release()
        assert squeezer.allocate(4096) == 4096
    finally:
        squeezer.close()
    assert squeezer._process.returncode == 0
