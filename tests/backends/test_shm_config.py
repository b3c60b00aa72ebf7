"""Bad input for the ``shm`` tier: a path on a disk, a pool of another geometry, capacity or
format, a file that is not a pool, a path this process may not open. Each is a clear error
naming the path and what differs (or, for a disk path, a warning), and nothing stored in the
existing pool is lost or misread."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import uuid
from pathlib import Path

import pytest
import shm_workers as workers

from tierkv import Engine
from tierkv.errors import ConfigError
from tierkv_backends.shm import SharedMemoryBackend
from tierkv_backends.shm.layout import MAGIC, VERSION, Word

SHM = Path("/dev/shm")


def opened(path: Path, capacity: int = 4 << 20, **options: object) -> SharedMemoryBackend:
    return SharedMemoryBackend("node", capacity, path=str(path), **{"max_chunks": 256, **options})  # type: ignore[arg-type]


def test_a_pool_is_created_for_its_owner_only_unless_configured(pool_path: Path, tmp_path: Path) -> None:
    tier = opened(pool_path)
    asyncio.run(tier.close())
    assert stat.S_IMODE(pool_path.stat().st_mode) == 0o600, "every tenant's KV: owner only by default"
    shared = (SHM if SHM.is_dir() else tmp_path) / f"tierkv-test-{uuid.uuid4().hex[:12]}.pool"
    try:
        tier = opened(shared, mode="0660")
        asyncio.run(tier.close())
        assert stat.S_IMODE(shared.stat().st_mode) == 0o660
    finally:
        shared.unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.mode: expected a file mode its owner can read and write"):
        Engine({"model": "m", "tiers": [{"name": "node", "backend": "shm", "capacity": "4MiB", "mode": "0400",
                                         "path": str(pool_path)}]})


def test_another_geometry_capacity_or_format_is_refused_and_the_pool_kept(pool_path: Path) -> None:
    tier = opened(pool_path)
    asyncio.run(tier.put(workers.key_of(7), workers.chunk_of(7)))
    asyncio.run(tier.close())
    with pytest.raises(ConfigError, match=r"its capacity is 4194304 bytes and this config asks for 8388608") as info:
        opened(pool_path, capacity=8 << 20)
    assert str(pool_path) in str(info.value) and "Remove it (once no process uses it)" in str(info.value)
    with pytest.raises(ConfigError, match="created with max_chunks=256.*this config asks for max_chunks=512"):
        opened(pool_path, max_chunks=512)
    with pytest.raises(ConfigError, match="created with .*max_processes=64.*asks for .*max_processes=8"):
        opened(pool_path, max_processes=8)
    tier = opened(pool_path)  # the pool itself is untouched by the refusals
    try:
        assert workers.exact(7, asyncio.run(tier.get(workers.key_of(7))))
        assert asyncio.run(tier.get(workers.key_of(7))) is not None
    finally:
        asyncio.run(tier.close())
    with open(pool_path, "r+b") as handle:  # a pool of a later layout version
        handle.seek(8 * int(Word.VERSION))
        handle.write((99).to_bytes(8, "little"))
    with pytest.raises(ConfigError, match=f"layout version 99; this tierkv reads version {VERSION}"):
        opened(pool_path)


def test_a_file_that_is_not_a_pool_is_never_read_as_one(pool_path: Path) -> None:
    pool_path.write_bytes(os.urandom(1 << 16))
    pool_path.chmod(0o600)
    with pytest.raises(ConfigError, match="not a tierkv pool"):
        opened(pool_path)
    assert pool_path.stat().st_size == 1 << 16, "the file was left as it was"
    for contents in (b"", bytes(1 << 16)):  # empty, or a header of zeros: still not this process's to format
        pool_path.write_bytes(contents)
        with pytest.raises(ConfigError, match="not a tierkv pool"):
            opened(pool_path)
        assert pool_path.read_bytes() == contents, "a file tierkv did not create is never turned into a pool"
    header = bytearray(1 << 16)
    header[: 8] = MAGIC.to_bytes(8, "little")
    header[8 * int(Word.VERSION) : 8 * int(Word.VERSION) + 8] = VERSION.to_bytes(8, "little")
    pool_path.write_bytes(bytes(header))  # the magic word, and nothing that matches its geometry
    with pytest.raises(ConfigError, match="its capacity is 0 bytes"):
        opened(pool_path)


def test_a_path_on_a_disk_warns_and_still_works(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    tier = opened(tmp_path / "pool")
    try:
        asyncio.run(tier.put(workers.key_of(1), workers.chunk_of(1)))
        assert workers.exact(1, asyncio.run(tier.get(workers.key_of(1))))
    finally:
        asyncio.run(tier.close())
    assert "not in memory" in caplog.text and str(tmp_path / "pool") in caplog.text


def test_a_pool_this_process_may_not_open_is_an_error_naming_it(pool_path: Path) -> None:
    """Another user's pool (owner-only): a clear error, never a private pool of its own."""
    if os.getuid() != 0:
        pytest.skip("only root can become another user to try")
    tier = opened(pool_path)
    asyncio.run(tier.close())
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            opened(pool_path)
            message = "opened"
        except ConfigError as exc:
            message = f"ConfigError: {exc}"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode()[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as handle:
        message = handle.read()
    os.waitpid(child, 0)
    assert message.startswith("ConfigError") and "no permission to open the pool" in message, message
    assert str(pool_path) in message


def test_pool_size_says_what_a_capacity_costs_and_whether_it_fits(pool_path: Path) -> None:
    import re
    import subprocess
    import sys

    def pool_size(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tierkv.cli", "pool-size", *args], capture_output=True, text=True,
                              timeout=120)

    said = pool_size("4MiB", "--path", str(pool_path))
    assert said.returncode == 0, said.stderr
    stated = int(re.search(r"is a file of .* \((\d+) bytes\)", said.stdout).group(1))  # type: ignore[union-attr]
    tier = SharedMemoryBackend("node", 4 << 20, path=str(pool_path))
    asyncio.run(tier.close())
    assert stated == pool_path.stat().st_size > 4 << 20, "the real size of the file, index and hold rows included"
    free = os.statvfs(pool_path.parent).f_bavail * os.statvfs(pool_path.parent).f_frsize
    too_big = pool_size(str(2 * free), "--path", str(pool_path))
    assert too_big.returncode == 1 and "does NOT fit" in too_big.stdout and "tierkv: error:" in too_big.stderr


@pytest.mark.parametrize(("capacity", "at_most"), [(8 << 20, 16 << 20), (32 << 20, 64 << 20), (1 << 30, (1 << 30) + (24 << 20))])
def test_a_pool_files_overhead_grows_with_its_capacity(pool_path: Path, capacity: int, at_most: int) -> None:
    """The index, the hold rows and the journal scale with the capacity: an 8 MiB pool is a file of
    at most 16 MiB, a 32 MiB pool fits in Docker's default 64 MiB /dev/shm, a 1 GiB pool is the
    1 GiB file with what it had before (16 MiB of journal, 4,096 chunks indexed); the real file is
    the size ``file_size`` (``tierkv pool-size``) says, and it holds chunks."""
    said = SharedMemoryBackend.file_size(capacity, str(pool_path))
    assert said["file_bytes"] <= at_most, said
    tier = SharedMemoryBackend("node", capacity, path=str(pool_path))
    try:
        assert pool_path.stat().st_size == said["file_bytes"]
        for index in range(8):
            asyncio.run(tier.put(workers.key_of(index), workers.chunk_of(index)))
        assert tier.stats()["pool_chunks"] == 8
    finally:
        asyncio.run(tier.close())
    if capacity == 1 << 30:
        assert (said["max_chunks"], said["journal_bytes"], said["holds_per_process"]) == (4096, 16 << 20, 16384)


def test_evictions_count_their_bytes(pool_path: Path) -> None:
    tier = opened(pool_path, capacity=64 << 10)
    try:
        size = workers.chunk_of(0).numel() * 4
        for index in range(40):
            asyncio.run(tier.put(workers.key_of(index), workers.chunk_of(index)))
        stats = tier.stats()
        assert stats["evictions"] > 0 and stats["evicted_bytes"] >= stats["evictions"] * size, stats
        assert stats["pool_evicted_bytes"] == stats["evicted_bytes"], "one process: the pool's count is its own"
    finally:
        asyncio.run(tier.close())
