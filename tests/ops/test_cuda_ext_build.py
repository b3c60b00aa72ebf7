"""The extension's sources build: every .cu file compiles with nvcc (so a CUDA syntax or type error
fails CI even without a GPU), and the prebuild command reports what it loaded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from tierkv import ops
from tierkv.testing.requirements import missing

CU_FILES = sorted(ops.source_dir().glob("*.cu"))


def torch_includes(shim: Path) -> list[str]:
    """torch's include dirs, plus a stand-in for the one generated CUDA header a CPU-only torch
    wheel lacks (c10/cuda/impl/cuda_cmake_macros.h), so the real headers still compile."""
    includes = cpp_extension.include_paths()
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for p in includes):
        header = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [*includes, str(shim)]
    return includes


def test_there_are_cuda_sources() -> None:
    assert CU_FILES, f"no .cu files in {ops.source_dir()}"


@pytest.mark.slow  # a CUDA compile
@pytest.mark.parametrize("source", CU_FILES, ids=lambda path: path.name)
def test_cuda_source_compiles_with_nvcc(source: Path, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the CUDA sources cannot be compiled on this machine")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [nvcc, "-c", str(source), "-o", str(tmp_path / (source.stem + ".o")), "-std=c++20",
               "-arch=sm_80", "--expt-relaxed-constexpr", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               "-DTIERKV_WITH_CUDA", "-I", str(ops.source_dir()), "-diag-suppress=3306",
               *(f"-I{path}" for path in torch_includes(tmp_path / "shim"))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stderr[-4000:]}"
    assert (tmp_path / (source.stem + ".o")).stat().st_size > 0


def test_status_command_reports_why_not_loaded(tmp_path: Path) -> None:
    env = {**os.environ, "TIERKV_NO_EXT": "1"}
    result = subprocess.run([sys.executable, "-m", "tierkv.ops", "status"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["loaded"] is False and status["reason"] == "disabled by TIERKV_NO_EXT"


def test_info_command_lists_kernels() -> None:
    result = subprocess.run([sys.executable, "-m", "tierkv.cli", "info"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    kernels = json.loads(result.stdout)["kernels"]
    assert set(kernels) >= {"loaded", "reason", "cuda_kernels"}


@pytest.mark.slow  # a build of the extension from scratch
def test_serving_start_builds_the_kernels_in_the_background(tmp_path: Path) -> None:
    """What a serving integration calls at start (no manual `python -m tierkv.ops build`): in a
    fresh process with an empty build cache the extension is not there, a background build
    starts, lands, and the ops use it; with TIERKV_BUILD_EXT=0 nothing starts."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        missing("a C++ compiler (c++ or g++ on PATH)", "the extension cannot be built on this machine")
    script = (
        "import json, torch\n"
        "from tierkv import ops\n"
        "before = ops.extension_status()['loaded']\n"
        "done = []\n"
        "thread = ops.build_in_background(done.append)\n"
        "started = thread is not None\n"
        "thread and thread.join(600)\n"
        "print(json.dumps({'before': before, 'started': started, 'done': done,\n"
        "                  'in_use': ops.paged_copy_strided_available(torch.empty(1))}))\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    env.pop("TIERKV_NO_EXT", None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"before": False, "started": True, "done": [True],
                                                                  "in_use": True}
    off = subprocess.run([sys.executable, "-c", "from tierkv import ops; print(ops.build_in_background() is None)"],
                         capture_output=True, text=True, env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path / "other"),
                                                              "TIERKV_BUILD_EXT": "0"}, timeout=300)
    assert off.stdout.strip() == "True", off.stderr[-2000:]


def _build(root: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 900
           ) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **(env or {})}
    environment.pop("TIERKV_NO_EXT", None)
    return subprocess.run([sys.executable, "-m", "tierkv.ops", *extra, "--build-dir", str(root)], capture_output=True,
                          text=True, env=environment, timeout=timeout)


@pytest.mark.slow  # two builds of the extension, the first killed midway
def test_a_build_killed_midway_is_detected_and_the_next_one_completes(tmp_path: Path) -> None:
    """A build killed with its compilers (a serving process ended during its background build)
    leaves a staging directory and no library; status says the build was interrupted, and the
    next build removes the leftovers and completes, never waiting on a lock nobody holds (an
    older tierkv's torch `lock` file in the library's directory included)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        missing("a C++ compiler (c++ or g++ on PATH)", "the extension cannot be built on this machine")
    root = tmp_path / "cache"
    environment = {**os.environ}
    environment.pop("TIERKV_NO_EXT", None)
    first = subprocess.Popen([sys.executable, "-m", "tierkv.ops", "build", "--build-dir", str(root)],
                             env=environment, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(root.glob("*.build-*/build.ninja")) and time.monotonic() < deadline:  # compiling now
        time.sleep(0.1)
    time.sleep(2)
    os.killpg(first.pid, signal.SIGKILL)  # the build and its compilers
    first.wait(60)
    staging = list(root.glob("*.build-*"))
    assert staging and not list(root.glob("*/*.so")), "killed midway: a staging directory, no library"
    name = staging[0].name.split(".build-")[0]
    (root / name).mkdir(exist_ok=True)
    (root / name / "lock").touch()  # what torch leaves when a build in that directory is killed
    status = json.loads(_build(root, "status", timeout=120).stdout)
    assert not status["loaded"] and "interrupted" in status["reason"], status
    second = _build(root, "build")
    assert second.returncode == 0, second.stderr[-3000:]
    rebuilt = json.loads(second.stdout)
    assert rebuilt["loaded"] and rebuilt["library"] == str(root / name / f"{name}.so")
    assert "left by an interrupted kernel build" in second.stderr
    assert not list(root.glob("*.build-*")) and not (root / name / "lock").exists()


def test_a_build_waits_for_a_live_builder_within_a_bound_and_says_who(tmp_path: Path) -> None:
    """Another live process building the same sources is waited for, with a message naming it,
    and only up to the bound: then the build gives up with the reason (never a silent hang)."""
    from tierkv.ops import build_cache, extension

    root = tmp_path / "cache"
    name = extension._build_name(extension._cuda_buildable()[0])
    with build_cache.build_lock(root, name, wait_s=0):  # this process is "building"
        started = time.monotonic()
        waited = _build(root, "build", env={"TIERKV_BUILD_WAIT_S": "1"}, timeout=120)
        elapsed = time.monotonic() - started
        status = json.loads(_build(root, "status", timeout=120).stdout)
    assert waited.returncode == 1 and elapsed < 60
    assert f"waiting for the kernel build of process {os.getpid()}" in waited.stderr
    reason = json.loads(waited.stdout)["reason"]
    assert f"being built by process {os.getpid()}" in reason and "gave up waiting after 1 s" in reason
    assert f"being built by process {os.getpid()}" in status["reason"]
    assert build_cache.holder(root, name) is None, "the lock went with its holder"
