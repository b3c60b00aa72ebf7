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
