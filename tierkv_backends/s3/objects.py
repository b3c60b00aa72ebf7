"""Blocking requests of the ``s3`` tier for one bucket (run in its worker threads).

``S3Objects`` is everything the tier asks of the store, request by request: retries of
transient faults under a deadline, whole or ranged GETs of one object (ranges in parallel),
multipart puts, HEAD and DELETE, and the start-up check of the bucket. It knows nothing of
batches, chunks in caller memory or health: ``tierkv_backends.s3.S3Backend`` does.

Small batches (with ``min_range`` set): a batch of fewer objects than ``max_concurrency``
leaves request slots idle, so each object is fetched as ``ways`` ranges in parallel (no
smaller than ``min_range``), sized from the last object seen (chunks of one model are all
alike); the first range also tells the real size, and anything the guess missed is fetched
after it. Off by default: on a loopback store on a busy 2-core machine one 8 MiB GET took
28 ms and four 2 MiB ranges at once 54 ms (the requests share the CPU, not a link); it pays
where one connection is slower than several (AWS S3 serves ~100 MB/s per connection).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import botocore.exceptions

from tierkv.errors import ConfigError
from tierkv_backends.s3.requests import (
    NO_BUCKET_CODES,
    TRANSIENT_ERRORS,
    IncompleteBodyError,
    checked_body,
    error_code,
    http_status,
    is_missing,
    is_transient,
)

logger = logging.getLogger("tierkv_backends.s3_objects")
T = TypeVar("T")


class S3Objects:
    """The requests of one tier to one bucket; every method blocks (worker threads only)."""

    def __init__(self, tier: str, client: Any, bucket: str, prefix: str, endpoint_url: str | None, region: str, *,
                 part_size: int, multipart_threshold: int, min_range: int | None, retries: int, backoff_base_s: float,
                 backoff_max_s: float, read_parts: concurrent.futures.Executor,
                 write_parts: concurrent.futures.Executor, count: Callable[[str, int], None],
                 redact: Callable[[BaseException | str], str]) -> None:
        self.tier, self.client, self.bucket, self.prefix = tier, client, bucket, prefix
        self.endpoint_url, self.region = endpoint_url, region
        self.part_size, self.multipart_threshold, self.min_range = part_size, multipart_threshold, min_range
        self.retries, self.backoff_base_s, self.backoff_max_s = retries, backoff_base_s, backoff_max_s
        self.read_parts, self.write_parts = read_parts, write_parts  # apart: a stalled read never holds a write
        self.count = count
        self.redact = redact
        self.size_hint = 0  # the size of the last object fetched whole: how to split the next one

    def where(self) -> str:
        return f"bucket {self.bucket!r} at {self.endpoint_url or 'AWS S3'}"

    def object_key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    # -- start-up ------------------------------------------------------------------------------------
    def check_bucket(self, create: bool) -> None:
        """Fail at start-up, clearly, on a wrong endpoint, wrong credentials or a missing bucket."""
        tier = self.tier
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return
        except botocore.exceptions.NoCredentialsError as exc:
            raise ConfigError(f"tier {tier!r}: no S3 credentials: set access_key_id and secret_access_key, "
                              "or configure the boto3 credential chain (AWS_* env, profile, role)") from exc
        except TRANSIENT_ERRORS as exc:
            raise ConfigError(f"tier {tier!r}: cannot reach the S3 endpoint {self.endpoint_url or '(AWS)'}: "
                              f"{self.redact(exc)} (check endpoint_url; check_on_start: false starts anyway)"
                              ) from exc
        except botocore.exceptions.ClientError as exc:
            status = http_status(exc)
            if status in (401, 403) or error_code(exc) in {"InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                             "AccessDenied", "Forbidden"}:
                raise ConfigError(f"tier {tier!r}: access denied to {self.where()}: wrong access_key_id/"
                                  f"secret_access_key, or no permission on the bucket (HTTP {status})") from exc
            if not (status == 404 or error_code(exc) in NO_BUCKET_CODES):
                raise ConfigError(f"tier {tier!r}: checking {self.where()} failed: {self.redact(exc)}") from exc
        if not create:
            raise ConfigError(f"tier {tier!r}: {self.where()} does not exist; create it, or set create_bucket: true")
        try:
            if self.region == "us-east-1" or self.endpoint_url:
                self.client.create_bucket(Bucket=self.bucket)
            else:
                self.client.create_bucket(Bucket=self.bucket,
                                          CreateBucketConfiguration={"LocationConstraint": self.region})
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                raise ConfigError(f"tier {tier!r}: cannot create {self.where()}: {self.redact(exc)}") from exc
        logger.info("tier %r: created %s", tier, self.where())

    # -- one request, retried -------------------------------------------------------------------------
    def request(self, call: Callable[[], T], deadline: float) -> T:
        """Run one S3 request, retrying throttling and transient faults until ``deadline``."""
        attempt = 0
        while True:
            if time.monotonic() >= deadline:  # waited for a slot past it, or retried up to it
                raise TimeoutError("the operation's deadline passed before this request was sent")
            self.count("requests", 1)
            try:
                return call()
            except Exception as exc:
                if not is_transient(exc) or attempt >= self.retries:
                    raise
                delay = min(self.backoff_max_s, self.backoff_base_s * (2 ** attempt)) * random.uniform(0.5, 1.0)
                if time.monotonic() + delay >= deadline:
                    raise
                self.count("retries", 1)
                time.sleep(delay)
                attempt += 1

    def get_range(self, key: str, start: int, end: int, deadline: float) -> tuple[bytes, int]:
        """Bytes [start, end] of an object and the object's total size.

        A body that did not arrive whole (cut, short, reset mid-body) is a transient fault
        (see ``tierkv_backends.s3.requests``): retried here, never taken for corruption. A
        whole first range of an object whose size (Content-Range) differs from its chunk
        header's raises ``tierkv_backends.s3.requests.ObjectSizeError`` at once: the
        object is wrong, and asking again cannot help.
        """
        def call() -> tuple[bytes, int]:
            response = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}")
            body = response["Body"].read()
            try:
                return body, checked_body(body, response, start)
            except IncompleteBodyError:
                self.count("incomplete_bodies", 1)
                raise
        return self.request(call, deadline)

    def _speculative_range(self, key: str, start: int, end: int, deadline: float) -> bytes | None:
        """A range guessed from the last object's size: None when this object ends before it."""
        try:
            return self.get_range(key, start, end, deadline)[0]
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) == "InvalidRange" or is_missing(exc):
                return None
            raise

    # -- objects --------------------------------------------------------------------------------------
    def fetch(self, name: str, deadline: float, ways: int = 1) -> bytes | bytearray | None:
        """An object's bytes (None when absent): one ranged GET, then the rest in parallel ranges.

        With ``ways`` > 1 (request slots the batch leaves idle) and an object the size of the
        last one large enough to split, its ranges are all asked at once.
        """
        key = self.object_key(name)
        span, guessed = self.part_size, []
        hint = self.size_hint
        ways = min(ways, hint // self.min_range) if self.min_range else 1  # no range smaller than min_range
        if ways > 1:
            span = min(self.part_size, -(-hint // ways))
            guessed = [(s, min(s + span, hint) - 1) for s in range(span, hint, span)]
        futures = [self.read_parts.submit(self._speculative_range, key, s, e, deadline) for s, e in guessed]
        try:
            try:
                first, total = self.get_range(key, 0, span - 1, deadline)
            except botocore.exceptions.ClientError as exc:
                if is_missing(exc):
                    return None
                if error_code(exc) == "InvalidRange":  # a zero-byte object: garbage, not a chunk
                    return b""
                raise
            if total <= len(first):
                self.count("bytes_read", len(first))
                self.size_hint = total
                return first
            self.count("ranged_gets", 1)
            data = bytearray(total)
            data[: len(first)] = first
            covered = len(first)
            for (start, _), future in zip(guessed, futures):
                if start != covered or start >= total:
                    break
                body = future.result()
                if body is None:
                    break
                data[start : start + len(body)] = body
                covered = start + len(body)
            if covered < total:
                self._fetch_rest(key, data, covered, total, deadline)
            self.count("bytes_read", total)
            self.size_hint = total
            return data
        finally:  # a guess still running returns bytes of its own: nothing of the caller's to wait for
            for future in futures:
                future.cancel()

    def _fetch_rest(self, key: str, data: bytearray, start: int, total: int, deadline: float) -> None:
        starts = range(start, total, self.part_size)
        parts = [self.read_parts.submit(self.get_range, key, s, min(s + self.part_size, total) - 1, deadline)
                 for s in starts]
        try:
            for begin, part in zip(starts, parts):
                body, _ = part.result()
                data[begin : begin + len(body)] = body
        finally:
            for part in parts:
                part.cancel()

    def store(self, name: str, data: bytes | bytearray, deadline: float) -> None:
        key = self.object_key(name)
        if len(data) < self.multipart_threshold:
            self.request(lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=data), deadline)
        else:
            self._store_multipart(key, data, deadline)
        self.count("bytes_written", len(data))

    def _store_multipart(self, key: str, data: bytes | bytearray, deadline: float) -> None:
        upload = self.request(lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=key), deadline)
        upload_id = upload["UploadId"]
        view = memoryview(data)

        def send(number: int, start: int) -> dict[str, Any]:
            body = bytes(view[start : start + self.part_size])
            reply = self.request(lambda: self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body), deadline)
            return {"PartNumber": number, "ETag": reply["ETag"]}

        try:
            futures = [self.write_parts.submit(send, i + 1, start)
                       for i, start in enumerate(range(0, len(data), self.part_size))]
            parts = [f.result() for f in futures]
            self.request(lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}), deadline)
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - best effort; the store expires abandoned uploads
                logger.debug("tier %r: could not abort multipart upload of %s", self.tier, key)
            raise
        self.count("multipart_puts", 1)

    def head(self, name: str, deadline: float) -> bool:
        try:
            self.request(lambda: self.client.head_object(Bucket=self.bucket, Key=self.object_key(name)), deadline)
        except botocore.exceptions.ClientError as exc:
            if is_missing(exc):
                return False
            raise
        return True

    def remove_matching(self, match: Callable[[str], bool], request_timeout_s: float) -> list[str]:
        """Delete every object under the prefix whose name (the key string) ``match`` accepts,
        a listed page at a time (1,000 names per request each way); the names deleted. Each
        request has ``request_timeout_s`` of its own: a bucket of millions takes many pages."""
        start = f"{self.prefix}/" if self.prefix else ""
        removed: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": start}
            if token:
                kwargs["ContinuationToken"] = token
            page = self.request(functools.partial(self.client.list_objects_v2, **kwargs),
                                time.monotonic() + request_timeout_s)
            names = [item["Key"][len(start):] for item in page.get("Contents", ())]
            doomed = [name for name in names if match(name)]
            if doomed:
                batch = {"Objects": [{"Key": self.object_key(name)} for name in doomed], "Quiet": True}
                answer = self.request(functools.partial(self.client.delete_objects, Bucket=self.bucket, Delete=batch),
                                      time.monotonic() + request_timeout_s)
                failed = {error.get("Key") for error in answer.get("Errors", ())}
                removed.extend(name for name in doomed if self.object_key(name) not in failed)
            if not page.get("IsTruncated"):
                return removed
            token = page.get("NextContinuationToken")

    def remove(self, name: str, deadline: float) -> bool:
        existed = self.head(name, deadline)
        if existed:
            self.request(lambda: self.client.delete_object(Bucket=self.bucket, Key=self.object_key(name)), deadline)
        return existed
