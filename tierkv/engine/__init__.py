"""The prompt API and its blocking facade: ``AsyncEngine`` (store, retrieve, lookup,
plan, prefetch) and ``Engine`` (the same on a private loop thread), with the
chunk layout of a prompt, prefix plans and the engine's metadata.

``tierkv.engine`` re-exports the public classes.
"""

from tierkv.engine.async_engine import AsyncEngine
from tierkv.engine.blocking import Engine, EngineBuilder
from tierkv.engine.metadata import EngineMetadata

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineBuilder",
    "EngineMetadata",
]
