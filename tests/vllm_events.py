"""A subscriber to vLLM's KV event stream (its ZMQ publisher), as a KV-aware router reads it."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Subscriber:
    """Collects every event vLLM publishes on ``endpoint`` (a thread with a ZMQ SUB socket)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.events: list[Any] = []
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._socket.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _, _, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(decoder.decode(payload).events)

    def close(self) -> None:
        time.sleep(1.0)  # the publisher's thread sends what vLLM queued last
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)
