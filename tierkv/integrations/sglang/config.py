"""The backend's settings, from SGLang's ``--hicache-storage-backend-extra-config`` JSON.

SGLang reads ``backend_name``, ``module_path``, ``class_name`` and ``interface_v1`` itself (the
dynamic loader; ``interface_v1: 1`` selects the zero-copy page path) and a few keys of its own
backends; tierkv reads:

- ``config``: path of a tierkv YAML file, or the config as a mapping (required unless
  ``TIERKV_CONFIG`` names a file). Its ``chunk_size`` is replaced by SGLang's page size (one
  chunk per page) and its ``model`` by SGLang's model name (keys use SGLang's);
- ``load_deadline_s``: pages not read after this many seconds are misses, so a stuck tier
  costs SGLang at most that (default: none). A deadline makes disk and remote tiers read
  into a staging buffer first (a read abandoned at the deadline must never write into
  SGLang's pool later): one more copy per byte;
- ``stats_file``: a path where each rank keeps a JSON summary of its counters (the
  counters of a backend living in SGLang's scheduler process, for tests and operators).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierkv.config.loader import EngineConfig, config_for_integration
from tierkv.errors import ConfigError

SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
               "enable_metadata_cache", "metadata_ttl")
"""Keys SGLang's loader or its own backends read; accepted and left to SGLang."""
TIERKV_KEYS = ("config", "load_deadline_s", "stats_file")
_WHERE = "hicache-storage-backend-extra-config"


@dataclass(frozen=True)
class BackendSettings:
    """What the backend needs, checked once when SGLang creates it."""

    config: EngineConfig
    load_deadline_s: float | None
    stats_file: str | None

    def for_pages(self, page_size: int, model_name: str) -> EngineConfig:
        """The engine config for one host pool: one chunk per SGLang page, SGLang's model name."""
        return dataclasses.replace(self.config, chunk_size=page_size, model=model_name)


def _deadline(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{_WHERE}.load_deadline_s: expected a positive number of seconds or null, got {value!r}")
    return float(value)


def engine_config(source: Any, model_name: str) -> EngineConfig:
    """The tierkv config named by ``source`` (a YAML path or a mapping); ``model`` defaults to SGLang's."""
    return config_for_integration(source, model_name or "sglang", f"{_WHERE}.config")


def settings_from(extra: Mapping[str, Any] | None, model_name: str) -> BackendSettings:
    """Validate the extra config (errors name the key and what was expected)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(SGLANG_KEYS) - set(TIERKV_KEYS))
    if unknown:
        raise ConfigError(f"{_WHERE}: unknown key(s) {unknown}; tierkv reads {list(TIERKV_KEYS)} "
                          f"(and SGLang {list(SGLANG_KEYS)})")
    source = extra.get("config") or os.environ.get("TIERKV_CONFIG")
    if not source:
        raise ConfigError(
            f"{_WHERE}.config: name a tierkv YAML file (or give the config inline, or set TIERKV_CONFIG), e.g. "
            '{"config": {"tiers": [{"name": "host", "backend": "cpu", "capacity": "8GiB"}]}}'
        )
    stats_file = extra.get("stats_file")
    if stats_file is not None and not isinstance(stats_file, str):
        raise ConfigError(f"{_WHERE}.stats_file: expected a path, got {stats_file!r}")
    return BackendSettings(engine_config(source, model_name), _deadline(extra.get("load_deadline_s")),
                           stats_file)
