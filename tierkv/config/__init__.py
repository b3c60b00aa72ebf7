"""Reading a tierkv YAML (or a mapping) into an ``EngineConfig``.

``tierkv.config`` re-exports the public names of ``tierkv.config.loader``; the
tiers' part of the file is parsed in ``tierkv.config.tier_config``.
"""

from tierkv.config.loader import (
    DTYPES,
    WRITE_POLICIES,
    BackgroundConfig,
    EngineConfig,
    HealthConfig,
    PressureConfig,
    RecomputeConfig,
    config_for_integration,
    config_from_mapping,
    load_config,
)
from tierkv.config.tier_config import TierConfig

__all__ = [
    "BackgroundConfig",
    "DTYPES",
    "EngineConfig",
    "HealthConfig",
    "PressureConfig",
    "RecomputeConfig",
    "TierConfig",
    "WRITE_POLICIES",
    "config_for_integration",
    "config_from_mapping",
    "load_config",
]
