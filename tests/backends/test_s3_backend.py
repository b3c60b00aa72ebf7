"""The s3 tier against a real S3 server on 127.0.0.1 (SeaweedFS or MinIO): conformance,
start-up errors, credential hygiene, corrupt objects, a stalled endpoint, and an engine
that keeps serving while the object store is killed and picks it up again after a restart."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from s3_fixtures import s3_tier_options
from waiting import wait_until

from tierkv import CacheKey, Engine, load_config
from tierkv.backend import StorageBackend
from tierkv.engine.blocking import build_tiers
from tierkv.errors import ConfigError, TierUnavailableError
from tierkv.testing import BackendTests, make_chunk, make_key, same_bytes
from tierkv.testing.s3server import S3Server, free_ports
from tierkv_backends.s3 import S3Backend

CHUNK = 16


def make_s3(server: S3Server, bucket: str, prefix: str | None = None, capacity: int | None = None,
            **extra: Any) -> S3Backend:
    options = S3Backend.validate_options(s3_tier_options(server, bucket, prefix or uuid.uuid4().hex, **extra),
                                         "tiers[0]")
    return S3Backend(name="shared", capacity=capacity, **options)


class TestS3Conformance(BackendTests):
    """The shared backend contract, against the live server."""

    @pytest.fixture(autouse=True)
    def _live(self, s3_server: S3Server, s3_bucket: str) -> None:
        self.server, self.bucket = s3_server, s3_bucket

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> S3Backend:
        # the prefix follows tmp_path, so reopening for the same test sees the same objects. The
        # contract is about what is stored, not how fast: deadlines far above a busy machine's
        # queueing (24 concurrent callers behind max_concurrency slots missed 3 s beside vLLM)
        return make_s3(self.server, self.bucket, f"conformance/{tmp_path.name}", capacity,
                       timeout_s=60.0, read_timeout_s=30.0)

    def corrupt_stored(self, backend: StorageBackend, key: CacheKey) -> None:
        assert isinstance(backend, S3Backend)
        raw = self.server.boto3_client()
        name = backend._object_key(key.to_string())
        data = raw.get_object(Bucket=self.bucket, Key=name)["Body"].read()
        raw.put_object(Bucket=self.bucket, Key=name, Body=data[:-1] + bytes([data[-1] ^ 0xFF]))


# -- configuration mistakes fail at start-up, clearly ------------------------------------------
def test_unknown_option_and_bad_bucket_name_name_the_yaml_path() -> None:
    with pytest.raises(ConfigError, match=r"tiers\[1\]: unknown key 'buckt' \(did you mean 'bucket'\?\)"):
        S3Backend.validate_options({"buckt": "x"}, "tiers[1]")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.bucket: expected an S3 bucket name"):
        S3Backend.validate_options({"bucket": "Not_A_Bucket"}, "tiers[1]")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.bucket: required option is missing"):
        S3Backend.validate_options({}, "tiers[1]")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.max_concurrency: must be >= 1"):
        S3Backend.validate_options({"bucket": "abc", "max_concurrency": 0}, "tiers[1]")
    with pytest.raises(ConfigError, match=r"part_size: must be >= "):
        S3Backend.validate_options({"bucket": "abc", "part_size": "1MiB"}, "tiers[1]")


def test_half_given_credentials_are_rejected(s3_server: S3Server, s3_bucket: str) -> None:
    with pytest.raises(ConfigError, match="both access_key_id and secret_access_key"):
        S3Backend(name="shared", bucket=s3_bucket, endpoint_url=s3_server.endpoint_url, access_key_id="only-me")


def test_wrong_endpoint_is_a_clear_start_up_error(s3_server: S3Server, s3_bucket: str) -> None:
    (dead_port,) = free_ports(1)
    with pytest.raises(ConfigError, match=rf"tier 'shared': cannot reach the S3 endpoint http://127.0.0.1:{dead_port}"):
        make_s3(s3_server, s3_bucket, endpoint_url=f"http://127.0.0.1:{dead_port}")


def test_missing_bucket_is_an_error_unless_create_bucket(s3_server: S3Server) -> None:
    bucket = f"tierkv-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigError, match=rf"bucket '{bucket}' at http://127.0.0.1:\d+ does not exist; .*"
                                          "create_bucket: true"):
        make_s3(s3_server, bucket)

    async def roundtrip() -> None:
        backend = make_s3(s3_server, bucket, create_bucket=True)
        try:
            await backend.put(make_key(1), make_chunk(1))
            assert same_bytes(await backend.get(make_key(1)), make_chunk(1))
        finally:
            await backend.close()
    asyncio.run(roundtrip())
    s3_server.boto3_client().head_bucket(Bucket=bucket)  # really created on the server


@pytest.fixture(scope="module")
def strict_server() -> Iterator[S3Server]:
    """A second server that enforces its credentials (the session one accepts any)."""
    with S3Server(credentials=("TIERKVSTRICTKEY", "strict-secret-value-123"), allow_external=False) as server:
        yield server


def test_wrong_credentials_fail_at_start_up_without_leaking_them(strict_server: S3Server,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tierkv")
    strict_server.boto3_client().create_bucket(Bucket="strict-bucket")
    wrong_secret = "wrong-secret-must-not-leak-42"
    raw = {"bucket": "strict-bucket", "endpoint_url": strict_server.endpoint_url,
           "access_key_id": "TIERKVSTRICTKEY", "secret_access_key": wrong_secret}
    with pytest.raises(ConfigError, match=r"access denied to bucket 'strict-bucket'.*wrong access_key_id") as info:
        S3Backend(name="shared", **S3Backend.validate_options(raw, "tiers[0]"))
    assert wrong_secret not in str(info.value)
    assert wrong_secret not in caplog.text
    # a bad value of a secret option is not echoed back either
    with pytest.raises(ConfigError) as bad:
        S3Backend.validate_options({**raw, "secret_access_key": 12345678}, "tiers[0]")
    assert "12345678" not in str(bad.value) and "<redacted>" in str(bad.value)


def test_right_credentials_never_appear_in_repr_stats_errors_or_logs(strict_server: S3Server,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = strict_server.secret_access_key
    config = {"model": "creds", "chunk_size": CHUNK, "tiers": [{
        "name": "shared", "backend": "s3", "bucket": "strict-creds", "create_bucket": True,
        **s3_tier_options(strict_server, "strict-creds", "creds")}]}

    async def body() -> None:
        (backend,) = build_tiers(load_config(config))
        try:
            await backend.put(make_key(1), make_chunk(1))
            assert same_bytes(await backend.get(make_key(1)), make_chunk(1))
            strict_server.stop()  # now every request fails: errors and log lines are produced
            for _ in range(3):
                with pytest.raises(TierUnavailableError) as info:
                    await backend.batched_get([make_key(1)])
                assert secret not in str(info.value)
            with pytest.raises(TierUnavailableError, match="unhealthy"):
                await backend.put(make_key(2), make_chunk(2))
            shown = f"{backend!r} {backend.stats()}"
            assert "strict-creds" in shown  # the bucket is shown ...
            assert secret not in shown and strict_server.access_key_id not in shown  # ... the credentials never
        finally:
            await backend.close()
            strict_server.start()
    asyncio.run(body())
    assert "marked unhealthy" in caplog.text
    assert secret not in caplog.text


# -- objects written by someone else ------------------------------------------------------------
def test_credentials_given_as_env_references_work_and_are_not_inline(strict_server: S3Server,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The benchmarks' S3 configs (``client_options(inline=False)``): credentials named as
    ``{env: NAME}``, read from the environment; the config holds no secret and the
    inline-credential warning is not given."""
    from tierkv.testing.s3server import CREDENTIAL_ENV

    for name in CREDENTIAL_ENV:
        monkeypatch.delenv(name, raising=False)  # client_options sets them: this undoes it after the test
    options = strict_server.client_options(inline=False)
    assert options["access_key_id"] == {"env": CREDENTIAL_ENV[0]}
    assert options["secret_access_key"] == {"env": CREDENTIAL_ENV[1]}
    assert strict_server.secret_access_key not in repr(options)
    caplog.set_level(logging.WARNING, logger="tierkv")
    config = {"model": "env-creds", "chunk_size": CHUNK, "tiers": [{
        "name": "shared", "backend": "s3", "bucket": "env-creds", "create_bucket": True, **options}]}
    with Engine(config) as engine:
        tokens = torch.arange(CHUNK)
        kv = torch.randn(2, 2, CHUNK, 2, 8, dtype=torch.bfloat16)
        engine.store(tokens, kv)
        assert engine.lookup(tokens) == CHUNK, "the strict server took the credentials from the environment"
    assert "credential is written into a config given inline" not in caplog.text


