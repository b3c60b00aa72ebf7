"""The Redis tier on a real 3-node Redis Cluster (redis-server processes on loopback ports).

Conformance kit with ``cluster: true``, seed-node options, slots moved under a running client
(MOVED followed by redis-py), and one node down: its chunks are misses while the other
nodes serve theirs, and the node's return brings its slots back.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from tierkv_redis import RedisBackend
from tierkv_redis.testing import RedisClusterServers, server_binary

from tierkv.backend import StorageBackend
from tierkv.chunks.keys import CacheKey
from tierkv.errors import ConfigError
from tierkv.testing import BackendTests
from tierkv.testing.backend_tests import make_chunk, make_key, same_bytes
from tierkv.testing.requirements import missing


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterServers]:
    if server_binary() is None:
        missing("redis-server", "apt-get install redis-server")
    with RedisClusterServers(nodes=3) as servers:
        yield servers


def cluster_tier(servers: RedisClusterServers, prefix: str, **extra: object) -> RedisBackend:
    options: dict[str, object] = {"connect_timeout": 0.5, "socket_timeout": 1.0, **extra}
    return RedisBackend(name="redis-cluster", url=servers.url, key_prefix=prefix, cluster=True,
                        **options)  # type: ignore[arg-type]


class TestRedisClusterConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _use_cluster(self, redis_cluster: RedisClusterServers) -> None:
        self.servers = redis_cluster

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        # the kit checks what the tier does, not how fast: generous timeouts, so 24 concurrent
        # callers connecting on a loaded 2-core machine are not taken for an outage
        return cluster_tier(self.servers, "conf:" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:12] + ":",
                            connect_timeout=5.0, socket_timeout=5.0)

    def corrupt_stored(self, backend: StorageBackend, key: CacheKey) -> None:
        assert isinstance(backend, RedisBackend)
        client = redis.RedisCluster.from_url(self.servers.url)
        name = backend.key_prefix + key.to_string()
        value = client.get(name)
        assert value is not None
        client.set(name, value[:-1] + bytes([value[-1] ^ 0xFF]))
        client.close()


def test_cluster_option_forms() -> None:
    options = RedisBackend.validate_options({"cluster": ["127.0.0.1:7000", "10.0.0.2:7001"]}, "tiers[1]")
    assert options["cluster"] == ["127.0.0.1:7000", "10.0.0.2:7001"]
    assert RedisBackend.validate_options({"cluster": True}, "tiers[1]")["cluster"] is True
    for bad in ("yes", ["nohost"], [], ["127.0.0.1:99999"]):
        with pytest.raises(ConfigError, match="seed nodes"):
            RedisBackend.validate_options({"cluster": bad}, "tiers[1]")


def test_seed_list_spreads_chunks_over_every_node(redis_cluster: RedisClusterServers) -> None:
    async def main() -> None:
        tier = RedisBackend(name="rc", url="redis://127.0.0.1:1/0", key_prefix="seeds:",
                            cluster=redis_cluster.seeds[1:], connect_timeout=0.5, socket_timeout=1.0)
        try:
            keys = [make_key(i) for i in range(64)]
            assert await tier.batched_put(keys, [make_chunk(i) for i in range(64)]) == 64
            got = await tier.batched_get(keys)
            assert all(same_bytes(g, make_chunk(i)) for i, g in enumerate(got))
            assert tier.stats()["cluster"] is True
        finally:
            await tier.close()
        per_node = []
        for port in redis_cluster.ports:  # every node holds some of them: the batch was spread by slot
            node = redis.Redis(port=port)
            per_node.append(sum(1 for _ in node.scan_iter(match="seeds:*")))
            node.close()
        assert all(count > 0 for count in per_node) and sum(per_node) == 64
    asyncio.run(main())


def test_moved_slots_are_followed(redis_cluster: RedisClusterServers) -> None:
    """Reshard slots (with their keys) to another node under a running client: reads still hit."""
    async def main() -> None:
        tier = cluster_tier(redis_cluster, "moved:")
        try:
            keys = [make_key(i) for i in range(48)]
            await tier.batched_put(keys, [make_chunk(i) for i in range(48)])
            source = redis.Redis(port=redis_cluster.ports[0])
            target = redis.Redis(port=redis_cluster.ports[1])
            source_id, target_id = source.cluster("myid"), target.cluster("myid")
            source.close()
            target.close()
            await asyncio.to_thread(subprocess.run, [
                "redis-cli", "--cluster", "reshard", redis_cluster.seeds[0], "--cluster-from", _text(source_id),
                "--cluster-to", _text(target_id), "--cluster-slots", "3000", "--cluster-yes"],
                check=True, capture_output=True, timeout=120)
            outs = [torch.empty_like(make_chunk(0)) for _ in keys]
            assert await tier.batched_get_into(keys, outs) == [True] * 48
            assert all(same_bytes(o, make_chunk(i)) for i, o in enumerate(outs))
        finally:
            await tier.close()
    asyncio.run(main())


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def test_one_node_down_its_chunks_miss_the_rest_serve_then_it_returns(redis_cluster: RedisClusterServers) -> None:
    async def main() -> None:
        tier = cluster_tier(redis_cluster, "down:")
        keys = [make_key(i) for i in range(60)]
        try:
            await tier.batched_put(keys, [make_chunk(i) for i in range(60)])
            victim = redis_cluster.ports[2]
            probe = redis.RedisCluster.from_url(redis_cluster.url)
            on_victim = {i for i, key in enumerate(keys)
                         if probe.get_node_from_key(tier.key_prefix + key.to_string()).port == victim}
            probe.close()
            assert 0 < len(on_victim) < 60
            redis_cluster.stop_node(victim)
            outs = [torch.full_like(make_chunk(0), 7.0) for _ in keys]
            started = time.monotonic()
            hits = await tier.batched_get_into(keys, outs)
            assert time.monotonic() - started < 10, "a dead node stalled the batch"
            for i, hit in enumerate(hits):
                if i in on_victim:
                    assert not hit and bool((outs[i] == 7).all()), "a chunk of the dead node was reported or written"
                else:
                    assert hit and same_bytes(outs[i], make_chunk(i)), "the other nodes must keep serving"
            assert tier.stats()["node_failures"] >= 1
            redis_cluster.start_node(victim)
            redis_cluster.wait_ok()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # back: the node serves again (its data is gone: a fresh node)
                try:
                    await tier.batched_put(keys, [make_chunk(i) for i in range(60)])
                    got = await tier.batched_get(keys)
                    if all(same_bytes(g, make_chunk(i)) for i, g in enumerate(got)):
                        break
                except Exception:  # noqa: BLE001 - the client relearns the node
                    pass
                await asyncio.sleep(0.2)
            got = await tier.batched_get(keys)
            assert all(same_bytes(g, make_chunk(i)) for i, g in enumerate(got)), "no recovery after the node returned"
        finally:
            await tier.close()
    asyncio.run(main())
