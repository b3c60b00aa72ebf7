"""Decisions from pure bookkeeping and readings: residency and eviction order (LRU,
S3-FIFO, pins), admission rules, the load-or-recompute cost model, memory-pressure
probes (NVML, host memory) and circuit breakers.

Nothing here touches a backend, so every decision is unit-testable alone.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """``tierkv.policy.residency`` was the bookkeeping module before it became this package: its names
    are found in ``tierkv.policy.residency``, with a DeprecationWarning."""
    import importlib
    import warnings

    residency = importlib.import_module("tierkv.policy.residency")
    if name.startswith("_") or not hasattr(residency, name):
        raise AttributeError(f"module 'tierkv.policy.residency' has no attribute {name!r}")
    warnings.warn(f"tierkv.policy.residency.{name} moved to tierkv.policy.residency.{name}", DeprecationWarning, stacklevel=2)
    return getattr(residency, name)