def test_garbage_object_from_another_writer_is_a_miss_deleted_and_counted(s3_server: S3Server, s3_bucket: str) -> None:
    async def body() -> None:
        backend = make_s3(s3_server, s3_bucket, "garbage")
        try:
            await backend.batched_put([make_key(1), make_key(2)], [make_chunk(1), make_chunk(2)])
            raw = s3_server.boto3_client()
            name = f"garbage/{make_key(1).to_string()}"
            good = raw.get_object(Bucket=s3_bucket, Key=name)["Body"].read()
            torn = good[:-1] + bytes([good[-1] ^ 0xFF])  # a valid header over one flipped payload byte
            raw.put_object(Bucket=s3_bucket, Key=name, Body=torn)
            got = await backend.batched_get([make_key(1), make_key(2)])
            assert got[0] is None, "a chunk whose checksum fails must be a miss, never a wrong tensor"
            assert same_bytes(got[1], make_chunk(2))
            assert backend.stats()["corrupt_chunks"] == 1
            assert not await backend.contains(make_key(1)), "the corrupt object should have been deleted"
            raw.put_object(Bucket=s3_bucket, Key=name, Body=b"not a tierkv chunk at all")
            assert await backend.get(make_key(1)) is None
            raw.put_object(Bucket=s3_bucket, Key=name, Body=b"")
            assert await backend.get(make_key(1)) is None
            assert backend.stats()["corrupt_chunks"] == 3
        finally:
            await backend.close()
    asyncio.run(body())


