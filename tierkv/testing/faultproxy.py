"""An HTTP proxy on loopback that damages traffic to a real object store, for tests.

``FaultProxy`` forwards requests like ``tierkv.testing.slowproxy.SlowProxy``
(latency and a bandwidth cap included) and, while ``FaultProxy.fault`` is set, damages
the replies to matching requests the way a flaky network or middlebox does:

========================  ==============================================================
``"cut"``                 headers with the real Content-Length, half the body, then the
                          connection is closed (the client sees an incomplete read)
``"short"``               half the body with a Content-Length that matches it, the
                          original Content-Range kept (a body shorter than announced)
``"short_unranged"``      half the body, Content-Length matching it, no Content-Range,
                          status 200 (only the chunk's own header can tell)
``"reset"``               headers and part of the body, then a TCP reset (RST)
``"503"`` / ``"500"``     an S3 error reply (SlowDown / InternalError); upstream not asked
``"stall"``               the request is held, unanswered, until the fault is cleared (or
                          ``FaultProxy.stall_max_s`` passed), then forwarded: a store
                          that stops answering
========================  ==============================================================

Only requests whose method is in ``FaultProxy.methods`` (GET by default) and, when set,
whose path contains ``FaultProxy.path_contains`` are damaged; with ``FaultProxy.budget``
set, only that many, after which the proxy heals by itself. ``FaultProxy.injected``
counts the damaged replies per fault.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler

from tierkv.testing.slowproxy import SlowProxy

FAULTS = ("cut", "short", "short_unranged", "reset", "503", "500")
"""The faults that damage a reply (``"stall"`` withholds it instead)."""
_ALL_FAULTS = (*FAULTS, "stall")
_ERROR_REPLIES = {
    "503": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
}


class FaultProxy(SlowProxy):
    """A ``SlowProxy`` that can damage replies; ``fault`` may change at any time."""

    def __init__(self, upstream: str, fault: str | None = None, methods: Iterable[str] = ("GET",),
                 latency_s: float = 0.0) -> None:
        self._fault_lock = threading.Lock()
        self.fault = fault
        self.methods = frozenset(methods)
        self.path_contains: str | None = None
        self.budget: int | None = None
        self.stall_max_s = 60.0
        self.injected: Counter[str] = Counter()
        super().__init__(upstream, latency_s=latency_s)

    @property
    def fault(self) -> str | None:
        return self._fault

    @fault.setter
    def fault(self, value: str | None) -> None:
        if value is not None and value not in _ALL_FAULTS:
            raise ValueError(f"fault: expected one of {list(_ALL_FAULTS)} or None, got {value!r}")
        self._fault = value

    def heal(self) -> None:
        """Forward everything untouched from now on."""
        self.fault = None
        self.budget = None

    def _take(self, handler: BaseHTTPRequestHandler, kinds: tuple[str, ...]) -> str | None:
        """The fault to inject into this request (counted), if any of ``kinds`` applies."""
        with self._fault_lock:
            fault = self._fault
            if fault not in kinds or handler.command not in self.methods:
                return None
            if self.path_contains is not None and self.path_contains not in handler.path:
                return None
            if self.budget is not None:
                if self.budget <= 0:
                    return None
                self.budget -= 1
            self.injected[fault] += 1
            return fault

    def _intercept(self, handler: BaseHTTPRequestHandler) -> bool:
        if self._take(handler, ("stall",)) is not None:
            started = time.monotonic()
            while self._fault == "stall" and time.monotonic() - started < self.stall_max_s:
                time.sleep(0.02)
            return False  # then forwarded as usual
        fault = self._take(handler, tuple(_ERROR_REPLIES))
        if fault is None:
            return False
        status, reason, code, message = _ERROR_REPLIES[fault]
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                f"</Message></Error>").encode()
        handler.send_response(status, reason)
        handler.send_header("Content-Type", "application/xml")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)
        return True

    def _reply(self, handler: BaseHTTPRequestHandler, status: int, reason: str, headers: list[tuple[str, str]],
               data: bytes) -> None:
        fault = self._take(handler, ("cut", "short", "short_unranged", "reset")) if len(data) > 1 else None
        if fault is None:
            super()._reply(handler, status, reason, headers, data)
            return
        half = len(data) // 2
        if fault == "short_unranged":
            status, reason = 200, "OK"
            headers = [(key, value) for key, value in headers if key.lower() != "content-range"]
        handler.send_response(status, reason)
        for key, value in headers:
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(half if fault.startswith("short") else len(data)))
        handler.end_headers()
        self._send_body(handler, data[:half])
        if fault.startswith("short"):
            return  # a complete HTTP reply, just with the wrong bytes in it
        handler.wfile.flush()
        handler.close_connection = True
        connection = handler.connection
        if fault == "reset":  # close with a RST (linger 0) instead of a FIN; the fd goes when the handler ends
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            connection.close()
            return
        try:
            connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
