"""Typed option parsing shared by the engine config and every backend.

Each backend declares its options as a mapping of name -> ``Option``; values are
checked and converted here so every tier reports mistakes the same way: the YAML path,
what was expected, and the valid choices or a close match.
"""

from __future__ import annotations

import difflib
import os
import re
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
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
    """``nbytes`` for people: the largest binary unit it reaches, one decimal."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.1f}{unit}"
    return f"{nbytes}B"


@dataclass(frozen=True)
class Option:
    """One declared option of a backend: its kind, default and documentation.

    A backend declares its YAML keys as ``options = {"name": Option(...)}``;
    ``StorageBackend.validate_options`` checks a tier's values against them and every
    mistake is reported the same way (the YAML path, what was expected, the valid choices
    or a close match). The configuration reference is generated from ``doc``.

    Attributes:
        kind: One of ``"str"``, ``"int"``, ``"float"``, ``"bool"``, ``"size"`` (bytes, from
            an int or ``4GiB``), ``"path"``, or a callable converting the raw value (raising
            ValueError or TypeError with a message on bad input).
        default: The value when the key is absent or null.
        required: Whether the key must be given.
        doc: What the option does, for the configuration reference and error messages.
        choices: The values allowed; None: any of the kind.
        minimum: The smallest value allowed (numbers); None: no bound.
        secret: Whether the value is a credential: never echoed back in errors or reprs,
            and it may be given as ``{env: NAME}`` (read from that environment variable).
    """

    kind: str | Callable[[Any], Any]
    default: Any = None
    required: bool = False
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    secret: bool = False  # never echoed back in errors or reprs


REDACTED = "<redacted>"
# option names that hold credentials even where no Option declared them secret (a plain dict)
_SECRET_WORDS = ("secret", "password", "passwd", "token", "credential", "access_key", "private_key", "api_key")


def looks_secret(name: str) -> bool:
    """Whether an option name says it holds a credential (for mappings without a spec)."""
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


class OptionValues(dict[str, Any]):
    """Validated options of one tier: a plain dict (``Backend(**values)`` works) whose repr
    and str show ``<redacted>`` for every secret option (credentials, URLs with passwords),
    so printing a config, a tier or an error never reveals them."""

    __slots__ = ("secret",)

    def __init__(self, values: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
                 secret: Iterable[str] = ()) -> None:
        super().__init__(values)
        self.secret = frozenset(secret)

    def __repr__(self) -> str:
        return redacted_repr(self, self.secret)

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self), tuple(self.secret)))


def redacted_repr(values: Mapping[str, Any], secret: Iterable[str] = ()) -> str:
    """``repr`` of a mapping of options with secret values (declared, or named like one) hidden."""
    hidden = frozenset(secret)

    def show(key: Any, value: Any) -> str:
        secret_value = value is not None and (key in hidden or looks_secret(str(key)))
        return REDACTED if secret_value else repr(value)
    return "{" + ", ".join(f"{key!r}: {show(key, value)}" for key, value in values.items()) + "}"


def _redact_text(text: str, value: Any) -> str:
    """``text`` with every occurrence of a secret ``value`` (and its repr) replaced."""
    for form in {repr(value), str(value)}:
        if form and form not in ("None", "''"):
            text = text.replace(form, REDACTED)
    return text


def _convert(option: Option, value: Any, path: str) -> Any:
    kind = option.kind
    shown = REDACTED if option.secret else repr(value)
    if callable(kind):
        try:
            return kind(value)
        except (TypeError, ValueError) as exc:
            message = _redact_text(str(exc), value) if option.secret else str(exc)
            raise ConfigError(f"{path}: {message}") from (None if option.secret else exc)
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
    """The ConfigError for an unknown key at ``path``: the closest valid key, and all of them."""
    hint = difflib.get_close_matches(key, valid, n=1)
    suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ConfigError(f"{path}: unknown key {key!r}{suggestion}; valid keys: {', '.join(sorted(valid))}")


def from_environment(value: Any, where: str) -> Any:
    """A secret option's value: ``{env: NAME}`` is read from the environment variable NAME (the
    config then holds no credential a serving engine could log); anything else as it is."""
    if not isinstance(value, Mapping):
        return value
    if set(value) != {"env"} or not isinstance(value["env"], str) or not value["env"]:
        raise ConfigError(f"{where}: expected the credential itself or {{env: NAME}} (an environment variable "
                          f"holding it), got a mapping with keys {sorted(map(str, value))}")
    name = value["env"]
    found = os.environ.get(name)
    if not found:
        raise ConfigError(f"{where}: the environment variable {name!r} named for it is not set (or empty)")
    return found


def inline_secrets(spec: Mapping[str, Option], raw: Mapping[str, Any]) -> list[str]:
    """The options of ``raw`` holding a credential written out (not ``{env: NAME}``): declared
    secret in ``spec``, or named like one."""
    return [name for name, value in raw.items()
            if isinstance(value, str) and value and not _url_without_password(value)
            and ((name in spec and spec[name].secret) or (name not in spec and looks_secret(name)))]


def _url_without_password(value: str) -> bool:
    """Whether ``value`` is a URL that holds no password (a secret option may be a URL)."""
    if "://" not in value:
        return False
    try:
        return urllib.parse.urlsplit(value).password is None
    except ValueError:
        return False


def parse_options(spec: Mapping[str, Option], raw: Mapping[str, Any], path: str) -> OptionValues:
    """Check ``raw`` against ``spec``: unknown keys, missing required ones, types, choices.
    A secret option may be ``{env: NAME}`` (``from_environment``). The result's repr hides
    the options declared ``secret``."""
    for key in raw:
        if key not in spec:
            raise unknown_key_error(key, list(spec), path)
    parsed = OptionValues(secret=(name for name, option in spec.items() if option.secret))
    for name, option in spec.items():
        where = f"{path}.{name}" if path else name
        if name not in raw or raw[name] is None:
            if option.required:
                raise ConfigError(f"{where}: required option is missing ({option.doc or option.kind})")
            parsed[name] = option.default
            continue
        value = _convert(option, from_environment(raw[name], where) if option.secret else raw[name], where)
        shown = REDACTED if option.secret else repr(value)
        if option.choices is not None and value not in option.choices:
            raise ConfigError(f"{where}: expected one of {list(option.choices)}, got {shown}")
        if option.minimum is not None and value < option.minimum:
            raise ConfigError(f"{where}: must be >= {option.minimum}, got {shown}")
        parsed[name] = value
    return parsed


def required(raw: Mapping[str, Any], key: str, path: str) -> Any:
    """``raw[key]``, or a ConfigError naming ``path + key`` when it is missing."""
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{path}{key}: required key is missing")
    return raw[key]


def one_of(value: Any, choices: tuple[str, ...], path: str) -> str:
    """``value`` when it is one of ``choices``, else a ConfigError naming ``path`` and the choices."""
    if value not in choices:
        raise ConfigError(f"{path}: expected one of {list(choices)}, got {value!r}")
    return str(value)
