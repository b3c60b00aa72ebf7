"""YAML (or a dict) to a typed, validated engine configuration (each tier's part:
``tierkv.config.tier_config``).

Every mistake is reported with its YAML path and what was expected; unknown keys are
errors with a close match, never ignored. ``TIERKV_*`` environment variables override
top-level keys; an unrecognised ``TIERKV_`` variable is reported once rather than
silently ignored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from tierkv.backend.options import Option, one_of, parse_options, required, unknown_key_error
from tierkv.chunks.keys import KV_FORMATS
from tierkv.config.tier_config import TierConfig, check_lossy_below_exact, default_admission, parse_tier
from tierkv.errors import ConfigError

__all__ = ["DTYPES", "WRITE_POLICIES", "EngineConfig", "TierConfig", "config_for_integration", "config_from_mapping",
           "default_admission", "load_config"]

logger = logging.getLogger("tierkv.config")

WRITE_POLICIES = ("write_through", "write_back")
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    **{name: getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)},
}

_PRESSURE_OPTIONS = {
    "gpu_high_watermark": Option("float", 0.92, minimum=0.0, doc="fraction of device memory in use at which the gpu "
                                                                   "tier shrinks"),
    "gpu_low_watermark": Option("float", 0.85, minimum=0.0, doc="the gpu tier shrinks until device memory in "
                                                                 "use is back below this fraction"),
    "host_high_watermark": Option("float", 0.95, minimum=0.0, doc="fraction of host memory in use at which the "
                                                                   "host tiers shrink"),
    "host_low_watermark": Option("float", 0.90, minimum=0.0, doc="they shrink until host memory in use is "
                                                                 "back below this fraction"),
    "poll_interval_ms": Option("int", 200, minimum=1, doc="how often memory in use is read"),
}
_BACKGROUND_OPTIONS = {
    "queue_bytes": Option("size", 1 << 30, doc="bytes of chunks waiting to be written to lower tiers"),
    "when_full": Option("str", "wait", choices=("wait", "drop"),
                        doc="a put waits for room, or its lower-tier fill is dropped and counted"),
}
_HEALTH_OPTIONS = {
    "failure_threshold": Option("int", 3, minimum=1, doc="consecutive failures before a tier is skipped"),
    "retry_after_s": Option("float", 5.0, minimum=0.0, doc="how long an unhealthy tier is skipped"),
    "timeout_s": Option("float", None, minimum=0.0, doc="limit on one tier operation (none by default)"),
}
_RECOMPUTE_KEYS = ("tokens_per_s", "curve")
_TOP_LEVEL = (
    "model", "chunk_size", "kv_format", "dtype", "write_policy", "world_size", "worker_id", "tiers", "pressure",
    "background", "health", "recompute", "cost_aware", "model_revision",
)
# TIERKV_<NAME> overrides these top-level keys (parsed as YAML scalars).
_ENV_OVERRIDES = ("model", "model_revision", "chunk_size", "kv_format", "dtype", "write_policy", "world_size", "worker_id")
# Variables tierkv reads elsewhere; anything else under TIERKV_ is reported.
_ENV_KNOWN = {"TIERKV_CONFIG", "TIERKV_S3_ENDPOINT", "TIERKV_LOG_LEVEL", "TIERKV_NO_EXT"} | {
    f"TIERKV_{key.upper()}" for key in _ENV_OVERRIDES
}
_warned_env: set[str] = set()


@dataclass(frozen=True)
class PressureConfig:
    gpu_high_watermark: float = 0.92
    gpu_low_watermark: float = 0.85
    host_high_watermark: float = 0.95
    host_low_watermark: float = 0.90
    poll_interval_ms: int = 200


@dataclass(frozen=True)
class BackgroundConfig:
    queue_bytes: int = 1 << 30
    when_full: str = "wait"


@dataclass(frozen=True)
class HealthConfig:
    failure_threshold: int = 3
    retry_after_s: float = 5.0
    timeout_s: float | None = None


@dataclass(frozen=True)
class RecomputeConfig:
    """How fast the serving model prefills: one throughput, or throughputs at a few prompt
    lengths (interpolated; attention makes long prompts slower per token)."""

    tokens_per_s: float | None = None
    curve: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine: model identity, chunking, KV layout and the tier stack (top first).

    Made by [load_config][tierkv.load_config], which validates every value; the YAML keys
    of the same names are documented in the configuration reference.

    Attributes:
        model: The model's name; part of every key.
        tiers: The tiers, fastest first.
        chunk_size: Tokens per chunk (the unit of storage and of every key).
        kv_format: The layout of KV blobs: ``"vllm"`` or ``"huggingface"``.
        dtype: The dtype every stored KV must have; None: any.
        write_policy: ``"write_through"`` or ``"write_back"``.
        world_size: How many workers (tensor-parallel ranks) share the model; part of
            every key.
        worker_id: This worker's rank, below ``world_size``; part of every key.
        pressure: The memory watermarks at which memory tiers shrink.
        background: The bound of the queue of lower-tier fills, and what a put does when
            it is full.
        health: When a failing tier is skipped, for how long, and the limit on one tier
            operation.
        recompute: How fast the serving model prefills, for the cost model.
        cost_aware: Load a cached prefix only as far as that beats recomputing it; None:
            on once a recompute speed is known.
        source: Where the configuration came from (a file path, or ``"<dict>"``).
        model_revision: What tells this model's weights from another revision under the
            same name; part of every key.
    """

    model: str
    tiers: tuple[TierConfig, ...]
    chunk_size: int = 256
    kv_format: str = "vllm"
    dtype: torch.dtype | None = None
    write_policy: str = "write_through"
    world_size: int = 1
    worker_id: int = 0
    pressure: PressureConfig = field(default_factory=PressureConfig)
    background: BackgroundConfig = field(default_factory=BackgroundConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    # load a cached prefix only as far as it beats recomputing it; None: when a recompute speed is known
    cost_aware: bool | None = None
    source: str = "<dict>"
    # what tells this model's weights from another revision under the same name; in every key
    model_revision: str | None = None


def _int(value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value}")
    return value


def _referenced_env(value: Any) -> set[str]:
    """The environment variables a config names as ``{env: NAME}`` (credentials), anywhere in it."""
    if isinstance(value, dict):
        if set(value) == {"env"} and isinstance(value["env"], str):
            return {value["env"]}
        return set().union(*(_referenced_env(item) for item in value.values()))
    if isinstance(value, list | tuple):
        return set().union(*(_referenced_env(item) for item in value))
    return set()


def _env_overrides(raw: dict[str, Any]) -> dict[str, Any]:
    merged = dict(raw)
    referenced = _referenced_env(raw)  # a credential a tier reads: not a misspelt override
    for name, value in os.environ.items():
        if not name.startswith("TIERKV_") or name in referenced:
            continue
        if name not in _ENV_KNOWN:
            if name not in _warned_env:
                _warned_env.add(name)
                logger.warning("ignoring unknown environment variable %s (known: %s)", name, ", ".join(sorted(_ENV_KNOWN)))
            continue
        key = name[len("TIERKV_"):].lower()
        if key in _ENV_OVERRIDES:
            merged[key] = yaml.safe_load(value)
    return merged


def _section(raw: Mapping[str, Any], name: str, spec: Mapping[str, Option]) -> dict[str, Any]:
    section = raw.get(name)
    if section is None:  # absent, or `name:` with nothing under it: the defaults
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{name}: expected a mapping of {', '.join(spec)}, got {section!r}")
    return parse_options(spec, section, name)


def _positive(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{path}: expected a positive number, got {value!r}")
    return float(value)


def _recompute(raw: Any) -> RecomputeConfig:
    """``recompute: {tokens_per_s: 12000}`` or ``{curve: [[1024, 20000], [16384, 6000]]}``."""
    if raw is None:
        return RecomputeConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"recompute: expected a mapping with tokens_per_s and/or curve, got {raw!r}")
    for key in raw:
        if key not in _RECOMPUTE_KEYS:
            raise unknown_key_error(str(key), list(_RECOMPUTE_KEYS), "recompute")
    tokens_per_s = None if raw.get("tokens_per_s") is None else _positive(raw["tokens_per_s"], "recompute.tokens_per_s")
    curve_raw = raw.get("curve") or []
    if not isinstance(curve_raw, list):
        raise ConfigError(f"recompute.curve: expected a list of [prompt_tokens, tokens_per_s] pairs, got {curve_raw!r}")
    curve = []
    for index, point in enumerate(curve_raw):
        if not isinstance(point, list | tuple) or len(point) != 2:
            raise ConfigError(f"recompute.curve[{index}]: expected [prompt_tokens, tokens_per_s], got {point!r}")
        curve.append((_int(point[0], f"recompute.curve[{index}][0]", 1),
                      _positive(point[1], f"recompute.curve[{index}][1]")))
    return RecomputeConfig(tokens_per_s, tuple(sorted(curve)))


def config_from_mapping(raw: Mapping[str, Any], source: str = "<dict>") -> EngineConfig:
    """Validate a parsed YAML document (after environment overrides)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
    raw = _env_overrides(dict(raw))
    for key in raw:
        if key not in _TOP_LEVEL:
            raise unknown_key_error(str(key), list(_TOP_LEVEL), source)
    model = required(raw, "model", "")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"model: expected a non-empty model name, got {model!r}")
    chunk_size = _int(raw.get("chunk_size", 256), "chunk_size", 1)
    kv_format = one_of(raw.get("kv_format", "vllm"), KV_FORMATS, "kv_format")
    write_policy = one_of(raw.get("write_policy", "write_through"), WRITE_POLICIES, "write_policy")
    dtype = None
    if raw.get("dtype") is not None:
        dtype = DTYPES[one_of(raw["dtype"], tuple(DTYPES), "dtype")]
    world_size = _int(raw.get("world_size", 1), "world_size", 1)
    worker_id = _int(raw.get("worker_id", 0), "worker_id", 0)
    if worker_id >= world_size:
        raise ConfigError(f"worker_id: must be below world_size ({world_size}), got {worker_id}")
    tiers_raw = required(raw, "tiers", "")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError("tiers: expected a non-empty list of tiers, fastest first")
    seen: set[str] = set()
    inline = source == "<dict>"  # a mapping (an integration's extra config), not a file
    tiers = tuple(parse_tier(tier, index, seen, write_policy, last=index == len(tiers_raw) - 1, inline=inline)
                  for index, tier in enumerate(tiers_raw))
    check_lossy_below_exact(tiers, write_policy)
    pressure = PressureConfig(**_section(raw, "pressure", _PRESSURE_OPTIONS))
    background = BackgroundConfig(**_section(raw, "background", _BACKGROUND_OPTIONS))
    health = HealthConfig(**_section(raw, "health", _HEALTH_OPTIONS))
    for kind in ("gpu", "host"):
        low, high = getattr(pressure, f"{kind}_low_watermark"), getattr(pressure, f"{kind}_high_watermark")
        if not 0 < low <= high <= 1:
            raise ConfigError(f"pressure: need 0 < {kind}_low_watermark <= {kind}_high_watermark <= 1, got {low} and {high}")
    revision = raw.get("model_revision")
    if revision is not None and (not isinstance(revision, str | int) or isinstance(revision, bool) or revision == ""):
        raise ConfigError(f"model_revision: expected a non-empty string (a commit id, a digest, a version), "
                          f"got {revision!r}")
    cost_aware = raw.get("cost_aware")
    if cost_aware is not None and not isinstance(cost_aware, bool):
        raise ConfigError(f"cost_aware: expected true, false or null (true once a recompute speed is known), "
                          f"got {cost_aware!r}")
    return EngineConfig(
        model=model, tiers=tiers, chunk_size=chunk_size, kv_format=kv_format, dtype=dtype,
        write_policy=write_policy, world_size=world_size, worker_id=worker_id, pressure=pressure,
        background=background, health=health, recompute=_recompute(raw.get("recompute")), cost_aware=cost_aware,
        source=source, model_revision=None if revision is None else str(revision),
    )


def load_config(source: EngineConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None) -> EngineConfig:
    """Load and validate a configuration.

    Args:
        source: An ``EngineConfig`` (returned as it is), a mapping in the shape of the YAML
            file, the path of a YAML file, or None: the YAML file ``$TIERKV_CONFIG`` names.
            For a mapping or a file, ``TIERKV_*`` environment variables override top-level
            keys.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: if no source is given and ``TIERKV_CONFIG`` is not set, the file cannot
            be read or is not YAML, or a value is missing, unknown, of the wrong type or
            impossible (the message names its YAML path and what was expected).
        BackendNotFoundError: if a tier names a backend no installed distribution provides
            (a ``ConfigError``).
        BackendLoadError: if a tier's backend is found but cannot be imported, or its name
            is registered by more than one distribution.
    """
    if isinstance(source, EngineConfig):
        return source
    if isinstance(source, Mapping):
        return config_from_mapping(source)
    if source is None:
        env_path = os.environ.get("TIERKV_CONFIG")
        if not env_path:
            raise ConfigError("no configuration given: pass a dict or a YAML path, or set TIERKV_CONFIG to a YAML file")
        source = env_path
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from exc
    return config_from_mapping(document or {}, source=str(path))


def config_for_integration(source: Any, model_name: str, where: str) -> EngineConfig:
    """The tierkv config a serving-engine integration was given: a YAML path or a mapping, whose
    ``model`` defaults to the serving engine's model name. Errors name ``where`` (the
    integration's own config key), since the user wrote the value there, not in a tierkv file."""
    if isinstance(source, Mapping):
        return load_config({"model": model_name, **source})
    if not isinstance(source, str | os.PathLike):
        raise ConfigError(f"{where}: expected a YAML path or a mapping of tierkv settings, got {type(source).__name__}")
    path = Path(source)
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {str(path)!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(document, Mapping):
        raise ConfigError(f"{path}: expected a mapping of tierkv settings, got {type(document).__name__}")
    return config_from_mapping({"model": model_name, **document}, source=str(path))
