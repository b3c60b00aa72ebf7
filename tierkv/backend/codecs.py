"""KV codecs for byte tiers: a chunk as it is kept on a slow medium, and back.

A coded chunk is stored as a *frame*, a 1-D ``uint8`` chunk whose bytes are a small header
and the codec's body; the tier stores and checksums the frame like any chunk, so the
checksum covers exactly what is stored and every backend -- a plugin too -- carries coded
chunks without knowing codecs exist.

    magic "TKVZ" | version u8 | codec u8 | dtype u8 | ndim u8 | raw_len u64 | body_len u64 |
    shape u64 * ndim | body

Codecs (ids are part of the stored format: append only):

- ``1`` Blosc (lossless), one buffer: byte- or bit-shuffle then LZ4 or Zstd, from the
  ``blosc`` package. The body is a Blosc buffer, which names its own compressor, so a reader
  decodes whatever lossless codec a writer chose. Read, no longer written.
- ``2`` fp8 (lossy, opt-in): e4m3 values with one float32 scale per (layer, K/V, head). The
  body is ``keep u8 | n u32 | scales f32 * n | values``; ``keep`` is the bitmask of the
  chunk's dimensions the scales vary along.
- ``3`` Blosc (lossless), one buffer per *slab*: the chunk split along its dimensions before
  the token dimension (``vllm``: one slab per (layer, K/V); ``huggingface``: per (layer, K/V,
  head)). The body is ``split u8 | n u32 | stored length u32 * n | Blosc buffers``. A token
  slice of a serving engine's cache is contiguous within each slab, so every slab decompresses
  straight into its place in the destination, the slabs in parallel.

Decoding writes each byte of the destination once: Blosc slabs decompress straight into a
host destination whose slabs are contiguous (a token slice of a larger cache is), fp8 is
converted into it. Nothing here unpickles: every header field, and every Blosc buffer's
header, is checked before a byte is decoded; a frame that does not parse is a
``ChunkFormatError``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from tierkv.chunks import copies, serde
from tierkv.chunks.keys import KV_FORMATS
from tierkv.chunks.kvlayout import nbytes_of, token_dim
from tierkv.chunks.memory import contiguous_host, copy_into, empty_host, gather_bytes
from tierkv.errors import ChunkFormatError

FRAME_MAGIC = b"TKVZ"
FRAME_VERSION = 1
_FRAME = struct.Struct("<4sBBBBQQ")
_FP8_BODY = struct.Struct("<BI")
_SLABS_BODY = struct.Struct("<BI")
_BLOSC_ID, _FP8_ID, _BLOSC_SLABS_ID = 1, 2, 3
_CODEC_IDS = (_BLOSC_ID, _FP8_ID, _BLOSC_SLABS_ID)
_PARALLEL_BYTES = 1 << 20  # chunks smaller than this are coded on the calling thread
_MAX_NDIM = 8
FP8_E4M3_MAX = 448.0
BLOSC_MAX_BYTES = 2**31 - 256  # a Blosc buffer holds at most 2 GiB (minus its overhead)
WORTH_IT = 0.97
"""A lossless frame is stored only when it is at most this fraction of the chunk's size;
otherwise the chunk is stored raw (decoding would cost time and save almost nothing)."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """What a frame says about the chunk it holds."""

    codec: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    raw_len: int
    header_len: int


class Codec:
    """How a tier keeps chunks: ``encode`` a chunk into a frame (None: store it raw), and
    ``decode_into`` a frame's body into the destination. ``lossy`` codecs change the bytes,
    so their chunks live under keys marked ``marker`` (an exact reader never sees them)."""

    name: ClassVar[str] = "none"
    lossy: ClassVar[bool] = False
    marker: ClassVar[str] = ""

    def encode(self, chunk: torch.Tensor, kv_format: str | None) -> torch.Tensor | None:
        return None

    def describe(self) -> str:
        return self.name


class BloscCodec(Codec):
    """Lossless: shuffle the bytes of each element so the exponents sit together, then LZ4
    (fast to decode) or Zstd (smaller). On bf16 KV of a trained model this keeps the sign and
    exponent bytes, not the mantissas, compressible: about 1.2-1.4x (benchmarks/compression.py)."""

    lossy = False

    def __init__(self, name: str, cname: str, shuffle: str, clevel: int) -> None:
        self.name = name  # type: ignore[misc]  # the config's name for this setting
        self.cname, self.shuffle, self.clevel = cname, shuffle, clevel

    def encode(self, chunk: torch.Tensor, kv_format: str | None) -> torch.Tensor | None:
        blosc = _blosc()
        source = contiguous_host(chunk.detach())
        nbytes = source.numel() * source.element_size()
        split = slab_split(tuple(source.shape), kv_format)
        count = math.prod(source.shape[:split])
        if nbytes == 0 or nbytes // count > BLOSC_MAX_BYTES:
            return None
        shuffle = blosc.BITSHUFFLE if self.shuffle == "bit" else blosc.SHUFFLE
        items, size, base = source.numel() // count, source.element_size(), source.data_ptr()

        def compress(index: int) -> bytes:
            return blosc.compress_ptr(base + index * items * size, items, size, self.clevel, shuffle, self.cname)

        bodies = _each_slab(compress, count, nbytes)
        head = _SLABS_BODY.pack(split, count) + struct.pack(f"<{count}I", *(len(body) for body in bodies))
        if len(head) + sum(len(body) for body in bodies) > WORTH_IT * nbytes:
            return None
        return _frame(_BLOSC_SLABS_ID, chunk, [head, *bodies])

    def describe(self) -> str:
        return f"{self.name} (blosc {self.cname}, {self.shuffle}-shuffle, level {self.clevel})"


class Fp8Codec(Codec):
    """Lossy, opt-in: e4m3 with a float32 scale per (layer, K/V, head), half the bytes of
    bf16. Its chunks are keyed apart (``marker``): a reader without it never takes them."""

    name = "fp8"
    lossy = True
    marker = "fp8"

    def encode(self, chunk: torch.Tensor, kv_format: str | None) -> torch.Tensor | None:
        if not chunk.is_floating_point() or chunk.element_size() < 2 or chunk.dim() > _MAX_NDIM:
            return None  # already 8-bit (an fp8 cache): nothing to gain
        keep = _scale_dims(chunk.dim(), kv_format)
        source = chunk.detach().to("cpu", torch.float32)
        reduce = tuple(d for d in range(chunk.dim()) if d not in keep)
        amax = source.abs().amax(dim=reduce, keepdim=True) if reduce else source.abs()
        scales = (amax / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        values = (source / scales).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        mask = sum(1 << d for d in keep)
        head = _FP8_BODY.pack(mask, scales.numel())
        return _frame(_FP8_ID, chunk, [head, scales.contiguous().view(torch.uint8).numpy().data,
                                       values.view(torch.uint8).numpy().data])


@functools.cache
def _blosc() -> Any:
    """The ``blosc`` module, set to release the GIL (slabs are coded in worker threads) and to
    use no threads of its own, or an ImportError naming the package to install."""
    try:
        import blosc
    except ImportError as exc:
        raise ImportError("lossless codecs need the 'blosc' package: pip install blosc (or the compress extra: pip install '.[compress]' in tierkv's clone)") from exc
    blosc.set_releasegil(True)
    blosc.set_nthreads(1)  # parallel across slabs instead (_each_slab): no thread handoff per block
    return blosc


_SLAB_WORKERS = max(1, min(4, os.cpu_count() or 1))


@functools.cache
def _slab_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=_SLAB_WORKERS, thread_name_prefix="tierkv-codec")


def _each_slab(work: Callable[[int], Any], count: int, nbytes: int) -> list[Any]:
    """``work(i)`` for every slab ``i``, in order: split into one contiguous run of slabs per
    worker thread when the chunk is large enough to gain from it (Blosc releases the GIL).
    Every run has finished before this returns or raises, so no worker writes into (or reads
    from) the caller's memory after a slab failed."""
    if count == 1 or nbytes < _PARALLEL_BYTES or _SLAB_WORKERS == 1:
        return [work(index) for index in range(count)]
    step = -(-count // _SLAB_WORKERS)
    runs = [_slab_pool().submit(lambda run: [work(i) for i in run], range(start, min(count, start + step)))
            for start in range(0, count, step)]
    concurrent.futures.wait(runs)
    return [result for run in runs for result in run.result()]


_CODECS: dict[str, Codec] = {
    "lz4": BloscCodec("lz4", "lz4", "bit", 1),
    "zstd": BloscCodec("zstd", "zstd", "byte", 1),
    "fp8": Fp8Codec(),
}
CODEC_NAMES = ("none", "auto", *_CODECS)
AUTO_CANDIDATES = ("lz4", "zstd")


def codec(name: str) -> Codec:
    """The codec called ``name`` (``none`` stores chunks raw)."""
    if name == "none":
        return Codec()
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)}") from None


