"""What the examples import from ``tierkv.testing`` works without the test tools installed: the
CPU vLLM quickstart (examples/vllm-quickstart) saves its model with ``tierkv.testing.vllm_runner``
in a user's venv, where pytest is not installed."""

from __future__ import annotations

import subprocess
import sys


def test_the_quickstart_s_helpers_import_without_pytest() -> None:
    code = ("import sys; sys.modules['pytest'] = None\n"  # `import pytest` now raises ImportError
            "from tierkv.testing.vllm_runner import save_random_llama, wait_for_stat\n"
            "import tierkv.testing\n"
            "try:\n    tierkv.testing.BackendTests\nexcept ImportError:\n    print('conformance suite needs pytest')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "conformance suite needs pytest", "the suite is still loaded on first use"


def test_the_conformance_suite_is_still_importable_by_name() -> None:
    from tierkv.testing import BackendTests, make_chunk, make_key, same_bytes

    assert BackendTests.__module__ == "tierkv.testing.backend_tests"
    assert callable(make_chunk) and callable(make_key) and callable(same_bytes)
