"""``redis`` tier: KV chunks as Redis strings, batched through pipelines.

One chunk is one Redis value under ``<key_prefix><CacheKey.to_string()>``, in tierkv's
checksummed chunk format (never pickle). A batch is one round trip: ``MGET`` (or pipelined
``GETEX`` when a ``ttl`` slides on reads), pipelined ``SET``, pipelined ``EXISTS``.

The tier is not ``bounded``: Redis itself evicts (``maxmemory`` + ``maxmemory-policy``),
and a chunk refused for lack of memory is a :class:`~tierkv.errors.CapacityError`. A
server that is down or silent raises :class:`~tierkv.errors.TierUnavailableError`
within ``connect_timeout`` / ``socket_timeout`` (no retries, no backoff): the engine
turns that into misses and skips the tier for a while, so a dead Redis never stalls a
request for longer than one timeout.

Ownership (what a caller may rely on when it abandons a call -- a timeout, a deadline, a
cancellation): nothing here runs on another thread. A reply is verified and copied into
the caller's destination on the event loop, in the same step that follows the await for
that reply, and a put gathers the caller's chunk into a buffer of its own before its
first await. So once a call returned, raised or was cancelled, it neither writes into
the caller's destinations nor reads the caller's chunks any more; an abandoned reply is
dropped with the coroutine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar, cast

import numpy as np
import torch
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError, ResponseError

from tierkv.backend import BlobBackend, check_destinations
from tierkv.backend.options import Option, format_size
from tierkv.chunks import serde
from tierkv.chunks.keys import KV_FORMATS, CacheKey
from tierkv.chunks.memory import as_bytes, copy_into, direct_target, empty_host, gather_bytes
from tierkv.errors import CapacityError, ChunkFormatError, TierUnavailableError
from tierkv.policy.planner import SpeedSeed
from tierkv_redis import cluster as redis_cluster
from tierkv_redis.options import REDIS_MAX_VALUE_BYTES, duration, redact_url, redis_url, value_limit

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: a pipelined SET batch is flushed once it holds this many encoded bytes (bounds the extra memory)
_PUT_BATCH_BYTES = 64 << 20
#: keys per MGET / pipeline on reads (large replies are parsed incrementally either way)
_GET_BATCH_KEYS = 256


class RedisBackend(BlobBackend):
    """A Redis (or Valkey) server as a shared, network-attached tier."""

    speed_seed: ClassVar[SpeedSeed] = SpeedSeed(fixed_s=1e-3, bytes_per_s=500e6)  # one round trip on a LAN
    persistent: ClassVar[bool] = True  # chunks outlive this process as long as the server keeps them
    bounded: ClassVar[bool] = False  # the server evicts, by its maxmemory-policy
    options: ClassVar[dict[str, Option]] = {
        "url": Option(redis_url, "redis://127.0.0.1:6379/0", secret=True,
                      doc="redis://[user:password@]host:port/db, rediss:// for TLS, or unix:///path.sock"),
        "key_prefix": Option("str", "tierkv:", doc="prepended to every key, to share a server between caches"),
        "ttl": Option(duration, None, doc="expire a chunk this long after its last write or read (e.g. 1h); unset: never"),
        "max_connections": Option("int", 16, minimum=1, doc="connections to the server, shared by concurrent calls"),
        "connect_timeout": Option(duration, 1.0, doc="seconds to wait for a connection (e.g. 500ms)"),
        "socket_timeout": Option(duration, 2.0, doc="seconds to wait for a reply before the tier counts as down"),
        "max_value_size": Option(value_limit, REDIS_MAX_VALUE_BYTES, doc="largest encoded chunk; Redis's own limit is 512MiB"),
        "cluster": Option(redis_cluster.cluster_nodes, False,
                          doc="true: a Redis Cluster seeded from url; or its seed nodes, [host:port, ...]"),
    }

    def __init__(
        self,
        name: str,
        capacity: int | None = None,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "tierkv:",
        ttl: float | None = None,
        max_connections: int = 16,
        connect_timeout: float = 1.0,
        socket_timeout: float = 2.0,
        max_value_size: int = REDIS_MAX_VALUE_BYTES,
        cluster: bool | list[str] = False,
    ) -> None:
        super().__init__(name, capacity)
        self.url = redis_url(url)
        self.key_prefix = key_prefix
        self.ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.socket_timeout = socket_timeout
        self.max_value_size = value_limit(max_value_size)
        self.cluster = redis_cluster.cluster_nodes(cluster)
        # redis.asyncio clients belong to one event loop: built lazily in the loop that uses them
        self._redis: Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counters.update({"server_errors": 0, "bytes_written": 0, "bytes_read": 0, "node_failures": 0})

    # -- connection --------------------------------------------------------------------------
    def _client(self) -> Redis:
        self._ensure_open()
        loop = asyncio.get_running_loop()
        if (self._redis is None or self._loop is not loop) and self.cluster:
            self._redis = redis_cluster.make_client(self.url, self.cluster, self.max_connections, self.connect_timeout,
                                                    self.socket_timeout)  # type: ignore[assignment]
            self._loop = loop
        elif self._redis is None or self._loop is not loop:
            pool = BlockingConnectionPool.from_url(
                self.url,
                max_connections=self.max_connections,
                timeout=self.connect_timeout + self.socket_timeout,  # wait for a free connection, then give up
                socket_connect_timeout=self.connect_timeout,
                socket_timeout=self.socket_timeout,
                retry=Retry(NoBackoff(), 0),  # redis-py's default retries with backoff would stretch one timeout into many
            )
            self._redis = Redis.from_pool(pool)
            self._loop = loop
        return self._redis

    async def _call(self, operation: str, awaitable: Awaitable[T]) -> T:
        """Await a Redis call, turning client errors into tierkv's (chained, password redacted)."""
        try:
            return await awaitable
        except ResponseError as exc:
            self.counters["server_errors"] += 1
            if isinstance(exc, OutOfMemoryError) or "maxmemory" in str(exc):
                raise CapacityError(f"tier {self.name!r}: redis refused the write, it is out of memory: {exc}") from exc
            raise TierUnavailableError(f"tier {self.name!r}: redis at {redact_url(self.url)} rejected {operation}: {exc}") from exc
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self.counters["server_errors"] += 1
            raise TierUnavailableError(
                f"tier {self.name!r}: redis at {redact_url(self.url)} did not complete {operation} "
                f"(connect_timeout {self.connect_timeout}s, socket_timeout {self.socket_timeout}s): "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        client, self._redis = self._redis, None
        if client is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            await client.aclose()
        # else: the loop that owned the connections is gone; the OS reclaims the sockets

    # -- encoding ----------------------------------------------------------------------------------
    def _redis_key(self, key: CacheKey | str) -> str:
        return self.key_prefix + (key if isinstance(key, str) else key.to_string())

    def _encode(self, key: CacheKey, chunk: torch.Tensor) -> memoryview:
        """Header and payload in one buffer, with a single copy of the tensor's bytes.

        The buffer is a pooled host slab: a fresh multi-MiB allocation per put would spend
        more time in first-touch page faults than in the copy. The slab goes back to the
        pool once redis-py has sent it and the last reference is dropped.
        """
        runs = serde.payload_runs(chunk)  # a token slice's pieces, gathered straight into the value
        header = serde.encode_header(chunk, key.fmt if key.fmt in KV_FORMATS else None, runs)
        total = len(header) + sum(run.nbytes for run in runs)
        self._check_value_size(total)
        buffer = as_bytes(empty_host((total,), torch.uint8))
        buffer[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        gather_bytes(runs, buffer.data[len(header) :])
        return buffer.data

    def _check_value_size(self, nbytes: int) -> None:
        self._check_fits(nbytes)
        if nbytes > self.max_value_size:
            raise CapacityError(
                f"tier {self.name!r}: a chunk of {format_size(nbytes)} is larger than max_value_size "
                f"({format_size(self.max_value_size)}; Redis stores at most 512MiB in one value): "
                f"use a smaller chunk_size or a tier that takes larger objects"
            )

    def _decode(self, name: str, data: bytes | None, corrupt: list[str]) -> torch.Tensor | None:
        if data is None:
            return None
        self.counters["bytes_read"] += len(data)
        try:
            return serde.decode(data)
        except ChunkFormatError as exc:
            self.count_corrupt([(name, exc)])  # counted and reported as every tier does; deleted by the caller
            corrupt.append(name)
            return None

    # -- tensors, batched: one round trip per batch ---------------------------------------------
    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return (await self.batched_get([key]))[0]

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        if len(keys) != len(chunks):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(chunks)} chunks")
        client = self._client()
        # encode (and size-check) everything first: a chunk that cannot fit fails the batch before any write
        pending: list[tuple[str, memoryview]] = []
        pending_bytes = 0
        for key, chunk in zip(keys, chunks):
            blob = self._encode(key, chunk)
            pending.append((self._redis_key(key), blob))
            pending_bytes += blob.nbytes
            if pending_bytes >= _PUT_BATCH_BYTES:
                await self._set_many(client, pending)
                pending, pending_bytes = [], 0
        if pending:
            await self._set_many(client, pending)
        return len(keys)

    async def _set_many(self, client: Redis, items: list[tuple[str, memoryview]]) -> None:
        if self.cluster:  # one pipeline per node, all at once; a later duplicate wins
            blobs = dict(items)
            await self._per_node("SET", list(blobs), lambda group: self._set_pipeline(client, group, blobs))
            self.counters["bytes_written"] += sum(blob.nbytes for blob in blobs.values())
            return
        pipe = client.pipeline(transaction=False)
        for name, blob in items:  # in order: a later duplicate overwrites an earlier one
            pipe.set(name, blob, px=self.ttl_ms)
        await self._call("SET", pipe.execute())
        self.counters["bytes_written"] += sum(blob.nbytes for _, blob in items)

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        client = self._client()
        names = [self._redis_key(key) for key in keys]
        out: list[torch.Tensor | None] = []
        corrupt: list[str] = []
        for start in range(0, len(names), _GET_BATCH_KEYS):
            group = names[start : start + _GET_BATCH_KEYS]
            values = await self._fetch(client, group)
            out.extend(self._decode(name, data, corrupt) for name, data in zip(group, values))
        if corrupt:
            await self._call("DEL", client.delete(*corrupt))
        return out

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """One round trip per group; each reply verified in place and copied once into its destination."""
        check_destinations(keys, outs)
        client = self._client()
        names = [self._redis_key(key) for key in keys]
        hits: list[bool] = []
        corrupt: list[str] = []
        for start in range(0, len(names), _GET_BATCH_KEYS):
            group = names[start : start + _GET_BATCH_KEYS]
            values = await self._fetch(client, group)
            hits.extend(self._decode_into(name, data, out, corrupt)
                        for name, data, out in zip(group, values, outs[start : start + _GET_BATCH_KEYS]))
        if corrupt:
            await self._call("DEL", client.delete(*corrupt))
        return hits

    def _decode_into(self, name: str, data: bytes | None, out: torch.Tensor, corrupt: list[str]) -> bool:
        if data is None:
            return False
        self.counters["bytes_read"] += len(data)
        target, staged = direct_target(out)
        try:
            header = serde.decode_header(data)
            hit = serde.copy_payload_into(header, memoryview(data)[header.header_len :], target)
        except ChunkFormatError as exc:
            self.count_corrupt([(name, exc)])  # counted and reported as every tier does; deleted by the caller
            corrupt.append(name)
            return False
        if hit and staged:
            copy_into(out, target)
        return hit

    async def _fetch(self, client: Redis, names: list[str]) -> list[bytes | None]:
        # replies are bytes: the client is built without decode_responses
        if self.cluster:  # each node's share in one pipeline; a dead node's chunks are misses
            return cast(list[bytes | None], await self._per_node("GET", names, lambda group: self._fetch_node(
                client, group), missing=None))
        return await self._fetch_node(client, names)

    async def _fetch_node(self, client: Redis, names: list[str]) -> list[bytes | None]:
        if self.ttl_ms is None:
            if self.cluster:  # keys of many slots: one MGET per slot, pipelined
                return cast(list[bytes | None], await self._call("MGET", client.mget_nonatomic(names)))
            return cast(list[bytes | None], await self._call("MGET", client.mget(names)))
        pipe = client.pipeline(transaction=False)
        for name in names:  # a read slides the expiry, so hot chunks stay
            pipe.getex(name, px=self.ttl_ms)
        return cast(list[bytes | None], await self._call("GETEX", pipe.execute()))

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        client = self._client()
        if not keys:
            return []
        names = [self._redis_key(key) for key in keys]
        if self.cluster:
            return [bool(found) for found in await self._per_node(
                "EXISTS", names, lambda group: self._exists_pipeline(client, group), missing=False)]
        return await self._exists_pipeline(client, names)

    async def _exists_pipeline(self, client: Redis, names: list[str]) -> list[bool]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(found) for found in await self._call("EXISTS", pipe.execute())]

    # -- Redis Cluster: a batch fanned out per node -----------------------------------------------
    async def _set_pipeline(self, client: Redis, names: list[str], blobs: dict[str, memoryview]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.set(name, blobs[name], px=self.ttl_ms)
        return cast(list[Any], await self._call("SET", pipe.execute()))

    async def _per_node(self, operation: str, names: list[str], send: Callable[[list[str]], Awaitable[list[T]]],
                        missing: Any = None) -> list[Any]:
        """Each node's share of ``names`` through ``send``, all nodes at once; a failed node's keys
        get ``missing`` (their chunks are misses) unless every node failed, which raises."""
        client = cast(redis_cluster.RedisCluster, self._client())
        try:
            await self._call("CLUSTER SLOTS", client.initialize())  # the slot map, once (again after a failure)
        except RedisClusterException as exc:  # no seed node answered
            raise TierUnavailableError(f"tier {self.name!r}: no node of the redis cluster at "
                                       f"{redact_url(self.url)} answered: {exc}") from exc
        results = await redis_cluster.per_node(client, names, send)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed and len(failed) == len(results):
            raise failed[0]
        if failed:
            self.counters["node_failures"] += 1
            logger.warning("tier %r: %d of %d key(s) of a %s batch failed (a cluster node is down?): %s",
                           self.name, len(failed), len(results), operation, failed[0])
        return [missing if isinstance(r, BaseException) else r for r in results]

    # -- bytes (the BlobBackend contract, used by contains/delete and by tools) ----------------
    async def get_bytes(self, key: str) -> bytes | None:
        client = self._client()
        name = self._redis_key(key)
        if self.ttl_ms is None:
            return cast(bytes | None, await self._call("GET", client.get(name)))
        return cast(bytes | None, await self._call("GETEX", client.getex(name, px=self.ttl_ms)))

    async def put_bytes(self, key: str, data: bytes) -> None:
        client = self._client()
        self._check_value_size(len(data))
        await self._call("SET", client.set(self._redis_key(key), data, px=self.ttl_ms))
        self.counters["bytes_written"] += len(data)

    async def delete_bytes(self, key: str) -> bool:
        return bool(await self._call("DEL", self._client().delete(self._redis_key(key))))

    async def exists(self, key: str) -> bool:
        return bool(await self._call("EXISTS", self._client().exists(self._redis_key(key))))

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "url": redact_url(self.url),
            "key_prefix": self.key_prefix,
            "ttl_s": None if self.ttl_ms is None else self.ttl_ms / 1000,
            "cluster": bool(self.cluster),
        }

    def __repr__(self) -> str:
        return f"RedisBackend(name={self.name!r}, url={redact_url(self.url)!r}, key_prefix={self.key_prefix!r})"
