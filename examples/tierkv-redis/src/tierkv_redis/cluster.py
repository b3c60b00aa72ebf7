"""Redis Cluster support of the Redis tier: the client, and batches fanned out per node.

With ``cluster: true`` (seeded from ``url``) or ``cluster: [host:port, ...]`` the tier talks
to a Redis Cluster through redis-py's :class:`~redis.asyncio.cluster.RedisCluster`, which
learns the slot map, follows ``MOVED`` / ``ASK`` redirections and refreshes its map.

A batch is split by the node that owns each key's slot, and each node's share goes out as
one pipeline, all nodes at once. A node that is down or silent fails only its own share:
those chunks are misses (or puts not made) while the other nodes serve theirs; only when
every node failed does the batch raise. For that to hold on the server side too, run the
cluster with ``cluster-require-full-coverage no`` (else the surviving nodes refuse every
query once they see a slot uncovered).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

T = TypeVar("T")

_NODE_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def cluster_nodes(value: Any) -> bool | list[str]:
    """Option converter: ``true`` / ``false``, or the seed nodes of a cluster as ``host:port`` strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value:
        nodes = []
        for item in value:
            match = _NODE_RE.match(item.strip()) if isinstance(item, str) else None
            if not match or not 0 < int(match.group(2)) < 65536:
                raise ValueError(f"expected seed nodes as host:port strings, e.g. [10.0.0.1:7000], got {item!r}")
            nodes.append(item.strip())
        return nodes
    raise ValueError(f"expected true, false or a list of seed nodes such as [10.0.0.1:7000, 10.0.0.2:7000], got {value!r}")


def make_client(url: str, seeds: bool | list[str], max_connections: int, connect_timeout: float,
                socket_timeout: float) -> RedisCluster:
    """A cluster client: credentials and TLS from ``url``, seeds from the list (or ``url``'s host)."""
    startup = [ClusterNode(*_split(node)) for node in seeds] if isinstance(seeds, list) else None
    return RedisCluster.from_url(
        url,
        startup_nodes=startup,
        max_connections=max_connections,
        socket_connect_timeout=connect_timeout,
        socket_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 0),  # a dead node fails its share at once instead of stalling the batch
        require_full_coverage=False,  # slots of a dead node are misses; the others serve
    )


def _split(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host.strip("[]"), int(port)


async def per_node(client: RedisCluster, names: Sequence[str],
                   send: Callable[[list[str]], Awaitable[list[T]]]) -> list[T | BaseException]:
    """``send`` each node's share of ``names`` at once; results in input order.

    Every key of a failed share gets that share's exception in place of a result. The
    client must be initialized (it knows the slot map): ``await client.initialize()``.
    """
    shares: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        node = client.get_node_from_key(name)  # None for a slot no node covers: sent anyway, fails alone
        shares.setdefault(node.name if node is not None else "", []).append(index)
    groups = list(shares.values())
    replies = await asyncio.gather(*(send([names[i] for i in group]) for group in groups), return_exceptions=True)
    results: list[T | BaseException] = [None] * len(names)  # type: ignore[list-item]
    for group, reply in zip(groups, replies):
        for position, index in enumerate(group):
            results[index] = reply if isinstance(reply, BaseException) else reply[position]
    return results
