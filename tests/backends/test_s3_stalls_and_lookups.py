"""The s3 tier cannot starve itself and does not ask the store what it already knows.

Against the session's real SeaweedFS behind the project's fault proxy (tierkv.testing.faultproxy),
which holds chosen GETs unanswered (``stall``):
- reads the store stalls take only read slots: writes of the same engine still land, and a
  stalled read gives its slot back at its deadline, so the next read is served;
- a lookup of chunks this process stored, read or asked about costs no request; only chunks it
  has not seen cost a HEAD, and a chunk found missing is asked again once its answer is old.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from s3_fixtures import s3_tier_options

from tierkv import Engine
from tierkv.testing.faultproxy import FaultProxy
from tierkv.testing.s3server import S3Server

CHUNK = 16
MISS_TTLS_S = (1.0, 4.0, 16.0)  # lookup_miss_ttl_s tried in turn, until the calls fit in one


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 1, 8) / 16).contiguous()


def prompt(index: int, chunks: int = 4) -> torch.Tensor:
    return torch.arange(chunks * CHUNK) + 10_000 * (index + 1)


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint_url) as running:
        running.stall_max_s = 30.0
        yield running


def s3_only(server: S3Server, bucket: str, endpoint: str, **extra: Any) -> dict[str, Any]:
    prefix = f"stalls/{uuid.uuid4().hex[:8]}"
    return {"model": "stalls", "chunk_size": CHUNK, "kv_format": "vllm", "cost_aware": False,
            "health": {"failure_threshold": 100},  # the stall must not trip a breaker: slots are under test
            "tiers": [{"name": "shared", "backend": "s3",
                       **s3_tier_options(server, bucket, prefix, endpoint_url=endpoint,
                                         **{"failure_threshold": 100, **extra})}]}


def heads(proxy: FaultProxy) -> int:
    return proxy.counts["HEAD"]


def test_writes_land_while_reads_are_stalled(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    cfg = s3_only(s3_server, s3_bucket, proxy.url, max_concurrency=2, timeout_s=2.0, read_timeout_s=30.0)
    with Engine(cfg) as engine:
        stored = prompt(0)
        engine.store(stored, kv_of(stored))
        proxy.fault = "stall"  # every GET is held from now on; PUTs pass
        readers = [threading.Thread(target=engine.retrieve, args=(stored,)) for _ in range(3)]
        for reader in readers:
            reader.start()
        time.sleep(0.3)  # the reads hold every read slot
        for index in range(1, 4):
            tokens = prompt(index)
            assert engine.store(tokens, kv_of(tokens)) == 4, "a write waited behind stalled reads and failed"
        for reader in readers:
            reader.join(60)
        shared = engine.stats()["tiers"]["shared"]
        assert shared["put_errors"] == 0 and shared["timeouts"] > 0 and proxy.injected["stall"] > 0
        proxy.heal()
        for index in range(4):
            tokens = prompt(index)
            kv, mask = engine.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(kv, kv_of(tokens))


def test_a_stalled_read_gives_its_slot_back_at_its_deadline(s3_server: S3Server, s3_bucket: str,
                                                            proxy: FaultProxy) -> None:
    cfg = s3_only(s3_server, s3_bucket, proxy.url, max_concurrency=2, timeout_s=1.0, read_timeout_s=30.0)
    with Engine(cfg) as engine:
        stalled, served = prompt(0, chunks=2), prompt(1, chunks=1)
        engine.store(stalled, kv_of(stalled))
        engine.store(served, kv_of(served))
        proxy.fault = "stall"
        _, mask = engine.retrieve(stalled, return_tuple=False)  # its two GETs hold both read slots...
        assert not mask.any(), "held chunks are misses at the deadline"
        proxy.path_contains = "no-such-object"  # ...and stay held (30 s); new requests pass
        kv, mask = engine.retrieve(served, return_tuple=False)
        assert mask.all() and torch.equal(kv, kv_of(served)), "a read waited for a slot a stalled read kept"
        assert proxy.injected["stall"] == 2
        proxy.heal()


def test_a_repeated_lookup_asks_the_store_nothing(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    cfg = s3_only(s3_server, s3_bucket, proxy.url)
    tokens = prompt(0, chunks=16)
    with Engine(cfg) as writer:
        writer.store(tokens, kv_of(tokens))
        before = heads(proxy)
        assert writer.lookup(tokens) >= len(tokens) - CHUNK
        assert heads(proxy) == before, "chunks this process stored are known"
    with Engine(cfg) as replica:  # another replica: it has not seen them
        before = heads(proxy)
        found = replica.lookup(tokens)
        assert found >= len(tokens) - CHUNK and heads(proxy) - before == 16, "one HEAD per chunk it has not seen"
        assert replica.lookup(tokens) == found and heads(proxy) - before == 16, "then none"
        before = heads(proxy)
        assert replica.lookup(prompt(1, chunks=16)) == 0
        assert heads(proxy) - before == 1, "a new prompt: one HEAD, for its first chunk"
    off = {**cfg, "tiers": [{**cfg["tiers"][0], "lookup_cache": 0}]}
    with Engine(off) as uncached:
        uncached.lookup(tokens)
        before = heads(proxy)
        uncached.lookup(tokens)
        assert heads(proxy) - before == 16, "lookup_cache: 0 asks the store every time"


def test_a_chunk_found_missing_is_asked_again_once_the_answer_is_old(s3_server: S3Server, s3_bucket: str) -> None:
    """A miss is believed for ``lookup_miss_ttl_s`` (a lookup meanwhile asks nothing and finds
    nothing, though another replica stored the chunk), then asked again. The TTL runs on the
    clock, so what each lookup must answer follows from the time measured around the calls:
    the miss is recorded during the first lookup, so it is fresh for the whole second lookup
    when that ends less than a TTL after the first began, and old once a TTL has passed since
    the first ended. A machine too slow to store a chunk within the TTL gets a longer one."""
    for attempt, ttl in enumerate(MISS_TTLS_S):
        cfg = s3_only(s3_server, s3_bucket, s3_server.endpoint_url, lookup_miss_ttl_s=ttl)
        tokens = prompt(attempt, chunks=2)
        with Engine(cfg) as reader, Engine(cfg) as writer:
            began = time.monotonic()
            assert reader.lookup(tokens) == 0
            answered = time.monotonic()  # the miss was recorded between `began` and now
            writer.store(tokens, kv_of(tokens))  # another replica stores it
            believed = reader.lookup(tokens)
            if time.monotonic() - began >= ttl:
                continue  # the miss may have aged out during these calls: try again with a longer TTL
            assert believed == 0, "within lookup_miss_ttl_s the miss is believed"
            time.sleep(max(0.0, answered + ttl - time.monotonic()) + 0.05)  # the miss is old now
            assert reader.lookup(tokens) >= CHUNK, "then the store is asked again"
            return
    pytest.fail(f"a lookup, a store of two chunks and a lookup never fit in lookup_miss_ttl_s {MISS_TTLS_S}")
