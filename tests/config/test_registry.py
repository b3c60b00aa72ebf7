"""Entry-point discovery with real distributions put on sys.path as dist-info."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from distributions import PLUGIN, make_dict_plugin, make_distribution

from tierkv import BackendLoadError, Engine
from tierkv.backend import registry


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "site"
    make_dict_plugin(root)
    monkeypatch.syspath_prepend(str(root))
    registry.refresh()
    yield root
    registry.refresh()


def test_third_party_backend_selected_from_yaml(plugin_path: Path, tmp_path: Path) -> None:
    config = {"model": "m", "chunk_size": 4, "tiers": [{"name": "mine", "backend": "dict", "label": "x"}]}
    with Engine(config) as engine:
        assert type(engine.tiers[0]).__name__ == "DictBackend" and engine.tiers[0].label == "x"
        tokens = torch.arange(10)
        kv = torch.randn(2, 2, 10, 1, 4)
        engine.store(tokens, kv)
        out, mask = engine.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(out, kv)


def test_cli_lists_plugin_with_distribution_and_version(plugin_path: Path) -> None:
    env_path = f"{plugin_path}"
    result = subprocess.run([sys.executable, "-m", "tierkv.cli", "backends"], capture_output=True, text=True,
                            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    rows = {" ".join(line.split()[:2]): line for line in result.stdout.splitlines() if line.strip()}
    assert rows["dict tierkv-dict"].rstrip().endswith("ok"), "listed with its distribution and version, and loads"
    assert "tierkv-dict 1.2.3" in rows["dict tierkv-dict"]
    assert rows["lmdb tierkv-engine"].rstrip().endswith("ok")
    assert "BROKEN" in rows["broken tierkv-dict"] and result.returncode == 1, "the path's broken plugin is named"


def test_plugin_that_fails_to_import_is_an_error(plugin_path: Path) -> None:
    config = {"model": "m", "tiers": [{"name": "t", "backend": "broken"}]}
    with pytest.raises(BackendLoadError) as info:
        Engine(config)
    text = str(info.value)
    assert "tiers[0].backend" in text and "'broken'" in text and "tierkv-dict 1.2.3" in text
    assert "failed to import" in text and isinstance(info.value.__cause__, ModuleNotFoundError)


def test_plugin_that_is_not_a_storage_backend(plugin_path: Path) -> None:
    with pytest.raises(BackendLoadError, match="not a subclass of tierkv.StorageBackend"):
        Engine({"model": "m", "tiers": [{"name": "t", "backend": "notabackend"}]})


def test_two_distributions_claiming_one_name(plugin_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "site2"
    make_distribution(other, "tierkv-dict-fork", "tierkv_dict_fork", {"dict": "tierkv_dict_fork:DictBackend"}, PLUGIN)
    monkeypatch.syspath_prepend(str(other))
    registry.refresh()
    config = {"model": "m", "tiers": [{"name": "t", "backend": "dict"}]}
    with pytest.raises(BackendLoadError) as info:
        Engine(config)
    text = str(info.value)
    assert "tierkv-dict 1.2.3" in text and "tierkv-dict-fork 1.2.3" in text and "'tierkv-dict-fork:dict'" in text
    pinned = {"model": "m", "tiers": [{"name": "t", "backend": "tierkv-dict-fork:dict"}]}
    with Engine(pinned) as engine:
        assert type(engine.tiers[0]).__module__ == "tierkv_dict_fork"


def test_registry_is_lazy(plugin_path: Path) -> None:
    script = textwrap.dedent("""
        import sys
        from tierkv import registry
        assert "dict" in registry.installed()
        assert "tierkv_dict" not in sys.modules, "listing must not import plugins"
        registry.load("dict")
        assert "tierkv_dict" in sys.modules
        print("lazy")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={"PYTHONPATH": str(plugin_path), "PATH": "/usr/bin:/bin"})
    assert "lazy" in result.stdout, result.stderr
