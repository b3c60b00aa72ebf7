"""No credential in any repr or str: configs, tiers, backends, engines, stats, errors, logs.

Real objects: an s3 tier against the session's SeaweedFS (which accepts any credentials)
and, through a fault proxy, failing; the redis example plugin with a password in its URL.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from s3_fixtures import s3_tier_options

from tierkv import Engine, load_config
from tierkv.backend.options import OptionValues, parse_options
from tierkv.config import TierConfig
from tierkv.engine.blocking import build_tiers
from tierkv.errors import ConfigError, TierKVError
from tierkv.testing import make_chunk, make_key
from tierkv.testing.faultproxy import FaultProxy
from tierkv.testing.s3server import S3Server
from tierkv_backends.s3 import S3Backend

KEY_ID = "AKIATIERKVSECRETID42"
SECRET = "s3cr3t-value-that-must-never-show-7f3a"
TOKEN = "session-token-that-must-never-show-91c2"
REDIS_PASSWORD = "redis-pa55word-never-shown-5d1e"
SECRETS = (SECRET, TOKEN, REDIS_PASSWORD)


def assert_clean(*objects: Any, also: Iterable[str] = ()) -> None:
    for obj in objects:
        for text in (repr(obj), str(obj), *also):
            for secret in SECRETS:
                assert secret not in text, f"a credential shows in {type(obj).__name__}: {text[:300]}"


def exception_texts(exc: BaseException) -> list[str]:
    texts = []
    seen: BaseException | None = exc
    while seen is not None and len(texts) < 10:
        texts += [repr(seen), str(seen)]
        seen = seen.__cause__ or seen.__context__
    return texts


def s3_config(server: S3Server, bucket: str, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
    options = s3_tier_options(server, bucket, f"secrets/{uuid.uuid4().hex[:8]}", access_key_id=KEY_ID,
                              secret_access_key=SECRET, session_token=TOKEN, **extra)
    if endpoint is not None:
        options["endpoint_url"] = endpoint
    return {"model": "secrets", "chunk_size": 16, "kv_format": "vllm",
            "health": {"failure_threshold": 2, "retry_after_s": 0.1},
            "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                      {"name": "shared", "backend": "s3", **options}]}


def test_config_reprs_hide_declared_secrets() -> None:
    spec = S3Backend.options
    values = parse_options(spec, {"bucket": "b-1", "access_key_id": KEY_ID, "secret_access_key": SECRET,
                                  "session_token": TOKEN}, "tiers[1]")
    assert isinstance(values, OptionValues) and values["secret_access_key"] == SECRET  # the value is kept ...
    assert_clean(values)  # ... never shown
    assert "<redacted>" in repr(values) and "b-1" in repr(values)
    # a config built by hand with a plain dict: credential-looking names are hidden too
    manual = TierConfig(name="s", backend="s3", capacity=None, options={"secret_access_key": SECRET, "x": 1},
                        path="tiers[0]")
    assert_clean(manual)
    assert "'x': 1" in repr(manual)


def test_s3_credentials_never_show_in_config_engine_tiers_stats_or_errors(
        s3_server: S3Server, s3_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with FaultProxy(s3_server.endpoint_url) as proxy:
        config = load_config(s3_config(s3_server, s3_bucket, endpoint=proxy.url))
        assert_clean(config, *config.tiers, config.tiers[1].options)
        with Engine(config) as eng:
            tokens = torch.arange(32)
            kv = torch.randn(2, 2, 32, 1, 8)
            assert eng.store(tokens, kv) == 2
            eng.flush()
            shared = next(t for t in eng.tiers if t.name == "shared")
            assert_clean(eng, eng.core, eng.config, *eng.tiers, also=[str(eng.stats()), str(shared.stats())])

            proxy.fault = "503"  # failures produce errors, log lines and breaker state
            for _ in range(3):
                with pytest.raises(TierKVError) as info:
                    eng.run(shared.batched_get(eng.keys_for(tokens)))
                assert_clean(info.value, also=exception_texts(info.value))
            eng.retrieve(torch.arange(32) + 500, return_tuple=False)
            assert_clean(also=[str(eng.stats())])
            proxy.heal()
    assert_clean(also=[caplog.text])


def test_start_up_errors_with_credentials_never_show_them(s3_server: S3Server, black_hole: str) -> None:
    raw = s3_config(s3_server, "no-such-bucket-secrets", endpoint=black_hole, connect_timeout_s=0.2,
                    read_timeout_s=0.2)
    with pytest.raises(ConfigError) as unreachable:
        build_tiers(load_config(raw))
    assert_clean(unreachable.value, also=exception_texts(unreachable.value))
    missing = s3_config(s3_server, "no-such-bucket-secrets")
    with pytest.raises(ConfigError) as no_bucket:
        build_tiers(load_config(missing))
    assert_clean(no_bucket.value, also=exception_texts(no_bucket.value))
    bad_type = s3_config(s3_server, "b-1")
    bad_type["tiers"][1]["secret_access_key"] = ["not", SECRET]
    with pytest.raises(ConfigError) as wrong:
        load_config(bad_type)
    assert_clean(wrong.value, also=exception_texts(wrong.value))


def test_redis_password_never_shows(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("tierkv_redis", reason="the redis example plugin is not installed in this environment")
    caplog.set_level(logging.DEBUG)
    url = f"redis://tierkv:{REDIS_PASSWORD}@127.0.0.1:1/0"  # port 1: nothing listens, every call fails
    config = load_config({"model": "secrets", "chunk_size": 16,
                          "tiers": [{"name": "cache", "backend": "redis", "url": url, "connect_timeout": 0.2,
                                     "socket_timeout": 0.2}]})
    assert config.tiers[0].options["url"] == url
    assert_clean(config, *config.tiers)
    (backend,) = build_tiers(config)

    async def body() -> None:
        try:
            assert_clean(backend, also=[str(backend.stats())])
            with pytest.raises(TierKVError) as info:
                await backend.batched_put([make_key(1)], [make_chunk(1)])
            assert_clean(info.value, also=exception_texts(info.value))
        finally:
            await backend.close()
    asyncio.run(body())
    bad = {"model": "secrets", "tiers": [{"name": "cache", "backend": "redis", "url": f"http://u:{REDIS_PASSWORD}@x"}]}
    with pytest.raises(ConfigError) as wrong:
        load_config(bad)
    assert_clean(wrong.value, also=exception_texts(wrong.value))
    assert_clean(also=[caplog.text])
