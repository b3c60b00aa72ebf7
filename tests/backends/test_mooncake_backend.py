"""The mooncake tier on a real Mooncake Store (master + storage node on loopback ports).

Conformance kit, options, eviction as misses, a master outage (bounded calls, breaker,
recovery) and the zero-copy paths. Skips with an install hint where Mooncake is missing.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch

from tierkv.backend.registry import load as load_backend_class
from tierkv.chunks.keys import CacheKey
from tierkv.errors import ConfigError, TierFullError, TierUnavailableError
from tierkv.testing import BackendTests
from tierkv.testing.backend_tests import make_chunk, make_key, same_bytes
from tierkv.testing.mooncake_server import MooncakeCluster, MooncakeServerError, mooncake_importable
from tierkv.testing.requirements import missing

if mooncake_importable() is not None:
    missing("the Mooncake transfer engine", mooncake_importable() or "", module_level=True)

from tierkv_backends.mooncake import MooncakeBackend  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[MooncakeCluster]:
    try:
        with MooncakeCluster(pool_size=256 << 20) as running:
            yield running
    except MooncakeServerError as exc:
        missing("a running Mooncake master", str(exc))


def make_tier(cluster: MooncakeCluster, prefix: str, **extra: object) -> MooncakeBackend:
    options = {"key_prefix": prefix, "buffer_size": 16 << 20, "timeout_s": 3.0, "probe_interval_s": 0.2, **extra}
    return MooncakeBackend(name="mooncake", **cluster.tier_options(**options))  # type: ignore[arg-type]


def on_own_cluster(pool_size: int, main: Callable[[MooncakeCluster], Awaitable[None]]) -> None:
    """Run ``main`` against a cluster of its own (tests that fill the pool or kill the master)."""
    try:
        with MooncakeCluster(pool_size=pool_size) as own:
            asyncio.run(main(own))  # type: ignore[arg-type]
    except MooncakeServerError as exc:
        missing("a running Mooncake master", str(exc))


class TestMooncakeConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _use_cluster(self, cluster: MooncakeCluster) -> None:
        self.cluster = cluster

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> MooncakeBackend:
        # one namespace per test directory; the persistence test reopens the same one
        return make_tier(self.cluster, "conf/" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:12] + "/")

    def corrupt_stored(self, backend: object, key: CacheKey) -> None:
        assert isinstance(backend, MooncakeBackend)
        name = backend.key_prefix + key.to_string()
        data = bytearray(backend._store.get(name))  # the raw client, behind the tier's back
        assert data
        data[-1] ^= 0xFF
        assert backend._store.upsert(name, bytes(data)) == 0


def test_entry_point_and_option_errors(cluster: MooncakeCluster) -> None:
    cls = load_backend_class("mooncake")
    assert cls is MooncakeBackend
    good = {"master_address": cluster.master_address, "metadata_server": cluster.metadata_server}
    parsed = cls.validate_options({**good, "buffer_size": "32MiB", "protocol": "rdma", "replicas": 2}, "tiers[1]")
    assert parsed["buffer_size"] == 32 << 20 and parsed["replicas"] == 2
    bad = [({"metadata_server": cluster.metadata_server}, "master_address"),
           ({**good, "master_address": "nohost"}, "host:port"),
           ({**good, "metadata_server": "ftp://x"}, "metadata server"),
           ({**good, "protocol": "udp"}, "tcp"),
           ({**good, "buffer_size": "lots"}, "size"),
           ({**good, "replicas": 0}, ">= 1"),
           ({**good, "timeout": 1}, "timeout_s")]
    for raw, expected in bad:
        with pytest.raises(ConfigError, match=expected):
            cls.validate_options(raw, "tiers[1]")


def test_unreachable_master_is_a_clear_config_error() -> None:
    from tierkv.testing.mooncake_server import free_port
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ConfigError, match="nothing answers at the master"):
        MooncakeBackend(name="mc", master_address=f"127.0.0.1:{port}", local_hostname="127.0.0.1",
                        metadata_server=f"http://127.0.0.1:{free_port()}/metadata", setup_timeout_s=3.0)
    assert time.monotonic() - started < 30


def test_zero_copy_paths_and_large_batches(cluster: MooncakeCluster) -> None:
    """Batches larger than half the arena are split; reads of a strided destination land bit-exact."""
    async def main() -> None:
        tier = make_tier(cluster, "zc/", buffer_size=2 << 20)
        try:
            chunks = [make_chunk(i, shape=(2, 2, 64, 2, 64)) for i in range(12)]  # 64KiB each... x12 > 1MiB
            keys = [make_key(1000 + i) for i in range(12)]
            assert await tier.batched_put(keys, chunks) == 12
            blob = torch.zeros((2, 2, 64 * 12, 2, 64), dtype=torch.bfloat16)
            outs = [blob.narrow(2, 64 * i, 64) for i in range(12)]
            assert await tier.batched_get_into(keys, outs) == [True] * 12
            assert all(same_bytes(o, c) for o, c in zip(outs, chunks))
            assert tier._arena.free_bytes() == tier._arena.nbytes, "every arena region came back"
            assert tier.stats()["bytes_written"] > 0
        finally:
            await tier.close()
    asyncio.run(main())


def test_pool_eviction_shows_up_as_misses_never_errors() -> None:
    """A 32MiB pool filled 4x over: early chunks are evicted (misses), later ones read back bit-exact."""
    async def main(small: MooncakeCluster) -> None:
        tier = make_tier(small, "evict/")
        try:
            chunk_shape = (2, 2, 256, 2, 256)  # 1MiB
            stored = []
            for i in range(128):
                try:
                    await tier.put(make_key(i), make_chunk(i, shape=chunk_shape))
                    stored.append(i)
                except Exception as exc:  # noqa: BLE001 - a full pool may refuse a put while it evicts
                    assert "full" in str(exc)
            outs = [torch.empty(chunk_shape, dtype=torch.bfloat16) for _ in range(128)]
            hits = await tier.batched_get_into([make_key(i) for i in range(128)], outs)
            assert 0 < sum(hits) < 128, "some chunks must have been evicted and some kept"
            for i, hit in enumerate(hits):
                if hit:
                    assert same_bytes(outs[i], make_chunk(i, shape=chunk_shape))
            assert tier.health.healthy
        finally:
            await tier.close()
    on_own_cluster(32 << 20, main)


@pytest.mark.slow
def test_master_outage_bounded_unhealthy_then_recovers() -> None:
    """Kill the master: every call returns within the timeout, the tier turns unhealthy and
    fails fast; restart it: the probe makes the tier healthy and puts and gets work again."""
    async def main(c: MooncakeCluster) -> None:
        timeout = 1.0
        tier = make_tier(c, "outage/", timeout_s=timeout, failure_threshold=2, probe_interval_s=0.2)
        try:
            await tier.put(make_key(1), make_chunk(1))
            c.stop_master()
            for _attempt in range(4):
                out = torch.full_like(make_chunk(1), 9.0)
                started = time.monotonic()
                try:
                    hits = await tier.batched_get_into([make_key(1)], [out])
                    assert hits == [False] or same_bytes(out, make_chunk(1)), "wrong bytes during an outage"
                except TierUnavailableError:
                    pass
                assert time.monotonic() - started < timeout + 20, "a call hung past its timeout"
            assert not tier.health.healthy
            with pytest.raises(TierUnavailableError, match="unhealthy"):  # the breaker refuses: no call is tried
                await tier.put(make_key(2), make_chunk(2))
            c.start_master()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    await tier.put(make_key(3), make_chunk(3))
                    if same_bytes(await tier.get(make_key(3)), make_chunk(3)):
                        break
                except (TierUnavailableError, TierFullError):  # full: the storage node has not re-registered yet
                    pass
                await asyncio.sleep(0.3)
            assert tier.health.healthy
            assert same_bytes(await tier.get(make_key(3)), make_chunk(3)), "no recovery after the master restarted"
        finally:
            await tier.close()
    on_own_cluster(64 << 20, main)


def test_abandoned_read_never_writes_the_destination_afterwards(cluster: MooncakeCluster) -> None:
    """A batch given up at its deadline: destinations reported missing stay untouched, also
    after the worker that was still transferring has finished (its WriteGrant was revoked)."""
    async def main() -> None:
        writer = make_tier(cluster, "abandon/", buffer_size=256 << 20, timeout_s=60.0)
        shape = (32, 2, 64, 8, 128)  # 8MiB chunks, 96MiB in all: longer than the deadline below
        chunks = [make_chunk(i, shape=shape) for i in range(12)]
        keys = [make_key(5000 + i) for i in range(12)]
        try:
            await writer.batched_put(keys, chunks)
        finally:
            await writer.close()
        reader = make_tier(cluster, "abandon/", buffer_size=256 << 20, timeout_s=0.02, failure_threshold=100)
        outs = [torch.full(shape, 5.0, dtype=torch.bfloat16) for _ in keys]
        try:
            try:
                hits = await reader.batched_get_into(keys, outs)
            except TierUnavailableError:
                hits = [False] * len(keys)
        finally:
            await reader.close()  # waits for the abandoned worker: anything it would write is written by now
        for hit, out, chunk in zip(hits, outs, chunks):
            if hit:
                assert same_bytes(out, chunk)
            else:
                assert bool((out == 5).all()), "a destination reported missing was written after the call returned"
        assert reader.stats()["timeouts"] + sum(hits) >= 1
    asyncio.run(main())