def is_lossy(name: str) -> bool:
    """Whether the codec setting ``name`` changes the bytes it stores (``auto`` never does)."""
    return name in _CODECS and _CODECS[name].lossy


def check_available(name: str) -> None:
    """Raise ImportError, naming the package, when ``name`` needs a library not installed."""
    if name in ("auto", "lz4", "zstd"):
        _blosc()


def slab_split(shape: tuple[int, ...], kv_format: str | None) -> int:
    """How many leading dimensions a chunk is split along into slabs: those before the token
    dimension of a KV blob (a token slice of a cache is contiguous within each), none else."""
    if len(shape) == 5 and kv_format in KV_FORMATS:
        return token_dim(kv_format)
    return 0


def _slab_pointers(out: torch.Tensor, split: int) -> list[int] | None:
    """The address of each slab of ``out`` (split along its first ``split`` dimensions), or
    None when ``out`` is not host memory, a slab of it is not contiguous or slabs share memory
    (a broadcast view)."""
    if out.device.type != "cpu" or any(out.shape[d] > 1 and out.stride(d) == 0 for d in range(split)):
        return None
    expected = 1
    for dim in reversed(range(split, out.dim())):
        if out.shape[dim] != 1 and out.stride(dim) != expected:
            return None
        expected *= out.shape[dim]
    if split == 0:
        return [out.data_ptr()]
    index = np.indices(tuple(out.shape[:split])).reshape(split, -1)
    offsets = (np.asarray(out.stride()[:split], dtype=np.int64)[:, None] * index).sum(axis=0)
    return [out.data_ptr() + int(offset) * out.element_size() for offset in offsets]


