"""``s3`` tier: one object per chunk in an S3 bucket (AWS S3, MinIO, SeaweedFS, Ceph RGW).

Every serving replica can point at the same bucket: a prefix computed once anywhere is
reused everywhere. Object names are ``<prefix>/<CacheKey.to_string()>`` — the key string
carries the KV format, model, world size, worker id and chunk hash, percent-escaped — so
caches of different models or tensor-parallel shards never mix in a shared bucket.

How it talks to the store:

- boto3 clients are thread-safe; every request runs in a bounded thread pool of
  ``max_concurrency`` workers (never on the event loop), and a batch is that many requests
  in flight at once. Encoding, checksum and decoding of a chunk also happen in the worker.
- Large chunks: a put of ``multipart_threshold`` bytes or more is a multipart upload of
  ``part_size`` parts sent in parallel; a get asks for the first ``part_size`` bytes and,
  when the object is larger, fetches the remaining ranges in parallel. Below those sizes
  (the default covers a 32-layer, 256-token Llama-3-8B chunk) it is one request each way.
- Retries: throttling (SlowDown, 429, 503) and transient faults (connection refused/reset,
  timeouts, 5xx, a body cut, short or reset mid-transfer) are retried ``retries`` times with
  capped, jittered exponential backoff, never past the operation's ``timeout_s`` deadline.
  Anything else fails at once. A transport fault is never taken for corruption: only a whole
  body (as long as the reply and the chunk header say) that fails its checksum is deleted
  (:mod:`tierkv_backends.s3_requests`).
- Ownership: a read writes into the caller's destinations, and a put reads the caller's
  chunk, only while the call still owns them (:class:`tierkv.ownership.WriteGrant`): a
  request abandoned at ``timeout_s`` or by a cancellation never touches them afterwards.
- Health: a batch whose requests all fail counts against a :class:`~tierkv.health.CircuitBreaker`;
  after ``failure_threshold`` in a row the tier fails fast (no network) and a HEAD on the
  bucket probes it every ``probe_interval_s`` until it answers. Gets return what arrived
  within ``timeout_s`` (the rest are misses); puts that failed are counted and reported as
  :class:`~tierkv.errors.TierUnavailableError`, which the engine counts as a dropped fill.
- Credentials: from the options or the standard boto3 chain (env, profile, instance role).
  They are never put in reprs, stats, log lines or exception messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from tierkv import serde
from tierkv.backend import BlobBackend, check_batch, check_destinations
from tierkv.errors import ChunkFormatError, ConfigError, TierUnavailableError
from tierkv.health import CircuitBreaker
from tierkv.keys import KV_FORMATS, CacheKey
from tierkv.memory import copy_into, direct_target
from tierkv.options import Option
from tierkv.ownership import WriteGrant
from tierkv.planner import SpeedSeed
from tierkv_backends.s3_requests import (
    NO_BUCKET_CODES,
    TRANSIENT_ERRORS,
    IncompleteBodyError,
    bucket_name,
    checked_body,
    error_code,
    http_status,
    is_missing,
    is_transient,
    key_prefix,
)

try:
    import boto3
    import botocore.exceptions
    from botocore.config import Config as BotoConfig
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the s3 tier needs boto3: pip install 'tierkv[s3]'") from _exc

logger = logging.getLogger(__name__)
T = TypeVar("T")

_MiB = 1 << 20
_MIN_PART = 5 * _MiB  # S3's minimum multipart part size (all parts but the last)

__all__ = ["S3Backend", "bucket_name", "is_missing", "is_transient", "key_prefix"]


class S3Backend(BlobBackend):
    """Shared object-store tier; survives restarts and is shared by every replica."""

    speed_seed: ClassVar[SpeedSeed] = SpeedSeed(fixed_s=20e-3, bytes_per_s=150e6)  # a remote object store
    persistent: ClassVar[bool] = True
    bounded: ClassVar[bool] = False
    options: ClassVar[dict[str, Option]] = {
        "bucket": Option(bucket_name, required=True, doc="bucket holding the chunks"),
        "prefix": Option(key_prefix, "tierkv", doc="object-name prefix inside the bucket"),
        "endpoint_url": Option("str", None, doc="S3 endpoint, e.g. http://127.0.0.1:9000 (AWS when unset)"),
        "region": Option("str", None, doc="region name (us-east-1 when unset)"),
        "access_key_id": Option("str", None, secret=True, doc="access key (else the boto3 credential chain)"),
        "secret_access_key": Option("str", None, secret=True, doc="secret key (with access_key_id)"),
        "session_token": Option("str", None, secret=True, doc="session token for temporary credentials"),
        "addressing_style": Option("str", "path", choices=("path", "virtual", "auto"),
                                   doc="path for MinIO/SeaweedFS, virtual for AWS"),
        "max_concurrency": Option("int", 16, minimum=1, doc="requests in flight at once"),
        "connect_timeout_s": Option("float", 2.0, minimum=0.01),
        "read_timeout_s": Option("float", 10.0, minimum=0.01),
        "timeout_s": Option("float", 30.0, minimum=0.01, doc="deadline of one batched operation, retries included"),
        "retries": Option("int", 3, minimum=0, doc="retries of a throttled or transient request"),
        "backoff_base_s": Option("float", 0.05, minimum=0.0),
        "backoff_max_s": Option("float", 1.0, minimum=0.0),
        "multipart_threshold": Option("size", 64 * _MiB, doc="puts this large or larger use multipart upload"),
        "part_size": Option("size", 64 * _MiB, minimum=_MIN_PART, doc="multipart part and ranged-GET size"),
        "create_bucket": Option("bool", False, doc="create the bucket when it does not exist"),
        "check_on_start": Option("bool", True, doc="check endpoint, credentials and bucket when the tier is built"),
        "failure_threshold": Option("int", 3, minimum=1, doc="failed batches in a row that mark the tier unhealthy"),
        "probe_interval_s": Option("float", 2.0, minimum=0.01, doc="how often an unhealthy tier is probed"),
    }

    def __init__(self, name: str, capacity: int | None = None, *, bucket: str, prefix: str = "tierkv",
                 endpoint_url: str | None = None, region: str | None = None, access_key_id: str | None = None,
                 secret_access_key: str | None = None, session_token: str | None = None,
                 addressing_style: str = "path", max_concurrency: int = 16, connect_timeout_s: float = 2.0,
                 read_timeout_s: float = 10.0, timeout_s: float = 30.0, retries: int = 3,
                 backoff_base_s: float = 0.05, backoff_max_s: float = 1.0, multipart_threshold: int = 64 * _MiB,
                 part_size: int = 64 * _MiB, create_bucket: bool = False, check_on_start: bool = True,
                 failure_threshold: int = 3, probe_interval_s: float = 2.0) -> None:
        super().__init__(name, capacity)
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError(f"tier {name!r}: give both access_key_id and secret_access_key, or neither "
                              "(to use the boto3 credential chain)")
        if part_size < _MIN_PART:
            raise ConfigError(f"tier {name!r} part_size: S3 parts must be at least 5MiB, got {part_size}")
        self.bucket = bucket_name(bucket)
        self.prefix = key_prefix(prefix)
        self.endpoint_url = endpoint_url
        self.region = region or "us-east-1"
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.multipart_threshold = max(multipart_threshold, _MIN_PART)
        self.part_size = part_size
        self._secrets = tuple(s for s in (access_key_id, secret_access_key, session_token) if s)
        session = boto3.session.Session(aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key,
                                        aws_session_token=session_token, region_name=self.region)
        config = BotoConfig(
            connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
            retries={"total_max_attempts": 1},  # retried here, with our deadline and counters
            max_pool_connections=2 * max_concurrency, tcp_keepalive=True,
            s3={"addressing_style": addressing_style},
            # chunks carry an XXH3 checksum of their own; skip botocore's per-request CRC32
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
        )
        self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix=f"tierkv-s3-{name}")
        self._part_pool = concurrent.futures.ThreadPoolExecutor(max_concurrency,
                                                                thread_name_prefix=f"tierkv-s3-{name}-part")
        self._count_lock = threading.Lock()
        self.counters.update({"requests": 0, "retries": 0, "get_errors": 0, "put_errors": 0, "timeouts": 0,
                              "bytes_read": 0, "bytes_written": 0, "multipart_puts": 0, "ranged_gets": 0,
                              "incomplete_bodies": 0, "abandoned_copies": 0})
        self.health = CircuitBreaker(name, self._probe, failure_threshold, probe_interval_s)
        if check_on_start:
            self._check_bucket(create_bucket)

    # -- start-up checks ------------------------------------------------------------------------
    def _where(self) -> str:
        return f"bucket {self.bucket!r} at {self.endpoint_url or 'AWS S3'}"

    def _check_bucket(self, create: bool) -> None:
        """Fail at start-up, clearly, on a wrong endpoint, wrong credentials or a missing bucket."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except botocore.exceptions.NoCredentialsError as exc:
            raise ConfigError(f"tier {self.name!r}: no S3 credentials: set access_key_id and secret_access_key, "
                              "or configure the boto3 credential chain (AWS_* env, profile, role)") from exc
        except TRANSIENT_ERRORS as exc:
            raise ConfigError(f"tier {self.name!r}: cannot reach the S3 endpoint {self.endpoint_url or '(AWS)'}: "
                              f"{self._redact(exc)} (check endpoint_url; check_on_start: false starts anyway)"
                              ) from exc
        except botocore.exceptions.ClientError as exc:
            status = http_status(exc)
            if status in (401, 403) or error_code(exc) in {"InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                             "AccessDenied", "Forbidden"}:
                raise ConfigError(f"tier {self.name!r}: access denied to {self._where()}: wrong access_key_id/"
                                  f"secret_access_key, or no permission on the bucket (HTTP {status})") from exc
            if not (status == 404 or error_code(exc) in NO_BUCKET_CODES):
                raise ConfigError(f"tier {self.name!r}: checking {self._where()} failed: {self._redact(exc)}"
                                  ) from exc
        if not create:
            raise ConfigError(f"tier {self.name!r}: {self._where()} does not exist; create it, "
                              "or set create_bucket: true")
        try:
            if self.region == "us-east-1" or self.endpoint_url:
                self._client.create_bucket(Bucket=self.bucket)
            else:
                self._client.create_bucket(Bucket=self.bucket,
                                           CreateBucketConfiguration={"LocationConstraint": self.region})
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                raise ConfigError(f"tier {self.name!r}: cannot create {self._where()}: {self._redact(exc)}") from exc
        logger.info("tier %r: created %s", self.name, self._where())

    def _redact(self, exc: BaseException | str) -> str:
        text = str(exc)
        for secret in self._secrets:
            text = text.replace(secret, "<redacted>")
        return text

    # -- request plumbing (worker threads) ------------------------------------------------------------
    def _count(self, name: str, amount: int = 1) -> None:
        with self._count_lock:
            self.counters[name] += amount

    def _request(self, call: Callable[[], T], deadline: float) -> T:
        """Run one S3 request, retrying throttling and transient faults until ``deadline``."""
        attempt = 0
        while True:
            self._count("requests")
            try:
                return call()
            except Exception as exc:
                if not is_transient(exc) or attempt >= self.retries:
                    raise
                delay = min(self.backoff_max_s, self.backoff_base_s * (2 ** attempt)) * random.uniform(0.5, 1.0)
                if time.monotonic() + delay >= deadline:
                    raise
                self._count("retries")
                time.sleep(delay)
                attempt += 1

    def _object_key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _get_range(self, key: str, start: int, end: int, deadline: float) -> tuple[bytes, int]:
        """Bytes [start, end] of an object and the object's total size.

        A body that did not arrive whole (cut, short, reset mid-body) is a transient fault
        (see :mod:`tierkv_backends.s3_requests`): retried here, never taken for corruption.
        """
        def call() -> tuple[bytes, int]:
            response = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}")
            body = response["Body"].read()
            try:
                return body, checked_body(body, response, start)
            except IncompleteBodyError:
                self._count("incomplete_bodies")
                raise
        return self._request(call, deadline)

    def _fetch(self, name: str, deadline: float) -> bytes | bytearray | None:
        """An object's bytes (None when absent): one ranged GET, then the rest in parallel ranges."""
        key = self._object_key(name)
        try:
            first, total = self._get_range(key, 0, self.part_size - 1, deadline)
        except botocore.exceptions.ClientError as exc:
            if is_missing(exc):
                return None
            if error_code(exc) == "InvalidRange":  # a zero-byte object: garbage, not a chunk
                return b""
            raise
        if total <= len(first):
            self._count("bytes_read", len(first))
            return first
        self._count("ranged_gets")
        data = bytearray(total)
        data[: len(first)] = first
        starts = range(len(first), total, self.part_size)
        parts = [self._part_pool.submit(self._get_range, key, s, min(s + self.part_size, total) - 1, deadline)
                 for s in starts]
        try:
            for start, part in zip(starts, parts):
                body, _ = part.result()
                data[start : start + len(body)] = body
        finally:
            for part in parts:
                part.cancel()
        self._count("bytes_read", total)
        return data

    def _load(self, name: str, deadline: float) -> torch.Tensor | None | ChunkFormatError:
        data = self._fetch(name, deadline)
        if data is None:
            return None
        try:
            return serde.decode(data)
        except ChunkFormatError as exc:
            return exc

    def _store(self, name: str, data: bytes | bytearray, deadline: float) -> None:
        key = self._object_key(name)
        if len(data) < self.multipart_threshold:
            self._request(lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=data), deadline)
        else:
            self._store_multipart(key, data, deadline)
        self._count("bytes_written", len(data))

    def _store_multipart(self, key: str, data: bytes | bytearray, deadline: float) -> None:
        upload = self._request(lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=key), deadline)
        upload_id = upload["UploadId"]
        view = memoryview(data)

        def send(number: int, start: int) -> dict[str, Any]:
            body = bytes(view[start : start + self.part_size])
            reply = self._request(lambda: self._client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body), deadline)
            return {"PartNumber": number, "ETag": reply["ETag"]}

        try:
            futures = [self._part_pool.submit(send, i + 1, start)
                       for i, start in enumerate(range(0, len(data), self.part_size))]
            parts = [f.result() for f in futures]
            self._request(lambda: self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}), deadline)
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - best effort; the store expires abandoned uploads
                logger.debug("tier %r: could not abort multipart upload of %s", self.name, key)
            raise
        self._count("multipart_puts")

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
        self._store(name, encoded[0], deadline)

    def _load_into(self, name: str, out: torch.Tensor, deadline: float, grant: WriteGrant
                   ) -> bool | ChunkFormatError:
        """Fetch an object, verify it in the response buffer, copy it once into ``out``.

        ``out`` is the caller's: the copy runs only while ``grant`` allows it, so a request
        the caller stopped waiting for (timeout, cancellation) never writes into ``out``
        after the call returned. Verification happens before, outside the grant.
        """
        if grant.revoked:
            return False
        data = self._fetch(name, deadline)
        if data is None:
            return False
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

    def _head(self, name: str, deadline: float) -> bool:
        try:
            self._request(lambda: self._client.head_object(Bucket=self.bucket, Key=self._object_key(name)), deadline)
        except botocore.exceptions.ClientError as exc:
            if is_missing(exc):
                return False
            raise
        return True

    def _remove(self, name: str, deadline: float) -> bool:
        existed = self._head(name, deadline)
        if existed:
            self._request(lambda: self._client.delete_object(Bucket=self.bucket, Key=self._object_key(name)),
                          deadline)
        return existed

    # -- batching, deadline and health (event loop) ------------------------------------------------
    async def _batch(self, op: str, calls: Sequence[Callable[[float], Any]]) -> list[Any]:
        """Run ``calls`` in the pool under one deadline; each result is a value or the exception.

        Requests still running at the deadline are abandoned (a miss or a dropped put) and
        counted as timeouts. Raises TierUnavailableError when the tier is unhealthy (at once)
        or when every request failed; otherwise records a success with the breaker.
        """
        self._ensure_open()
        self.health.check()
        if not calls:
            return []
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout_s
        # each request carries the caller's context (copy accounting follows it into the pool)
        futures = [loop.run_in_executor(self._pool, contextvars.copy_context().run, call, deadline) for call in calls]
        try:
            done, pending = await asyncio.wait(futures, timeout=self.timeout_s)
        except asyncio.CancelledError:
            for future in futures:  # requests not started yet never start; running ones lose their grant
                future.cancel()
            raise
        for future in pending:
            future.cancel()
        results: list[Any] = []
        failures: list[BaseException] = []
        for future in futures:
            if future in pending:
                outcome: Any = TimeoutError(f"no answer within timeout_s={self.timeout_s:g}s")
                self._count("timeouts")
            else:
                outcome = future.exception() or future.result()
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
        results = await self._batch("get", [lambda d, n=n: self._load(n, d) for n in names])
        await self._drop_corrupt_objects([n for n, r in zip(names, results) if isinstance(r, ChunkFormatError)],
                                         [r for r in results if isinstance(r, ChunkFormatError)])
        return [r if isinstance(r, torch.Tensor) else None for r in results]

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Every object fetched in parallel, verified, and copied once into its destination.

        The destinations are the caller's until this returns (or raises): a request still
        running at ``timeout_s`` or at a cancellation loses its grant to write before this
        call gives them back (:class:`tierkv.ownership.WriteGrant`).
        """
        check_destinations(keys, outs)
        names = [key.to_string() for key in keys]
        grant = WriteGrant()
        try:
            results = await self._batch("get", [lambda d, n=n, o=o: self._load_into(n, o, d, grant)
                                                for n, o in zip(names, outs)])
        finally:
            grant.revoke()
        await self._drop_corrupt_objects([n for n, r in zip(names, results) if isinstance(r, ChunkFormatError)],
                                         [r for r in results if isinstance(r, ChunkFormatError)])
        return [r is True for r in results]

    async def _drop_corrupt_objects(self, names: list[str], problems: list[ChunkFormatError]) -> None:
        """Count, log and delete objects that failed to decode (they are misses)."""
        if not names:
            return
        for name, problem in zip(names, problems):
            logger.warning("tier %r: dropping corrupt object %s: %s", self.name, self._object_key(name), problem)
        self.counters["corrupt_chunks"] += len(names)
        try:
            await self._batch("delete", [lambda d, n=n: self._remove(n, d) for n in names])
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
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise TierUnavailableError(f"tier {self.name!r}: {len(failed)} of {len(calls)} put(s) to "
                                       f"{self._where()} failed: {self._redact(failed[0])}") from failed[0]
        return len(keys)

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        names = [key.to_string() for key in keys]
        results = await self._batch("contains", [lambda d, n=n: self._head(n, d) for n in names])
        return [r is True for r in results]

    async def contains(self, key: CacheKey) -> bool:
        return (await self.batched_contains([key]))[0]

    async def delete(self, key: CacheKey) -> bool:
        return await self.delete_bytes(key.to_string())

    # -- BlobBackend byte API (single objects, same plumbing) -------------------------------------
    async def _one(self, op: str, call: Callable[[float], T]) -> T:
        result = (await self._batch(op, [call]))[0]
        if isinstance(result, BaseException):
            raise TierUnavailableError(f"tier {self.name!r}: {op} failed: {self._redact(result)}") from result
        return result  # type: ignore[no-any-return]

    async def get_bytes(self, key: str) -> bytes | None:
        data = await self._one("get", lambda d: self._fetch(key, d))
        return None if data is None else bytes(data)

    async def put_bytes(self, key: str, data: bytes | bytearray) -> None:
        await self._one("put", lambda d: self._store(key, bytes(data), d))

    async def delete_bytes(self, key: str) -> bool:
        return bool(await self._one("delete", lambda d: self._remove(key, d)))

    async def exists(self, key: str) -> bool:
        return bool(await self._one("contains", lambda d: self._head(key, d)))

    # -- lifecycle and reporting ------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.health.close()
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._part_pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "bucket": self.bucket, "prefix": self.prefix,
                "endpoint_url": self.endpoint_url, "store_health": self.health.state()}

    def __repr__(self) -> str:
        return f"S3Backend(name={self.name!r}, bucket={self.bucket!r}, prefix={self.prefix!r}, " \
               f"endpoint_url={self.endpoint_url!r})"
