"""A real redis-server for the whole session, started on a free port and stopped by PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tierkv_redis.testing import RedisServer, server_binary


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if server_binary() is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server); .ci/run installs it in CI")
    with RedisServer() as server:
        yield server