def _scale_dims(ndim: int, kv_format: str | None) -> tuple[int, ...]:
    """The dimensions fp8 scales vary along: layer, K/V and head of a KV blob
    (``vllm``: ``[layers, 2, tokens, heads, head_size]``, ``huggingface``: heads before
    tokens), the first dimension of anything else."""
    if ndim == 5 and kv_format == "vllm":
        return (0, 1, 3)
    if ndim == 5 and kv_format == "huggingface":
        return (0, 1, 2)
    return (0,) if ndim else ()


def _frame(codec_id: int, chunk: torch.Tensor, parts: list[Any]) -> torch.Tensor:
    """A frame tensor holding the header for ``chunk`` and the body ``parts`` (one copy of each)."""
    shape = tuple(chunk.shape)
    body_len = sum(memoryview(part).nbytes for part in parts)
    header = _FRAME.pack(FRAME_MAGIC, FRAME_VERSION, codec_id, serde.dtype_code(chunk.dtype), len(shape),
                         nbytes_of(shape, chunk.dtype), body_len) + struct.pack(f"<{len(shape)}Q", *shape)
    frame = torch.empty(len(header) + body_len, dtype=torch.uint8)
    gather_bytes([memoryview(part).cast("B") for part in (header, *parts)], frame.numpy().data)
    return frame


def is_frame(stored: torch.Tensor) -> bool:
    """Whether a stored chunk is a frame (a 1-D uint8 chunk that starts with the magic)."""
    return (stored.dtype == torch.uint8 and stored.dim() == 1 and stored.numel() >= _FRAME.size
            and bytes(stored[:4].numpy()) == FRAME_MAGIC)


def read_header(frame: torch.Tensor) -> FrameHeader:
    """Parse and check a frame's header; ChunkFormatError names what is wrong."""
    data = frame.numpy()
    if data.size < _FRAME.size:
        raise ChunkFormatError(f"truncated coded chunk: {data.size} bytes, shorter than its {_FRAME.size}-byte header")
    magic, version, codec_id, dtype_code, ndim, raw_len, body_len = _FRAME.unpack_from(data.data)
    if magic != FRAME_MAGIC or version != FRAME_VERSION:
        raise ChunkFormatError(f"not a tierkv coded chunk (magic {bytes(magic)!r}, version {version}); this tierkv "
                               f"reads {FRAME_MAGIC!r} version {FRAME_VERSION}")
    dtype = serde.code_dtype(dtype_code)
    if codec_id not in _CODEC_IDS or dtype is None or ndim > _MAX_NDIM:
        raise ChunkFormatError(f"corrupt coded chunk header (codec {codec_id}, dtype code {dtype_code}, ndim {ndim})")
    header_len = _FRAME.size + 8 * ndim
    if data.size != header_len + body_len:
        raise ChunkFormatError(f"truncated coded chunk: {data.size} bytes, its header says {header_len + body_len}")
    shape = struct.unpack_from(f"<{ndim}Q", data.data, _FRAME.size)
    if nbytes_of(shape, dtype) != raw_len:
        raise ChunkFormatError(f"corrupt coded chunk header: shape {shape} of {dtype} is not {raw_len} bytes")
    return FrameHeader(codec_id, dtype, tuple(shape), raw_len, header_len)


def decode_into(frame: torch.Tensor, out: torch.Tensor, header: FrameHeader | None = None) -> bool:
    """Decode ``frame`` into ``out``; False (``out`` untouched) when it holds another chunk
    (shape or dtype), ChunkFormatError when it is damaged (checked before ``out`` is written)."""
    header = read_header(frame) if header is None else header
    if out.dtype != header.dtype or tuple(out.shape) != header.shape:
        return False
    body = frame[header.header_len :].numpy()
    if header.codec == _FP8_ID:
        _fp8_into(body, out, header)
    else:
        _blosc_into(body, out, header)
    return True


