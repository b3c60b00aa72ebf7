"""Polling for background work in tests: one helper instead of a copy per test file."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_until(condition: Callable[[], object], what: str, deadline_s: float = 30.0, interval_s: float = 0.02) -> None:
    """Poll ``condition`` (fills, rescans and recoveries are asynchronous); fail naming ``what``
    if it does not hold within ``deadline_s`` (a generous bound, never a timing assertion)."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(interval_s)
