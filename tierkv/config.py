"""YAML (or a dict) to a typed, validated engine configuration.

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

from tierkv import codecs, registry
from tierkv.admission import Admission, parse_admission
from tierkv.backend import InPlaceTier, NamesVictims, StorageBackend
from tierkv.errors import ConfigError
from tierkv.keys import KV_FORMATS
from tierkv.options import (
    Option,
    OptionValues,
    inline_secrets,
    parse_options,
    parse_size,
    redacted_repr,
    unknown_key_error,
)

logger = logging.getLogger(__name__)

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
    "gpu_high_watermark": Option("float", 0.92, minimum=0.0, doc="fraction of device memory in use"),
    "gpu_low_watermark": Option("float", 0.85, minimum=0.0),
    "host_high_watermark": Option("float", 0.95, minimum=0.0),
    "host_low_watermark": Option("float", 0.90, minimum=0.0),
    "poll_interval_ms": Option("int", 200, minimum=1),
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
_TIER_COMMON = ("name", "backend", "capacity", "promote", "admission", "codec")
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
class TierConfig:
    """One tier: its name, backend entry-point name, capacity and validated options."""

    name: str
    backend: str
    capacity: int | None
    options: Mapping[str, Any]
    path: str  # where in the YAML it came from, for error messages
    promote: bool = True  # copy hits from lower tiers up into this tier
    admission: Admission = Admission()  # which chunks may be copied in (tierkv.admission)
    codec: str = "none"  # how chunks are kept on a byte tier (tierkv.codecs)

    def __repr__(self) -> str:
        """Options declared secret (and any named like a credential) show as ``<redacted>``."""
        secret = self.options.secret if isinstance(self.options, OptionValues) else ()
        return (f"TierConfig(name={self.name!r}, backend={self.backend!r}, capacity={self.capacity!r}, "
                f"options={redacted_repr(self.options, secret)}, path={self.path!r}, promote={self.promote!r}, "
                f"admission={self.admission.describe()!r}, codec={self.codec!r})")

    __str__ = __repr__


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
    """The whole engine: model identity, chunking, KV layout and the tier stack (top first)."""

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


def _require(raw: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{path}{key}: required key is missing")
    return raw[key]


def _int(value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value}")
    return value


def _choice(value: Any, choices: tuple[str, ...], path: str) -> str:
    if value not in choices:
        raise ConfigError(f"{path}: expected one of {list(choices)}, got {value!r}")
    return str(value)


def _env_overrides(raw: dict[str, Any]) -> dict[str, Any]:
    merged = dict(raw)
    for name, value in os.environ.items():
        if not name.startswith("TIERKV_"):
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


def _parse_tier(raw: Any, index: int, seen: set[str], write_policy: str = "write_through",
                last: bool = False, inline: bool = False) -> TierConfig:
    path = f"tiers[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping with at least 'name' and 'backend', got {raw!r}")
    name = _require(raw, "name", f"{path}.")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.name: expected a non-empty string, got {name!r}")
    if name in seen:
        raise ConfigError(f"{path}.name: tier name {name!r} is used twice; tier names must be unique")
    seen.add(name)
    backend_name = _require(raw, "backend", f"{path}.")
    if not isinstance(backend_name, str):
        raise ConfigError(f"{path}.backend: expected a backend name such as 'cpu' or 'lmdb', got {backend_name!r}")
    capacity = parse_size(raw["capacity"], f"{path}.capacity") if raw.get("capacity") is not None else None
    if capacity == 0:
        raise ConfigError(f"{path}.capacity: a tier of capacity 0 can hold no chunk; give a size such as 4GiB, "
                          f"or leave the tier out")
    backend_cls = registry.load(backend_name, where=f"{path}.backend")
    if backend_cls.requires_capacity and capacity is None:
        raise ConfigError(f"{path}.capacity: backend {backend_name!r} needs a capacity such as 4GiB")
    specific = {k: v for k, v in raw.items() if k not in _TIER_COMMON}
    for key in specific:
        if key not in backend_cls.options:
            raise unknown_key_error(key, [*_TIER_COMMON, *backend_cls.options], path)
    options = backend_cls.validate_options(specific, path)
    if inline:
        _warn_inline_secrets(backend_cls, specific, path)
    promote = raw.get("promote", True)
    if not isinstance(promote, bool):
        raise ConfigError(f"{path}.promote: expected true or false, got {promote!r}")
    admission = parse_admission(raw.get("admission", default_admission(backend_cls, write_policy)),
                                f"{path}.admission")
    if write_policy == "write_back" and last and admission.filters:
        raise ConfigError(f"{path}.admission: under write_back every chunk a memory tier evicts or flushes is "
                          f"written to the tier below whatever its admission (a flush keeps what it acknowledged), "
                          f"and nothing is promoted into the last tier, so {admission.describe()} would do nothing "
                          f"here; leave admission out, or use write_policy: write_through")
    if admission.policy == "tinylfu" and not issubclass(backend_cls, NamesVictims):
        raise ConfigError(f"{path}.admission: tinylfu compares a chunk with the one the tier would evict, and "
                          f"backend {backend_name!r} cannot name it; use reused(n) (or a cpu, gpu, lmdb or fs tier)")
    codec = _parse_codec(raw.get("codec", "none"), backend_cls, f"{path}.codec")
    return TierConfig(name=name, backend=backend_name, capacity=capacity, options=options, path=path, promote=promote,
                      admission=admission, codec=codec)


def _warn_inline_secrets(backend_cls: type[StorageBackend], raw: Mapping[str, Any], path: str) -> None:
    """Say that a credential written into a config given inline (a mapping, not a file) may end up
    in a serving engine's log: vLLM logs its engine arguments at start, the connector's
    ``kv_connector_extra_config`` (this config) included. It still works."""
    for name in inline_secrets(backend_cls.options, raw):
        logger.warning("%s.%s: a credential is written into a config given inline; a serving engine may log its "
                       "config (vLLM logs kv_connector_extra_config at start, and this with it). Give it as "
                       "{env: NAME} (an environment variable holding it), or leave it out where the backend has a "
                       "credential chain of its own (s3: AWS_* variables, ~/.aws profiles, instance roles)",
                       path, name)


def _parse_codec(value: Any, backend_cls: type, path: str) -> str:
    """A tier's ``codec``: one of :data:`tierkv.codecs.CODEC_NAMES`, on a byte tier only (a
    memory tier hands out its chunks in place), with its library installed."""
    name = _choice(value, codecs.CODEC_NAMES, path)
    if name != "none" and issubclass(backend_cls, InPlaceTier):
        raise ConfigError(f"{path}: a memory tier keeps chunks in place and cannot code them; set codec on a "
                          f"byte tier (lmdb, fs, s3, mooncake or a plugin), or leave it out")
    try:
        codecs.check_available(name)
    except ImportError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return name


def _check_lossy_below_exact(tiers: tuple[TierConfig, ...], write_policy: str) -> None:
    """A chunk read from a lossy tier is promoted into memory tiers only, but from memory two
    copies go down without knowing where it came from: write-back demotes what a memory tier
    evicts, and under write-through a ``reused(n)`` tier gets a late fill of a chunk read n
    times. Either would put the lossy chunk into an exact byte tier under its exact key, so a
    lossy tier has no exact byte tier above it that such a copy reaches."""
    lossy = [codecs.is_lossy(tier.codec) for tier in tiers]
    for index, tier in enumerate(tiers):
        if not lossy[index]:
            continue
        for above, above_lossy in zip(tiers[:index], lossy):
            if above_lossy or issubclass(registry.load(above.backend, where=above.path), InPlaceTier):
                continue
            if write_policy == "write_back":
                how, fix = "demoted", "or use write_through"
            elif above.admission.policy == "reused":
                how, fix = "copied (a late fill of admission reused(n))", f"or another admission on {above.name!r}"
            else:
                continue
            raise ConfigError(f"{tier.path}.codec: chunks read from this lossy tier could be {how} into the exact "
                              f"tier {above.name!r} above it under their exact keys; put this tier above "
                              f"{above.name!r}, give {above.name!r} codec {tier.codec} too, {fix}")


def default_admission(backend_cls: type, write_policy: str = "write_through") -> str:
    """``tinylfu`` for a bounded tier below memory that can name its victims (lmdb, fs): once
    full it keeps the chunks seen most often instead of the latest ones (benchmarks/admission.py:
    fewer bytes written and a higher hit rate than taking every chunk); ``all`` for memory
    tiers and for tiers that cannot say what they would evict (s3, mooncake, redis). Under
    ``write_back`` ``all`` everywhere: the tier below a memory tier is where its chunks are kept,
    not a filtered copy (dirty chunks are written down whatever the rule), so a rule would only
    filter promotions."""
    if write_policy == "write_back":
        return "all"
    if issubclass(backend_cls, NamesVictims) and not issubclass(backend_cls, InPlaceTier):
        return "tinylfu"
    return "all"


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
    model = _require(raw, "model", "")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"model: expected a non-empty model name, got {model!r}")
    chunk_size = _int(raw.get("chunk_size", 256), "chunk_size", 1)
    kv_format = _choice(raw.get("kv_format", "vllm"), KV_FORMATS, "kv_format")
    write_policy = _choice(raw.get("write_policy", "write_through"), WRITE_POLICIES, "write_policy")
    dtype = None
    if raw.get("dtype") is not None:
        dtype = DTYPES[_choice(raw["dtype"], tuple(DTYPES), "dtype")]
    world_size = _int(raw.get("world_size", 1), "world_size", 1)
    worker_id = _int(raw.get("worker_id", 0), "worker_id", 0)
    if worker_id >= world_size:
        raise ConfigError(f"worker_id: must be below world_size ({world_size}), got {worker_id}")
    tiers_raw = _require(raw, "tiers", "")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError("tiers: expected a non-empty list of tiers, fastest first")
    seen: set[str] = set()
    inline = source == "<dict>"  # a mapping (an integration's extra config), not a file
    tiers = tuple(_parse_tier(tier, index, seen, write_policy, last=index == len(tiers_raw) - 1, inline=inline)
                  for index, tier in enumerate(tiers_raw))
    _check_lossy_below_exact(tiers, write_policy)
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
    """Load and validate a configuration from a dict, a YAML file path, or ``$TIERKV_CONFIG``."""
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
