"""Converters for the Redis tier's YAML options.

Each converter raises ``ValueError`` with a message saying what was expected; tierkv's
option parser prefixes it with the YAML path (``tiers[2].ttl: ...``). Nothing here echoes
a password: a URL is always shown through :func:`redact_url`.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tierkv.backend.options import parse_size
from tierkv.errors import ConfigError

#: URL schemes redis-py understands
URL_SCHEMES = ("redis", "rediss", "unix")

#: Redis refuses a bulk string longer than this (``proto-max-bulk-len``'s default, 512 MB)
REDIS_MAX_VALUE_BYTES = 512 * 1024 * 1024

_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log or put in an error)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hostport}", parts.path, parts.query, parts.fragment))


def redis_url(value: Any) -> str:
    """A ``redis://``, ``rediss://`` or ``unix://`` URL."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a URL such as redis://127.0.0.1:6379/0, got {type(value).__name__}")
    shown = redact_url(value)
    try:
        parts = urlsplit(value)
        port = parts.port  # raises on a port that is not a number
    except ValueError as exc:
        raise ValueError(f"expected a URL such as redis://127.0.0.1:6379/0, got {shown!r} ({exc})") from exc
    if parts.scheme not in URL_SCHEMES:
        raise ValueError(
            f"expected a URL with scheme {', '.join(s + '://' for s in URL_SCHEMES)}, got {shown!r}"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"expected a host in the URL, e.g. redis://127.0.0.1:6379/0, got {shown!r}")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError(f"expected a socket path, e.g. unix:///run/redis.sock, got {shown!r}")
    del port
    return value


def duration(value: Any) -> float:
    """Seconds from a positive number or a string with a unit (``500ms``, ``30s``, ``10m``, ``2h``, ``1d``)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 30s, 10m or 3600, got {value!r}")
    seconds: float | None = None
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match:
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds is None:
        raise ValueError(f"expected a duration such as 30s, 10m or 3600 (units: ms, s, m, h, d), got {value!r}")
    if seconds <= 0:
        raise ValueError(f"expected a duration greater than zero, got {value!r}")
    return seconds


def value_limit(value: Any) -> int:
    """A byte size no larger than what Redis accepts for one value."""
    try:
        nbytes = parse_size(value, "max_value_size")
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("max_value_size: ")) from exc
    if nbytes <= 0:
        raise ValueError(f"expected a size greater than zero, got {value!r}")
    if nbytes > REDIS_MAX_VALUE_BYTES:
        raise ValueError(
            f"expected at most 512MiB (Redis's limit for one value, proto-max-bulk-len), got {value!r}"
        )
    return nbytes
