"""One tier's part of the configuration: its YAML keys (name, backend, capacity, promote,
admission, codec, and the backend's own options, checked by the backend) to a
``TierConfig``, and the rules that look at the tiers together (a lossy tier below an exact
one). ``tierkv.config.loader`` reads the rest of the file and calls these.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierkv.backend import codecs, registry
from tierkv.backend.contract import InPlaceTier, NamesVictims, StorageBackend
from tierkv.backend.options import (
    OptionValues,
    inline_secrets,
    one_of,
    parse_size,
    redacted_repr,
    required,
    unknown_key_error,
)
from tierkv.errors import ConfigError
from tierkv.policy.admission import Admission, parse_admission

logger = logging.getLogger("tierkv.config")

TIER_COMMON = ("name", "backend", "capacity", "promote", "admission", "codec")
"""The keys every tier takes; the others belong to its backend."""


@dataclass(frozen=True)
class TierConfig:
    """One tier: its name, backend entry-point name, capacity and validated options.

    One entry of ``EngineConfig.tiers``, made by [load_config][tierkv.load_config]. Its
    repr shows options declared secret (and any named like a credential) as
    ``<redacted>``.

    Attributes:
        name: The tier's name, unique in the configuration.
        backend: The backend's entry-point name (``cpu``, ``lmdb``, ``dist:name`` ...).
        capacity: The tier's capacity in bytes; None when the YAML gives none (a backend that
            needs one refuses that).
        options: The backend's own options, validated by it.
        path: Where in the YAML the tier came from (``tiers[1]``), for error messages.
        promote: Copy hits from lower tiers up into this tier.
        admission: Which chunks may be copied into the tier (``tierkv.policy.admission``).
        codec: How chunks are kept on a byte tier (``tierkv.backend.codecs``); ``"none"``:
            as they are.
    """

    name: str
    backend: str
    capacity: int | None
    options: Mapping[str, Any]
    path: str  # where in the YAML it came from, for error messages
    promote: bool = True  # copy hits from lower tiers up into this tier
    admission: Admission = Admission()  # which chunks may be copied in (tierkv.policy.admission)
    codec: str = "none"  # how chunks are kept on a byte tier (tierkv.backend.codecs)

    def __repr__(self) -> str:
        """Options declared secret (and any named like a credential) show as ``<redacted>``."""
        secret = self.options.secret if isinstance(self.options, OptionValues) else ()
        return (f"TierConfig(name={self.name!r}, backend={self.backend!r}, capacity={self.capacity!r}, "
                f"options={redacted_repr(self.options, secret)}, path={self.path!r}, promote={self.promote!r}, "
                f"admission={self.admission.describe()!r}, codec={self.codec!r})")

    __str__ = __repr__


def parse_tier(raw: Any, index: int, seen: set[str], write_policy: str = "write_through",
               last: bool = False, inline: bool = False) -> TierConfig:
    """Tier ``index`` of the YAML's ``tiers`` (``seen``: the names before it; ``last``: no tier below
    it; ``inline``: the config came as a mapping, which a serving engine may log)."""
    path = f"tiers[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping with at least 'name' and 'backend', got {raw!r}")
    name = required(raw, "name", f"{path}.")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.name: expected a non-empty string, got {name!r}")
    if name in seen:
        raise ConfigError(f"{path}.name: tier name {name!r} is used twice; tier names must be unique")
    seen.add(name)
    backend_name = required(raw, "backend", f"{path}.")
    if not isinstance(backend_name, str):
        raise ConfigError(f"{path}.backend: expected a backend name such as 'cpu' or 'lmdb', got {backend_name!r}")
    capacity = parse_size(raw["capacity"], f"{path}.capacity") if raw.get("capacity") is not None else None
    if capacity == 0:
        raise ConfigError(f"{path}.capacity: a tier of capacity 0 can hold no chunk; give a size such as 4GiB, "
                          f"or leave the tier out")
    backend_cls = registry.load(backend_name, where=f"{path}.backend")
    if backend_cls.requires_capacity and capacity is None:
        raise ConfigError(f"{path}.capacity: backend {backend_name!r} needs a capacity such as 4GiB")
    specific = {k: v for k, v in raw.items() if k not in TIER_COMMON}
    for key in specific:
        if key not in backend_cls.options:
            raise unknown_key_error(key, [*TIER_COMMON, *backend_cls.options], path)
    options = backend_cls.validate_options(specific, path)
    if inline:
        warn_inline_secrets(backend_cls, specific, path)
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
    codec = parse_codec(raw.get("codec", "none"), backend_cls, f"{path}.codec")
    return TierConfig(name=name, backend=backend_name, capacity=capacity, options=options, path=path, promote=promote,
                      admission=admission, codec=codec)


def warn_inline_secrets(backend_cls: type[StorageBackend], raw: Mapping[str, Any], path: str) -> None:
    """Say that a credential written into a config given inline (a mapping, not a file) may end up
    in a serving engine's log: vLLM logs its engine arguments at start, the connector's
    ``kv_connector_extra_config`` (this config) included. It still works."""
    for name in inline_secrets(backend_cls.options, raw):
        logger.warning("%s.%s: a credential is written into a config given inline; a serving engine may log its "
                       "config (vLLM logs kv_connector_extra_config at start, and this with it). Give it as "
                       "{env: NAME} (an environment variable holding it), or leave it out where the backend has a "
                       "credential chain of its own (s3: AWS_* variables, ~/.aws profiles, instance roles)",
                       path, name)


def parse_codec(value: Any, backend_cls: type, path: str) -> str:
    """A tier's ``codec``: one of ``tierkv.backend.codecs.CODEC_NAMES``, on a byte tier only (a
    memory tier hands out its chunks in place), with its library installed."""
    name = one_of(value, codecs.CODEC_NAMES, path)
    if name != "none" and issubclass(backend_cls, InPlaceTier):
        raise ConfigError(f"{path}: a memory tier keeps chunks in place and cannot code them; set codec on a "
                          f"byte tier (lmdb, fs, s3, mooncake or a plugin), or leave it out")
    try:
        codecs.check_available(name)
    except ImportError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return name


def check_lossy_below_exact(tiers: tuple[TierConfig, ...], write_policy: str) -> None:
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
