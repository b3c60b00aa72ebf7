"""Chunk <-> bytes for byte-oriented tiers (disk, files, object stores).

Layout: a small versioned header, then the tensor's raw bytes.

    magic "TKVC" | version u16 | header_len u16 | dtype u8 | kv_format u8 | ndim u8 |
    checksum_algo u8 | payload_len u64 | checksum u64 | shape u64 * ndim

Bytes read from a tier may have been written by another machine or damaged on the way,
so nothing here unpickles or ``torch.load``s: the header is parsed field by field and
the payload's XXH3-64 checksum must match before a tensor is built.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from tierkv.chunks import copies
from tierkv.chunks.memory import (
    as_bytes,
    byte_runs,
    contiguous_host,
    copy_from_bytes,
    empty_host,
    gather_bytes,
    scatter_bytes,
)
from tierkv.errors import ChunkFormatError

MAGIC = b"TKVC"
VERSION = 1
_FIXED = struct.Struct("<4sHHBBBBQQ")
_CHECKSUM_XXH3_64 = 1
_MAX_NDIM = 8
# Bytes to read to be sure of holding a whole header (fixed part + largest shape).
MAX_HEADER_BYTES = _FIXED.size + 8 * _MAX_NDIM

# Codes are part of the on-disk format: append only, never renumber.
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
for _code, _name in enumerate(
    ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"), start=20
):
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = _code
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

_FORMAT_CODES = {None: 0, "vllm": 1, "huggingface": 2}
_CODE_FORMATS = {code: fmt for fmt, code in _FORMAT_CODES.items()}

SUPPORTED_DTYPES = tuple(_DTYPE_CODES)


def dtype_code(dtype: torch.dtype) -> int:
    """The stored code of ``dtype`` (ValueError naming the supported ones for any other)."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"cannot store dtype {dtype}; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}") from None


def code_dtype(code: int) -> torch.dtype | None:
    """The dtype a stored code stands for, None for a code this tierkv does not know."""
    return _CODE_DTYPES.get(code)


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What the header of a stored chunk says about its payload."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    kv_format: str | None
    payload_len: int
    checksum: int
    header_len: int


def checksum(data: np.ndarray | memoryview | bytes) -> int:
    """XXH3-64 of a byte buffer (tens of GB/s: never the bottleneck of a tier)."""
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]  # ndarray is a buffer


def checksum_runs(runs: list[memoryview]) -> int:
    """XXH3-64 of the concatenation of ``runs`` (equal to ``checksum`` of the joined bytes)."""
    if len(runs) == 1:
        return checksum(runs[0])
    state = xxhash.xxh3_64()
    for run in runs:
        state.update(run)
    return state.intdigest()


def payload_runs(tensor: torch.Tensor) -> list[memoryview]:
    """The chunk's bytes in element order, without gathering a token slice into a temporary
    when its pieces are contiguous (host tensors); a pooled contiguous copy otherwise."""
    if tensor.device.type == "cpu" and (tensor.dim() == 0 or tensor.stride(-1) == 1):
        return byte_runs(tensor)
    return [as_bytes(contiguous_host(tensor.detach())).data]


def contiguous_payload(tensor: torch.Tensor) -> np.ndarray:
    """The chunk's bytes as one contiguous host array (a pooled, counted copy when it is not
    already one), for stores that take a single buffer."""
    return as_bytes(contiguous_host(tensor.detach()))


