"""A real redis-server for the whole session, started on a free port and stopped by PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tierkv_redis.testing import RedisServer, server_binary

from tierkv.testing.requirements import missing


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if server_binary() is None:
        missing("redis-server", "apt-get install redis-server")
    with RedisServer() as server:
        yield server
