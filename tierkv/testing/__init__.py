"""Test helpers shipped with tierkv: the backend conformance suite."""

from tierkv.testing.backend_tests import BackendTests, make_chunk, make_key, same_bytes

__all__ = ["BackendTests", "make_chunk", "make_key", "same_bytes"]