def test_keys_carry_model_world_size_and_worker_under_the_prefix(s3_server: S3Server, s3_bucket: str) -> None:
    from tierkv.chunks.keys import CacheKey

    async def body() -> None:
        backend = make_s3(s3_server, s3_bucket, "team/kv/")
        try:
            key = CacheKey("vllm", "org/llama 3@8b", 4, 3, "ab" * 16)
            await backend.put(key, make_chunk(9))
            listed = s3_server.boto3_client().list_objects_v2(Bucket=s3_bucket, Prefix="team/kv/")
            assert [o["Key"] for o in listed["Contents"]] == [f"team/kv/vllm@org%2Fllama%203%408b@4@3@{'ab' * 16}"]
            assert same_bytes(await backend.get(key), make_chunk(9))
            other_worker = CacheKey("vllm", "org/llama 3@8b", 4, 2, "ab" * 16)
            assert await backend.get(other_worker) is None
        finally:
            await backend.close()
    asyncio.run(body())


def test_large_chunks_use_multipart_upload_and_ranged_gets(s3_server: S3Server, s3_bucket: str) -> None:
    async def body() -> None:
        backend = make_s3(s3_server, s3_bucket, "multipart", multipart_threshold="5MiB", part_size="5MiB")
        try:
            big = make_chunk(3, shape=(4, 2, 1024, 8, 128), dtype=torch.float16)  # 16 MiB: 4 parts
            await backend.put(make_key(1), big)
            assert same_bytes(await backend.get(make_key(1)), big)
            stats = backend.stats()
            assert stats["multipart_puts"] == 1 and stats["ranged_gets"] == 1
        finally:
            await backend.close()
    asyncio.run(body())


def test_a_small_batch_fetches_ranges_of_one_object_in_parallel(s3_server: S3Server, s3_bucket: str) -> None:
    """Batch 1 with 16 request slots: the object is asked as ranges at once (sized from the
    last object seen); objects smaller or larger than that guess still arrive exact."""
    async def body() -> None:
        backend = make_s3(s3_server, s3_bucket, "ranges", min_range="1MiB", max_concurrency=16)
        try:
            chunks = {1: make_chunk(1, shape=(4, 2, 256, 8, 128), dtype=torch.float16),  # 4 MiB
                      2: make_chunk(2, shape=(4, 2, 64, 8, 128), dtype=torch.float16),  # 1 MiB: smaller than the guess
                      3: make_chunk(3, shape=(4, 2, 512, 8, 128), dtype=torch.float16)}  # 8 MiB: larger
            await backend.batched_put([make_key(i) for i in chunks], list(chunks.values()))
            assert same_bytes(await backend.get(make_key(1)), chunks[1])  # one GET: nothing known yet
            before = backend.stats()
            out = torch.empty_like(chunks[1])
            assert await backend.batched_get_into([make_key(1)], [out]) == [True] and same_bytes(out, chunks[1])
            after = backend.stats()
            assert after["ranged_gets"] == before["ranged_gets"] + 1
            assert after["requests"] - before["requests"] == 4, "4 MiB + header as four ranges, all at once"
            for index in (2, 3, 1):
                assert same_bytes(await backend.get(make_key(index)), chunks[index])
            assert backend.stats()["corrupt_chunks"] == 0
        finally:
            await backend.close()
    asyncio.run(body())


