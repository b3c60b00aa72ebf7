"""Impossible configurations are refused at load, naming the path; the ``tierkv`` command
prints one line per error (no traceback unless ``--debug``) and exits non-zero."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tierkv import ConfigError, load_config

BASE = {"model": "m", "tiers": [{"name": "host", "backend": "cpu", "capacity": "64MiB"}]}


@pytest.mark.parametrize("section", ["background", "health", "pressure"])
@pytest.mark.parametrize("value", [[], "fast", 3])
def test_a_section_must_be_a_mapping(section: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{section}: expected a mapping of "):
        load_config({**BASE, section: value})


def test_an_empty_section_means_the_defaults() -> None:
    assert load_config({**BASE, "background": None}).background == load_config(BASE).background


@pytest.mark.parametrize("backend", ["cpu", "lmdb", "fs"])
@pytest.mark.parametrize("capacity", [0, "0", "0MiB", "0GiB"])
def test_a_capacity_of_zero_is_refused(backend: str, capacity: object, tmp_path: Path) -> None:
    tier = {"name": "t", "backend": backend, "capacity": capacity}
    if backend != "cpu":
        tier["path"] = str(tmp_path / backend)
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capacity: a tier of capacity 0 can hold no chunk"):
        load_config({"model": "m", "tiers": [tier]})


def tierkv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierkv.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["missing", "malformed", "unknown-backend", "zero-capacity"])
def test_cli_errors_are_one_line_without_a_traceback(case: str, tmp_path: Path) -> None:
    path = tmp_path / "tierkv.yaml"
    documents = {"malformed": "model: m\ntiers: [\n  - name: host\n  backend: cpu\n",
                 "unknown-backend": "model: m\ntiers:\n  - {name: host, backend: nosuch}\n",
                 "zero-capacity": "model: m\ntiers:\n  - {name: host, backend: cpu, capacity: 0}\n"}
    if case in documents:
        path.write_text(documents[case])
    result = tierkv("inspect", str(path))
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierkv: error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    expected = {"missing": "cannot read config file", "malformed": "not valid YAML",
                "unknown-backend": "nosuch", "zero-capacity": "tiers[0].capacity"}[case]
    assert expected in lines[0]
    debug = tierkv("--debug", "inspect", str(path))
    assert debug.returncode != 0 and "Traceback" in debug.stderr, "--debug shows where it came from"


def test_a_capacity_below_one_chunk_is_refused_when_the_kv_shape_is_known() -> None:
    import torch

    from tierkv import Engine, EngineMetadata

    config = {"model": "m", "chunk_size": 256, "tiers": [{"name": "host", "backend": "cpu", "capacity": "1MiB"}]}
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capacity: 1\.0MiB cannot hold one chunk of 256 tokens"):
        Engine(config, EngineMetadata("m", kv_shape=(32, 8, 128, torch.bfloat16)))
    with Engine(config, EngineMetadata("m", kv_shape=(1, 1, 8, torch.bfloat16))) as engine:  # 8 KiB chunks fit
        assert engine.lookup([1, 2, 3]) == 0


def test_version_and_strict_json_from_inspect(tmp_path: Path) -> None:
    import json

    from tierkv import __version__

    version = tierkv("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"tierkv {__version__} (distribution tierkv-engine)"
    path = tmp_path / "tierkv.yaml"
    path.write_text(f"model: m\ntiers:\n  - {{name: host, backend: cpu, capacity: 16MiB}}\n"
                    f"  - {{name: disk, backend: fs, path: {tmp_path / 'fs'}}}\n")
    result = tierkv("inspect", str(path))
    assert result.returncode == 0, result.stderr

    def refuse(constant: str) -> None:
        raise AssertionError(f"inspect printed {constant}, which strict JSON parsers reject")

    report = json.loads(result.stdout, parse_constant=refuse)
    assert "occupancy" in report



def test_a_cpu_tier_larger_than_the_machines_memory_is_refused_not_left_to_the_oom_killer(tmp_path: Path) -> None:
    """A preallocated cpu tier touches its whole capacity at start: beyond MemAvailable it is a
    clear error naming both, before anything is allocated; ``preallocate: false`` is the way out."""
    from tierkv import Engine
    from tierkv_backends.memory.tier import available_memory

    available = available_memory()
    if available is None:
        pytest.skip("no /proc/meminfo on this OS: the check has nothing to read")
    too_big = {"model": "m", "tiers": [{"name": "host", "backend": "cpu", "capacity": f"{4 * available >> 30}GiB"}]}
    with pytest.raises(ConfigError, match=r"tier 'host': capacity .* is more than the .* of memory available"):
        Engine(too_big)
    lazy = {**too_big, "tiers": [{**too_big["tiers"][0], "preallocate": False}]}
    with Engine(lazy) as engine:
        assert engine.tiers[0].capacity == (4 * available >> 30) << 30
    path = tmp_path / "tierkv.yaml"
    path.write_text(f"model: m\ntiers:\n  - {{name: host, backend: cpu, capacity: {4 * available >> 30}GiB}}\n")
    result = tierkv("inspect", str(path))
    assert result.returncode == 1 and "MemAvailable" in result.stderr and "Traceback" not in result.stderr
