"""Counting the bytes tierkv copies, per data path, so "one copy" is a measured figure.

Every place that moves KV bytes from one buffer to another (a memcpy, a file read or
write, a gather or scatter) calls ``count``. The engine names the path an operation
belongs to (``store``, ``retrieve``, ``fill``, ``promote``) with ``on_path``; the name
travels in a context variable, so it follows the operation into worker threads started
with ``asyncio.to_thread`` (and executors that run ``contextvars.copy_context().run``).
Copies made outside any path are not counted.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

PATHS = ("store", "retrieve", "fill", "promote")


class CopyCounter:
    """Bytes copied and bytes delivered, per path (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.copied = dict.fromkeys(PATHS, 0)
        self.delivered = dict.fromkeys(PATHS, 0)

    def add_copied(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.copied[path] += nbytes

    def add_delivered(self, path: str, nbytes: int) -> None:
        """Bytes the caller asked to move on this path (the denominator of copies per byte)."""
        with self._lock:
            self.delivered[path] += nbytes

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                path: {
                    "copied_bytes": self.copied[path],
                    "delivered_bytes": self.delivered[path],
                    "copies_per_byte": self.copied[path] / self.delivered[path] if self.delivered[path] else 0.0,
                }
                for path in PATHS
            }


_current: contextvars.ContextVar[tuple[CopyCounter, str] | None] = contextvars.ContextVar(
    "tierkv_copy_path", default=None
)


@contextlib.contextmanager
def on_path(counter: CopyCounter, path: str) -> Iterator[None]:
    """Attribute the copies made inside this block (and the threads it starts) to ``path``."""
    if path not in PATHS:
        raise ValueError(f"copy path must be one of {PATHS}, got {path!r}")
    token = _current.set((counter, path))
    try:
        yield
    finally:
        _current.reset(token)


def count(nbytes: int) -> None:
    """Record ``nbytes`` copied on the current path (a no-op outside any path)."""
    current = _current.get()
    if current is not None and nbytes:
        current[0].add_copied(current[1], nbytes)


def current_path() -> str | None:
    """The path copies are attributed to here, if any."""
    current = _current.get()
    return None if current is None else current[1]
