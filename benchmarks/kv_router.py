"""A small KV-aware router, as llm-d's precise prefix-cache scorer or Dynamo's KV router work:
it subscribes to each replica's vLLM KV event stream (ZMQ), keeps the block hashes each replica
announced (``BlockStored`` adds, ``BlockRemoved`` removes, ``AllBlocksCleared`` empties), hashes
a request's prompt into vLLM's block hashes itself (vLLM's own hash function and seed, as those
routers reimplement them) and sends the request to the replica that announced the longest
prefix of them in any medium (vLLM's own cache, a private tierkv tier, the node pool); among
those, the longest in vLLM's own cache (``medium`` GPU: no load at all, where a tierkv hit is a
copy), then the one with fewer requests in flight, then round robin. Every replica on a node
announces the node pool's blocks, so a prefix in the pool is a hit wherever the request goes,
and the tie-breaks keep a user on the replica whose own cache still holds it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

MEDIUM_GPU = "GPU"  # vLLM's own cache's medium in its events (its CPU build's too)


class KVRouter:
    """Routes requests by the replicas' announced blocks (see the module docstring)."""

    def __init__(self, endpoints: Sequence[str], block_size: int = 128, hash_algorithm: str = "sha256") -> None:
        import zmq
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        self._hash_fn = get_hash_fn_by_name(hash_algorithm)
        kv_cache_utils.init_none_hash(self._hash_fn)
        self.block_size = block_size
        self._blocks: list[Counter[Any]] = [Counter() for _ in endpoints]  # hash -> media announcing it
        self._own: list[Counter[Any]] = [Counter() for _ in endpoints]  # the same, vLLM's own cache only
        self._in_flight = [0] * len(endpoints)
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.events = [0] * len(endpoints)
        self._sockets = []
        for endpoint in endpoints:
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 200)
            sub.connect(endpoint)
            self._sockets.append(sub)
        self._threads = [threading.Thread(target=self._listen, args=(index,), daemon=True, name=f"kv-router-{index}")
                         for index in range(len(endpoints))]
        for thread in self._threads:
            thread.start()

    def _listen(self, index: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                parts = self._sockets[index].recv_multipart()
            except zmq.Again:
                continue
            batch = decoder.decode(parts[-1])
            with self._lock:
                for event in batch.events:
                    self.events[index] += 1
                    kind = type(event).__name__
                    own = getattr(event, "medium", None) in (None, MEDIUM_GPU)
                    counters = (self._blocks[index], self._own[index]) if own else (self._blocks[index],)
                    for blocks in counters:
                        if kind == "BlockStored":
                            blocks.update(event.block_hashes)
                        elif kind == "BlockRemoved":
                            for block_hash in event.block_hashes:
                                blocks[block_hash] -= 1
                                if blocks[block_hash] <= 0:
                                    del blocks[block_hash]
                        elif kind == "AllBlocksCleared":
                            blocks.clear()

    def block_hashes(self, prompt: Sequence[int]) -> list[Any]:
        """vLLM's hashes of the prompt's full blocks, as its events carry them."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

        hashes, parent = [], None
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            parent = hash_block_tokens(self._hash_fn, parent, prompt[start : start + self.block_size])
            hashes.append(maybe_convert_block_hash(parent))
        return hashes

    def matched(self, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """Per replica, the announced prefix of ``prompt`` in blocks: in any medium, and in
        vLLM's own cache."""
        hashes = self.block_hashes(prompt)

        def prefix(blocks: Counter[Any]) -> int:
            return next((i for i, h in enumerate(hashes) if h not in blocks), len(hashes))
        with self._lock:
            return [(prefix(every), prefix(own)) for every, own in zip(self._blocks, self._own)]

    def route(self, prompt: Sequence[int]) -> int:
        """The replica for a request (call ``done`` with it when the request answered)."""
        matched = self.matched(prompt)
        with self._lock:
            order = [(self._next + i) % len(matched) for i in range(len(matched))]
            best = max(order, key=lambda i: (*matched[i], -self._in_flight[i]))
            self._next = (best + 1) % len(matched)
            self._in_flight[best] += 1
        return best

    def done(self, replica: int) -> None:
        with self._lock:
            self._in_flight[replica] -= 1

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        for sub in self._sockets:
            sub.close(0)
