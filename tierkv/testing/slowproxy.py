"""An HTTP proxy in front of a local object store that adds latency, caps bandwidth and counts
requests: a remote S3 seen from one machine, for tests and the cost benchmark.

Every request waits ``latency_s`` before it is forwarded; response bodies leave the proxy no
faster than ``bytes_per_s`` (shared by all connections, like one network link). The request
methods are counted (``counts["GET"]``, ``counts["HEAD"]``...), so a test can tell how many
round trips an operation cost. The proxy forwards the client's Host header unchanged, so
signed requests stay valid.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
_PIECE = 256 << 10  # bytes sent between two bandwidth checks


class _Link:
    """One shared link of ``bytes_per_s``: each piece of a body books its share of the link's time."""

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None
        self._free_at = 0.0
        self._lock = threading.Lock()

    def send_time(self, nbytes: int) -> float:
        """When a piece of ``nbytes`` has finished crossing the link (monotonic clock)."""
        if not self.bytes_per_s:
            return 0.0
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at


class SlowProxy:
    """Forward HTTP requests to ``upstream`` (e.g. ``http://127.0.0.1:8333``) from
    ``http://127.0.0.1:<port>``; ``latency_s`` and ``bytes_per_s`` may change at any time."""

    def __init__(self, upstream: str, latency_s: float = 0.0, bytes_per_s: float | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"upstream: expected http://host:port, got {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port)
        self.latency_s = latency_s
        self.link = _Link()
        self.link.bytes_per_s = bytes_per_s
        self.counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="tierkv-slowproxy", daemon=True)
        self._thread.start()

    @property
    def bytes_per_s(self) -> float | None:
        return self.link.bytes_per_s

    @bytes_per_s.setter
    def bytes_per_s(self, value: float | None) -> None:
        self.link.bytes_per_s = value

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def reset_counts(self) -> None:
        with self._counts_lock:
            self.counts.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> SlowProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _intercept(self, handler: BaseHTTPRequestHandler) -> bool:
        """Answer a request without asking upstream (a subclass injecting faults); whether it did."""
        return False

    def _reply(self, handler: BaseHTTPRequestHandler, status: int, reason: str, headers: list[tuple[str, str]],
               data: bytes) -> None:
        """Send upstream's reply (its headers less Content-Length and hop-by-hop ones) to the client."""
        handler.send_response(status, reason)
        for key, value in headers:
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            self._send_body(handler, data)

    def _send_body(self, handler: BaseHTTPRequestHandler, data: bytes | memoryview) -> None:
        """Write a body no faster than the shared link allows."""
        view = memoryview(data)
        for start in range(0, len(view), _PIECE):
            piece = view[start : start + _PIECE]
            ready_at = self.link.send_time(len(piece))
            delay = ready_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            handler.wfile.write(piece)

    def _count(self, method: str) -> None:
        with self._counts_lock:
            self.counts[method] += 1

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            upstream_conn: http.client.HTTPConnection | None = None

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass  # quiet: requests carry signed headers

            def setup(self) -> None:
                super().setup()
                # small writes (headers, then the body) must not wait for delayed ACKs (40 ms stalls)
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def finish(self) -> None:
                super().finish()
                if self.upstream_conn is not None:
                    self.upstream_conn.close()

            def _forward(self) -> None:
                proxy._count(self.command)
                body = self._read_body()
                if proxy.latency_s:
                    time.sleep(proxy.latency_s)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                if proxy._intercept(self):
                    return
                try:
                    reply, data = self._ask_upstream(headers, body)
                except OSError as exc:
                    self.send_error(502, f"upstream unreachable: {exc}")
                    return
                kept = [(key, value) for key, value in reply.getheaders()
                        if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length"]
                proxy._reply(self, reply.status, reply.reason, kept, data)

            def _read_body(self) -> bytes | None:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts: list[bytes] = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                length = self.headers.get("Content-Length")
                return self.rfile.read(int(length)) if length else None

            def _ask_upstream(self, headers: dict[str, str], body: bytes | None
                              ) -> tuple[http.client.HTTPResponse, bytes]:
                for attempt in range(2):  # an idle keep-alive connection may have been dropped
                    if self.upstream_conn is None:
                        self.upstream_conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                        self.upstream_conn.connect()
                        self.upstream_conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    try:
                        self.upstream_conn.request(self.command, self.path, body=body, headers=headers)
                        reply = self.upstream_conn.getresponse()
                        return reply, reply.read()
                    except (http.client.HTTPException, OSError):
                        self.upstream_conn.close()
                        self.upstream_conn = None
                        if attempt:
                            raise
                raise OSError("unreachable")

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        return Handler
