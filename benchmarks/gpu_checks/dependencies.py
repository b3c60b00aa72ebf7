"""Dependencies on a machine without network: install from shipped wheels, declare the backends.

The GPU machine has no network. What tierkv needs beyond its image (only ``lmdb``) travels as
wheels in ``benchmarks/gpu_wheels/`` (``scripts/gpu_wheels.sh``) and is installed from there with
pip, or unpacked into a private directory when pip cannot install. tierkv itself runs from this
checkout (``PYTHONPATH``); its backends are found through entry points, so when the checkout is
not installed a minimal ``tierkv-*.dist-info`` declaring them is written to that directory
(``benchmarks/node_cache_gpu.py`` uses ``write_dist_info`` for the same reason).
"""

from __future__ import annotations

import importlib.util
import json
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from .context import REPO, Context, child_env
from .processes import run_bounded

WHEELS = REPO / "benchmarks" / "gpu_wheels"

# import name -> distribution, for tierkv's runtime dependencies (pyproject.toml)
RUNTIME_MODULES = {"torch": "torch", "numpy": "numpy", "yaml": "pyyaml", "lmdb": "lmdb", "aiofiles": "aiofiles",
                   "xxhash": "xxhash"}
TEST_MODULES = {"pytest": "pytest", "pytest_timeout": "pytest-timeout", "pynvml": "nvidia-ml-py"}
REQUIRED_BACKENDS = ("cpu", "gpu", "lmdb")


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


def prepare(ctx: Context) -> dict[str, Any]:
    """Dependencies from the shipped wheels and tierkv's entry points, before any part runs."""
    ctx.site.mkdir(parents=True, exist_ok=True)
    return {"dependencies": ensure_dependencies(ctx), "entry_points": ensure_entry_points(ctx),
            "site": str(ctx.site), "pythonpath": child_env(ctx)["PYTHONPATH"]}
