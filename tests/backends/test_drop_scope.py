"""A tenant's drop reaches the chunks another process wrote: an LMDB environment written by
another process, an S3 prefix written by another tier instance. Each drop reads what the store
holds, not what this process remembers; the other scope's chunks stay bit-exact. A tier that
fails its drop keeps no other tier from dropping."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from s3_fixtures import s3_tier_options

from tierkv import CacheKey, Engine, RequestIdentity
from tierkv.errors import TierUnavailableError
from tierkv.testing import make_chunk, same_bytes
from tierkv.testing.faults import FaultyBackend
from tierkv.testing.s3server import S3Server
from tierkv_backends.lmdb import LMDBBackend
from tierkv_backends.s3 import S3Backend

TENANT_A, TENANT_B = "a1" * 8, "b2" * 8


def scoped(index: int, scope: str) -> CacheKey:
    return CacheKey("vllm", "drop-model", 1, 0, f"{index:032x}", scope)


WRITER = """
import asyncio, sys
from tierkv import CacheKey
from tierkv.testing import make_chunk
from tierkv_backends.lmdb import LMDBBackend

async def main() -> None:
    backend = LMDBBackend("disk", 64 << 20, path=sys.argv[1])
    for scope in sys.argv[2:]:
        for index in range(4):
            await backend.put(CacheKey("vllm", "drop-model", 1, 0, f"{index:032x}", scope), make_chunk(index))
    await backend.close()
asyncio.run(main())
"""


def test_lmdb_drops_a_scope_another_process_wrote(tmp_path: Path) -> None:
    path = str(tmp_path / "disk")

    async def main() -> None:
        dropper = LMDBBackend("disk", 64 << 20, path=path)  # opened before the writer: its index knows nothing
        try:
            subprocess.run([sys.executable, "-c", WRITER, path, TENANT_A, TENANT_B], check=True, timeout=120)
            assert await dropper.drop_scope("drop-model", TENANT_A) == 4
            assert await dropper.drop_scope("another-model", TENANT_B) == 0, "one model's scope, not another's"
            assert [await dropper.get(scoped(index, TENANT_A)) for index in range(4)] == [None] * 4
            for index in range(4):
                assert same_bytes(await dropper.get(scoped(index, TENANT_B)), make_chunk(index))
        finally:
            await dropper.close()
        reopened = LMDBBackend("disk", 64 << 20, path=path)  # the drop is in the file, not in one process's index
        try:
            assert await reopened.batched_contains([scoped(i, TENANT_A) for i in range(4)]) == [False] * 4
            assert await reopened.batched_contains([scoped(i, TENANT_B) for i in range(4)]) == [True] * 4
        finally:
            await reopened.close()
    asyncio.run(main())


def test_s3_drops_a_scope_another_tier_wrote(s3_server: S3Server, s3_bucket: str) -> None:
    prefix = f"drop/{uuid.uuid4().hex}"

    def tier() -> S3Backend:
        options = S3Backend.validate_options(s3_tier_options(s3_server, s3_bucket, prefix), "tiers[0]")
        return S3Backend(name="shared", **options)

    async def main() -> None:
        writer, dropper = tier(), tier()
        try:
            for scope in (TENANT_A, TENANT_B):
                for index in range(4):
                    await writer.put(scoped(index, scope), make_chunk(index))
            await writer.put(CacheKey("vllm", "another-model", 1, 0, f"{9:032x}", TENANT_A), make_chunk(9))
            assert await dropper.drop_scope("drop-model", TENANT_A) == 4
            assert dropper.stats()["scope_deletes"] == 4
            names = [item["Key"] for item in s3_server.boto3_client().list_objects_v2(
                Bucket=s3_bucket, Prefix=f"{prefix}/").get("Contents", [])]
            assert len(names) == 5 and not any(TENANT_A in name and "drop-model" in name for name in names)
            assert [await writer.get(scoped(index, TENANT_A)) for index in range(4)] == [None] * 4
            assert await dropper.batched_contains([scoped(i, TENANT_A) for i in range(4)]) == [False] * 4
            for index in range(4):
                assert same_bytes(await dropper.get(scoped(index, TENANT_B)), make_chunk(index))
        finally:
            await writer.close()
            await dropper.close()
    asyncio.run(main())


def test_a_tier_that_fails_a_drop_does_not_keep_the_others_from_dropping(tmp_path: Path) -> None:
    """A tenant's drop asks every tier even when one fails, then names the failed one: here the
    middle of three tiers is down, and the tiers above and below it still lose the tenant."""
    chunk = 16
    tiers = [{"name": "host", "backend": "cpu", "capacity": "4MiB"},
             {"name": "flaky", "backend": "lmdb", "path": str(tmp_path / "flaky"), "capacity": "16MiB"},
             {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "disk"), "capacity": "16MiB"}]
    config = {"model": "drop-model", "chunk_size": chunk, "write_policy": "write_through", "tiers": tiers}
    tenant_a, tenant_b = RequestIdentity(salt="tenant-a"), RequestIdentity(salt="tenant-b")
    tokens = list(range(1, 4 * chunk + 1))
    kv = torch.arange(2 * 2 * 4 * chunk * 2 * 8, dtype=torch.float32).reshape(2, 2, 4 * chunk, 2, 8)
    with Engine(config) as engine:
        flaky = engine.wrap_tier("flaky", FaultyBackend)
        for identity in (tenant_a, tenant_b):
            engine.store(tokens, kv, identity=identity)
        engine.flush()
        flaky.failing = True
        with pytest.raises(TierUnavailableError, match=r"1 tier\(s\) failed: 'flaky'.*8 chunk\(s\) dropped"):
            engine.drop_identity(tenant_a)
        flaky.failing = False
        assert engine.locate(tokens, tenant_a) == ["flaky"] * 4, "only the failed tier still holds them"
    disk_only = {"model": "drop-model", "chunk_size": chunk, "tiers": [tiers[2]]}
    with Engine(disk_only) as reopened:
        assert reopened.lookup(tokens, tenant_a) == 0 and reopened.lookup(tokens, tenant_b) == 4 * chunk
