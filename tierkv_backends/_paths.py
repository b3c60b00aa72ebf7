"""Helpers the file-backed tiers (lmdb, fs) share: a directory the tier can write into."""

from __future__ import annotations

import os

from tierkv.errors import ConfigError


def ensure_writable_dir(path: str, where: str) -> None:
    """Create ``path`` if needed and fail clearly if this process cannot write there."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot create directory {path!r}: {exc.strerror}") from exc
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: {path!r} exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: directory {path!r} is not writable by this process")
