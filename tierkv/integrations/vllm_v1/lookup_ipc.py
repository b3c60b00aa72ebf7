"""Lookups from vLLM's scheduler, answered by the worker that owns the tiers.

vLLM runs its scheduler and its workers in different processes (one per tensor-parallel
rank, even for one GPU), and a worker's memory tiers exist only in that worker. So worker
rank 0 answers "how much of this prompt is cached, and how much of that in memory?" on a
Unix socket named after the vLLM instance, and the scheduler asks there. When both sides
live in one process (vLLM's in-process executor) the answer is a direct call.

Wire format (no pickle): request = uint32 token count + uint32 identity length + that many
int32 ids (little endian) + the request's identity as UTF-8 JSON
(``tierkv.chunks.identity.RequestIdentity.to_wire``); reply = int64 cached tokens + int64 of
them in memory tiers. Any failure to ask
(worker not up yet, worker gone) is answered as "nothing cached": a lookup never fails a
request, it only costs a recompute.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable

import numpy as np

from tierkv.chunks.identity import RequestIdentity
from tierkv.integrations.vllm_v1.scheduler import LookupResult
from tierkv.threads import name_native_thread

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
_REPLY = struct.Struct("<qq")
_MAX_TOKENS = 1 << 24
_MAX_IDENTITY = 1 << 20
_RESET = 0xFFFFFFFF  # a header whose token count is this asks the worker to reset its cache
Lookup = Callable[[np.ndarray, RequestIdentity], LookupResult]
Reset = Callable[[], int]
_LOCAL: dict[str, tuple[Lookup, Reset | None]] = {}
_LOCAL_LOCK = threading.Lock()


def socket_path(engine_id: str, data_parallel_rank: int = 0) -> str:
    """Where the instance's worker rank 0 listens (short enough for AF_UNIX)."""
    return os.path.join(tempfile.gettempdir(), f"tierkv-vllm-{engine_id}-dp{data_parallel_rank}.sock")


def _receive(conn: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        piece = conn.recv(nbytes - len(data))
        if not piece:
            raise ConnectionError(f"peer closed after {len(data)} of {nbytes} bytes")
        data += piece
    return bytes(data)


class LookupServer:
    """Serves lookups on ``path`` from threads (one per scheduler connection)."""

    def __init__(self, path: str, lookup: Lookup, cpus: set[int] | None = None, reset: Reset | None = None) -> None:
        self.path = path
        self.lookup = lookup
        self.reset = reset  # vLLM's reset_cache: clears what this instance may clear; the chunks cleared
        self.cpus = cpus  # where to run (the CPUs vLLM keeps free); None: wherever the process runs
        if os.path.exists(path):
            os.unlink(path)  # left over by a process that died
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(path)
        os.chmod(path, 0o600)
        self._socket.listen(8)
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="tierkv-lookup-server", daemon=True)
        self._thread.start()
        with _LOCAL_LOCK:
            _LOCAL[path] = (lookup, reset)

    def _accept(self) -> None:
        name_native_thread("tierkv-lookup")
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # this thread and the connection threads it starts
        while not self._closed.is_set():
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return
            self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tierkv-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        name_native_thread("tierkv-lookup")
        with conn:
            while not self._closed.is_set():
                try:
                    count, identity_size = _HEADER.unpack(_receive(conn, _HEADER.size))
                    if count == _RESET:
                        conn.sendall(_REPLY.pack(_reset_or_fail(self.reset), 0))
                        continue
                    if count > _MAX_TOKENS or identity_size > _MAX_IDENTITY:
                        raise ValueError(f"lookup of {count} tokens (at most {_MAX_TOKENS}) and an identity of "
                                         f"{identity_size} bytes (at most {_MAX_IDENTITY})")
                    tokens = np.frombuffer(_receive(conn, 4 * count), dtype="<i4")
                    identity = RequestIdentity.from_wire(json.loads(_receive(conn, identity_size)))
                    try:
                        result = self.lookup(tokens, identity)
                    except Exception as exc:  # a broken tier: nothing cached, the request recomputes
                        logger.warning("tierkv: lookup failed, answering 'not cached': %s: %s", type(exc).__name__, exc)
                        result = LookupResult(0, 0)
                    conn.sendall(_REPLY.pack(result.cached_tokens, result.in_memory_tokens))
                except (ConnectionError, OSError, ValueError):
                    break
        self._connections.discard(conn)

    def close(self) -> None:
        self._closed.set()
        with _LOCAL_LOCK:
            _LOCAL.pop(self.path, None)
        for conn in list(self._connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self._socket.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)


def _reset_or_fail(reset: Reset | None) -> int:
    if reset is None:
        return -1
    try:
        return reset()
    except Exception as exc:  # a tier that refuses: report a failed reset, keep serving lookups
        logger.warning("tierkv: cache reset failed: %s: %s", type(exc).__name__, exc)
        return -1


class LookupClient:
    """Asks the worker's ``LookupServer`` (or calls it, in the same process)."""

    def __init__(self, path: str, timeout_s: float = 5.0, reset_timeout_s: float = 150.0) -> None:
        self.path = path
        self.timeout_s = timeout_s  # a lookup's answer: the scheduler asks for every request
        self.reset_timeout_s = reset_timeout_s  # a reset's: it waits for the saves and fills in flight
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False

    def __call__(self, tokens: np.ndarray, identity: RequestIdentity) -> LookupResult:
        with _LOCAL_LOCK:
            local = _LOCAL.get(self.path)
        if local is not None:
            return local[0](tokens, identity)
        wire_identity = json.dumps(identity.to_wire(), separators=(",", ":")).encode()
        payload = (_HEADER.pack(len(tokens), len(wire_identity)) + np.ascontiguousarray(tokens, dtype="<i4").tobytes()
                   + wire_identity)
        with self._lock:
            for attempt in range(2):  # a dropped connection is re-opened once
                try:
                    conn = self._connect()
                    conn.sendall(payload)
                    cached, in_memory = _REPLY.unpack(_receive(conn, _REPLY.size))
                    return LookupResult(int(cached), int(in_memory))
                except OSError as exc:
                    self._drop()
                    if attempt == 1:
                        self._warn(exc)
        return LookupResult(0, 0)

    def reset(self) -> int:
        """Ask the worker to reset its cache; the chunks it cleared, -1 when it could not. The
        worker first waits for the saves and fills in flight (up to its ``RESET_WAIT_S``), so
        this waits up to ``reset_timeout_s``, not a lookup's ``timeout_s``."""
        with _LOCAL_LOCK:
            local = _LOCAL.get(self.path)
        if local is not None:
            return _reset_or_fail(local[1])
        with self._lock:
            try:
                conn = self._connect()
                conn.settimeout(self.reset_timeout_s)
                try:
                    conn.sendall(_HEADER.pack(_RESET, 0))
                    cleared, _ = _REPLY.unpack(_receive(conn, _REPLY.size))
                finally:
                    conn.settimeout(self.timeout_s)
                return int(cleared)
            except OSError as exc:
                self._drop()
                self._warn(exc)
                return -1

    def _connect(self) -> socket.socket:
        if self._conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(self.timeout_s)
            try:
                conn.connect(self.path)
            except OSError:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("tierkv: the worker's lookup server at %s is not answering (%s); "
                           "counting prompts as not cached until it does", self.path, exc)

    def close(self) -> None:
        with self._lock:
            self._drop()
