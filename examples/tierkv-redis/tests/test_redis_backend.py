"""Redis-specific behaviour: options from YAML, pipelining, TTLs, limits, a down or silent server."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Iterator

import pytest
import redis
import torch
from tierkv_redis import RedisBackend
from tierkv_redis.options import redact_url
from tierkv_redis.testing import RedisServer, free_port

from tierkv import CapacityError, ConfigError, Engine, TierUnavailableError
from tierkv.testing.backend_tests import make_chunk, make_key, same_bytes


def fresh_prefix() -> str:
    return f"t:{uuid.uuid4().hex[:10]}:"


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


# -- options, validated where the YAML is loaded -------------------------------------------------
def engine_config(**tier: object) -> dict[str, object]:
    return {"model": "m", "chunk_size": 4, "tiers": [{"name": "shared", "backend": "redis", **tier}]}


@pytest.mark.parametrize(
    ("tier", "expected"),
    [
        ({"url": "http://127.0.0.1:6379"}, r"tiers\[0\]\.url: expected a URL with scheme redis://"),
        ({"url": "redis://127.0.0.1:notaport/0"}, r"tiers\[0\]\.url: expected a URL such as redis://"),
        ({"url": 6379}, r"tiers\[0\]\.url: expected a URL"),
        ({"ttl": 0}, r"tiers\[0\]\.ttl: expected a duration greater than zero"),
        ({"ttl": "soon"}, r"tiers\[0\]\.ttl: expected a duration such as 30s"),
        ({"max_connections": 0}, r"tiers\[0\]\.max_connections: must be >= 1"),
        ({"socket_timeout": "-1s"}, r"tiers\[0\]\.socket_timeout: expected a duration"),
        ({"max_value_size": "1GiB"}, r"tiers\[0\]\.max_value_size: expected at most 512MiB"),
        ({"key_prefx": "x"}, r"tiers\[0\]: unknown key 'key_prefx' \(did you mean 'key_prefix'\?\)"),
    ],
)
def test_bad_options_name_the_yaml_path(tier: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        Engine(engine_config(**tier))


def test_password_never_appears_in_errors_or_stats() -> None:
    with pytest.raises(ConfigError) as info:
        Engine(engine_config(url="redis://:hunter2@127.0.0.1:bad/0"))
    assert "hunter2" not in str(info.value) and "***" in str(info.value)
    backend = RedisBackend("r", url="redis://user:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in repr(backend) and "hunter2" not in str(backend.stats())
    assert redact_url("rediss://u:p@h:6380/1") == "rediss://u:***@h:6380/1"


def test_options_reach_the_backend(redis_server: RedisServer) -> None:
    config = engine_config(url=redis_server.url, key_prefix="app:", ttl="10m", max_connections=3,
                           connect_timeout="250ms", socket_timeout=1.5, max_value_size="64MiB")
    with Engine(config) as engine:
        tier = engine.tiers[0]
        assert isinstance(tier, RedisBackend)
        assert (tier.key_prefix, tier.ttl_ms, tier.max_connections) == ("app:", 600_000, 3)
        assert (tier.connect_timeout, tier.socket_timeout, tier.max_value_size) == (0.25, 1.5, 64 << 20)


# -- batching: one command per batch, not one round trip per key ------------------------------------
def command_calls(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in client.info("commandstats").items()}


def test_batches_are_pipelined(redis_server: RedisServer) -> None:
    client = raw_client(redis_server)
    keys = [make_key(i) for i in range(20)]

    async def main() -> list[torch.Tensor | None]:
        backend = RedisBackend("r", url=redis_server.url, key_prefix=fresh_prefix())
        try:
            await backend.batched_put(keys, [make_chunk(i) for i in range(20)])
            return await backend.batched_get(keys)
        finally:
            await backend.close()

    client.config_resetstat()
    got = asyncio.run(main())
    calls = command_calls(client)
    assert all(same_bytes(chunk, make_chunk(i)) for i, chunk in enumerate(got))
    assert calls.get("mget") == 1 and "get" not in calls, calls
    assert calls.get("set") == 20
    # 20 SETs in one pipeline: the server saw them on at most a couple of connections' single writes
    assert client.info("stats")["total_connections_received"] >= 1


# -- TTL ---------------------------------------------------------------------------------------------
def test_ttl_is_set_on_write_and_slides_on_read(redis_server: RedisServer) -> None:
    client = raw_client(redis_server)
    prefix = fresh_prefix()

    async def main() -> None:
        backend = RedisBackend("r", url=redis_server.url, key_prefix=prefix, ttl=100)
        try:
            await backend.put(make_key(1), make_chunk(1))
            name = prefix + make_key(1).to_string()
            assert 0 < client.pttl(name) <= 100_000
            client.pexpire(name, 5_000)  # as if most of the TTL had elapsed
            assert same_bytes(await backend.get(make_key(1)), make_chunk(1))
            assert client.pttl(name) > 5_000, "a read must push the expiry back out"
        finally:
            await backend.close()

    asyncio.run(main())


def test_without_ttl_chunks_do_not_expire(redis_server: RedisServer) -> None:
    client = raw_client(redis_server)
    prefix = fresh_prefix()

    async def main() -> None:
        backend = RedisBackend("r", url=redis_server.url, key_prefix=prefix)
        try:
            await backend.put(make_key(1), make_chunk(1))
        finally:
            await backend.close()

    asyncio.run(main())
    assert client.pttl(prefix + make_key(1).to_string()) == -1


# -- limits and damaged values -------------------------------------------------------------------------
def test_value_past_the_limit_is_a_capacity_error_and_loses_nothing(redis_server: RedisServer) -> None:
    async def main() -> None:
        backend = RedisBackend("r", url=redis_server.url, key_prefix=fresh_prefix(), max_value_size="16KiB")
        try:
            await backend.put(make_key(1), make_chunk(1))
            big = make_chunk(2, shape=(2, 2, 256, 2, 8))  # 32 KiB of bf16
            with pytest.raises(CapacityError, match=r"larger than max_value_size \(16.0KiB; Redis stores at most 512MiB"):
                await backend.batched_put([make_key(3), make_key(2)], [make_chunk(3), big])
            assert await backend.get(make_key(3)) is None, "a batch with an oversized chunk writes nothing"
            assert same_bytes(await backend.get(make_key(1)), make_chunk(1))
        finally:
            await backend.close()

    asyncio.run(main())


def test_server_out_of_memory_is_a_capacity_error() -> None:
    with RedisServer(extra_args=("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")) as server:
        async def main() -> None:
            backend = RedisBackend("r", url=server.url, key_prefix=fresh_prefix())
            try:
                big = make_chunk(1, shape=(2, 2, 256, 2, 256))  # 1 MiB
                with pytest.raises(CapacityError, match="out of memory"):
                    for index in range(8):
                        await backend.put(make_key(index), big)
            finally:
                await backend.close()

        asyncio.run(main())


def test_corrupt_value_is_a_counted_miss_and_deleted(redis_server: RedisServer) -> None:
    client = raw_client(redis_server)
    prefix = fresh_prefix()
    client.set(prefix + make_key(7).to_string(), b"TKVC this is not a chunk")

    async def main() -> None:
        backend = RedisBackend("r", url=redis_server.url, key_prefix=prefix)
        try:
            await backend.put(make_key(8), make_chunk(8))
            got = await backend.batched_get([make_key(7), make_key(8)])
            assert got[0] is None and same_bytes(got[1], make_chunk(8))
            assert backend.stats()["corrupt_chunks"] == 1
        finally:
            await backend.close()

    asyncio.run(main())
    assert not client.exists(prefix + make_key(7).to_string())


# -- a server that is down, or up but silent ------------------------------------------------------------
@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a hung server, a black hole)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield int(listener.getsockname()[1])
    listener.close()


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_unreachable_server_fails_fast_with_a_clear_error(kind: str, request: pytest.FixtureRequest) -> None:
    port = free_port() if kind == "refused" else request.getfixturevalue("silent_server")
    url = f"redis://:secret@127.0.0.1:{port}/0"

    async def main() -> None:
        backend = RedisBackend("r", url=url, connect_timeout=0.2, socket_timeout=0.2)
        try:
            for call in (backend.batched_get([make_key(1)]), backend.put(make_key(1), make_chunk(1)),
                         backend.batched_contains([make_key(1)])):
                # the guard is a hang detector, far above the configured 0.2 s timeouts
                with pytest.raises(TierUnavailableError, match=f"redis at redis://:\\*\\*\\*@127.0.0.1:{port}/0") as info:
                    await asyncio.wait_for(call, timeout=30)
                assert "secret" not in str(info.value) and info.value.__cause__ is not None
        finally:
            await backend.close()

    asyncio.run(main())


def test_engine_over_a_down_redis_serves_misses_and_keeps_working(silent_server: int) -> None:
    config = {
        "model": "m", "chunk_size": 4,
        "tiers": [
            {"name": "host", "backend": "cpu", "capacity": "1MiB"},
            {"name": "shared", "backend": "redis", "url": f"redis://127.0.0.1:{silent_server}/0",
             "connect_timeout": 0.2, "socket_timeout": 0.2},
        ],
    }
    tokens = torch.arange(16)
    kv = torch.randn(2, 2, 16, 1, 4)
    with Engine(config) as engine:
        engine.store(tokens, kv)  # acknowledged by the cpu tier; the background fill to redis fails
        out, mask = engine.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(out, kv)
        other = torch.arange(100, 116)
        _, miss = engine.retrieve(other, return_tuple=False)  # cpu misses, redis cannot answer: a miss
        assert not miss.any()
