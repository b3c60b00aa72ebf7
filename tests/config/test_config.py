"""YAML configuration: validation messages name the path and the valid choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv import BackendNotFoundError, ConfigError, load_config
from tierkv.backend.options import parse_size


def base(tmp_path: Path, **extra: object) -> dict:
    return {"model": "m", "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                                    {"name": "disk", "backend": "lmdb", "path": str(tmp_path), "capacity": "1GiB"}],
            **extra}


def test_sizes_with_units() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("500MB") == 500_000_000
    assert parse_size("1.5KiB") == 1536
    assert parse_size(42) == 42
    with pytest.raises(ConfigError, match="expected a size"):
        parse_size("lots")


def test_yaml_file_and_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tierkv.yaml"
    path.write_text(f"model: llama\nchunk_size: 128\ntiers:\n  - name: disk\n    backend: lmdb\n"
                    f"    path: {tmp_path / 'db'}\n    capacity: 1GiB\n")
    config = load_config(path)
    assert (config.model, config.chunk_size, config.tiers[0].capacity) == ("llama", 128, 1 << 30)
    monkeypatch.setenv("TIERKV_CONFIG", str(path))
    monkeypatch.setenv("TIERKV_CHUNK_SIZE", "64")
    assert load_config().chunk_size == 64


def test_a_credential_a_tier_names_is_not_an_unknown_override(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """``TIERKV_*`` variables the config does not know are warned about (a misspelt override),
    except one a tier reads as ``{env: NAME}``: a user's own credential, named as they like."""
    monkeypatch.setenv("TIERKV_S3_SECRET_TEST", "s3cr3t")
    monkeypatch.setenv("TIERKV_CHUNK_SIZ_TEST", "64")
    config = {"model": "m", "tiers": [{"name": "shared", "backend": "s3", "bucket": "bucket", "endpoint_url": "http://x",
                                       "access_key_id": "id", "secret_access_key": {"env": "TIERKV_S3_SECRET_TEST"}}]}
    caplog.set_level("WARNING", logger="tierkv")
    load_config(config)
    assert "TIERKV_CHUNK_SIZ_TEST" in caplog.text, "a misspelt override is still named"
    assert "TIERKV_S3_SECRET_TEST" not in caplog.text and "s3cr3t" not in caplog.text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chunk_sise": 256}, r"unknown key 'chunk_sise' \(did you mean 'chunk_size'\?\)"),
        ({"chunk_size": "big"}, r"chunk_size: expected an integer"),
        ({"chunk_size": 0}, r"chunk_size: must be >= 1"),
        ({"kv_format": "tgi"}, r"kv_format: expected one of \['vllm', 'huggingface'\]"),
        ({"write_policy": "sometimes"}, r"write_policy: expected one of"),
        ({"dtype": "float13"}, r"dtype: expected one of"),
        ({"pressure": {"gpu_low_watermark": 0.99}}, r"gpu_low_watermark <= gpu_high_watermark"),
        ({"tiers": []}, r"tiers: expected a non-empty list"),
    ],
)
def test_top_level_errors(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(base(tmp_path, **change))


def test_tier_errors_name_their_path(tmp_path: Path) -> None:
    raw = base(tmp_path)
    raw["tiers"][1]["capacity"] = "a lot"
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.capacity: expected a size"):
        load_config(raw)
    raw = base(tmp_path)
    raw["tiers"][1]["pth"] = "/x"
    with pytest.raises(ConfigError, match=r"tiers\[1\]: unknown key 'pth' \(did you mean 'path'\?\)"):
        load_config(raw)
    raw = base(tmp_path)
    del raw["tiers"][1]["path"]
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path: required option is missing"):
        load_config(raw)
    raw = base(tmp_path)
    raw["tiers"][0]["pinned"] = "yes"
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.pinned: expected true or false"):
        load_config(raw)
    raw = base(tmp_path)
    raw["tiers"][1]["name"] = "host"
    with pytest.raises(ConfigError, match="used twice"):
        load_config(raw)
    raw = base(tmp_path)
    del raw["tiers"][0]["capacity"]
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: backend 'cpu' needs a capacity"):
        load_config(raw)


def test_unknown_backend_lists_installed_and_suggests(tmp_path: Path) -> None:
    raw = base(tmp_path)
    raw["tiers"][1]["backend"] = "lmbd"
    with pytest.raises(BackendNotFoundError) as info:
        load_config(raw)
    text = str(info.value)
    assert "tiers[1].backend" in text and "'lmbd'" in text and "did you mean 'lmdb'" in text
    assert "cpu (tierkv" in text, "the message lists installed backends with their distribution"


def test_missing_file_and_bad_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    monkeypatch.delenv("TIERKV_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="TIERKV_CONFIG"):
        load_config()


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    import os

    from tierkv import Engine

    if os.geteuid() == 0:
        target = "/proc/tierkv-cannot-exist"  # even root cannot create directories in /proc
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = str(locked / "db")
    raw = base(tmp_path)
    raw["tiers"][1]["path"] = target
    with pytest.raises(ConfigError, match="cannot create directory|not writable"):
        Engine(raw)