def decode(frame: torch.Tensor) -> torch.Tensor:
    """A frame decoded into a fresh host tensor."""
    header = read_header(frame)
    out = empty_host(header.shape, header.dtype)
    decode_into(frame, out, header)
    return out


def _blosc_slabs(body: np.ndarray, header: FrameHeader) -> tuple[int, list[np.ndarray]]:
    """A Blosc body as (dimensions split along, its Blosc buffers): codec id 1 is one buffer
    for the whole chunk, id 3 a table of one buffer per slab."""
    if header.codec == _BLOSC_ID:
        return 0, [body]
    if body.size < _SLABS_BODY.size:
        raise ChunkFormatError("corrupt coded chunk: body shorter than its slab table")
    split, count = _SLABS_BODY.unpack_from(body.data)
    table_end = _SLABS_BODY.size + 4 * count
    if split > len(header.shape) or count != math.prod(header.shape[:split]) or not count or \
            body.size < table_end:
        raise ChunkFormatError(f"corrupt coded chunk: {count} slabs split along {split} dimensions do not describe "
                               f"shape {header.shape} in {body.size} body bytes")
    lengths = np.frombuffer(body.data, dtype="<u4", count=count, offset=_SLABS_BODY.size).astype(np.int64)
    if table_end + int(lengths.sum()) != body.size:
        raise ChunkFormatError(f"truncated coded chunk: its slabs say {table_end + int(lengths.sum())} body bytes, "
                               f"it has {body.size}")
    ends = table_end + np.cumsum(lengths)
    return split, [body[end - length : end] for end, length in zip(ends.tolist(), lengths.tolist())]


def _blosc_into(body: np.ndarray, out: torch.Tensor, header: FrameHeader) -> None:
    """Each Blosc buffer of the body decompressed at its slab's address in ``out`` (through one
    staging buffer where ``out``'s slabs are not contiguous host memory)."""
    blosc = _blosc()
    split, slabs = _blosc_slabs(body, header)
    if not header.raw_len:
        raise ChunkFormatError("corrupt coded chunk: a Blosc frame of an empty chunk (empty chunks are stored raw)")
    slab_bytes = header.raw_len // len(slabs)
    for index, slab in enumerate(slabs):  # every Blosc header, before a byte of ``out`` is written
        try:
            nbytes, cbytes, _ = blosc.get_cbuffer_sizes(slab)  # takes an array, not a memoryview
        except Exception as exc:
            raise ChunkFormatError(f"corrupt coded chunk: slab {index} is not a Blosc buffer ({exc})") from exc
        if nbytes != slab_bytes or cbytes != slab.size or not blosc.cbuffer_validate(slab):
            raise ChunkFormatError(f"corrupt coded chunk: slab {index} holds {nbytes} bytes ({cbytes} stored) where "
                                   f"{slab_bytes} bytes in {slab.size} were expected")
    pointers = _slab_pointers(out, split)
    target = out if pointers is not None else empty_host(header.shape, header.dtype)
    if pointers is None:
        pointers = _slab_pointers(target, split)
    assert pointers is not None  # a fresh host tensor is contiguous
    copies.count(header.raw_len)

    def decompress(index: int) -> None:
        try:
            blosc.decompress_ptr(slabs[index], pointers[index])
        except Exception as exc:  # the Blosc header was sound, the blocks were not
            raise ChunkFormatError(f"corrupt coded chunk: Blosc could not decode slab {index} ({exc})") from exc

    _each_slab(decompress, len(slabs), header.raw_len)
    if target is not out:
        copy_into(out, target)


def _fp8_into(body: np.ndarray, out: torch.Tensor, header: FrameHeader) -> None:
    if body.size < _FP8_BODY.size:
        raise ChunkFormatError("corrupt fp8 chunk: body shorter than its scale header")
    mask, count = _FP8_BODY.unpack_from(body.data)
    ndim = len(header.shape)
    scale_shape = tuple(size if mask >> d & 1 else 1 for d, size in enumerate(header.shape))
    values = int(np.prod(header.shape, dtype=np.int64))
    if mask >> ndim or int(np.prod(scale_shape, dtype=np.int64)) != count or \
            body.size != _FP8_BODY.size + 4 * count + values:
        raise ChunkFormatError(f"corrupt fp8 chunk: {count} scales over dims mask {mask:#x} and {body.size} body "
                               f"bytes do not describe shape {header.shape}")
    start = _FP8_BODY.size
    scales = torch.from_numpy(body[start : start + 4 * count].copy()).view(torch.float32).reshape(scale_shape)
    quantized = torch.from_numpy(body[start + 4 * count :]).view(torch.float8_e4m3fn).reshape(header.shape)
    copies.count(header.raw_len)
    out.copy_(quantized.to(torch.float32).mul_(scales))
