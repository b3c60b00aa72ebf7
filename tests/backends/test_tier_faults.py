"""Transport faults between tierkv and a real object store are not corruption.

A fault proxy on loopback (tierkv.testing.faultproxy) sits in front of the session's real
SeaweedFS and cuts bodies, shortens them, resets connections mid-body, answers 503 or 500,
or adds latency. Through a real Engine every chunk is exact or a miss, the calls end in a
bounded time, no valid object is deleted (checked with boto3 straight at the server), and
the tier serves hits again once the proxy is healthy. A request the backend stopped waiting
for (its timeout_s, a cancellation) never writes into the caller's memory afterwards.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from s3_fixtures import s3_tier_options
from waiting import wait_until

from tierkv import Engine
from tierkv.errors import TierUnavailableError
from tierkv.testing import make_chunk, make_key
from tierkv.testing.faultproxy import FAULTS, FaultProxy
from tierkv.testing.s3server import S3Server
from tierkv_backends.s3 import S3Backend

CHUNK = 16
PROMPTS = 4
SENTINEL = -7.0


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 1, 8) / 16).contiguous()


def prompts() -> list[torch.Tensor]:
    return [torch.arange(2 * CHUNK) + 1000 * (i + 1) for i in range(PROMPTS)]


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint_url) as running:
        yield running


def engine_config(server: S3Server, bucket: str, prefix: str, endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"model": "faults", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_through",
            "health": {"failure_threshold": 3, "retry_after_s": 0.1},
            "tiers": [{"name": "shared", "backend": "s3",
                       **s3_tier_options(server, bucket, prefix, endpoint_url=endpoint, **extra)}]}


def stored_objects(server: S3Server, bucket: str, prefix: str) -> dict[str, int]:
    """Object name -> size, straight from the server (not through the proxy)."""
    listing = server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    return {item["Key"]: item["Size"] for item in listing.get("Contents", [])}




def assert_exact_or_miss(kv: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> int:
    """Every token the mask calls a hit holds exactly the stored K/V; the number of hits."""
    expected = kv_of(tokens)
    hits = int(mask.sum())
    assert bool(mask[:hits].all()), "hits are a prefix"
    if hits:
        assert torch.equal(kv[:, :, :hits], expected[:, :, :hits]), "a hit must hold the stored bytes exactly"
    return hits


@pytest.mark.parametrize("fault", FAULTS)
def test_transport_fault_is_a_miss_never_a_delete_and_the_tier_recovers(
        fault: str, s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    prefix = f"faults/{fault}/{uuid.uuid4().hex[:8]}"
    with Engine(engine_config(s3_server, s3_bucket, prefix, proxy.url)) as eng:
        for tokens in prompts():
            assert eng.store(tokens, kv_of(tokens)) == 2
        eng.flush()
        before = stored_objects(s3_server, s3_bucket, prefix)
        assert len(before) == 2 * PROMPTS

        proxy.fault = fault
        started = time.monotonic()
        for tokens in prompts():
            kv, mask = eng.retrieve(tokens, return_tuple=False)
            assert assert_exact_or_miss(kv, mask, tokens) == 0, f"every GET is damaged ({fault}): all misses"
        backend = next(t for t in eng.tiers if t.name == "shared")
        assert isinstance(backend, S3Backend)
        # straight at the backend, into caller memory: damaged replies never reach it
        outs = [torch.full_like(kv_of(prompts()[0])[:, :, :CHUNK], SENTINEL) for _ in range(2)]
        keys = eng.keys_for(prompts()[0])
        try:
            hits = eng.run(backend.batched_get_into(keys, outs))
        except TierUnavailableError:
            hits = [False, False]
        assert hits == [False, False]
        assert all(bool((out == SENTINEL).all()) for out in outs), "a damaged reply wrote into the destination"
        try:  # and the fresh-tensor read: a miss too, never a delete
            fresh = eng.run(backend.batched_get(keys))
        except TierUnavailableError:
            fresh = [None, None]
        assert fresh == [None, None]
        assert time.monotonic() - started < 90, "damaged replies must end in a bounded time"
        assert proxy.injected[fault] > 0

        assert backend.stats()["corrupt_chunks"] == 0, "a transport fault was taken for corruption"
        assert stored_objects(s3_server, s3_bucket, prefix) == before, "valid shared objects were deleted"

        proxy.heal()

        def all_hit() -> bool:
            return all(assert_exact_or_miss(*eng.retrieve(t, return_tuple=False), t) == 2 * CHUNK
                       for t in prompts())
        wait_until(all_hit, f"the s3 tier to serve hits again after {fault}")
        assert backend.stats()["store_health"]["healthy"]


def test_one_cut_body_is_retried_into_a_hit(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    prefix = f"faults/retry/{uuid.uuid4().hex[:8]}"
    with Engine(engine_config(s3_server, s3_bucket, prefix, proxy.url)) as eng:
        tokens = prompts()[0]
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        for fault in ("cut", "short", "reset"):
            proxy.fault, proxy.budget = fault, 1
            kv, mask = eng.retrieve(tokens, return_tuple=False)
            assert assert_exact_or_miss(kv, mask, tokens) == 2 * CHUNK, f"one {fault} reply is retried, then a hit"
            assert proxy.injected[fault] == 1
        backend = next(t for t in eng.tiers if t.name == "shared")
        assert backend.stats()["retries"] >= 3
        assert backend.stats()["incomplete_bodies"] >= 1
        assert backend.stats()["corrupt_chunks"] == 0


def test_a_whole_body_with_a_bad_checksum_is_still_corrupt(s3_server: S3Server, s3_bucket: str,
                                                          proxy: FaultProxy) -> None:
    """The other side of the line: a complete reply whose checksum fails is deleted and counted."""
    prefix = f"faults/corrupt/{uuid.uuid4().hex[:8]}"

    async def body() -> None:
        options = S3Backend.validate_options(s3_tier_options(s3_server, s3_bucket, prefix, endpoint_url=proxy.url),
                                             "tiers[0]")
        backend = S3Backend(name="shared", **options)
        try:
            await backend.batched_put([make_key(1), make_key(2)], [make_chunk(1), make_chunk(2)])
            raw = s3_server.boto3_client()
            name = f"{prefix}/{make_key(1).to_string()}"
            good = raw.get_object(Bucket=s3_bucket, Key=name)["Body"].read()
            raw.put_object(Bucket=s3_bucket, Key=name, Body=good[:-1] + bytes([good[-1] ^ 0xFF]))
            outs = [torch.full_like(make_chunk(i), SENTINEL) for i in (1, 2)]
            assert await backend.batched_get_into([make_key(1), make_key(2)], outs) == [False, True]
            assert bool((outs[0] == SENTINEL).all()) and torch.equal(outs[1], make_chunk(2))
            assert backend.stats()["corrupt_chunks"] == 1
            assert list(stored_objects(s3_server, s3_bucket, prefix)) == [f"{prefix}/{make_key(2).to_string()}"]
        finally:
            await backend.close()
    asyncio.run(body())


def _slow_backend(server: S3Server, bucket: str, prefix: str, endpoint: str, **extra: Any) -> S3Backend:
    options = S3Backend.validate_options(
        s3_tier_options(server, bucket, prefix, endpoint_url=endpoint, timeout_s=1.5, read_timeout_s=10.0,
                        retries=0, **extra), "tiers[0]")
    return S3Backend(name="shared", **options)


def test_a_read_abandoned_at_timeout_s_never_writes_into_the_destination_afterwards(
        s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    prefix = f"faults/late/{uuid.uuid4().hex[:8]}"
    keys = [make_key(i) for i in range(4)]

    async def body() -> None:
        # one request at a time: the second starts 1 s in, past half the 1.5 s deadline, and its
        # answer comes at 2 s, after the call returned and before its socket gives up (1.5 s)
        backend = _slow_backend(s3_server, s3_bucket, prefix, proxy.url, max_concurrency=1)
        try:
            await backend.batched_put(keys, [make_chunk(i) for i in range(4)])
            proxy.latency_s = 1.0
            outs = [torch.full_like(make_chunk(i), SENTINEL) for i in range(4)]
            hits = await backend.batched_get_into(keys, outs)
            assert hits == [True, False, False, False]
            await asyncio.sleep(2.0)  # the abandoned request gets its answer meanwhile
            assert torch.equal(outs[0], make_chunk(0))
            assert all(bool((out == SENTINEL).all()) for out in outs[1:]), "bytes landed after the call returned"
            assert backend.stats()["abandoned_copies"] >= 1, "the late answer was dropped, not copied"

            # a cancelled call: the same, and the engine's memory is free to reuse right away
            outs = [torch.full_like(make_chunk(i), SENTINEL) for i in range(4)]
            task = asyncio.ensure_future(backend.batched_get_into(keys, outs))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(1.5)
            assert all(bool((out == SENTINEL).all()) for out in outs), "bytes landed after the cancellation"
            proxy.latency_s = 0.0
            assert await backend.batched_get_into(keys, outs) == [True] * 4
            assert all(torch.equal(out, make_chunk(i)) for i, out in enumerate(outs))
        finally:
            proxy.latency_s = 0.0
            await backend.close()
    asyncio.run(body())


def test_latency_past_timeout_s_through_the_engine_is_a_miss_and_out_stays_the_callers(
        s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    """The measured case: retrieve(out=...) with no deadline, the s3 tier answering after its
    timeout_s. The call returns misses; nothing lands in ``out`` afterwards; no object is lost;
    with the latency gone the same engine serves hits."""
    prefix = f"faults/latency/{uuid.uuid4().hex[:8]}"
    config = engine_config(s3_server, s3_bucket, prefix, proxy.url, timeout_s=1.5, read_timeout_s=10.0, retries=0)
    with Engine(config) as eng:
        tokens = prompts()[0]
        assert eng.store(tokens, kv_of(tokens)) == 2
        eng.flush()
        before = stored_objects(s3_server, s3_bucket, prefix)
        proxy.latency_s = 2.5
        out = torch.full_like(kv_of(tokens), SENTINEL)
        started = time.monotonic()
        kv, mask = eng.retrieve(tokens, return_tuple=False, out=out)
        assert time.monotonic() - started < 60
        hits = assert_exact_or_miss(kv, mask, tokens)
        time.sleep(3.0)  # the abandoned requests get their answers meanwhile
        assert bool((out[:, :, hits:] == SENTINEL).all()), "bytes landed in out after retrieve returned"
        assert stored_objects(s3_server, s3_bucket, prefix) == before
        proxy.latency_s = 0.0

        def hit() -> bool:
            again = torch.full_like(kv_of(tokens), SENTINEL)
            kv, mask = eng.retrieve(tokens, return_tuple=False, out=again)
            return assert_exact_or_miss(kv, mask, tokens) == 2 * CHUNK
        wait_until(hit, "hits once the latency is gone")


@pytest.mark.parametrize("damage", ["shorter", "longer"])
def test_an_object_of_the_wrong_size_for_its_header_is_corrupt_not_a_fault(
        damage: str, s3_server: S3Server, s3_bucket: str) -> None:
    """An object whose size (as the server states it) disagrees with its own chunk header was
    not written by tierkv as it is: a miss, deleted and counted as corrupt, and no strike
    against the tier's health (failure_threshold 1 would trip on the first). Straight at the
    server, no proxy: the replies are whole; only the object is wrong."""
    prefix = f"faults/size/{damage}/{uuid.uuid4().hex[:8]}"

    async def body() -> None:
        options = S3Backend.validate_options(
            s3_tier_options(s3_server, s3_bucket, prefix, failure_threshold=1), "tiers[0]")
        backend = S3Backend(name="shared", **options)
        raw = s3_server.boto3_client()

        def damage_object(index: int) -> None:
            name = f"{prefix}/{make_key(index).to_string()}"
            good = raw.get_object(Bucket=s3_bucket, Key=name)["Body"].read()
            bad = good[:-16] if damage == "shorter" else good + b"\0" * 16
            raw.put_object(Bucket=s3_bucket, Key=name, Body=bad)
            assert stored_objects(s3_server, s3_bucket, prefix)[name] == len(bad)

        try:
            keys = [make_key(i) for i in (1, 2, 3)]
            await backend.batched_put(keys, [make_chunk(i) for i in (1, 2, 3)])
            damage_object(1)
            damage_object(3)

            # into caller memory: the wrong object is a miss, the valid one a hit
            outs = [torch.full_like(make_chunk(i), SENTINEL) for i in (1, 2)]
            assert await backend.batched_get_into(keys[:2], outs) == [False, True]
            assert bool((outs[0] == SENTINEL).all()), "a wrong object wrote into the destination"
            assert torch.equal(outs[1], make_chunk(2))
            # a batch of only a wrong object: still a miss, not a failed (unreachable) tier
            assert await backend.batched_get([keys[2]]) == [None]

            stats = backend.stats()
            assert stats["corrupt_chunks"] == 2
            assert stats["incomplete_bodies"] == 0 and stats["retries"] == 0, "taken for a transport fault"
            assert stats["get_errors"] == 0
            health = stats["store_health"]
            assert health["healthy"] and backend.health.counts["failures"] == 0, health
            assert list(stored_objects(s3_server, s3_bucket, prefix)) == [f"{prefix}/{keys[1].to_string()}"], \
                "the wrong objects are dropped, the valid one kept"
            got = await backend.batched_get(keys)
            assert got[0] is None and got[2] is None and torch.equal(got[1], make_chunk(2))
        finally:
            await backend.close()
    asyncio.run(body())
