"""Strict CI: under CI=true a service the suite needs that is missing fails the run, naming it,
instead of turning its area into skips (tierkv.testing.requirements)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS_REDIS = "examples/tierkv-redis/tests/test_redis_backend.py::test_options_reach_the_backend"


def run_without_redis_server(ci: str) -> subprocess.CompletedProcess[str]:
    """One test of the redis plugin in a child pytest whose PATH finds no redis-server."""
    env = {name: value for name, value in os.environ.items() if name != "CI"}
    env.update(PATH=str(ROOT / "no-such-dir"), CI=ci)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", NEEDS_REDIS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_ci_fails_naming_a_missing_redis_server() -> None:
    pytest.importorskip("tierkv_redis.testing", reason="the redis example plugin is not installed here (tox installs it)")
    strict = run_without_redis_server("true")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "CI=true and redis-server is missing" in strict.stdout, strict.stdout
    lenient = run_without_redis_server("")
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr
    assert "1 skipped" in lenient.stdout and "redis-server is missing" in lenient.stdout, lenient.stdout
