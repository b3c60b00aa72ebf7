"""A byte tier that keeps its chunks coded (``codec:`` in a tier's YAML, ``tierkv.backend.codecs``).

One module of about 410 lines, by choice: one wrapper over one backend: every call of the
backend contract passes through it (puts encode, reads decode, ``auto`` chooses, reads feed the
cost model), and a call split from its wrapper would need the wrapper's state; the codecs
themselves are ``tierkv.backend.codecs``.

``CodedBackend`` sits between the tier's handle and its backend: a put encodes each
chunk into a frame (or leaves it raw when coding would not pay), a read decodes frames
into the caller's destinations. The backend stores, checksums and evicts frames like any
chunk, so lmdb, fs, s3, mooncake and plugin backends all carry coded chunks unchanged.

Keys: a lossless codec keeps the chunk's key (a frame decodes to exactly the chunk), so
writers with different lossless codecs, or ``auto`` deciding per batch, share one key
space; a reader tells a frame from a raw chunk by what it finds. A lossy codec (fp8)
appends its marker to the key's hash (``<hash>.fp8``): an exact reader never finds it.

``auto``: the first put times LZ4 and Zstd on a chunk (ratio, encode and decode speed);
each batch then picks the candidate, or none, that gives the shortest expected read --
``transfer(stored bytes) + decode`` on the tier's measured speed line -- and codes only
when that is at least 10% shorter than reading the chunk raw. The cost model sees the same
numbers: ``CodedBackend.split`` is what ``tierkv.policy.planner.TierSpeed`` uses to turn
a prefix's bytes into stored bytes and decode time.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.backend import codecs
from tierkv.backend.contract import NamesVictims, StorageBackend, check_batch, check_destinations
from tierkv.chunks import ownership
from tierkv.chunks.keys import KV_FORMATS, CacheKey
from tierkv.chunks.memory import copy_into
from tierkv.errors import ChunkFormatError

AUTO_MARGIN = 0.90
"""``auto`` codes only when the expected read is at most this fraction of the raw one. The
expectation leaves out the CPU time decoding takes from the transfer running beside it (5-10%
near the break-even point on two cores), and near that point a misjudged decode speed would
cost more than coding saves."""
_EMA = 0.2  # weight of the newest batch in the running ratio and decode speed


class CodingEstimate:
    """Running estimates of what coding does to this tier's reads: the share of a chunk's bytes
    that is stored (``stored_fraction``, raw chunks count as 1), seconds spent decoding per
    byte read (``decode_s_per_byte``) and per byte of a frame (``frame_decode_s_per_byte``:
    the codec's real speed on this read path, a staging copy included where there is one)."""

    def __init__(self) -> None:
        self.stored_fraction = 1.0
        self.decode_s_per_byte = 0.0
        self.frame_decode_s_per_byte: float | None = None
        self.reads = 0

    def observe(self, raw: int, stored: int, decode_s: float, frame_bytes: int) -> None:
        if raw <= 0:
            return
        weight = 1.0 if self.reads == 0 else _EMA
        self.stored_fraction += weight * (stored / raw - self.stored_fraction)
        self.decode_s_per_byte += weight * (decode_s / raw - self.decode_s_per_byte)
        if frame_bytes:
            speed = decode_s / frame_bytes
            last = self.frame_decode_s_per_byte
            self.frame_decode_s_per_byte = speed if last is None else last + _EMA * (speed - last)
        self.reads += 1


@dataclass
class ReadTally:
    """What one read moved and decoded, counted in the decoding thread and applied to the
    backend's counters and estimates on the event loop (``CodedBackend._account``)."""

    stored_bytes: int = 0  # bytes that came from the tier for the chunks served
    raw_bytes: int = 0  # bytes served
    frame_bytes: int = 0  # bytes served out of frames
    decode_s: float = 0.0
    frames: int = 0
    raw_chunks: int = 0
    corrupt: list[tuple[CacheKey, ChunkFormatError]] = field(default_factory=list)

    def raw(self, nbytes: int) -> None:
        self.raw_chunks += 1
        self.stored_bytes += nbytes
        self.raw_bytes += nbytes

    def frame(self, stored: int, nbytes: int, seconds: float) -> None:
        self.frames += 1
        self.stored_bytes += stored
        self.raw_bytes += nbytes
        self.frame_bytes += nbytes
        self.decode_s += seconds


class Trial:
    """One codec measured on one chunk: stored fraction, encode and decode seconds per byte."""

    def __init__(self, name: str, fraction: float, encode_s_per_byte: float, decode_s_per_byte: float) -> None:
        self.name, self.fraction = name, fraction
        self.encode_s_per_byte, self.decode_s_per_byte = encode_s_per_byte, decode_s_per_byte

    def describe(self) -> dict[str, float]:
        return {"ratio": round(1.0 / self.fraction, 3) if self.fraction else 0.0,
                "encode_GBps": round(1e-9 / self.encode_s_per_byte, 3) if self.encode_s_per_byte else 0.0,
                "decode_GBps": round(1e-9 / self.decode_s_per_byte, 3) if self.decode_s_per_byte else 0.0}


def trial(name: str, chunk: torch.Tensor, kv_format: str | None, runs: int = 3) -> Trial:
    """Encode and decode ``chunk`` with codec ``name``, timed (the median of ``runs``). Each
    decode goes into a token slice of a cache twice the chunk's length, touched once before,
    as a read into a serving engine's preallocated cache does: the speed the read path sees
    (slabs scattered across the cache), not the codec's peak on one contiguous buffer."""
    codec = codecs.codec(name)
    raw = max(1, chunk.numel() * chunk.element_size())
    along = codecs.slab_split(tuple(chunk.shape), kv_format)  # the token dimension of a KV blob, else 0
    if chunk.dim():
        wide = list(chunk.shape)
        wide[along] *= 2
        destination = torch.zeros(wide, dtype=chunk.dtype).narrow(along, chunk.shape[along], chunk.shape[along])
    else:
        destination = torch.zeros((), dtype=chunk.dtype)
    encodes, decodes = [], []
    frame = None
    for _ in range(runs):
        started = time.perf_counter()
        frame = codec.encode(chunk, kv_format)
        encodes.append(time.perf_counter() - started)
        if frame is None:
            return Trial(name, 1.0, statistics.median(encodes) / raw, 0.0)
        started = time.perf_counter()
        codecs.decode_into(frame, destination)
        decodes.append(time.perf_counter() - started)
    assert frame is not None
    encode_s, decode_s = statistics.median(encodes), statistics.median(decodes)
    return Trial(name, frame.numel() / raw, encode_s / raw, decode_s / raw)


class CodedBackend(StorageBackend):
    """``inner`` with its chunks coded by ``codec`` (a name of ``tierkv.backend.codecs.CODEC_NAMES``
    other than none). Everything but the coding is the inner backend's: capacity, counters,
    persistence, what it would evict."""

    def __init__(self, inner: StorageBackend, codec: str, transfer_seconds: Callable[[int], float] | None = None,
                 on_transfer: Callable[[int, float], None] | None = None) -> None:
        if codec == "none":
            raise ValueError(f"tier {inner.name!r}: CodedBackend needs a codec; 'none' is the backend itself")
        codecs.check_available(codec)
        super().__init__(inner.name, inner.capacity)
        self.inner = inner
        self.counters = inner.counters  # one set of counters for the tier
        self.persistent = inner.persistent  # type: ignore[misc]  # the tier's own capabilities
        self.bounded = inner.bounded  # type: ignore[misc]
        self.streams_into_destination = inner.streams_into_destination  # type: ignore[misc]
        self.speed_seed = inner.speed_seed  # type: ignore[misc]
        self.setting = codec
        self.auto = codec == "auto"
        self.codec: codecs.Codec = codecs.Codec() if self.auto else codecs.codec(codec)
        self.marker = self.codec.marker
        self.trials: dict[str, Trial] = {}
        self._choosing = threading.Lock()  # concurrent puts encode in worker threads: one trial, one choice
        self.estimate = CodingEstimate()
        self._transfer_seconds = transfer_seconds or (lambda nbytes: nbytes / inner.speed_seed.bytes_per_s)
        self.on_transfer = on_transfer  # (stored bytes, seconds) of each read: the tier's speed line
        self.coding = {"frames_written": 0, "raw_written": 0, "bytes_before_coding": 0, "bytes_stored": 0,
                       "frames_read": 0, "raw_read": 0, "decoded_bytes": 0}

    # -- keys -----------------------------------------------------------------------------
    def _stored_key(self, key: CacheKey) -> CacheKey:
        if not self.marker:
            return key
        return CacheKey(key.fmt, key.model_name, key.world_size, key.worker_id, f"{key.chunk_hash}.{self.marker}",
                        key.scope)

    def _plain_key(self, key: CacheKey) -> CacheKey:
        suffix = f".{self.marker}"
        if not self.marker or not key.chunk_hash.endswith(suffix):
            return key
        return CacheKey(key.fmt, key.model_name, key.world_size, key.worker_id, key.chunk_hash[: -len(suffix)],
                        key.scope)

    def _stored(self, keys: Sequence[CacheKey]) -> list[CacheKey]:
        return [self._stored_key(key) for key in keys] if self.marker else list(keys)

    # -- the codec of a batch -------------------------------------------------------------
    def choose(self, chunk: torch.Tensor, kv_format: str | None) -> codecs.Codec:
        """The codec for a batch like ``chunk``: the configured one, or under ``auto`` the
        candidate with the shortest expected read (none when coding does not pay)."""
        if not self.auto:
            return self.codec
        with self._choosing:
            if not self.trials:
                self.trials = {name: trial(name, chunk, kv_format) for name in codecs.AUTO_CANDIDATES}
            measured_speed = self.estimate.frame_decode_s_per_byte
            if measured_speed is not None and self.codec.name in self.trials:  # reads measured the codec in use
                self.trials[self.codec.name].decode_s_per_byte = measured_speed
            raw = chunk.numel() * chunk.element_size()
            best, best_s = "none", self._transfer_seconds(raw) * AUTO_MARGIN
            for name, measured in self.trials.items():
                seconds = self._transfer_seconds(int(raw * measured.fraction)) + raw * measured.decode_s_per_byte
                if measured.fraction < 1.0 and seconds < best_s:
                    best, best_s = name, seconds
            if best != self.codec.name:
                self.codec = codecs.codec(best)
            return self.codec

    def split(self, nbytes: int) -> tuple[int, float]:
        """A read of chunks of ``nbytes`` bytes as (bytes it moves from the tier, seconds it
        spends decoding), from the reads so far; before any, from the codec chosen and its trial."""
        estimate = self.estimate
        if estimate.reads:
            return int(nbytes * estimate.stored_fraction), nbytes * estimate.decode_s_per_byte
        measured = self.trials.get(self.codec.name)
        if measured is not None:
            return int(nbytes * measured.fraction), nbytes * measured.decode_s_per_byte
        written = self.coding["bytes_before_coding"]
        fraction = self.coding["bytes_stored"] / written if written else 1.0
        return int(nbytes * fraction), 0.0

    def _encode(self, chunks: Sequence[torch.Tensor], kv_formats: Sequence[str | None]) -> list[torch.Tensor]:
        """Each chunk as it will be stored: its frame, or the chunk itself where coding does not
        pay (exact, so harmless under a lossy key too). Runs in a worker thread."""
        codec = self.choose(chunks[0], kv_formats[0])
        return [frame if (frame := codec.encode(chunk, fmt)) is not None else chunk
                for chunk, fmt in zip(chunks, kv_formats)]

    def _count_written(self, chunks: Sequence[torch.Tensor], stored: Sequence[torch.Tensor]) -> None:
        for chunk, kept in zip(chunks, stored):
            self.coding["bytes_before_coding"] += chunk.nbytes
            self.coding["bytes_stored"] += kept.nbytes
            self.coding["raw_written" if kept is chunk else "frames_written"] += 1

    # -- writes -----------------------------------------------------------------------------
    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self.batched_put([key], [chunk])

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        self._ensure_open()
        check_batch(keys, chunks)
        if not keys:
            return 0
        formats = [key.fmt if key.fmt in KV_FORMATS else None for key in keys]
        stored = await ownership.in_thread(self._encode, chunks, formats)
        self._count_written(chunks, stored)
        return await self.inner.batched_put(self._stored(keys), stored)

    # -- reads ------------------------------------------------------------------------------
    async def get(self, key: CacheKey) -> torch.Tensor | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        self._ensure_open()
        started = time.perf_counter()
        found = await self.inner.batched_get(self._stored(keys))
        transfer_s = time.perf_counter() - started
        results, tally = await ownership.in_thread(self._decode_found, keys, found, None)
        await self._account(tally, transfer_s)
        return results

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Frames are read whole, then decoded into ``outs``. While ``auto`` writes chunks raw
        (or has written nothing yet), the read goes straight into ``outs`` first (one copy, as
        without a codec) and only what was not there raw is read again whole, as frames;
        otherwise every chunk is read whole and a raw one among them copied in."""
        self._ensure_open()
        check_destinations(keys, outs)
        hits = [False] * len(keys)
        pending = list(range(len(keys)))
        stored_keys = self._stored(keys)
        if self.codec.name == "none":  # auto, now writing raw chunks: those are read in place
            started = time.perf_counter()
            direct = await self.inner.batched_get_into(stored_keys, outs)
            tally = ReadTally()
            for out, hit in zip(outs, direct):
                if hit:
                    tally.raw(out.nbytes)
            await self._account(tally, time.perf_counter() - started)
            hits = list(direct)
            pending = [i for i, hit in enumerate(direct) if not hit]
        if not pending:
            return hits
        started = time.perf_counter()
        found = await self.inner.batched_get([stored_keys[i] for i in pending])
        transfer_s = time.perf_counter() - started
        targets = [outs[i] for i in pending]
        decoded, tally = await ownership.in_thread(self._decode_found, [keys[i] for i in pending], found, targets)
        await self._account(tally, transfer_s)
        for i, hit in zip(pending, decoded):
            hits[i] = hit is True
        return hits

    def _decode_found(self, keys: Sequence[CacheKey], found: Sequence[torch.Tensor | None],
                      outs: Sequence[torch.Tensor] | None) -> tuple[list[Any], ReadTally]:
        """Decode what a read found: into ``outs`` (True / False per key), or into fresh tensors
        (the tensor / None); with the read's tally. A damaged frame is a miss, in the tally's
        ``corrupt``. Runs in a worker thread: it touches no state of the backend."""
        results: list[Any] = []
        tally = ReadTally()
        for key, stored, out in zip(keys, found, outs if outs is not None else [None] * len(found)):
            if stored is None:
                results.append(False if out is not None else None)
            elif out is not None and _fits(out, stored):  # a raw chunk (a frame never fits a chunk)
                copy_into(out, stored)
                tally.raw(stored.nbytes)
                results.append(True)
            elif not codecs.is_frame(stored):
                if out is None:
                    tally.raw(stored.nbytes)
                results.append(stored if out is None else False)
            else:
                started = time.perf_counter()
                decoded: torch.Tensor | None
                try:
                    if out is None:
                        decoded = codecs.decode(stored)
                    else:  # None: a frame of another chunk (shape, dtype)
                        decoded = out if codecs.decode_into(stored, out) else None
                except ChunkFormatError as exc:
                    tally.corrupt.append((key, exc))
                    decoded = None
                if decoded is not None:
                    tally.frame(stored.nbytes, decoded.nbytes, time.perf_counter() - started)
                results.append(decoded if out is None else decoded is not None)
        return results, tally

    async def _account(self, tally: ReadTally, transfer_s: float) -> None:
        """Apply a read's tally on the event loop: counters, the coding estimate, the tier's speed
        line (bytes moved over the transfer time); count and delete damaged frames (a failed
        delete leaves one to be dropped at its next read)."""
        self.coding["raw_read"] += tally.raw_chunks
        self.coding["frames_read"] += tally.frames
        self.coding["decoded_bytes"] += tally.frame_bytes
        if tally.raw_bytes:
            self.estimate.observe(tally.raw_bytes, tally.stored_bytes, tally.decode_s, tally.frame_bytes)
            if self.on_transfer is not None:
                self.on_transfer(tally.stored_bytes, transfer_s)
        if tally.corrupt:
            self.count_corrupt([(key.to_string(), exc) for key, exc in tally.corrupt])
            for key, _ in tally.corrupt:
                try:
                    await self.inner.delete(self._stored_key(key))
                except Exception:
                    return

    # -- questions, deletes, lifecycle ---------------------------------------------------------
    async def contains(self, key: CacheKey) -> bool:
        self._ensure_open()
        return await self.inner.contains(self._stored_key(key))

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        self._ensure_open()
        return await self.inner.batched_contains(self._stored(keys))

    def batched_contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        return self.inner.batched_contains_nowait(self._stored(keys))

    async def delete(self, key: CacheKey) -> bool:
        self._ensure_open()
        return await self.inner.delete(self._stored_key(key))

    def next_victims(self, chunk_nbytes: Sequence[int]) -> Sequence[CacheKey] | None:
        """What the inner tier would evict for chunks this size once coded (``tinylfu``)."""
        if not isinstance(self.inner, NamesVictims):
            return None
        fraction = self.split(1 << 20)[0] / (1 << 20)
        victims = self.inner.next_victims([max(1, int(n * fraction)) for n in chunk_nbytes])
        return None if victims is None else [self._plain_key(key) for key in victims]

    async def close(self) -> None:
        await self.inner.close()
        self._closed = True

    @property
    def capacity_bytes(self) -> int | None:
        return self.inner.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def closed(self) -> bool:
        return self.inner.closed or self._closed

    def scope_usage(self) -> dict[str, dict[str, int]] | None:
        return self.inner.scope_usage()

    async def drop_scope(self, model_name: str, scope: str) -> int | None:
        self._ensure_open()
        return await self.inner.drop_scope(model_name, scope)  # coded keys keep model and scope

    def stats(self) -> dict[str, Any]:
        entry = self.inner.stats()
        written, stored = self.coding["bytes_before_coding"], self.coding["bytes_stored"]
        stored_bytes, decode_s = self.split(1 << 20)
        entry["codec"] = {
            "setting": self.setting, "now": self.codec.describe(), "lossy": self.codec.lossy, **self.coding,
            "write_ratio": round(written / stored, 3) if stored else None,
            "expected_stored_fraction": round(stored_bytes / (1 << 20), 4),
            "expected_decode_GBps": round((1 << 20) / decode_s / 1e9, 3) if decode_s else None,
            "trials": {name: measured.describe() for name, measured in self.trials.items()},
        }
        return entry


def _fits(out: torch.Tensor, stored: torch.Tensor) -> bool:
    return out.dtype == stored.dtype and tuple(out.shape) == tuple(stored.shape)
