"""Byte-level I/O of the ``fs`` tier's chunk files: vectored writes and reads that finish
short transfers, and the payload write that checksums as it goes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import xxhash

IOV_MAX = 1024
WRITE_STEP = 1 << 20
"""Bytes checksummed, then written, at a time: small enough to still be in the CPU cache when
the kernel copies them into the page cache, large enough that syscalls cost nothing."""


PAGE = 4096
ALIGN_FROM = 64 << 10
"""Payloads of at least this many bytes start on a page boundary of their file."""


def payload_offset(header_len: int, payload_len: int) -> int:
    """Where a new chunk file's payload starts: the header's length rounded up to a page for
    a payload of ``ALIGN_FROM`` bytes or more. Page-aligned, the kernel copies whole pages
    between the page cache and the caller's memory; right after a header of a few dozen
    bytes every page is copied in two pieces (writes ran about 25% slower on tmpfs here).
    The gap is a hole: nothing is written there."""
    if payload_len < ALIGN_FROM:
        return header_len
    return -(-header_len // PAGE) * PAGE


def payload_offset_in(file_size: int, header_len: int, payload_len: int) -> int | None:
    """Where an existing chunk file of ``file_size`` bytes holds its payload: right after the
    header (every file written before payloads were aligned) or where ``payload_offset``
    puts it; None when the size fits neither (a torn or appended file)."""
    offset = file_size - payload_len
    return offset if offset in (header_len, payload_offset(header_len, payload_len)) else None


def advance(pending: list[memoryview], done: int) -> list[memoryview]:
    """``pending`` without its first ``done`` bytes."""
    index = 0
    while index < len(pending) and done >= pending[index].nbytes:
        done -= pending[index].nbytes
        index += 1
    rest = pending[index:]
    if rest and done:
        rest[0] = rest[0][done:]
    return rest


def pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write the buffers back to back from ``offset`` on, however short each ``pwritev`` is."""
    pending = [b.cast("B") for b in buffers if b.nbytes]
    while pending:
        done = os.pwritev(fd, pending[:IOV_MAX], offset)
        offset += done
        pending = advance(pending, done)


def _steps(runs: list[memoryview]) -> Iterator[list[memoryview]]:
    """The payload's pieces in order, grouped into steps of about ``WRITE_STEP`` bytes (a
    large piece is cut)."""
    step: list[memoryview] = []
    size = 0
    for run in runs:
        run = run.cast("B")
        for start in range(0, run.nbytes, WRITE_STEP):
            piece = run[start : start + WRITE_STEP]
            step.append(piece)
            size += piece.nbytes
            if size >= WRITE_STEP or len(step) == IOV_MAX:
                yield step
                step, size = [], 0
    if step:
        yield step


def write_payload(fd: int, runs: list[memoryview], offset: int) -> int:
    """Write the payload from ``offset`` on and return its XXH3-64 checksum.

    Checksum and write go a step (about 1 MiB) at a time: the kernel copies each step into
    the page cache while it is still in the CPU cache from the checksum, so the caller's
    memory is read from RAM once, as by a bare ``writev`` (a checksum pass over the whole
    chunk first, then the write, read every byte from RAM twice)."""
    state = xxhash.xxh3_64()
    for step in _steps(runs):
        for piece in step:
            state.update(piece)
        pwrite_all(fd, step, offset)
        offset += sum(piece.nbytes for piece in step)
    return state.intdigest()


def read_all(fd: int, into: list[memoryview], offset: int) -> int:
    """Read into the buffers until they are full or the file ends; the number of bytes read."""
    pending = [b for b in into if b.nbytes]
    got = 0
    while pending:
        n = os.preadv(fd, pending[:IOV_MAX], offset + got)
        if n == 0:
            break
        got += n
        pending = advance(pending, n)
    return got
