"""Typed option parsing shared by the engine config and every backend.

Each backend declares its options as a mapping of name -> :class:`Option`; values are
checked and converted here so every tier reports mistakes the same way: the YAML path,
what was expected, and the valid choices or a close match.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tierkv.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, path: str = "size") -> int:
    """Bytes from an int or a string with a unit (``4GiB``, ``500MB``, ``1.5G``)."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected a size such as 4GiB or 500MB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{path}: a size cannot be negative, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise ConfigError(
        f"{path}: expected a size such as 4GiB or 500MB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}"
    )


def format_size(nbytes: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.1f}{unit}"
    return f"{nbytes}B"


@dataclass(frozen=True)
class Option:
    """One declared option: its kind, default and documentation.

    ``kind`` is one of ``str``, ``int``, ``float``, ``bool``, ``size``, ``path`` or a
    callable converting the raw value (raising ValueError with a message on bad input).
    """

    kind: str | Callable[[Any], Any]
    default: Any = None
    required: bool = False
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    secret: bool = False  # never echoed back in errors or reprs


def _convert(option: Option, value: Any, path: str) -> Any:
    kind = option.kind
    shown = "<redacted>" if option.secret else repr(value)
    if callable(kind):
        try:
            return kind(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    if kind == "size":
        return parse_size(value, path)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {shown}")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {shown}")
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {shown}")
    if kind in ("str", "path"):
        if isinstance(value, str) and value:
            return value
        raise ConfigError(f"{path}: expected a non-empty string, got {shown}")
    raise ConfigError(f"{path}: option declared with unknown kind {kind!r}")


def unknown_key_error(key: str, valid: list[str], path: str) -> ConfigError:
    hint = difflib.get_close_matches(key, valid, n=1)
    suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ConfigError(f"{path}: unknown key {key!r}{suggestion}; valid keys: {', '.join(sorted(valid))}")


def parse_options(spec: Mapping[str, Option], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Check ``raw`` against ``spec``: unknown keys, missing required ones, types, choices."""
    for key in raw:
        if key not in spec:
            raise unknown_key_error(key, list(spec), path)
    parsed: dict[str, Any] = {}
    for name, option in spec.items():
        where = f"{path}.{name}" if path else name
        if name not in raw or raw[name] is None:
            if option.required:
                raise ConfigError(f"{where}: required option is missing ({option.doc or option.kind})")
            parsed[name] = option.default
            continue
        value = _convert(option, raw[name], where)
        if option.choices is not None and value not in option.choices:
            raise ConfigError(f"{where}: expected one of {list(option.choices)}, got {value!r}")
        if option.minimum is not None and value < option.minimum:
            raise ConfigError(f"{where}: must be >= {option.minimum}, got {value!r}")
        parsed[name] = value
    return parsed
