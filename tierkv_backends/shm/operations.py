"""What a ``shm`` tier offers beyond a tier's calls: its journal (how engines on the node announce
each other's chunks, ``tierkv_backends.shm.journal``) and the operator's handle on the pool
(``tierkv pool``: join an existing pool without its config, name its scopes' models, drop a
model's or a tenant's chunks while engines run). A mixin of ``SharedMemoryBackend``, kept apart
because none of it is on a store's or a read's path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tierkv.chunks.keys import CacheKey
from tierkv.errors import ConfigError
from tierkv_backends.shm.file import now_ns
from tierkv_backends.shm.journal import Kind, Reading
from tierkv_backends.shm.layout import HEADER_BYTES, MAGIC, VERSION, Word, geometry_of
from tierkv_backends.shm.lock import PoolBusyError
from tierkv_backends.shm.processes import PoolBrokenError

if TYPE_CHECKING:
    from tierkv_backends.shm.pool import SharedPool

Attached = TypeVar("Attached", bound="PoolOperations")
_DROP_WAIT_S = 10.0  # a drop from the command line may wait longer for the lock than a store


def default_path() -> str:
    """This user's pool file when a config names none."""
    return f"/dev/shm/tierkv-{os.getuid()}.pool"


class PoolOperations:
    """The journal and the operator's calls of a ``shm`` tier (see the module docstring)."""

    pool: SharedPool
    counters: dict[str, int]
    retain_share: float
    _closed: bool

    if TYPE_CHECKING:  # the tier's own
        def _ensure_open(self) -> None: ...
        def _digest(self, key: CacheKey) -> tuple[int, int]: ...

    # -- the journal: what every process stored and what left ----------------------------------------
    def chunk_digest(self, key: CacheKey) -> tuple[int, int]:
        """The 128-bit digest the pool (and its journal) names ``key``'s chunk by."""
        return self._digest(key)

    def describe(self, descriptions: Sequence[tuple[CacheKey, bytes]]) -> int:
        """Journal what each chunk holds (an opaque payload, e.g. a KV event's tokens and block
        hashes) for the other processes on the pool; how many were written. A chunk no longer in
        the pool is left out; a busy lock writes nothing (counted in ``journal_busy``): a
        description is news, never needed for a read."""
        self._ensure_open()
        if not descriptions:
            return 0
        try:
            with self.pool.lock():
                return self.pool.describe([(self._digest(key), payload) for key, payload in descriptions])
        except (PoolBusyError, PoolBrokenError):
            self.counters["journal_busy"] += len(descriptions)
            return 0

    def journal_cursor(self, everything: bool = True) -> int:
        """A cursor for ``read_journal``: at the oldest record the ring still has (``everything``:
        a reader that attaches late and wants the contents), or past the newest."""
        self._ensure_open()
        return self.pool.journal.oldest() if everything else self.pool.journal.newest()

    def read_journal(self, cursor: int, limit: int = 4096) -> Reading:
        """The journal's records from ``cursor`` on (no lock: see ``tierkv_backends.shm.journal``)."""
        self._ensure_open()
        try:
            self.pool.check_intact()
        except PoolBrokenError:
            return Reading([], cursor)
        return self.pool.journal.read(cursor, limit)

    def holds_digests(self, digests: Sequence[tuple[int, int]]) -> list[bool]:
        """Whether the pool holds a committed chunk of each digest now (no lock)."""
        if self._closed or not digests:
            return [False] * len(digests)
        try:
            self.pool.check_intact()
        except PoolBrokenError:
            return [False] * len(digests)
        return self.pool.contains(digests)

    # -- retention: a lease that keeps chunks through evictions -------------------------------------
    def retain(self, keys: Sequence[CacheKey], seconds: float) -> list[bool]:
        """Keep each chunk of ``keys`` through evictions for ``seconds`` from now (a longer
        retention it has is kept; 0 releases it); whether the pool holds each. Retained chunks
        are evicted after every other chunk without readers, so under pressure retention is a
        bias, never a deadlock; the retained bytes of the whole pool are capped at
        ``retain_share`` of its capacity.

        A lock that stays busy (a stopped process holds it) retains nothing and is counted
        (``busy_hints``), after one wait of ``lock_timeout_s`` at most.

        Raises:
            RetentionRefusedError: if the retention would pass the cap (nothing was retained).
            ValueError: if ``seconds`` is negative or not finite.
        """
        self._ensure_open()
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"retain: expected a number of seconds >= 0, got {seconds!r}")
        if not keys:
            return []
        until = now_ns() + int(seconds * 1e9) if seconds else 0
        digests = np.array([self._digest(key) for key in keys], dtype=np.uint64).reshape(-1, 2)
        try:
            with self.pool.lock():
                return self.pool.retain(digests, until, int(self.retain_share * self.pool.geometry.capacity))
        except (PoolBusyError, PoolBrokenError):  # a hint is never worth a wait: nothing retained, counted
            self.counters["busy_hints"] += 1
            return [False] * len(keys)

    # -- operating the pool (tierkv pool) ------------------------------------------------------------
    @classmethod
    def attach(cls: type[Attached], path: str | None = None, name: str = "pool") -> Attached:
        """The existing pool at ``path`` (default: this user's), with the geometry its header
        records: how ``tierkv pool`` joins a pool that engines created, without their config.

        Raises:
            ConfigError: if there is no pool at ``path``, or the file is not one this tierkv reads.
        """
        path = path or default_path()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise ConfigError(f"no pool at {path!r} (an shm tier creates it when its first engine starts)") from exc
        except OSError as exc:
            raise ConfigError(f"cannot open the pool at {path!r}: {exc.strerror}") from exc
        try:
            head = os.pread(fd, HEADER_BYTES, 0)
        finally:
            os.close(fd)
        words = np.frombuffer(head, dtype=np.int64) if len(head) == HEADER_BYTES else None
        if words is None or int(words[Word.MAGIC]) != MAGIC or int(words[Word.VERSION]) != VERSION:
            raise ConfigError(f"the file at {path!r} is not a pool this tierkv reads (a tierkv pool of layout "
                              f"version {VERSION})")
        try:
            geometry = geometry_of(words)
        except ValueError as exc:
            raise ConfigError(f"the file at {path!r} has a damaged header: {exc}") from exc
        make: Any = cls
        return make(name, geometry.capacity, path=path, max_chunks=geometry.max_chunks,
                   max_processes=geometry.max_processes, holds_per_process=geometry.holds_per_process,
                   journal_bytes=geometry.journal_bytes, pinned=False)

    def scope_names(self) -> dict[str, str]:
        """The model name of each scope (16 hex digits) the journal still names."""
        self._ensure_open()
        names: dict[str, str] = {}
        cursor = self.pool.journal.oldest()
        while True:
            reading = self.pool.journal.read(cursor, limit=1 << 16)
            for record in reading.records:
                if record.kind == Kind.NAMED:
                    names[f"{record.digest[0]:016x}"] = record.payload.decode(errors="replace")
            if not reading.records or reading.cursor == cursor:
                return names
            cursor = reading.cursor

    def drop_scopes(self, scopes: Sequence[str] | None) -> tuple[int, int]:
        """Drop every chunk of ``scopes`` (16 hex digits each; None: every chunk) from the pool,
        every process's; (chunks, bytes). Safe beside live engines: a chunk being read is freed
        after its last reader, and every engine announces the removal (KV events).

        Raises:
            ValueError: if a scope is not 16 hex digits.
        """
        self._ensure_open()
        ids = None
        if scopes is not None:
            ids = set()
            for scope in scopes:
                if len(scope) != 16 or any(c not in "0123456789abcdef" for c in scope.lower()):
                    raise ValueError(f"expected a scope of 16 hex digits (tierkv pool status lists them), got {scope!r}")
                ids.add(int(scope, 16))
        with self.pool.lock(_DROP_WAIT_S):
            return self.pool.drop_scopes(ids)

    def attached_processes(self) -> list[int]:
        """The pids of the other processes attached to the pool now (a process attached twice,
        as two tiers, is listed for its other attachment)."""
        self._ensure_open()
        pids = self.pool.procs["pid"]
        return sorted(int(pids[slot]) for slot in range(len(pids)) if int(pids[slot]) and slot != self.pool.slot)
