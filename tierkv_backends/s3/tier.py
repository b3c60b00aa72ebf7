"""``s3`` tier: one object per chunk in an S3 bucket (AWS S3, MinIO, SeaweedFS, Ceph RGW).

Over 400 lines (about 475) by choice: the tier's batches, deadlines and health share one
set of request slots; options, requests, replies and the lookup cache are modules beside it.

Every serving replica can point at the same bucket: a prefix computed once anywhere is
reused everywhere. Object names are ``<prefix>/<CacheKey.to_string()>`` — the key string
carries the KV format, model, world size, worker id and chunk hash, percent-escaped — so
caches of different models or tensor-parallel shards never mix in a shared bucket.

How it talks to the store:

- boto3 clients are thread-safe; every request runs on a worker thread (never on the event
  loop). Reads, writes and the small requests (HEAD, DELETE) each have ``max_concurrency``
  slots of their own, so reads a store stalls never hold a write's slot (or the reverse); a
  request still running at its batch's deadline gives its slot back then, and finishes on its
  thread in the background within ``timeout_s`` more (its socket timeouts are capped at
  ``timeout_s``). Encoding, checksum and decoding of a chunk also happen in the worker.
- Lookups: what this process stored, read or asked about is remembered
  (``tierkv_backends.s3.existence``), so a lookup of known chunks is answered from memory
  (``batched_contains_nowait``, with no request), and only unknown chunks cost a HEAD.
- Large chunks: a put of ``multipart_threshold`` bytes or more is a multipart upload of
  ``part_size`` parts sent in parallel; a get asks for the first ``part_size`` bytes and,
  when the object is larger, fetches the remaining ranges in parallel. Below those sizes
  (the default covers a 32-layer, 256-token Llama-3-8B chunk) it is one request each way --
  except, with ``min_range`` set, for a batch of fewer objects than ``max_concurrency``: its
  idle request slots fetch ranges of the same object in parallel (``tierkv_backends.s3.objects``).
- Layout: options and their defaults (one source) in ``tierkv_backends.s3.options``, the
  blocking requests in ``tierkv_backends.s3.objects``, what a reply means in
  ``tierkv_backends.s3.requests``; here: batches, deadlines, health, caller memory.
- Retries: throttling (SlowDown, 429, 503) and transient faults (connection refused/reset,
  timeouts, 5xx, a body cut, short or reset mid-transfer) are retried ``retries`` times with
  capped, jittered exponential backoff, never past the operation's ``timeout_s`` deadline.
  Anything else fails at once. A transport fault is never taken for corruption: only a whole
  body that is not what tierkv wrote (it fails its checksum, or the object's size as the
  server states it differs from its chunk header's) is deleted and counted, as a miss that
  does not count against the tier's health (``tierkv_backends.s3.requests``).
- Ownership: a read writes into the caller's destinations, and a put reads the caller's
  chunk, only while the call still owns them (``tierkv.chunks.ownership.WriteGrant``): a
  request abandoned at ``timeout_s`` or by a cancellation never touches them afterwards.
- Health: a batch whose requests all fail counts against a ``tierkv.policy.health.CircuitBreaker``;
  after ``failure_threshold`` in a row the tier fails fast (no network) and a HEAD on the
  bucket probes it every ``probe_interval_s`` until it answers. Gets return what arrived
  within ``timeout_s`` (the rest are misses); puts that failed are counted and reported as
  ``tierkv.errors.TierUnavailableError``, which the engine counts as a dropped fill.
- Credentials: the standard boto3 chain (AWS_* variables, ``profile`` or AWS_PROFILE in the
  ~/.aws files, instance roles), or environment variables the config names (``{env: NAME}``),
  or written into the options (the config then warns: a serving engine may log its config).
  They are never put in reprs, stats, log lines or exception messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from tierkv.backend import BlobBackend, check_batch, check_destinations
from tierkv.backend.options import Option, parse_options
from tierkv.chunks import serde
from tierkv.chunks.keys import KV_FORMATS, CacheKey, in_scope
from tierkv.chunks.memory import copy_into, direct_target
from tierkv.chunks.ownership import WriteGrant
from tierkv.errors import ChunkFormatError, ConfigError, TierUnavailableError
from tierkv.policy.health import CircuitBreaker
from tierkv.policy.planner import SpeedSeed
from tierkv_backends.s3.existence import ExistenceCache
from tierkv_backends.s3.objects import S3Objects
from tierkv_backends.s3.options import MIN_PART, S3_OPTIONS
from tierkv_backends.s3.requests import bucket_name, is_missing, is_transient, key_prefix

try:
    import boto3
    import botocore.exceptions
    from botocore.config import Config as BotoConfig
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the s3 tier needs boto3: pip install '.[s3]' in tierkv's clone") from _exc

logger = logging.getLogger("tierkv_backends.s3")
T = TypeVar("T")

_SLOTS = {"get": "read", "put": "write", "contains": "small", "delete": "small"}
"""Which slots a batch of each operation takes: reads and writes never wait for each other."""
_ABSENT = object()
"""What a read worker returns for an object the store does not have (a 404, not a failure)."""

__all__ = ["S3Backend", "bucket_name", "is_missing", "is_transient", "key_prefix"]


class S3Backend(BlobBackend):
    """Shared object-store tier; survives restarts and is shared by every replica."""

    speed_seed: ClassVar[SpeedSeed] = SpeedSeed(fixed_s=20e-3, bytes_per_s=150e6)  # a remote object store
    persistent: ClassVar[bool] = True
    bounded: ClassVar[bool] = False
    options: ClassVar[dict[str, Option]] = S3_OPTIONS

    def __init__(self, name: str, capacity: int | None = None, **options: Any) -> None:
        """``options``: the keys of ``tierkv_backends.s3.options.S3_OPTIONS`` (``bucket``
        required); what is not given takes its default from there, what is given is checked."""
        super().__init__(name, capacity)
        settings = parse_options(S3_OPTIONS, options, f"tier {name!r}")
        access_key_id, secret_access_key = settings["access_key_id"], settings["secret_access_key"]
        session_token = settings["session_token"]
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError(f"tier {name!r}: give both access_key_id and secret_access_key, or neither "
                              "(to use the boto3 credential chain)")
        self.bucket = settings["bucket"]
        self.prefix = settings["prefix"]
        self.endpoint_url = settings["endpoint_url"]
        self.region = settings["region"] or "us-east-1"
        self.max_concurrency = settings["max_concurrency"]
        self.timeout_s = settings["timeout_s"]
        self._secrets = tuple(s for s in (access_key_id, secret_access_key, session_token) if s)
        try:
            session = boto3.session.Session(aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key,
                                            aws_session_token=session_token, region_name=self.region,
                                            profile_name=settings["profile"])
        except botocore.exceptions.ProfileNotFound as exc:
            raise ConfigError(f"tier {name!r}: profile {settings['profile']!r} is in no AWS config or shared "
                              "credentials file (~/.aws/credentials, AWS_SHARED_CREDENTIALS_FILE)") from exc
        config = BotoConfig(
            # a request waits on its socket no longer than its batch's deadline is long
            connect_timeout=min(settings["connect_timeout_s"], self.timeout_s),
            read_timeout=min(settings["read_timeout_s"], self.timeout_s),
            retries={"total_max_attempts": 1},  # retried here, with our deadline and counters
            max_pool_connections=4 * self.max_concurrency, tcp_keepalive=True,
            s3={"addressing_style": settings["addressing_style"]},
            # chunks carry an XXH3 checksum of their own; skip botocore's per-request CRC32
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
        )
        self._client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
        # live requests are bounded by the slots (_SLOTS); the threads beyond them carry requests
        # abandoned at a deadline to their end (each within timeout_s of it)
        self._threads = concurrent.futures.ThreadPoolExecutor(4 * self.max_concurrency,
                                                              thread_name_prefix=f"tierkv-s3-{name}")
        self._read_parts = concurrent.futures.ThreadPoolExecutor(self.max_concurrency,
                                                                 thread_name_prefix=f"tierkv-s3-{name}-read-part")
        self._write_parts = concurrent.futures.ThreadPoolExecutor(self.max_concurrency,
                                                                  thread_name_prefix=f"tierkv-s3-{name}-write-part")
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary())
        self._known = ExistenceCache(settings["lookup_cache"], settings["lookup_cache_ttl_s"],
                                     settings["lookup_miss_ttl_s"])
        self._count_lock = threading.Lock()
        self.counters.update({"requests": 0, "retries": 0, "get_errors": 0, "put_errors": 0, "timeouts": 0,
                              "bytes_read": 0, "bytes_written": 0, "multipart_puts": 0, "ranged_gets": 0,
                              "incomplete_bodies": 0, "abandoned_copies": 0, "scope_deletes": 0})
        self._objects = S3Objects(
            name, self._client, self.bucket, self.prefix, self.endpoint_url, self.region,
            part_size=settings["part_size"], multipart_threshold=max(settings["multipart_threshold"], MIN_PART),
            min_range=settings["min_range"], retries=settings["retries"], backoff_base_s=settings["backoff_base_s"],
            backoff_max_s=settings["backoff_max_s"], read_parts=self._read_parts,
            write_parts=self._write_parts, count=self._count,
            redact=self._redact)
        self.health = CircuitBreaker(name, self._probe, settings["failure_threshold"], settings["probe_interval_s"])
        if settings["check_on_start"]:
            self._objects.check_bucket(settings["create_bucket"])

    @classmethod
    def from_options(cls, name: str, capacity: int | None, options: Mapping[str, Any]) -> S3Backend:
        return cls(name, capacity, **options)

    def _where(self) -> str:
        return self._objects.where()

    def _redact(self, exc: BaseException | str) -> str:
        text = str(exc)
        for secret in self._secrets:
            text = text.replace(secret, "<redacted>")
        return text

    # -- request plumbing (worker threads) ------------------------------------------------------------
    def _count(self, name: str, amount: int = 1) -> None:
        with self._count_lock:
            self.counters[name] += amount

    def _object_key(self, name: str) -> str:
        return self._objects.object_key(name)

    def _fetch(self, name: str, deadline: float, ways: int = 1) -> bytes | bytearray | None:
        return self._objects.fetch(name, deadline, ways)

    def _ways(self, batch: int) -> int:
        """Ranges per object: the request slots a batch of ``batch`` objects leaves idle."""
        return max(1, self.max_concurrency // max(1, batch))

    def _load(self, name: str, deadline: float, ways: int = 1) -> torch.Tensor | object | ChunkFormatError:
        """A chunk, ``_ABSENT``, or the ChunkFormatError of an object that is not what
        tierkv wrote (a wrong size for its header, bad magic, checksum): corrupt, not a fault."""
        try:
            data = self._fetch(name, deadline, ways)
            if data is None:
                return _ABSENT
            return serde.decode(data)
        except ChunkFormatError as exc:
            return exc

    def _encode_and_store(self, name: str, chunk: torch.Tensor, fmt: str, deadline: float, grant: WriteGrant
                          ) -> None:
        """Header and payload gathered once into the request body, then sent.

        ``chunk`` is the caller's memory: it is read only while ``grant`` allows it, so a put
        the caller gave up on (timeout, cancellation) never reads memory that may by then
        hold another prompt's bytes -- it would store them under this key.
        """
        encoded: list[bytearray] = []
        if not grant.write(lambda: encoded.append(serde.encode(chunk, fmt if fmt in KV_FORMATS else None))):
            self._count("abandoned_copies")
            raise TimeoutError("put abandoned before its chunk was read")
        self._objects.store(name, encoded[0], deadline)

    def _load_into(self, name: str, out: torch.Tensor, deadline: float, grant: WriteGrant, ways: int = 1
                   ) -> bool | object | ChunkFormatError:
        """Fetch an object, verify it in the response buffer, copy it once into ``out``.

        ``out`` is the caller's: the copy runs only while ``grant`` allows it, so a request
        the caller stopped waiting for (timeout, cancellation) never writes into ``out``
        after the call returned. Verification happens before, outside the grant.
        """
        if grant.revoked:
            return False
        try:
            data = self._fetch(name, deadline, ways)
        except ChunkFormatError as exc:  # an object of the wrong size for its header: corrupt
            return exc
        if data is None:
            return _ABSENT
        try:
            header = serde.decode_header(data)
            payload = memoryview(data)[header.header_len :]
            if not serde.fits(header, out):
                return False
            serde.verify_payload(header, [payload])
        except ChunkFormatError as exc:
            return exc

        def copy() -> bool:
            target, staged = direct_target(out)
            hit = serde.copy_payload_into(header, payload, target, verify=False)
            if hit and staged:
                copy_into(out, target)
            return hit
        copied: list[bool] = []
        if not grant.write(lambda: copied.append(copy())):
            self._count("abandoned_copies")
            return False
        return copied[0]

    # -- batching, deadline and health (event loop) ------------------------------------------------
    async def _batch(self, op: str, calls: Sequence[Callable[[float], Any]]) -> list[Any]:
        """Run ``calls`` on worker threads under one deadline, at most ``max_concurrency`` at once
        in the op's slots (``_SLOTS``); each result is a value or the exception.

        Requests still running at the deadline are abandoned (a miss or a dropped put), counted
        as timeouts, and give their slot back at once. Raises TierUnavailableError when the tier
        is unhealthy (at once) or when every request failed; otherwise records a success.
        """
        self._ensure_open()
        self.health.check()
        if not calls:
            return []
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout_s
        slots = self._slots_of(loop, _SLOTS[op])

        async def one(call: Callable[[float], Any]) -> Any:
            async with slots:  # a cancellation (the deadline, the caller) gives the slot back at once
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no slot free within timeout_s={self.timeout_s:g}s")
                # the request carries the caller's context (copy accounting follows it to the thread)
                return await loop.run_in_executor(self._threads, contextvars.copy_context().run, call, deadline)

        tasks = [asyncio.ensure_future(one(call)) for call in calls]
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.timeout_s)
        except asyncio.CancelledError:
            for task in tasks:  # requests not started never start; running ones lose their grant
                task.cancel()
            raise
        for task in pending:
            task.cancel()
        results: list[Any] = []
        failures: list[BaseException] = []
        for task in tasks:
            if task in pending:
                outcome: Any = TimeoutError(f"no answer within timeout_s={self.timeout_s:g}s")
                self._count("timeouts")
            else:
                outcome = task.exception() or task.result()
            if isinstance(outcome, BaseException) and not isinstance(outcome, ChunkFormatError):
                failures.append(outcome)
            results.append(outcome)
        if failures:
            self._count(f"{'put' if op == 'put' else 'get'}_errors", len(failures))
        if failures and len(failures) == len(calls):
            self.health.record_failure(self._redact(failures[0]))
            raise TierUnavailableError(
                f"tier {self.name!r}: all {len(calls)} {op} request(s) to {self._where()} failed: "
                f"{type(failures[0]).__name__}: {self._redact(failures[0])}") from failures[0]
        self.health.record_success()
        if failures:
            logger.warning("tier %r: %d of %d %s request(s) failed: %s: %s", self.name, len(failures), len(calls),
                           op, type(failures[0]).__name__, self._redact(failures[0]))
        return results

    def _slots_of(self, loop: asyncio.AbstractEventLoop, kind: str) -> asyncio.Semaphore:
        """The ``max_concurrency`` request slots of ``kind`` on ``loop`` (a semaphore belongs to one loop)."""
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = {name: asyncio.Semaphore(self.max_concurrency) for name in set(_SLOTS.values())}
        return slots[kind]

    async def _probe(self) -> None:
        """A HEAD on the bucket; its error (kept by the breaker as ``last_error``) is redacted."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, lambda: self._client.head_bucket(Bucket=self.bucket)),
                                   self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure means "still down"; say why without secrets
            raise TierUnavailableError(f"{self._where()}: {type(exc).__name__}: {self._redact(exc)}") from None

    # -- StorageBackend -----------------------------------------------------------------------------
    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        names = [key.to_string() for key in keys]
        ways = self._ways(len(names))
        results = await self._batch("get", [lambda d, n=n: self._load(n, d, ways) for n in names])
        self._learn(keys, [isinstance(r, torch.Tensor) for r in results], [r is _ABSENT for r in results])
        await self._drop_corrupt_objects(keys, results)
        return [r if isinstance(r, torch.Tensor) else None for r in results]

    def _learn(self, keys: Sequence[CacheKey], present: Sequence[bool], absent: Sequence[bool]) -> None:
        """Remember what a batch found (a failed or abandoned request says nothing)."""
        self._known.record([key for key, flag in zip(keys, present) if flag], True)
        self._known.record([key for key, flag in zip(keys, absent) if flag], False)

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Every object fetched in parallel, verified, and copied once into its destination.

        The destinations are the caller's until this returns (or raises): a request still
        running at ``timeout_s`` or at a cancellation loses its grant to write before this
        call gives them back (``tierkv.chunks.ownership.WriteGrant``).
        """
        check_destinations(keys, outs)
        names = [key.to_string() for key in keys]
        grant = WriteGrant()
        try:
            ways = self._ways(len(names))
            results = await self._batch("get", [lambda d, n=n, o=o: self._load_into(n, o, d, grant, ways)
                                                for n, o in zip(names, outs)])
        finally:
            grant.revoke()
        self._learn(keys, [r is True for r in results], [r is _ABSENT for r in results])
        await self._drop_corrupt_objects(keys, results)
        return [r is True for r in results]

    async def _drop_corrupt_objects(self, keys: Sequence[CacheKey], results: Sequence[Any]) -> None:
        """Count, log and delete the objects of a batch that failed to decode (they are misses)."""
        corrupt = [(key, result) for key, result in zip(keys, results) if isinstance(result, ChunkFormatError)]
        if not corrupt:
            return
        names = [key.to_string() for key, _ in corrupt]
        self.count_corrupt([(self._object_key(name), problem) for name, (_, problem) in zip(names, corrupt)])
        self._known.record([key for key, _ in corrupt], False)
        try:
            await self._batch("delete", [lambda d, n=n: self._objects.remove(n, d) for n in names])
        except TierUnavailableError as exc:  # the reads stand; the next reader deletes it
            logger.warning("tier %r: could not delete corrupt object(s): %s", self.name, exc)

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return (await self.batched_get([key]))[0]

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        check_batch(keys, chunks)
        latest = {key.to_string(): (key, chunk) for key, chunk in zip(keys, chunks)}  # later duplicates win
        for _, chunk in latest.values():
            self._check_fits(chunk.numel() * chunk.element_size())
        grant = WriteGrant()  # the chunks are the caller's until this returns
        calls = [lambda d, n=n, k=k, c=c: self._encode_and_store(n, c, k.fmt, d, grant)
                 for n, (k, c) in latest.items()]
        try:
            results = await self._batch("put", calls)
        finally:
            grant.revoke()
        stored = [latest[name][0] for name, result in zip(latest, results) if not isinstance(result, BaseException)]
        self._known.record(stored, True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise TierUnavailableError(f"tier {self.name!r}: {len(failed)} of {len(calls)} put(s) to "
                                       f"{self._where()} failed: {self._redact(failed[0])}") from failed[0]
        return len(keys)

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Known chunks are answered from memory; the others cost one HEAD each, in parallel."""
        self._ensure_open()
        known = self._known.known(keys)
        unknown = [key for key, answer in zip(keys, known) if answer is None]
        if unknown:
            names = [key.to_string() for key in unknown]
            results = await self._batch("contains", [lambda d, n=n: self._objects.head(n, d) for n in names])
            self._learn(unknown, [r is True for r in results], [r is False for r in results])
            asked = iter(r is True for r in results)
            return [next(asked) if answer is None else answer for answer in known]
        return [bool(answer) for answer in known]

    def batched_contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        """From what this process knows (stored, read or asked recently), with no request; None
        when some chunk is not known (the engine then asks with ``batched_contains``)."""
        return None if self._closed else self._known.answer(keys)

    async def contains(self, key: CacheKey) -> bool:
        return (await self.batched_contains([key]))[0]

    async def delete(self, key: CacheKey) -> bool:
        self._known.record([key], False)
        return await self.delete_bytes(key.to_string())

    async def drop_scope(self, model_name: str, scope: str) -> int:
        """Every object of ``scope`` under the tier's prefix leaves the bucket, whoever wrote it
        (one listing of the prefix: an operator's action, not a per-request one)."""
        self._ensure_open()
        self.health.check()
        loop = asyncio.get_running_loop()
        try:
            names = await loop.run_in_executor(
                self._threads, self._objects.remove_matching,
                lambda name: in_scope(name, model_name, scope), self.timeout_s)
        except Exception as exc:
            raise TierUnavailableError(f"tier {self.name!r}: dropping a scope failed: {self._redact(exc)}") from exc
        self._known.record([CacheKey.from_string(name) for name in names], False)
        self._count("scope_deletes", len(names))
        return len(names)

    # -- BlobBackend byte API (single objects, same plumbing) -------------------------------------
    async def _one(self, op: str, call: Callable[[float], T]) -> T:
        result = (await self._batch(op, [call]))[0]
        if isinstance(result, ChunkFormatError):  # the object is not what tierkv wrote (not a fault)
            raise result
        if isinstance(result, BaseException):
            raise TierUnavailableError(f"tier {self.name!r}: {op} failed: {self._redact(result)}") from result
        return result  # type: ignore[no-any-return]

    async def get_bytes(self, key: str) -> bytes | None:
        data = await self._one("get", lambda d: self._fetch(key, d))
        return None if data is None else bytes(data)

    async def put_bytes(self, key: str, data: bytes | bytearray) -> None:
        payload = bytes(data)  # on the caller's side: a request still running at a timeout never reads their buffer
        await self._one("put", lambda d: self._objects.store(key, payload, d))

    async def delete_bytes(self, key: str) -> bool:
        return bool(await self._one("delete", lambda d: self._objects.remove(key, d)))

    async def exists(self, key: str) -> bool:
        return bool(await self._one("contains", lambda d: self._objects.head(key, d)))

    # -- lifecycle and reporting ------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.health.close()
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        for pool in (self._threads, self._read_parts, self._write_parts):
            pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "bucket": self.bucket, "prefix": self.prefix,
                "endpoint_url": self.endpoint_url, "store_health": self.health.state(),
                "lookups_answered_from_memory": self._known.answered, "lookup_cache_entries": len(self._known)}

    def __repr__(self) -> str:
        return f"S3Backend(name={self.name!r}, bucket={self.bucket!r}, prefix={self.prefix!r}, " \
               f"endpoint_url={self.endpoint_url!r})"
