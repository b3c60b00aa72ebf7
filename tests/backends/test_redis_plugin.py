"""Installation proof: ``pip install ./examples/tierkv-redis`` into a fresh virtual environment
makes ``backend: redis`` usable from YAML, with no other change.

The fresh environment sees torch and tierkv from the running one (so nothing is
downloaded), but the example itself is installed into it by pip, from a copy of the
source tree, exactly as a user would; the test then checks that the ``redis`` entry point
it finds belongs to that new installation.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import site
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tierkv-redis"

pytest.importorskip("tierkv_redis.testing", reason="tierkv-redis is not installed in this environment (tox installs it)")
from tierkv_redis.testing import RedisServer, server_binary  # noqa: E402

from tierkv.testing.requirements import missing  # noqa: E402


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if server_binary() is None:
        missing("redis-server", "apt-get install redis-server")
    with RedisServer() as server:
        yield server


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment with tierkv-redis pip-installed into it; returns its python."""
    root = tmp_path_factory.mktemp("fresh")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    inner_site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    # A venv made from inside a venv sees the *base* interpreter's site-packages, not ours:
    # point it at ours (with addsitedir, so editable installs' .pth files are honoured too).
    outer = [path for path in site.getsitepackages() if Path(path) != inner_site]
    (inner_site / "_outer_env.pth").write_text(
        "".join(f"import site; site.addsitedir({path!r})\n" for path in outer)
    )
    source = root / "tierkv-redis"  # build from a copy: the checkout gets no build/ or egg-info
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    install = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-input"]
    if importlib.util.find_spec("setuptools") is not None:
        install.append("--no-build-isolation")  # build with the setuptools we have: no download
    run([*install, str(source)])
    if importlib.util.find_spec("redis") is None:
        run([*install[:-1], "redis"])
    return python


@pytest.mark.slow
def test_fresh_install_registers_redis_backend(fresh_venv: Path) -> None:
    listing = run([str(fresh_venv), "-m", "tierkv.cli", "backends", "--load"]).stdout
    line = next((row for row in listing.splitlines() if row.split()[:1] == ["redis"]), None)
    assert line is not None, f"redis missing from `tierkv backends`:\n{listing}"
    assert "tierkv-redis 0.1.0" in line and "tierkv_redis:RedisBackend" in line and line.rstrip().endswith("ok")
    where = json.loads(run([str(fresh_venv), "-c", textwrap.dedent("""
        import json, tierkv_redis
        from importlib import metadata
        from tierkv import registry
        info = registry.resolve("redis")
        print(json.dumps({"module": tierkv_redis.__file__,
                          "dist": str(info.entry_point.dist.locate_file("")),
                          "name": info.distribution, "version": info.version}))
    """)]).stdout)
    venv_root = fresh_venv.parent.parent
    assert Path(where["module"]).is_relative_to(venv_root), f"imported from outside the fresh venv: {where}"
    assert Path(where["dist"]).is_relative_to(venv_root), f"entry point from outside the fresh venv: {where}"
    assert (where["name"], where["version"]) == ("tierkv-redis", "0.1.0")


@pytest.mark.slow
def test_yaml_stack_cpu_over_redis_is_bit_exact(fresh_venv: Path, redis_server: RedisServer, tmp_path: Path) -> None:
    config = tmp_path / "tierkv.yaml"
    config.write_text(textwrap.dedent(f"""
        model: proof-model
        chunk_size: 16
        tiers:
          - name: host
            backend: cpu
            capacity: 64KiB          # a few chunks: most must be evicted to redis
          - name: shared
            backend: redis
            url: {redis_server.url}
            key_prefix: "proof:"
    """))
    script = textwrap.dedent(f"""
        import json, torch
        from tierkv import Engine
        prompts = [torch.arange(i * 1000, i * 1000 + 64) for i in range(12)]
        caches = [torch.randn(4, 2, 64, 2, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
                  for i in range(12)]  # 4 layers, K/V, 64 tokens, 2 heads, 16 dims: 32 KiB per prompt
        with Engine.from_yaml({str(config)!r}) as engine:
            for tokens, kv in zip(prompts, caches):
                engine.store(tokens, kv)
            engine.flush()
            exact = []
            for tokens, kv in zip(prompts, caches):
                out, mask = engine.retrieve(tokens, return_tuple=False)
                exact.append(bool(mask.all()) and torch.equal(out.view(torch.int16), kv.view(torch.int16)))
            tiers = engine.stats()["tiers"]
        print(json.dumps({{"exact": exact, "host_evictions": tiers["host"]["evictions"],
                          "redis_hits": tiers["shared"]["hits"], "backend": tiers["shared"]["backend"]}}))
    """)
    result = json.loads(run([str(fresh_venv), "-c", script]).stdout.strip().splitlines()[-1])
    assert result["backend"] == "RedisBackend"
    assert result["host_evictions"] > 0, result
    assert result["redis_hits"] > 0, f"nothing was read back from redis: {result}"
    assert all(result["exact"]), result
