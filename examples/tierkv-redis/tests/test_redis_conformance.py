"""The Redis tier against tierkv's shipped conformance suite, on a live redis-server."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import redis
from tierkv_redis import RedisBackend
from tierkv_redis.testing import RedisServer

from tierkv.backend import StorageBackend
from tierkv.chunks.keys import CacheKey
from tierkv.testing import BackendTests


class TestRedisBackend(BackendTests):
    @pytest.fixture(autouse=True)
    def _use_server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        # one key namespace per test directory: tests never see each other's chunks, and the
        # persistence test reopens the same namespace for the same tmp_path
        prefix = "conformance:" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:12] + ":"
        return RedisBackend(name="redis", capacity=capacity, url=self.url, key_prefix=prefix)

    def corrupt_stored(self, backend: StorageBackend, key: CacheKey) -> None:
        assert isinstance(backend, RedisBackend)
        client = redis.Redis.from_url(self.url)
        name = backend.key_prefix + key.to_string()
        value = client.get(name)
        assert value is not None
        client.set(name, value[:-1] + bytes([value[-1] ^ 0xFF]))
        client.close()


class TestRedisBackendWithTTL(TestRedisBackend):
    """The same contract when a TTL is set (reads go through pipelined GETEX instead of MGET)."""

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        prefix = "conformance-ttl:" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:12] + ":"
        return RedisBackend(name="redis", capacity=capacity, url=self.url, key_prefix=prefix, ttl=3600)
