"""What a test suite needs from its machine: skipped without it on a developer's machine, a
failure under CI.

A service that does not start (redis-server, a Mooncake master), a missing compiler or no root
for a tmpfs would otherwise turn a whole area of the suite into skips and leave CI green. Under
``CI=true`` (set by most CI systems, and passed into tox's environments) ``missing`` fails
the test instead, naming what is missing.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def strict() -> bool:
    """Whether missing requirements fail (``CI`` set to 1 / true / yes) rather than skip."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(what: str, why: str = "", *, module_level: bool = False) -> NoReturn:
    """``what`` (a service or tool the test needs) is missing: skip, or fail under CI."""
    message = f"{what} is missing" + (f": {why}" if why else "")
    if strict():
        pytest.fail(f"CI=true and {message} (the suite needs it here; .ci/run installs what it needs)", pytrace=False)
    pytest.skip(message, allow_module_level=module_level)
