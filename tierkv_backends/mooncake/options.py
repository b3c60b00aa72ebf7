"""Option converters and error codes of the ``mooncake`` tier (kept apart from the I/O)."""

from __future__ import annotations

import re
from typing import Any

_HOST_PORT_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
_METADATA_SCHEMES = ("http://", "https://", "etcd://", "redis://")

#: Mooncake Store return codes the tier tells apart (negative; 0 or a length is success)
OBJECT_NOT_FOUND = -704  # absent, or evicted by the master: a miss
OBJECT_HAS_LEASE = -706  # a remove of an object a reader still leases (removed with force)
BUFFER_TOO_SMALL = -600  # get_into: the stored object is larger than this destination: another chunk, a miss
NO_AVAILABLE_HANDLE = -200  # put: no segment has room even after eviction (the pool is full)
RPC_FAIL = -900  # the master did not answer
#: codes that mean "the store is there and said no", never "the store is down"
STORE_ANSWERED = {OBJECT_NOT_FOUND, OBJECT_HAS_LEASE, BUFFER_TOO_SMALL, NO_AVAILABLE_HANDLE}


def host_port(value: Any) -> str:
    """Option converter: ``host:port`` (the master's RPC address)."""
    if isinstance(value, str):
        match = _HOST_PORT_RE.match(value.strip())
        if match and 0 < int(match.group(2)) < 65536:
            return value.strip()
    raise ValueError(f"expected host:port such as 10.0.0.5:50051, got {value!r}")


def metadata_server(value: Any) -> str:
    """Option converter: the transfer engine's metadata service.

    ``http://host:port/metadata`` (the master's embedded server, ``--enable_http_metadata_server``),
    ``etcd://host:port``, ``redis://host:port``, or ``P2PHANDSHAKE`` (no metadata server).
    """
    if isinstance(value, str):
        text = value.strip()
        if text == "P2PHANDSHAKE" or (text.startswith(_METADATA_SCHEMES) and len(text.split("://", 1)[1]) > 0):
            return text
    raise ValueError("expected a metadata server: http://host:port/metadata, etcd://host:port, redis://host:port "
                     f"or P2PHANDSHAKE, got {value!r}")


def key_prefix(value: Any) -> str:
    """Option converter: the namespace every key of this tier starts with."""
    if not isinstance(value, str) or any(ch.isspace() for ch in value):
        raise ValueError(f"expected a key prefix without whitespace such as 'tierkv/', got {value!r}")
    return value


def describe(code: int) -> str:
    """A Mooncake return code in words (for log lines and errors)."""
    names = {OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
             BUFFER_TOO_SMALL: "BUFFER_TOO_SMALL", NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (pool full)",
             RPC_FAIL: "RPC_FAIL (master unreachable)"}
    return f"{names.get(code, 'error')} ({code})"


class MooncakeError(RuntimeError):
    """A Mooncake Store call returned an error code (the store or the master is in trouble)."""

    def __init__(self, operation: str, code: int) -> None:
        super().__init__(f"mooncake {operation} returned {describe(code)}")
        self.code = code