def check_encodable(tensor: torch.Tensor, kv_format: str | None = None) -> None:
    """Raise ValueError, saying what is supported, for a chunk this format cannot store."""
    if tensor.dtype not in _DTYPE_CODES:
        raise ValueError(
            f"cannot store dtype {tensor.dtype}; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    if kv_format not in _FORMAT_CODES:
        raise ValueError(f"kv_format must be one of {[f for f in _FORMAT_CODES if f]}, got {kv_format!r}")
    if tensor.dim() > _MAX_NDIM:
        raise ValueError(f"chunks have at most {_MAX_NDIM} dimensions, got {tensor.dim()}")


def encode_header(tensor: torch.Tensor, kv_format: str | None = None,
                  payload: np.ndarray | list[memoryview] | None = None, digest: int | None = None) -> bytes:
    """Header for ``tensor``; pass ``payload`` (its bytes, or their runs) when already at hand,
    and its ``digest`` when already computed."""
    check_encodable(tensor, kv_format)
    if payload is None:
        payload = payload_runs(tensor)
    if isinstance(payload, list):
        nbytes = sum(run.nbytes for run in payload)
        digest = checksum_runs(payload) if digest is None else digest
    else:
        nbytes = payload.nbytes
        digest = checksum(payload) if digest is None else digest
    header_len = _FIXED.size + 8 * tensor.dim()
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        header_len,
        _DTYPE_CODES[tensor.dtype],
        _FORMAT_CODES[kv_format],
        tensor.dim(),
        _CHECKSUM_XXH3_64,
        nbytes,
        digest,
    )
    return fixed + struct.pack(f"<{tensor.dim()}Q", *tensor.shape)


def encode(tensor: torch.Tensor, kv_format: str | None = None) -> bytearray:
    """Header and payload as one buffer, for stores that take a single value (one copy)."""
    runs = payload_runs(tensor)
    header = encode_header(tensor, kv_format, runs)
    data = bytearray(len(header) + sum(run.nbytes for run in runs))
    view = memoryview(data)
    view[: len(header)] = header
    gather_bytes(runs, view[len(header) :])
    return data


