"""Loaded at start-up by every Python process whose PYTHONPATH names this folder (the tox
``sglang`` env sets it, so SGLang's scheduler processes get it too): applies the CPU
stand-ins of ``tests/sglang_stubs.py`` when ``SGLANG_CPU_TEST_STUBS=1``."""

import os
import sys

if os.environ.get("SGLANG_CPU_TEST_STUBS") == "1":
    _tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if _tests not in sys.path:
        sys.path.append(_tests)
    import sglang_stubs  # noqa: E402  (tests/ is on the path via the conftest too)

    sglang_stubs.install()
