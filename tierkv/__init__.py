"""tierkv: a tiered storage engine for the KV cache of LLM serving."""

from tierkv import _moved
from tierkv.backend.contract import BlobBackend, StorageBackend
from tierkv.chunks.identity import MediaSpan, RequestIdentity
from tierkv.chunks.keys import CacheKey, ChunkHasher
from tierkv.config.loader import EngineConfig, TierConfig, load_config
from tierkv.engine.blocking import AsyncEngine, Engine, EngineBuilder, EngineMetadata
from tierkv.errors import (
    BackendClosedError,
    BackendLoadError,
    BackendNotFoundError,
    CapacityError,
    ChunkFormatError,
    ConfigError,
    RetentionRefusedError,
    TierKVError,
    TierUnavailableError,
)

_moved.install()  # the flat module paths of 0.1 (keys, serde, router ...) keep importing

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "BackendClosedError",
    "BackendLoadError",
    "BackendNotFoundError",
    "BlobBackend",
    "CacheKey",
    "CapacityError",
    "ChunkFormatError",
    "ChunkHasher",
    "ConfigError",
    "Engine",
    "EngineBuilder",
    "EngineConfig",
    "EngineMetadata",
    "MediaSpan",
    "RequestIdentity",
    "RetentionRefusedError",
    "StorageBackend",
    "TierConfig",
    "TierKVError",
    "TierUnavailableError",
    "load_config",
    "__version__",
]