def decode_header(data: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse and sanity-check a header; raises ChunkFormatError on anything malformed."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise ChunkFormatError(f"truncated chunk: {len(view)} bytes is shorter than the {_FIXED.size}-byte header")
    magic, version, header_len, dtype_code, fmt_code, ndim, algo, payload_len, digest = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise ChunkFormatError(f"not a tierkv chunk: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ChunkFormatError(f"unsupported chunk format version {version}; this tierkv reads version {VERSION}")
    if algo != _CHECKSUM_XXH3_64:
        raise ChunkFormatError(f"unknown checksum algorithm code {algo}")
    if dtype_code not in _CODE_DTYPES or fmt_code not in _CODE_FORMATS or ndim > _MAX_NDIM:
        raise ChunkFormatError(f"corrupt chunk header (dtype code {dtype_code}, format code {fmt_code}, ndim {ndim})")
    if header_len != _FIXED.size + 8 * ndim or len(view) < header_len:
        raise ChunkFormatError(f"corrupt or truncated chunk header (header_len {header_len}, {len(view)} bytes)")
    shape = struct.unpack_from(f"<{ndim}Q", view, _FIXED.size)
    dtype = _CODE_DTYPES[dtype_code]
    expected = int(np.prod(shape, dtype=np.uint64)) * torch.empty((), dtype=dtype).element_size()
    if expected != payload_len:
        raise ChunkFormatError(f"corrupt chunk header: shape {shape} of {dtype} needs {expected} bytes, says {payload_len}")
    return ChunkHeader(dtype, tuple(shape), _CODE_FORMATS[fmt_code], payload_len, digest, header_len)


def verify_payload(header: ChunkHeader, payload: np.ndarray | memoryview | list[memoryview]) -> None:
    """Raise ChunkFormatError unless ``payload`` (read in place, or as runs) matches ``header``."""
    if isinstance(payload, list):
        runs = payload
    else:
        runs = [payload.reshape(-1).data.cast("B") if isinstance(payload, np.ndarray) else payload.cast("B")]
    nbytes = sum(run.nbytes for run in runs)
    if nbytes != header.payload_len:
        raise ChunkFormatError(f"truncated chunk: payload has {nbytes} bytes, header says {header.payload_len}")
    if checksum_runs(runs) != header.checksum:
        raise ChunkFormatError("chunk checksum mismatch: the stored bytes were altered or torn")


def fits(header: ChunkHeader, out: torch.Tensor) -> bool:
    """Whether the chunk ``header`` describes is the one destination ``out`` is waiting for."""
    return out.dtype == header.dtype and tuple(out.shape) == header.shape


def copy_payload_into(header: ChunkHeader, payload: bytes | memoryview | np.ndarray, out: torch.Tensor,
                      verify: bool = True, in_destination: bool = False) -> bool:
    """Verify ``payload`` and copy it once into the host tensor ``out``.

    False (``out`` untouched) when the chunk is not the one ``out`` waits for (another shape
    or dtype); raises ChunkFormatError for a damaged payload, ``out`` untouched -- unless
    ``in_destination``: then the bytes are checksummed as they land in ``out`` (each byte read
    from memory once instead of twice) and a damaged payload may have left its bytes there,
    for backends whose hit mask is the contract (see ``docs/writing-a-backend.md``). Without
    ``verify`` only the length is checked (a store that cannot tear a write, trusted).
    """
    if not fits(header, out):
        return False
    raw = memoryview(payload).cast("B") if not isinstance(payload, np.ndarray) else payload.reshape(-1).data
    if raw.nbytes != header.payload_len:
        raise ChunkFormatError(f"truncated chunk: payload has {raw.nbytes} bytes, header says {header.payload_len}")
    if not verify:
        copy_from_bytes(out, raw)
    elif in_destination:
        copy_verified(header, raw, byte_runs(out))
    else:
        verify_payload(header, [raw])
        scatter_bytes(raw, byte_runs(out), last_first=True)
    return True


VERIFY_STEP = 256 << 10
"""Bytes copied, then checksummed, at a time: the checksum reads them from the CPU cache."""


def copy_verified(header: ChunkHeader, source: memoryview, runs: list[memoryview]) -> None:
    """Copy ``source`` into ``runs`` and checksum what landed there, a step at a time, so each
    byte is read from memory once (a verify before the copy reads it twice). Raises
    ChunkFormatError on a mismatch, with ``runs`` then holding the damaged bytes."""
    total = sum(run.nbytes for run in runs)
    if total != source.nbytes:
        raise ValueError(f"copy_verified: {source.nbytes} source bytes for {total} destination bytes")
    copies.count(total)
    state = xxhash.xxh3_64()
    source_bytes = np.frombuffer(source, dtype=np.uint8)
    offset = 0
    for run in runs:
        destination = np.frombuffer(run.cast("B"), dtype=np.uint8)
        for start in range(0, destination.size, VERIFY_STEP):
            piece = destination[start : start + VERIFY_STEP]
            # numpy copies without the GIL (a memoryview copy holds it): two reader threads
            # copy at once (4.5 -> 6.4 GB/s here); xxhash releases it too
            np.copyto(piece, source_bytes[offset : offset + piece.size])
            state.update(piece.data)
            offset += piece.size
    if state.intdigest() != header.checksum:
        raise ChunkFormatError("chunk checksum mismatch: the stored bytes were altered or torn")


def decode_payload(
    header: ChunkHeader,
    payload: bytes | memoryview | np.ndarray,
    allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = empty_host,
    verify: bool = True,
) -> torch.Tensor:
    """Verify ``payload`` against ``header`` (its length only, without ``verify``) and copy
    it once into a fresh tensor."""
    raw = np.frombuffer(payload, dtype=np.uint8)
    if verify:
        verify_payload(header, raw)
    elif raw.nbytes != header.payload_len:
        raise ChunkFormatError(f"truncated chunk: payload has {raw.nbytes} bytes, header says {header.payload_len}")
    out = allocate(header.shape, header.dtype)
    if raw.nbytes:
        copies.count(raw.nbytes)
        as_bytes(out)[:] = raw
    return out


def decode(data: bytes | bytearray | memoryview, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = empty_host) -> torch.Tensor:
    """Inverse of ``encode``; raises ChunkFormatError for anything but a valid chunk."""
    header = decode_header(data)
    view = memoryview(data)
    return decode_payload(header, view[header.header_len :], allocate)
