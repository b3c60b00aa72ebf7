"""tierkv: a tiered storage engine for the KV cache of LLM serving."""

from tierkv.backend import BlobBackend, StorageBackend
from tierkv.config import EngineConfig, TierConfig, load_config
from tierkv.engine import AsyncEngine, Engine, EngineBuilder, EngineMetadata
from tierkv.errors import (
    BackendClosedError,
    BackendLoadError,
    BackendNotFoundError,
    CapacityError,
    ChunkFormatError,
    ConfigError,
    TierKVError,
    TierUnavailableError,
)
from tierkv.identity import MediaSpan, RequestIdentity
from tierkv.keys import CacheKey, ChunkHasher

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
    "StorageBackend",
    "TierConfig",
    "TierKVError",
    "TierUnavailableError",
    "load_config",
    "__version__",
]
