"""Registry edge cases a real plugin package runs into: how users spell a pinned
distribution name, and what ``tierkv backends --load`` says about broken plugins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from distributions import PLUGIN, make_dict_plugin, make_distribution

from tierkv import BackendNotFoundError, Engine
from tierkv.backend import registry


@pytest.fixture
def dotted_and_dashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two distributions claiming ``dict``: one named with dashes, one with dots."""
    root = tmp_path / "site"
    make_dict_plugin(root)
    other = tmp_path / "site2"
    make_distribution(other, "acme.kv", "acme_kv", {"dict": "acme_kv:DictBackend"}, PLUGIN)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.syspath_prepend(str(other))
    registry.refresh()
    yield root
    registry.refresh()


@pytest.mark.parametrize("pin", ["tierkv-dict:dict", "tierkv_dict:dict", "TierKV-Dict:dict", "tierkv.dict:dict"])
def test_pin_accepts_any_normalized_spelling_of_the_distribution(dotted_and_dashed: Path, pin: str) -> None:
    # PEP 503: names differing only in case and runs of '-', '_', '.' are the same distribution
    with Engine({"model": "m", "tiers": [{"name": "t", "backend": pin}]}) as engine:
        assert type(engine.tiers[0]).__module__ == "tierkv_dict"


@pytest.mark.parametrize("pin", ["acme.kv:dict", "acme-kv:dict", "ACME_KV:dict"])
def test_pin_of_a_dotted_distribution_name(dotted_and_dashed: Path, pin: str) -> None:
    with Engine({"model": "m", "tiers": [{"name": "t", "backend": pin}]}) as engine:
        assert type(engine.tiers[0]).__module__ == "acme_kv"


def test_pin_of_a_distribution_that_is_not_installed(dotted_and_dashed: Path) -> None:
    with pytest.raises(BackendNotFoundError) as info:
        Engine({"model": "m", "tiers": [{"name": "t", "backend": "nobody-ships-this:dict"}]})
    text = str(info.value)
    assert "tiers[0].backend" in text and "'nobody-ships-this:dict'" in text
    assert "tierkv-dict 1.2.3" in text and "acme.kv 1.2.3" in text, "the error lists what is installed"


def test_cli_load_marks_each_broken_plugin_and_keeps_listing(dotted_and_dashed: Path, tmp_path: Path) -> None:
    paths = f"{tmp_path / 'site'}:{tmp_path / 'site2'}"
    result = subprocess.run([sys.executable, "-m", "tierkv.cli", "backends", "--load"], capture_output=True,
                            text=True, env={"PYTHONPATH": paths, "PATH": "/usr/bin:/bin"}, timeout=120)
    rows = {line.split()[0] + " " + line.split()[1]: line for line in result.stdout.splitlines() if line.strip()}
    assert "BROKEN" in rows["broken tierkv-dict"] and "failed to import" in rows["broken tierkv-dict"]
    assert "ModuleNotFoundError" in rows["broken tierkv-dict"]
    assert "not a subclass of tierkv.StorageBackend" in rows["notabackend tierkv-dict"]
    # both claims of the shared name load once pinned, and the built-ins are still listed as fine
    assert rows["dict tierkv-dict"].rstrip().endswith("ok") and rows["dict acme.kv"].rstrip().endswith("ok")
    assert rows["lmdb tierkv-engine"].rstrip().endswith("ok")
    assert result.returncode == 1, "--load fails when any plugin is broken, so it works as a CI check"
    plain = subprocess.run([sys.executable, "-m", "tierkv.cli", "backends"], capture_output=True, text=True,
                           env={"PYTHONPATH": paths, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert plain.stdout == result.stdout and plain.returncode == 1, "ok is said only of a backend that imports"


def test_a_pin_of_the_former_distribution_name_means_this_one(tmp_path: Path) -> None:
    """Configs written as ``tierkv:lmdb`` before the distribution became tierkv-engine still load
    the built-in backend (the name ``tierkv`` on the public index is another project's)."""
    from tierkv.backend.registry import DISTRIBUTION

    assert DISTRIBUTION == "tierkv-engine"
    tier = {"name": "t", "backend": "tierkv:lmdb", "path": str(tmp_path / "db"), "capacity": "16MiB"}
    with Engine({"model": "m", "tiers": [tier]}) as engine:
        assert type(engine.tiers[0]).__module__ == "tierkv_backends.lmdb"


def test_a_built_in_backend_without_its_extra_is_not_installed_not_broken(tmp_path: Path) -> None:
    """A new user's first check after `pip install '.[s3,compress]'`: the mooncake backend's
    extra is not installed. It says so, and how to install it, and the check passes."""
    blocker = tmp_path / "no_mooncake"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text('import sys\nsys.modules["mooncake"] = None\n'
                                              'sys.modules["mooncake.store"] = None\n')
    result = subprocess.run([sys.executable, "-m", "tierkv.cli", "backends"], capture_output=True, text=True,
                            env={"PYTHONPATH": str(blocker), "PATH": "/usr/bin:/bin"}, timeout=120)
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "not installed: the mooncake tier needs Mooncake Store: pip install '.[mooncake]'" in rows["mooncake"]
    assert "BROKEN" not in result.stdout and rows["lmdb"].rstrip().endswith("ok")
    assert result.returncode == 0, result.stdout + result.stderr