def test_options_have_one_source_of_defaults(s3_server: S3Server, s3_bucket: str) -> None:
    from tierkv_backends.s3.options import S3_OPTIONS

    backend = S3Backend(name="defaults", bucket=s3_bucket, **s3_server.client_options())
    try:
        assert backend.timeout_s == S3_OPTIONS["timeout_s"].default
        assert backend.max_concurrency == S3_OPTIONS["max_concurrency"].default
        assert backend._objects.part_size == S3_OPTIONS["part_size"].default
        with pytest.raises(ConfigError, match="max_concurency"):
            S3Backend(name="typo", bucket=s3_bucket, max_concurency=4, check_on_start=False)
        with pytest.raises(ConfigError, match="max_concurrency: must be >= 1"):
            S3Backend(name="zero", bucket=s3_bucket, max_concurrency=0, check_on_start=False)
    finally:
        asyncio.run(backend.close())


# -- a stalled endpoint: the deadline holds -----------------------------------------------------------
def test_stalled_endpoint_gets_end_at_the_deadline_and_the_tier_trips(s3_server: S3Server, black_hole: str) -> None:
    async def body() -> None:
        backend = make_s3(s3_server, "stalled", endpoint_url=black_hole, check_on_start=False,
                          timeout_s=0.3, read_timeout_s=30.0, failure_threshold=2)
        try:
            for _ in range(2):
                with pytest.raises(TierUnavailableError, match="no answer within timeout_s=0.3s"):
                    await backend.batched_get([make_key(1), make_key(2)])
            stats = backend.stats()
            assert stats["timeouts"] == 4  # the batch deadline ended them, not the 30 s read timeout
            assert stats["store_health"]["healthy"] is False
            with pytest.raises(TierUnavailableError, match="unhealthy"):  # fail fast, no request sent
                await backend.put(make_key(3), make_chunk(3))
            assert backend.stats()["store_health"]["rejected_unhealthy"] == 1
        finally:
            backend._threads.shutdown(wait=False, cancel_futures=True)  # threads stuck on the black hole
            backend._closed = True
            await backend.health.close()
    asyncio.run(body())


# -- kill the object store mid-run, restart it ---------------------------------------------------------
def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 1, 8) / 16).contiguous()




def test_engine_keeps_serving_while_s3_is_killed_and_s3_comes_back(tmp_path: Path) -> None:
    with S3Server(data_dir=tmp_path / "store", allow_external=False) as server:
        server.boto3_client().create_bucket(Bucket="restart")
        s3_options = s3_tier_options(server, "restart", "replicas")

        def config(*tiers: dict[str, Any]) -> dict[str, Any]:
            return {"model": "restart", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_through",
                    "health": {"failure_threshold": 2, "retry_after_s": 0.1, "timeout_s": 5.0},
                    "background": {"when_full": "drop"}, "tiers": list(tiers)}
        shared = {"name": "shared", "backend": "s3", **s3_options}
        before, during, after = (torch.arange(2 * CHUNK) + 1000 * (i + 1) for i in range(3))

        with Engine(config({"name": "host", "backend": "cpu", "capacity": "64MiB"}, shared)) as eng:
            assert eng.store(before, kv_of(before)) == 2
            eng.flush()
            assert eng.stats()["tiers"]["shared"]["puts"] == 2

            server.kill()  # SIGKILL: no goodbye
            assert eng.store(during, kv_of(during)) == 2  # acknowledged by the host tier
            eng.flush()
            for tokens in (before, during):  # still served, from the host tier
                kv, mask = eng.retrieve(tokens, return_tuple=False)
                assert bool(mask.all()) and torch.equal(kv, kv_of(tokens))
            shared_stats = eng.stats()["tiers"]["shared"]
            assert shared_stats["errors"] >= 1 and shared_stats["put_errors"] >= 1, "dropped fills are counted"
            backend = next(t for t in eng.tiers if t.name == "shared")
            for _ in range(3):  # direct gets on the dead tier: misses via an error, never a hang
                with pytest.raises(TierUnavailableError):
                    asyncio.run_coroutine_threadsafe(backend.batched_get([make_key(1)]), eng._loop).result()
            assert eng.stats()["tiers"]["shared"]["store_health"]["healthy"] is False

            server.start()  # same data directory, same ports
            wait_until(lambda: eng.stats()["tiers"]["shared"]["store_health"]["healthy"], "the s3 tier to recover")
            assert eng.stats()["tiers"]["shared"]["store_health"]["recoveries"] == 1
            assert eng.store(after, kv_of(after)) == 2
            eng.flush()

        # another replica, s3 only: what was written before the outage and after it is there
        with Engine(config(shared)) as replica:
            for tokens, expected in ((before, True), (during, False), (after, True)):
                kv, mask = replica.retrieve(tokens, return_tuple=False)
                assert bool(mask.all()) is expected
                if expected:
                    assert torch.equal(kv, kv_of(tokens))


