"""Test helpers shipped with tierkv: the backend conformance suite, and the tools the examples
and benchmarks share (``tierkv.testing.vllm_runner``, ``tierkv.testing.s3server``, ...).

The conformance suite is a pytest class, so its names are imported on first use: an example
that only saves a model with ``tierkv.testing.vllm_runner`` runs without pytest installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierkv.testing.backend_tests import BackendTests, make_chunk, make_key, same_bytes

__all__ = ["BackendTests", "make_chunk", "make_key", "same_bytes"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tierkv.testing import backend_tests

        return getattr(backend_tests, name)
    raise AttributeError(f"module 'tierkv.testing' has no attribute {name!r}")
