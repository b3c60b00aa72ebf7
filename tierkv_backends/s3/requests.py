"""What an S3 reply means for the ``s3`` tier: retry it, a miss, or a damaged object.

Three kinds of trouble look alike from far away and must be told apart, because the tier
acts on them differently:

- *transient*: throttling (SlowDown, 429, 503), 5xx, timeouts, refused or reset
  connections, and bodies that did not arrive whole (cut, short, reset mid-body). Retried,
  then a miss. Never a delete: the object in the bucket may be fine and shared by every
  replica.
- *missing*: 404 / NoSuchKey. A miss.
- *corrupt*: a whole body (its length matches what the server said) that is not what tierkv
  wrote: not a valid chunk (bad magic, checksum mismatch), or an object whose size, as the
  server states it in Content-Range, differs from the size its own chunk header gives
  (``ObjectSizeError``). A miss, deleted and counted, and no strike against the tier's
  health: the store answered, the object is wrong. Without a Content-Range (a 200 to a
  ranged GET) the size comes only from Content-Length, which a middlebox may have rewritten
  together with the body, so a disagreement there stays transient.

Also the option converters of the tier (bucket names, prefixes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import botocore.exceptions

from tierkv.chunks import serde
from tierkv.errors import ChunkFormatError

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
NO_BUCKET_CODES = {"NoSuchBucket"}
TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "TooManyRequests", "TooManyRequestsException", "RequestLimitExceeded", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "ServerBusy", "PriorRequestNotComplete",
}


class IncompleteBodyError(Exception):
    """A reply body that did not arrive whole: a transport fault, retried, never corruption."""


class ObjectSizeError(ChunkFormatError):
    """A whole object whose size (as the server states it) is not what its chunk header says:
    the object itself is wrong, not the transfer. Corrupt (a miss, deleted), never retried."""


TRANSIENT_ERRORS = (
    botocore.exceptions.ConnectionError,  # refused, connect timeout, endpoint unreachable
    botocore.exceptions.HTTPClientError,  # read timeout, connection reset, broken stream (ResponseStreamingError)
    botocore.exceptions.IncompleteReadError,  # fewer body bytes than Content-Length
    IncompleteBodyError,  # fewer (or more) body bytes than Content-Range or the chunk header say
    ConnectionError,  # a reset surfacing as the builtin, below botocore's wrappers
)


def bucket_name(value: Any) -> str:
    """Option converter: an S3 bucket name (3-63 lowercase letters, digits, dots, hyphens)."""
    if not isinstance(value, str) or not _BUCKET_RE.match(value) or ".." in value:
        raise ValueError(f"expected an S3 bucket name (3-63 characters: lowercase letters, digits, '.', '-'; "
                         f"starting and ending with a letter or digit), got {value!r}")
    return value


def key_prefix(value: Any) -> str:
    """Option converter: an object-name prefix, without leading or trailing slashes."""
    if not isinstance(value, str):
        raise ValueError(f"expected a string prefix such as 'tierkv' or 'team/kv', got {value!r}")
    return value.strip("/")


def error_code(exc: BaseException) -> str:
    """The S3 error code of a ClientError (or its HTTP status as text); '' for other errors."""
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        return str(error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


def http_status(exc: BaseException) -> int:
    """The HTTP status of a botocore ClientError (0 for any other exception)."""
    if isinstance(exc, botocore.exceptions.ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return 0


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` can help: throttling, 5xx, timeouts, dropped connections, cut bodies."""
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    status = http_status(exc)
    return error_code(exc) in TRANSIENT_CODES or status == 429 or status >= 500


def is_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the object (or bucket) does not exist."""
    return error_code(exc) in MISSING_CODES


def checked_body(body: bytes, response: Mapping[str, Any], start: int) -> int:
    """The object's total size, once ``body`` (asked from byte ``start``) is known to be whole.

    The body must hold exactly the bytes the reply said it carries: the span of its
    Content-Range (or its Content-Length without one); anything else is a cut or short
    transfer (``IncompleteBodyError``, transient). A first range (``start == 0``) must
    also agree with the chunk header inside it: the object is as long as the header says.
    When the server stated the object's size (Content-Range) and the whole body arrived, a
    disagreement is the object's fault (``ObjectSizeError``, corrupt); without a
    Content-Range it may be a rewritten reply (``IncompleteBodyError``).
    """
    match = _CONTENT_RANGE_RE.match(response.get("ContentRange") or "")
    if match:
        first, last, total = (int(group) for group in match.groups())
        expected = last - first + 1
        if first != start:
            raise IncompleteBodyError(f"reply starts at byte {first}, asked from byte {start}")
    else:
        length = response.get("ContentLength")
        expected = len(body) if length is None else int(length)
        total = start + expected
    if len(body) != expected:
        raise IncompleteBodyError(f"body of {len(body)} bytes, the reply announced {expected}")
    if start == 0:
        _check_header_length(body, total, sized_by_server=match is not None)
    return total


def _check_header_length(first: bytes, total: int, sized_by_server: bool) -> None:
    """A body that starts with a readable chunk header must be as long as that header says.

    ``sized_by_server``: ``total`` comes from the server's Content-Range, so a mismatch means
    the stored object is wrong (corrupt); otherwise it may be the transfer (transient).
    """
    try:
        header = serde.decode_header(first)
    except ChunkFormatError:
        if len(first) < serde.MAX_HEADER_BYTES and len(first) < total:
            raise IncompleteBodyError(f"body of {len(first)} bytes is too short to hold a chunk header") from None
        return  # a whole body that is not a chunk: the decoder calls it corrupt
    declared = header.header_len + header.payload_len
    if declared != total:
        problem = f"object of {total} bytes, its chunk header says {declared}"
        if sized_by_server:
            raise ObjectSizeError(f"{problem} (size from the server's Content-Range: the object is wrong)")
        raise IncompleteBodyError(f"{problem} (no Content-Range to tell a rewritten reply from a wrong object)")
