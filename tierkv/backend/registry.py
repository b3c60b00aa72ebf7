"""Discovery of storage backends through the ``tierkv.backends`` entry-point group.

Listing is cheap (entry-point metadata only) and cached; a backend's module is imported
only when a configuration names it. A named backend that cannot be loaded is an error
that says what was asked for, where, what is installed, and why it failed: a tier is
never silently skipped.
"""

from __future__ import annotations

import difflib
import re
import threading
from dataclasses import dataclass
from importlib import metadata

from tierkv.backend.contract import StorageBackend
from tierkv.errors import BackendLoadError, BackendNotFoundError

GROUP = "tierkv.backends"


@dataclass(frozen=True)
class BackendInfo:
    """One installed backend: its entry-point name, target and distribution."""

    name: str
    target: str
    distribution: str
    version: str
    entry_point: metadata.EntryPoint

    @property
    def qualified_name(self) -> str:
        """``distribution:name``, which pins a backend when two packages claim a name."""
        return f"{self.distribution}:{self.name}"

    def describe(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"


_lock = threading.Lock()
_installed: dict[str, list[BackendInfo]] | None = None
_loaded: dict[str, type[StorageBackend]] = {}


def refresh() -> None:
    """Forget cached discovery results (after installing a plugin at run time)."""
    global _installed
    with _lock:
        _installed = None
        _loaded.clear()


def installed() -> dict[str, list[BackendInfo]]:
    """Every backend name registered by an installed distribution (usually one each)."""
    global _installed
    with _lock:
        if _installed is None:
            found: dict[str, list[BackendInfo]] = {}
            for entry_point in metadata.entry_points(group=GROUP):
                dist = entry_point.dist
                info = BackendInfo(
                    name=entry_point.name,
                    target=entry_point.value,
                    distribution=dist.metadata["Name"] if dist is not None else "<unknown>",
                    version=dist.version if dist is not None else "?",
                    entry_point=entry_point,
                )
                claims = found.setdefault(entry_point.name, [])
                # the same distribution seen twice on sys.path is one claim, not a conflict
                if not any(c.distribution == info.distribution and c.target == info.target for c in claims):
                    claims.append(info)
            _installed = found
        return _installed


DISTRIBUTION = "tierkv-engine"
"""This project's distribution name (the import package is ``tierkv``): the name ``tierkv`` on
the public package index belongs to an unrelated project. A pin ``tierkv:<backend>`` written
for the built-in backends before the rename still means this distribution."""


def _pinned(distribution: str) -> str:
    """The normalized distribution a pin names (``tierkv``, this project's former name, is ours)."""
    normalized = normalize_distribution(distribution)
    return DISTRIBUTION if normalized == "tierkv" else normalized


def normalize_distribution(name: str) -> str:
    """PEP 503 form of a distribution name: ``Acme.KV``, ``acme_kv`` and ``acme-kv`` are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_summary() -> str:
    listing = [info.describe() for claims in installed().values() for info in claims]
    return ", ".join(sorted(listing)) or "none"


def resolve(name: str, where: str = "backend") -> BackendInfo:
    """The installed backend a configuration means by ``name`` (``backend`` or ``dist:backend``)."""
    table = installed()
    distribution, _, short = name.rpartition(":")
    claims = table.get(short, [])
    if distribution:
        claims = [c for c in claims if normalize_distribution(c.distribution) == _pinned(distribution)]
    if not claims:
        hint = difflib.get_close_matches(short, list(table), n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        raise BackendNotFoundError(
            f"{where}: no backend named {name!r} is installed{suggestion}. "
            f"Installed backends: {_installed_summary()}. A backend is a distribution that declares an "
            f"entry point in the {GROUP!r} group (see README: writing a backend)."
        )
    if len(claims) > 1:
        owners = ", ".join(c.describe() for c in claims)
        pins = " or ".join(repr(c.qualified_name) for c in claims)
        raise BackendLoadError(
            f"{where}: backend name {short!r} is registered by more than one distribution ({owners}); "
            f"write {pins} to choose one"
        )
    return claims[0]


def load(name: str, where: str = "backend") -> type[StorageBackend]:
    """Import and return the backend class registered as ``name``."""
    info = resolve(name, where)
    key = info.qualified_name
    with _lock:
        cached = _loaded.get(key)
    if cached is not None:
        return cached
    try:
        target = info.entry_point.load()
    except Exception as exc:
        raise BackendLoadError(
            f"{where}: backend {info.name!r} from {info.distribution} {info.version} failed to import "
            f"({info.target}): {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(target, type) and issubclass(target, StorageBackend)):
        raise BackendLoadError(
            f"{where}: backend {info.name!r} from {info.distribution} {info.version} points at {info.target}, "
            f"which is {target!r}, not a subclass of tierkv.StorageBackend"
        )
    with _lock:
        _loaded[key] = target
    return target
