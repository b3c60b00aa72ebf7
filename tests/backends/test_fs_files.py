"""The fs tier's chunk files: the payload is checksummed step by step as it is written
(:func:`tierkv_backends.fs.files.write_payload`), and what lands on disk is exactly the chunk
format (header with the whole payload's checksum, then the payload), whatever the shape of
the pieces: one piece larger than a step, many small ones, more pieces than IOV_MAX."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from tierkv.chunks import serde
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.memory import byte_runs
from tierkv_backends.fs import FSBackend
from tierkv_backends.fs import files as fs_files


def _runs_of(data: bytes, sizes: list[int]) -> list[memoryview]:
    view, runs, start = memoryview(data), [], 0
    for size in sizes:
        runs.append(view[start : start + size])
        start += size
    assert start == len(data)
    return runs


@pytest.mark.parametrize("sizes", [
    [3 * fs_files.WRITE_STEP + 17],  # one piece cut into steps
    [fs_files.WRITE_STEP - 1, 2, fs_files.WRITE_STEP + 5, 1],  # steps that straddle pieces
    [7] * (fs_files.IOV_MAX + 300),  # more pieces than one pwritev takes
    [0, 5, 0],  # empty pieces are skipped
])
def test_write_payload_checksums_what_it_writes(tmp_path: Path, sizes: list[int]) -> None:
    data = os.urandom(sum(sizes))
    path = tmp_path / "payload"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        digest = fs_files.write_payload(fd, _runs_of(data, sizes), offset=11)
    finally:
        os.close(fd)
    assert digest == serde.checksum(data)
    written = path.read_bytes()
    assert written[11:] == data
    assert written[:11] == bytes(11)  # the header's place, left for the caller


def test_read_all_stops_at_end_of_file(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"abcdef")
    into = [memoryview(bytearray(4)), memoryview(bytearray(4))]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fs_files.read_all(fd, into, 1) == 5
    finally:
        os.close(fd)
    assert bytes(into[0]) + bytes(into[1][:1]) == b"bcdef"


def test_chunk_file_from_a_token_slice_is_the_chunk_format(tmp_path: Path) -> None:
    """A non-contiguous token slice of a vllm blob (one piece per layer and K/V) is written
    piece by piece; the file is a header then the chunk's bytes in element order, and the
    header's checksum covers all of them."""
    blob = torch.randn(4, 2, 64, 2, 8).to(torch.bfloat16)
    chunk = blob.narrow(2, 16, 16)
    assert len(byte_runs(chunk)) == 8
    key = CacheKey("vllm", "m", 1, 0, "0" * 32)
    tier = FSBackend("files", None, path=str(tmp_path / "fs"))

    async def put_and_close() -> None:
        await tier.batched_put([key], [chunk])
        await tier.close()

    asyncio.run(put_and_close())
    files = [p for p in (tmp_path / "fs").rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].suffix == ".tkv"  # no temporary file left behind
    data = files[0].read_bytes()
    header = serde.decode_header(data)
    payload = data[header.header_len :]
    assert payload == chunk.contiguous().view(torch.uint8).numpy().tobytes()
    serde.verify_payload(header, memoryview(payload))
    assert header.shape == tuple(chunk.shape) and header.kv_format == "vllm"


def _one_chunk_file(root: Path) -> Path:
    files = [p for p in root.rglob("*.tkv")]
    assert len(files) == 1
    return files[0]


def test_large_payload_starts_on_a_page_and_reads_back(tmp_path: Path) -> None:
    """A payload of ALIGN_FROM bytes or more starts at the first page boundary after the
    header; the file reads back whole, through batched_get, batched_get_into and get."""
    chunk = torch.randn(2, 2, 64, 4, 64)  # 256 KiB of float32
    assert chunk.numel() * 4 >= fs_files.ALIGN_FROM
    key = CacheKey("vllm", "m", 1, 0, "1" * 32)
    tier = FSBackend("files", None, path=str(tmp_path / "fs"))
    out = torch.zeros_like(chunk)

    async def round_trip() -> tuple[torch.Tensor | None, torch.Tensor | None, list[bool]]:
        await tier.batched_put([key], [chunk])
        got = (await tier.batched_get([key]))[0]
        single = await tier.get(key)
        mask = await tier.batched_get_into([key], [out])
        await tier.close()
        return got, single, mask

    got, single, mask = asyncio.run(round_trip())
    data = _one_chunk_file(tmp_path / "fs").read_bytes()
    header = serde.decode_header(data)
    assert header.header_len < fs_files.PAGE and len(data) == fs_files.PAGE + header.payload_len
    assert data[fs_files.PAGE :] == chunk.numpy().tobytes()
    assert got is not None and torch.equal(got, chunk)
    assert single is not None and torch.equal(single, chunk)
    assert mask == [True] and torch.equal(out, chunk)


def test_payload_right_after_the_header_is_still_read(tmp_path: Path) -> None:
    """Files written before payloads were page-aligned (the chunk format as one encoded blob)
    keep reading; a file whose size fits neither layout is a miss, not bytes from the hole."""
    chunk = torch.randn(2, 2, 64, 4, 64)
    key = CacheKey("vllm", "m", 1, 0, "2" * 32)
    root = tmp_path / "fs"
    tier = FSBackend("files", None, path=str(root))

    async def put() -> None:
        await tier.batched_put([key], [chunk])
        await tier.close()

    asyncio.run(put())
    path = _one_chunk_file(root)
    path.write_bytes(serde.encode(chunk, "vllm"))  # the older layout, same name

    async def read(tier: FSBackend) -> tuple[torch.Tensor | None, list[bool], torch.Tensor]:
        out = torch.zeros_like(chunk)
        got = (await tier.batched_get([key]))[0]
        mask = await tier.batched_get_into([key], [out])
        await tier.close()
        return got, mask, out

    got, mask, out = asyncio.run(read(FSBackend("files", None, path=str(root))))
    assert got is not None and torch.equal(got, chunk)
    assert mask == [True] and torch.equal(out, chunk)

    with open(path, "ab") as appended:  # neither layout's size any more
        appended.write(b"\0" * 16)
    got, mask, _ = asyncio.run(read(FSBackend("files", None, path=str(root))))
    assert got is None and mask == [False]
