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

    def __init__(self, endpoint: str, replay: str | None = None) -> None:
        """``replay``: vLLM's replay endpoint (``kv_events_replay`` in the runner's spec). ZMQ's
        SUB socket joins late: batches vLLM publishes before the subscription reaches its
        publisher are lost (on a busy machine, a whole prompt's). With it, a gap in the batches'
        sequence numbers is filled from vLLM's replay buffer, as a router does."""
        import zmq

        self.events: list[Any] = []
        self.replayed = 0  # batches filled in from vLLM's replay buffer
        self._replay = replay
        self._next = 0  # the sequence number of the next batch
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
                _, seq_bytes, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self._next:
                continue  # already filled in from the replay buffer
            if seq > self._next and self._replay is not None:
                for missed in self._missed(seq):
                    self.events.extend(decoder.decode(missed).events)
            self.events.extend(decoder.decode(payload).events)
            self._next = seq + 1

    def _missed(self, seq: int) -> list[bytes]:
        """The batches ``[self._next, seq)`` from vLLM's replay buffer (its ROUTER socket), which
        sends them in sequence order."""
        import zmq

        assert self._replay is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(self._replay)
        batches: list[bytes] = []
        try:
            dealer.send_multipart((b"", self._next.to_bytes(8, "big")))
            while True:
                _, _, seq_bytes, payload = dealer.recv_multipart()
                number = int.from_bytes(seq_bytes, "big", signed=True)
                if number < 0:  # the end marker
                    break
                if self._next <= number < seq:
                    batches.append(payload)
        finally:
            dealer.close(0)
        self.replayed += len(batches)
        return batches

    def close(self) -> None:
        time.sleep(1.0)  # the publisher's thread sends what vLLM queued last
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)
