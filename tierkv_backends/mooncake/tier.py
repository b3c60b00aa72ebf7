"""``mooncake`` tier: chunks in a Mooncake Store cluster, shared by every serving node.

One module of about 525 lines, by choice (why: below, "Over 400 lines").

Mooncake Store (the KV store of Mooncake, used by vLLM, SGLang HiCache and LMCache) keeps
objects in memory segments that storage nodes mount into one pool; a master indexes them
and evicts when the pool fills, and a transfer engine moves bytes over TCP or RDMA. This
tier is a client of such a cluster: it mounts no memory of its own unless ``segment_size``
says so (then what it stored leaves with the process), so node A's chunks stay readable by
node B after A exits as long as the storage nodes (``mooncake_client``) live.

- Keys are ``<key_prefix><CacheKey.to_string()>``: format, model, world size, worker and
  chunk hash in every key, so models and tensor-parallel shards never mix in a shared pool.
- Values are tierkv's checksummed chunk format (``tierkv.chunks.serde``, never pickle). A value
  that fails to verify is removed and is a miss; so is one the master evicted.
- Zero-copy where the API allows: one staging arena is registered with the transfer engine
  (``tierkv_backends.mooncake.arena``). A put gathers header and payload into it (the
  put's one copy) and hands it over with ``batch_upsert_from``; ``batched_get_into`` lands
  each chunk there with ``batch_get_into``, verifies it in place and copies it once into
  the destination. The destination itself is not registered and read into: the transfer
  engine would write it before the checksum could be verified, and a damaged or foreign
  chunk must leave a destination untouched (and registering per call costs a metadata round trip).
- A batch is one store call on one worker thread, bounded by ``timeout_s``; a worker the
  caller gave up on keeps its arena region but writes nothing more into the caller's
  memory (``tierkv.chunks.ownership.WriteGrant``). Calls that fail because the master or a
  peer is unreachable count against a ``tierkv.policy.health.CircuitBreaker``: the tier
  fails fast while unhealthy and a background probe brings it back.

Over 400 lines (about 525) by choice: every store call runs on a worker thread behind one
timeout, grant and breaker (``_run``), and the put / get-into / get / contains / delete work
functions beside it are its only callers; the arena and the options already live apart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from tierkv.backend import StorageBackend, check_batch, check_destinations
from tierkv.backend.options import Option, format_size
from tierkv.chunks import serde
from tierkv.chunks.keys import KV_FORMATS, CacheKey
from tierkv.chunks.memory import byte_runs, copy_into, direct_target, gather_bytes, scatter_bytes
from tierkv.chunks.ownership import WriteGrant
from tierkv.errors import ChunkFormatError, ConfigError, TierFullError, TierUnavailableError
from tierkv.policy.health import CircuitBreaker
from tierkv.policy.planner import SpeedSeed
from tierkv_backends.mooncake.arena import StagingArena
from tierkv_backends.mooncake.options import (
    BUFFER_TOO_SMALL,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    STORE_ANSWERED,
    MooncakeError,
    host_port,
    key_prefix,
    metadata_server,
)

try:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the mooncake tier needs Mooncake Store: pip install '.[mooncake]' in tierkv's clone (CPU build: "
                      "mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1 librdmacm1") from _exc

logger = logging.getLogger("tierkv_backends.mooncake")
T = TypeVar("T")

_MiB = 1 << 20
#: bytes of a chunk header before its shape (tierkv.chunks.serde's fixed part)
_HEADER_FIXED = len(serde.encode_header(torch.zeros(()), None, digest=0))


def _header_len(ndim: int) -> int:
    return _HEADER_FIXED + 8 * ndim


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class MooncakeBackend(StorageBackend):
    """A Mooncake Store cluster as a shared tier (storage nodes hold the pool; the master evicts)."""

    speed_seed: ClassVar[SpeedSeed] = SpeedSeed(fixed_s=500e-6, bytes_per_s=2e9)  # TCP on a LAN; RDMA is faster
    persistent: ClassVar[bool] = True  # chunks outlive this process as long as the storage nodes keep them
    bounded: ClassVar[bool] = False  # the master evicts when the pool fills: evicted chunks are misses
    options: ClassVar[dict[str, Option]] = {
        "master_address": Option(host_port, required=True, doc="the mooncake_master RPC address, host:port"),
        "metadata_server": Option(metadata_server, required=True,
                                  doc="http://host:port/metadata (the master's), etcd://host:port, or P2PHANDSHAKE"),
        "local_hostname": Option("str", None, doc="address other nodes reach this one at (default: this host's IP)"),
        "protocol": Option("str", "tcp", choices=("tcp", "rdma"), doc="transfer engine transport"),
        "rdma_devices": Option("str", "", doc="RDMA devices to use, e.g. mlx5_0,mlx5_1 (rdma only; empty: all)"),
        "segment_size": Option("size", 0, doc="memory this process adds to the pool (0: storage nodes hold it; "
                                              "chunks in this process's segment leave with it)"),
        "buffer_size": Option("size", 128 * _MiB, minimum=_MiB,
                              doc="registered staging arena (and the client's own buffer); bounds one batch's bytes"),
        "replicas": Option("int", 1, minimum=1, doc="copies of each chunk, on different storage nodes"),
        "key_prefix": Option(key_prefix, "tierkv/", doc="prepended to every key, to share a cluster between caches"),
        "timeout_s": Option("float", 5.0, minimum=0.01, doc="deadline of one batched call"),
        "setup_timeout_s": Option("float", 10.0, minimum=0.1, doc="how long connecting to the cluster may take"),
        "max_concurrency": Option("int", 4, minimum=1, doc="batches in flight at once"),
        "failure_threshold": Option("int", 3, minimum=1, doc="failed batches in a row that mark the tier unhealthy"),
        "probe_interval_s": Option("float", 2.0, minimum=0.01, doc="how often an unhealthy tier is probed"),
    }

    def __init__(self, name: str, capacity: int | None = None, *, master_address: str, metadata_server: str,
                 local_hostname: str | None = None, protocol: str = "tcp", rdma_devices: str = "",
                 segment_size: int = 0, buffer_size: int = 128 * _MiB, replicas: int = 1,
                 key_prefix: str = "tierkv/", timeout_s: float = 5.0, setup_timeout_s: float = 10.0,
                 max_concurrency: int = 4, failure_threshold: int = 3, probe_interval_s: float = 2.0) -> None:
        super().__init__(name, capacity)
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"tier {name!r} protocol: expected 'tcp' or 'rdma', got {protocol!r}")
        if buffer_size < _MiB:
            raise ConfigError(f"tier {name!r} buffer_size: expected at least 1MiB, got {format_size(buffer_size)}")
        self.master_address = host_port(master_address)
        self.metadata_server = metadata_server
        self.local_hostname = local_hostname or _this_host()
        self.protocol = protocol
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.replicas = replicas
        self._config = ReplicateConfig()
        self._config.replica_num = replicas
        self._count_lock = threading.Lock()
        self.counters.update({"requests": 0, "timeouts": 0, "get_errors": 0, "put_errors": 0,
                              "puts_rejected_full": 0, "bytes_read": 0, "bytes_written": 0})
        self._store = self._connect(segment_size, buffer_size, rdma_devices, setup_timeout_s)
        self._arena = StagingArena(buffer_size)
        if self._store.register_buffer(self._arena.ptr, self._arena.nbytes) != 0:
            self._store.close()
            raise ConfigError(f"tier {name!r}: the transfer engine refused to register a {format_size(buffer_size)} "
                              "staging buffer (lower buffer_size, or check the RDMA device's memory limits)")
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix=f"tierkv-mc-{name}")
        self._probe_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tierkv-mc-{name}-probe")
        self.health = CircuitBreaker(name, self._probe, failure_threshold, probe_interval_s)

    # -- start-up ---------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"mooncake master {self.master_address}"

    def _connect(self, segment_size: int, buffer_size: int, rdma_devices: str,
                 setup_timeout_s: float) -> MooncakeDistributedStore:
        """Join the cluster, bounded by ``setup_timeout_s``; a clear ConfigError when that fails."""
        hint = (f"(check that mooncake_master runs at {self.master_address} with its metadata server at "
                f"{_redact(self.metadata_server)}, and that storage nodes joined it)")
        # Mooncake's setup holds the GIL while it retries an unreachable master (a minute and
        # more): see first whether anything answers there at all
        for what, address in (("master", self.master_address), ("metadata server", _endpoint(self.metadata_server))):
            if address is not None and not _reachable(address, min(setup_timeout_s, 2.0)):
                raise ConfigError(f"tier {self.name!r}: nothing answers at the {what} address {address} {hint}")
        store = MooncakeDistributedStore()
        outcome: list[Any] = []

        def setup() -> None:
            try:
                outcome.append(store.setup(self.local_hostname, self.metadata_server, segment_size, buffer_size,
                                           self.protocol, rdma_devices, self.master_address))
            except Exception as exc:  # noqa: BLE001 - reported below with what was configured
                outcome.append(exc)

        worker = threading.Thread(target=setup, name=f"tierkv-mc-{self.name}-setup", daemon=True)
        worker.start()
        worker.join(setup_timeout_s)
        if not outcome:
            raise ConfigError(f"tier {self.name!r}: connecting to the {self._where()} took longer than "
                              f"setup_timeout_s={setup_timeout_s:g}s {hint}")
        if isinstance(outcome[0], BaseException) or outcome[0] != 0:
            raise ConfigError(f"tier {self.name!r}: cannot join the Mooncake cluster of {self._where()}: "
                              f"setup returned {outcome[0]!r} {hint}") from (
                outcome[0] if isinstance(outcome[0], BaseException) else None)
        return store

    # -- plumbing ---------------------------------------------------------------------------------
    def _count(self, name: str, amount: int = 1) -> None:
        with self._count_lock:
            self.counters[name] += amount

    def _name(self, key: CacheKey) -> str:
        return self.key_prefix + key.to_string()

    async def _run(self, op: str, work: Callable[[float], list[Any]], grant: WriteGrant | None = None,
                   landed: Callable[[], list[Any]] | None = None) -> list[Any]:
        """Run ``work`` (one batch) on a worker under the deadline; per-item results in input order.

        Items are values, or exceptions: MooncakeError for the store's errors, ChunkFormatError
        for damaged chunks. A worker still running at the deadline (or when the caller is
        cancelled) is abandoned: ``grant`` is revoked first, so it writes nothing more into the
        caller's memory, and ``landed`` says what it had finished by then. When every item
        failed the breaker counts a failure and TierUnavailableError is raised.
        """
        self._ensure_open()
        self.health.check()
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout_s
        future = loop.run_in_executor(self._pool, contextvars.copy_context().run, work, deadline)
        self._count("requests")
        try:
            done, _ = await asyncio.wait({future}, timeout=self.timeout_s)
        finally:
            if grant is not None:
                grant.revoke()  # nothing is written into the caller's memory after this
        if not done:
            future.add_done_callback(_retrieve)
            self._count("timeouts")
            results = landed() if landed is not None else []
            error = TimeoutError(f"no answer from the {self._where()} within timeout_s={self.timeout_s:g}s")
            self.health.record_failure(error)
            if not any(r is True for r in results):
                raise TierUnavailableError(f"tier {self.name!r}: {op}: {error}") from error
            return results
        try:
            results = future.result()
        except (MooncakeError, TimeoutError, OSError, RuntimeError) as exc:  # the whole batch failed
            results = [exc]
        failures = [r for r in results if isinstance(r, BaseException) and not isinstance(r, ChunkFormatError)]
        if failures:
            self._count("put_errors" if op == "put" else "get_errors", len(failures))
        if failures and len(failures) == len(results):
            self.health.record_failure(failures[0])
            raise TierUnavailableError(f"tier {self.name!r}: {op} against the {self._where()} failed: "
                                       f"{failures[0]}") from failures[0]
        self.health.record_success()
        if failures:
            logger.warning("tier %r: %d of %d %s item(s) failed: %s", self.name, len(failures), len(results), op,
                           failures[0])
        return results

    async def _probe(self) -> None:
        """Healthy again once the master answers a lookup (a missing key is an answer)."""
        loop = asyncio.get_running_loop()
        code = await asyncio.wait_for(loop.run_in_executor(
            self._probe_pool, self._store.get_size, self.key_prefix + "probe"), self.timeout_s)
        if code < 0 and code not in STORE_ANSWERED:
            raise MooncakeError("probe", code)

    def _groups(self, sizes: Sequence[int]) -> list[list[int]]:
        """Indices split into runs whose arena footprint fits half the arena (two batches progress at once)."""
        limit = max(self._arena.nbytes // 2, 1)
        groups: list[list[int]] = [[]]
        used = 0
        for index, size in enumerate(sizes):
            need = StagingArena.footprint(size)
            if groups[-1] and used + need > limit:
                groups.append([])
                used = 0
            groups[-1].append(index)
            used += need
        return [g for g in groups if g]

    def _check_item_fits(self, nbytes: int) -> None:
        if StagingArena.footprint(nbytes) > self._arena.nbytes:
            raise TierFullError(f"tier {self.name!r}: an encoded chunk of {format_size(nbytes)} does not fit its "
                                f"buffer_size of {format_size(self._arena.nbytes)} (raise buffer_size)")

    # -- worker-side batches ----------------------------------------------------------------------
    def _put_work(self, names: list[str], chunks: list[torch.Tensor], fmts: list[str | None], grant: WriteGrant,
                  deadline: float) -> list[Any]:
        sizes = [_header_len(c.dim()) + _nbytes(c) for c in chunks]
        results: list[Any] = [None] * len(names)
        for group in self._groups(sizes):
            region = self._arena.reserve(sum(StagingArena.footprint(sizes[i]) for i in group), deadline)
            try:
                offsets, offset = [], 0
                for i in group:
                    chunk, start = chunks[i], offset
                    payload = region.array[start + _header_len(chunk.dim()) : start + sizes[i]]
                    # the caller's chunk is read only under the grant: never after the put returned
                    if not grant.write(partial(_gather, chunk, payload)):
                        raise TimeoutError("the put was abandoned at its deadline")
                    header = serde.encode_header(chunk, fmts[i], payload)  # checksum of the bytes sent
                    region.array[start : start + len(header)] = np.frombuffer(header, dtype=np.uint8)
                    offsets.append(start)
                    offset += StagingArena.footprint(sizes[i])
                codes = self._store.batch_upsert_from([names[i] for i in group], [region.ptr + o for o in offsets],
                                                      [sizes[i] for i in group], self._config)
            finally:
                region.release()
            for i, code in zip(group, codes):
                results[i] = code if code == 0 or code == NO_AVAILABLE_HANDLE else MooncakeError("put", code)
                if code == 0:
                    self._count("bytes_written", sizes[i])
        return results

    def _get_into_work(self, names: list[str], outs: Sequence[torch.Tensor], grant: WriteGrant,
                       landed: list[bool], deadline: float) -> list[Any]:
        sizes = [_header_len(o.dim()) + _nbytes(o) for o in outs]
        results: list[Any] = [False] * len(names)
        corrupt: list[str] = []
        for group in self._groups(sizes):
            if grant.revoked:  # the caller gave up: no more transfers, no arena held for nothing
                break
            region = self._arena.reserve(sum(StagingArena.footprint(sizes[i]) for i in group), deadline)
            try:
                offsets = np.cumsum([0] + [StagingArena.footprint(sizes[i]) for i in group[:-1]]).tolist()
                codes = self._store.batch_get_into([names[i] for i in group], [region.ptr + o for o in offsets],
                                                   [sizes[i] for i in group])
                for i, offset, code in zip(group, offsets, codes):
                    if code in (OBJECT_NOT_FOUND, BUFFER_TOO_SMALL):  # absent, evicted, or a larger chunk
                        continue
                    if code < 0:
                        results[i] = MooncakeError("get", code)
                        continue
                    self._count("bytes_read", code)
                    try:
                        results[i] = self._verify_and_copy(region.array[offset : offset + code], outs[i], grant,
                                                           landed, i)
                    except ChunkFormatError as exc:
                        results[i] = exc
                        corrupt.append(names[i])
            finally:
                region.release()
        if corrupt:
            self._store.batch_remove(corrupt, True)
        return results

    @staticmethod
    def _verify_and_copy(data: np.ndarray, out: torch.Tensor, grant: WriteGrant, landed: list[bool],
                         index: int) -> bool:
        """Verify a chunk in the arena, then copy it once into ``out`` (under the grant)."""
        header = serde.decode_header(data.data)
        if not serde.fits(header, out):
            return False
        payload = data[header.header_len :]
        serde.verify_payload(header, payload)
        target, staged = direct_target(out)

        def copy() -> None:
            if staged:
                scatter_bytes(payload.data, byte_runs(target))
                copy_into(out, target)
            else:
                scatter_bytes(payload.data, byte_runs(out), last_first=True)
            landed[index] = True

        return grant.write(copy)

    def _get_work(self, names: list[str], deadline: float) -> list[Any]:
        unique = list(dict.fromkeys(names))  # a key asked twice is fetched once
        handles = self._store.batch_get_buffer(unique)
        found: dict[str, Any] = {}
        corrupt: list[str] = []
        for name, handle in zip(unique, handles):
            if handle is None:
                found[name] = None
                continue
            view = memoryview(handle)
            self._count("bytes_read", view.nbytes)
            try:
                found[name] = serde.decode(view)
            except ChunkFormatError as exc:
                found[name] = exc
                corrupt.append(name)
            del view, handle
        if corrupt:
            self._store.batch_remove(corrupt, True)
        if all(r is None for r in found.values()):  # misses, or a master that did not answer?
            codes = self._store.batch_is_exist(unique)
            if all(code < 0 for code in codes):
                return [MooncakeError("get", codes[0]) for _ in names]
        results = [found[name] for name in names]
        seen: set[str] = set()
        for index, name in enumerate(names):  # a repeated key gets a tensor of its own
            if name in seen and isinstance(results[index], torch.Tensor):
                results[index] = results[index].clone()
            seen.add(name)
        return results

    def _contains_work(self, names: list[str], deadline: float) -> list[Any]:
        return [code == 1 if code >= 0 else MooncakeError("is_exist", code)
                for code in self._store.batch_is_exist(names)]

    def _delete_work(self, names: list[str], deadline: float) -> list[Any]:
        codes = self._store.batch_remove(names, True)
        return [code == 0 if code in (0, OBJECT_NOT_FOUND) else MooncakeError("remove", code) for code in codes]

    # -- StorageBackend ------------------------------------------------------------------------------
    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        check_batch(keys, chunks)
        latest = {self._name(key): (key, chunk) for key, chunk in zip(keys, chunks)}  # later duplicates win
        for key, chunk in latest.values():
            serde.check_encodable(chunk, key.fmt if key.fmt in KV_FORMATS else None)
            self._check_item_fits(_header_len(chunk.dim()) + _nbytes(chunk))
        if not latest:
            return 0
        names = list(latest)
        items = list(latest.values())
        grant = WriteGrant()
        results = await self._run("put", lambda d: self._put_work(
            names, [c for _, c in items], [k.fmt if k.fmt in KV_FORMATS else None for k, _ in items], grant, d),
            grant)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise TierUnavailableError(f"tier {self.name!r}: {len(failed)} of {len(names)} put(s) to the "
                                       f"{self._where()} failed: {failed[0]}") from failed[0]
        full = sum(1 for r in results if r == NO_AVAILABLE_HANDLE)
        if full:
            self._count("puts_rejected_full", full)
            if full == len(names):
                raise TierFullError(f"tier {self.name!r}: the Mooncake pool behind the {self._where()} is full "
                                    f"(no segment has room for {full} chunk(s) even after eviction)")
        return len(keys) - full

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Each chunk lands in the registered arena, is verified there, and is copied once into ``outs[i]``."""
        check_destinations(keys, outs)
        if not keys:
            return []
        names = [self._name(key) for key in keys]
        grant = WriteGrant()
        landed = [False] * len(keys)
        results = await self._run("get", lambda d: self._get_into_work(names, outs, grant, landed, d), grant,
                                  landed=lambda: list(landed))
        self._note_corrupt(names, results)
        return [r is True and landed[i] for i, r in enumerate(results)]

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        if not keys:
            self._ensure_open()
            return []
        names = [self._name(key) for key in keys]
        results = await self._run("get", lambda d: self._get_work(names, d))
        self._note_corrupt(names, results)
        return [r if isinstance(r, torch.Tensor) else None for r in results]

    def _note_corrupt(self, names: list[str], results: list[Any]) -> None:
        """Count the chunks the worker found damaged (and already removed from the store)."""
        self.count_corrupt([(name, result) for name, result in zip(names, results)
                            if isinstance(result, ChunkFormatError)])

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return (await self.batched_get([key]))[0]

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        if not keys:
            self._ensure_open()
            return []
        names = [self._name(key) for key in keys]
        return [r is True for r in await self._run("contains", lambda d: self._contains_work(names, d))]

    async def contains(self, key: CacheKey) -> bool:
        return (await self.batched_contains([key]))[0]

    async def delete(self, key: CacheKey) -> bool:
        name = self._name(key)
        return (await self._run("delete", lambda d: self._delete_work([name], d)))[0] is True

    # -- lifecycle and reporting ---------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.health.close()
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # workers release their arena regions
        self._probe_pool.shutdown(wait=True, cancel_futures=True)
        self._store.unregister_buffer(self._arena.ptr)
        self._store.close()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "master_address": self.master_address, "protocol": self.protocol,
                "replicas": self.replicas, "key_prefix": self.key_prefix, "store_health": self.health.state()}

    def __repr__(self) -> str:
        return f"MooncakeBackend(name={self.name!r}, master_address={self.master_address!r}, " \
               f"protocol={self.protocol!r})"


def _gather(chunk: torch.Tensor, payload: np.ndarray) -> None:
    gather_bytes(serde.payload_runs(chunk), payload.data)


def _this_host() -> str:
    """This host's address as other nodes see it (what Mooncake registers this client under)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _redact(url: str) -> str:
    """A metadata server URL without any user:password part (safe for messages)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}<redacted>@{rest.rsplit('@', 1)[1]}" if sep and "@" in rest.split("/", 1)[0] else url


def _endpoint(url: str) -> str | None:
    """``host:port`` of a metadata server URL (None for P2PHANDSHAKE or a URL without a port)."""
    if "://" not in url:
        return None
    netloc = url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    return netloc if ":" in netloc else None


def _reachable(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Fetch an abandoned worker's outcome so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