# -- where credentials come from ----------------------------------------------------------------------
def _strict_tier(server: S3Server, **credentials: Any) -> dict[str, Any]:
    return {"model": "creds", "chunk_size": 16, "kv_format": "vllm",
            "tiers": [{"name": "shared", "backend": "s3", "bucket": "strict-creds", "prefix": uuid.uuid4().hex[:8],
                       "endpoint_url": server.endpoint_url, "create_bucket": True, **credentials}]}


def _round_trip(config: Any) -> bool:
    tokens = torch.arange(16)
    kv = torch.randn(2, 2, 16, 1, 8)
    with Engine(config) as engine:
        engine.store(tokens, kv)
        out, mask = engine.retrieve(tokens, return_tuple=False)
        return bool(mask.all()) and torch.equal(out, kv)


def test_credentials_from_variables_the_config_names_the_boto3_chain_or_a_profile(
        strict_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Where S3 users keep credentials, none of them written into the config (a serving engine
    logs its config): environment variables the config names, boto3's own chain (AWS_*), a
    profile of the shared credentials file. Wrong or missing ones fail at start, by name."""
    key, secret = strict_server.access_key_id, strict_server.secret_access_key
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("KV_S3_KEY", key)
    monkeypatch.setenv("KV_S3_SECRET", secret)
    named = _strict_tier(strict_server, access_key_id={"env": "KV_S3_KEY"}, secret_access_key={"env": "KV_S3_SECRET"})
    assert _round_trip(named)
    monkeypatch.setenv("KV_S3_SECRET", "not-the-secret")
    with pytest.raises(ConfigError, match="access denied"):
        Engine(named)
    monkeypatch.delenv("KV_S3_SECRET")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.secret_access_key: the environment variable 'KV_S3_SECRET'"):
        Engine(named)
    with pytest.raises(ConfigError, match=r"expected the credential itself or \{env: NAME\}"):
        Engine(_strict_tier(strict_server, access_key_id={"env": "KV_S3_KEY", "x": 1},
                            secret_access_key={"env": "KV_S3_KEY"}))

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)  # boto3's chain: nothing in the config
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert _round_trip(_strict_tier(strict_server))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")

    shared = tmp_path / "credentials"
    shared.write_text(f"[tierkv]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    assert _round_trip(_strict_tier(strict_server, profile="tierkv"))
    with pytest.raises(ConfigError, match="profile 'nobody' is in no AWS config"):
        Engine(_strict_tier(strict_server, profile="nobody"))
    assert "written into a config" not in caplog.text, "no credential was written into these configs"
    assert secret not in caplog.text


def test_a_credential_written_into_an_inline_config_works_and_warns(
        strict_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Inline (as an integration's extra config is, which vLLM logs) it still works, with a
    warning that names the option, never the value; in a YAML file it says nothing."""
    key, secret = strict_server.access_key_id, strict_server.secret_access_key
    inline = _strict_tier(strict_server, access_key_id=key, secret_access_key=secret)
    caplog.set_level(logging.WARNING)
    assert _round_trip(inline)
    warned = [r.getMessage() for r in caplog.records if "written into a config given inline" in r.getMessage()]
    assert len(warned) == 2 and "tiers[0].secret_access_key" in " ".join(warned)
    assert "{env: NAME}" in warned[0] and secret not in caplog.text
    caplog.clear()
    path = tmp_path / "tierkv.yaml"
    path.write_text(yaml.safe_dump(_strict_tier(strict_server, access_key_id=key, secret_access_key=secret)))
    assert _round_trip(load_config(path))
    assert "written into a config" not in caplog.text
