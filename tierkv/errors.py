"""Exception hierarchy: one base class so callers can catch everything tierkv raises."""

from __future__ import annotations


class TierKVError(Exception):
    """Base class of every error tierkv raises on purpose."""


class ConfigError(TierKVError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or impossible.

    The message always names the YAML path (``tiers[1].capacity``) and what was expected.
    """


class BackendNotFoundError(ConfigError, LookupError):
    """A tier names a backend that no installed distribution provides."""


class BackendLoadError(TierKVError, ImportError):
    """A backend entry point exists but could not be imported or is not a StorageBackend."""


class ChunkFormatError(TierKVError, ValueError):
    """Bytes read from a tier are not a valid chunk: bad magic, truncated, or checksum mismatch.

    The engine turns this into a miss, deletes the value and counts it; it is never a wrong tensor.
    """


class BackendClosedError(TierKVError, RuntimeError):
    """A backend or engine was used after ``close()``."""


class CapacityError(TierKVError):
    """A chunk cannot fit in a tier: larger than its capacity, or everything resident is in use."""


class TierUnavailableError(TierKVError):
    """A tier's backing store cannot be reached (down, timed out, unhealthy)."""


class TierFullError(CapacityError):
    """A tier's backing store ran out of space (ENOSPC, EDQUOT) or failed to write (EIO).

    The message names the tier and the path; the tier stops admitting until space returns,
    and what it stored before stays readable.
    """


class RetentionRefusedError(CapacityError):
    """A retention (a lease that keeps chunks through evictions) that would take more of a tier
    than its cap for retained chunks (``retain_share``): nothing was retained."""
