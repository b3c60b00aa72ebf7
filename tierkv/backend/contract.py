"""The storage backend contract every tier implements (async).

One module of about 660 lines, by choice: the contract (the base classes, the capability
Protocols and the helpers backends call) is what a backend author reads, in one place, and
each method carries its part of it in its docstring, which the API reference renders.

Backends are small async stores of whole chunks under ``tierkv.chunks.keys.CacheKey``.
The batched methods have defaults built on the single-key ones; a backend overrides
them when it can do better (one transaction, one pipeline, parallel requests).

Contract, checked by ``tierkv.testing.BackendTests``:

- ``get`` of a missing key is ``None``, never an exception; batched results keep input order.
- ``put`` copies the chunk: the caller may reuse its tensor as soon as ``put`` returns,
  and a tensor returned by ``get`` is the caller's own (mutating it changes nothing stored).
- ``batched_get_into`` writes each found chunk into the caller's destination tensor and
  reports True only for a destination that now holds the whole, verified chunk. A chunk
  whose shape or dtype differs from its destination is a miss.
- Any method after ``close()`` raises ``tierkv.errors.BackendClosedError``.
- A chunk that cannot fit raises ``tierkv.errors.CapacityError`` and loses nothing
  stored before; a bounded backend evicts least-recently-used chunks to make room.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from tierkv.backend.options import Option, format_size, parse_options
from tierkv.chunks import serde
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.memory import copy_into
from tierkv.errors import BackendClosedError, CapacityError, ChunkFormatError, TierFullError
from tierkv.policy.planner import SpeedSeed

logger = logging.getLogger("tierkv.backend")


class StorageBackend(abc.ABC):
    """Async store of KV chunks; one instance is one tier.

    Subclass it (or [BlobBackend][tierkv.backend.BlobBackend] for a byte store), implement
    ``put``, ``get``, ``contains`` and ``delete``, and check it with
    [BackendTests][tierkv.testing.BackendTests]. The class attributes describe capabilities
    so the engine and the conformance suite can adapt.

    Args:
        name: The tier's name (from the configuration).
        capacity: The tier's capacity in bytes; None: none given.

    Raises:
        CapacityError: if the class declares ``requires_capacity`` and ``capacity`` is None.

    Attributes:
        persistent: Whether what it stores survives close and reopen.
        bounded: Whether it evicts to stay within ``capacity``.
        requires_capacity: Whether the YAML must give a capacity.
        streams_into_destination: Whether ``batched_get_into`` may leave bytes in the
            destination of a chunk it then reports missing, because it reads before it can
            verify; the engine then reads into a staging buffer rather than straight into
            memory the caller owns.
        options: The backend's own YAML keys, each an [Option][tierkv.backend.Option]
            (validated by ``validate_options``).
        speed_seed: A get batch's fixed cost and bandwidth before any was timed: where the
            engine's estimate of the tier starts (``tierkv.policy.planner``).
        counters: Evictions, evicted bytes and corrupt chunks so far (in ``stats()``).
    """

    persistent: ClassVar[bool] = False
    bounded: ClassVar[bool] = True
    requires_capacity: ClassVar[bool] = False
    streams_into_destination: ClassVar[bool] = False
    options: ClassVar[Mapping[str, Option]] = {}
    # what a get batch costs before the engine has timed any: the seed of its cost model
    speed_seed: ClassVar[SpeedSeed] = SpeedSeed(fixed_s=1e-3, bytes_per_s=1e9)

    def __init__(self, name: str, capacity: int | None = None) -> None:
        if self.requires_capacity and capacity is None:
            raise CapacityError(f"tier {name!r}: backend {type(self).__name__} needs a capacity")
        self.name = name
        self.capacity = capacity
        self._closed = False
        self.counters: dict[str, int] = {"evictions": 0, "evicted_bytes": 0, "corrupt_chunks": 0}

    # -- construction from YAML -------------------------------------------------
    @classmethod
    def validate_options(cls, raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        """Check this backend's YAML options.

        Args:
            raw: The tier's keys that are not common to every tier.
            path: The tier's YAML path (``tiers[1]``), for error messages.

        Returns:
            The options converted to their kinds, defaults filled in (a dict whose repr hides
                the secret ones).

        Raises:
            ConfigError: if an option is unknown, missing, of the wrong kind or out of range
                (the message names ``path`` and what was expected).
        """
        return parse_options(cls.options, raw, path)

    @classmethod
    def from_options(cls, name: str, capacity: int | None, options: Mapping[str, Any]) -> StorageBackend:
        """Build a tier from validated options (the registry calls this).

        Args:
            name: The tier's name.
            capacity: The tier's capacity in bytes, or None.
            options: What ``validate_options`` returned, passed as keyword arguments.

        Returns:
            The backend.

        Raises:
            CapacityError: if the class declares ``requires_capacity`` and ``capacity`` is None.
        """
        return cls(name=name, capacity=capacity, **options)

    # -- single-key contract --------------------------------------------------------
    @abc.abstractmethod
    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        """Store a copy of ``chunk`` under ``key`` (replacing any older value).

        The caller may reuse its tensor as soon as ``put`` returns. A bounded backend evicts
        least-recently-used chunks to make room.

        Args:
            key: The chunk's key.
            chunk: The chunk's KV blob (possibly not contiguous).

        Raises:
            CapacityError: if the chunk cannot fit; nothing stored before is lost.
            BackendClosedError: if the backend is closed.
        """

    @abc.abstractmethod
    async def get(self, key: CacheKey) -> torch.Tensor | None:
        """The chunk stored under ``key``, as a tensor the caller owns.

        Args:
            key: The chunk's key.

        Returns:
            The chunk (changing it changes nothing stored), or None for a miss: a missing key
                is never an exception.

        Raises:
            BackendClosedError: if the backend is closed.
        """

    @abc.abstractmethod
    async def contains(self, key: CacheKey) -> bool:
        """Whether ``key`` is stored (a hint: a later get may still miss).

        Args:
            key: The chunk's key.

        Returns:
            True if the key is stored.

        Raises:
            BackendClosedError: if the backend is closed.
        """

    @abc.abstractmethod
    async def delete(self, key: CacheKey) -> bool:
        """Remove ``key``.

        Args:
            key: The chunk's key.

        Returns:
            True if it was there.

        Raises:
            BackendClosedError: if the backend is closed.
        """

    # -- batched defaults ---------------------------------------------------------------
    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Store many chunks; later duplicates win.

        The default calls ``put`` for each; override it when the medium does better (one
        transaction, one pipeline, parallel requests).

        Args:
            keys: One key per chunk.
            chunks: The chunks.

        Returns:
            How many chunks were stored.

        Raises:
            ValueError: if ``keys`` and ``chunks`` differ in length.
            CapacityError: if a chunk cannot fit.
            BackendClosedError: if the backend is closed.
        """
        check_batch(keys, chunks)
        for key, chunk in zip(keys, chunks):
            await self.put(key, chunk)
        return len(keys)

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The chunks stored under ``keys``.

        The default calls ``get`` for each key, concurrently.

        Args:
            keys: The keys to read.

        Returns:
            The chunks in input order, None for each miss.

        Raises:
            BackendClosedError: if the backend is closed.
        """
        return list(await asyncio.gather(*(self.get(key) for key in keys)))

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is stored.

        The default calls ``contains`` for each key, concurrently.

        Args:
            keys: The keys to look for.

        Returns:
            One flag per key, in input order.

        Raises:
            BackendClosedError: if the backend is closed.
        """
        return list(await asyncio.gather(*(self.contains(key) for key in keys)))

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Read each chunk into ``outs[i]``.

        The default reads with ``batched_get`` and copies, so it costs a second copy;
        override it to read straight into the destination (one copy) when the medium
        allows. A miss leaves its destination untouched unless the class declares
        ``streams_into_destination``; a chunk whose shape or dtype differs from its
        destination is a miss.

        Args:
            keys: The keys to read.
            outs: One destination tensor per key (possibly a strided slice of a larger one).

        Returns:
            Per key, True where the destination now holds the whole, verified chunk.

        Raises:
            ValueError: if ``keys`` and ``outs`` differ in length, or a destination is not a
                tensor.
            BackendClosedError: if the backend is closed.
        """
        check_destinations(keys, outs)
        chunks = await self.batched_get(keys)
        return [fill_destination(out, chunk) for out, chunk in zip(outs, chunks)]

    def batched_contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        """Whether each key is held, answered from memory at once.

        Called from any thread (a scheduler asking "how much is cached?" must not wait on
        the engine's event loop): read shared state only, never mutate it. Tiers with an
        in-memory index override it; the engine falls back to ``batched_contains``.

        Args:
            keys: The keys to look for.

        Returns:
            One flag per key, or None when answering needs I/O (the default).
        """
        return None

    async def close(self) -> None:
        """Release resources; later calls raise ``BackendClosedError``. Idempotent."""
        self._closed = True

    # -- accounting ---------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int | None:
        """The capacity in bytes now (a memory tier under pressure reports its lowered limit); None: unbounded."""
        return self.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes this tier holds (as far as this process knows)."""
        return 0

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    def scope_usage(self) -> dict[str, dict[str, int]] | None:
        """What this tier holds per key scope, without naming any key.

        A scope is the digest of a model revision, adapter and tenant salt
        (``tierkv.chunks.identity``).

        Returns:
            ``{scope: {"chunks": n, "bytes": b}}``, or None when the tier cannot list its keys
                cheaply (a remote store; the default).
        """
        return None

    async def drop_scope(self, model_name: str, scope: str) -> int | None:
        """Remove every chunk of one scope of one model: a tenant's or an adapter's chunks,
        dropped when its sessions end (``AsyncEngine.drop_identity``).

        A tier whose store another process shares drops what that store holds, whoever wrote
        it; a reader already holding a chunk's bytes keeps them.

        Args:
            model_name: The ``model_name`` field of the keys to drop. A tier whose entries
                carry only the scope may match on the scope alone: a scope's digest binds the
                model's revision.
            scope: Their ``scope`` field (``CacheKey.scope``: the identity's digest).

        Returns:
            How many chunks left, or None when the tier cannot find its chunks by scope (the
                default: it keeps them until its own eviction takes them).

        Raises:
            BackendClosedError: if the backend is closed.
        """
        return None

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy, safe to print (no credentials).

        Returns:
            The backend's class name, ``capacity_bytes``, ``used_bytes`` and ``counters``.
        """
        return {
            "backend": type(self).__name__,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            **self.counters,
        }

    def count_corrupt(self, dropped: Sequence[tuple[str, object]]) -> None:
        """Count and report chunks that failed verification and are being deleted.

        The one place a corrupt chunk is counted and reported (a miss to its reader). How to
        delete one is the store's own business; the count (``counters["corrupt_chunks"]``, in
        ``stats()``) and the warning are the same for all.

        Args:
            dropped: ``(which chunk, why)`` for each chunk dropped.
        """
        self.counters["corrupt_chunks"] += len(dropped)
        for which, why in dropped:
            logger.warning("tier %r: dropping corrupt chunk %s: %s", self.name, which, why)

    def _ensure_open(self) -> None:
        if self._closed:
            raise BackendClosedError(f"tier {self.name!r} ({type(self).__name__}) is closed")

    def _check_fits(self, nbytes: int) -> None:
        if self.capacity is not None and nbytes > self.capacity:
            raise CapacityError(
                f"tier {self.name!r}: a chunk of {format_size(nbytes)} cannot fit in its capacity of "
                f"{format_size(self.capacity)}"
            )

    def _count_eviction(self, nbytes: int) -> None:
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += nbytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, capacity={self.capacity!r})"


class ChunkHold(Protocol):
    """The bytes of one stored chunk, valid until ``release`` (see ``InPlaceTier``)."""

    chunk: torch.Tensor

    def release(self) -> None: ...


@runtime_checkable
class InPlaceTier(Protocol):
    """A tier whose chunks live in memory that may be written and read in place.

    The memory tiers: the engine fills lower tiers from the copy such a tier holds, and
    connectors gather into, and scatter out of, its slabs, so no byte is copied twice.
    """

    async def put_with(self, keys: Sequence[CacheKey], layouts: Sequence[tuple[tuple[int, ...], torch.dtype]],
                       write: Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]],
                       on_commit: Callable[[], None] | None = None) -> int:
        """Store chunks of the given layouts by letting ``write`` fill their memory in place.

        Args:
            keys: One key per chunk.
            layouts: The ``(shape, dtype)`` of each chunk.
            write: Called with the chunks' memory (key -> tensor view) and awaited; it fills
                them. It must not return while a copy into the views still runs.
            on_commit: Runs right at the commit, before another task can evict the chunks.

        Returns:
            How many chunks were stored.

        Raises:
            CapacityError: if the chunks cannot fit.
            BackendClosedError: if the tier is closed.
        """
        ...

    def hold(self, keys: Sequence[CacheKey], pin: bool = True) -> Sequence[ChunkHold | None]:
        """The bytes of each stored chunk, valid until released.

        Args:
            keys: The chunks' keys.
            pin: Keep each held chunk from eviction until its hold is released.

        Returns:
            A ``ChunkHold`` per key (``hold.chunk`` is the tier's memory; call
                ``hold.release()`` when done), None for misses.

        Raises:
            BackendClosedError: if the tier is closed.
        """
        ...


DemoteSink = Callable[[list[CacheKey], list[torch.Tensor]], Awaitable[None]]
"""Where a tier hands the chunks it evicts (write-back): ``await sink(keys, chunks)``."""


@runtime_checkable
class SupportsPressure(Protocol):
    """A tier whose capacity follows memory pressure (the memory tiers).

    The engine watches the memory it lives in and lowers or restores its effective
    capacity.

    Attributes:
        device: Where the tier's memory is.
        device_memory: Whether the capacity is accelerator memory (watched through NVML on
            a CUDA ``device``, with the gpu watermarks); otherwise host memory (the host
            watermarks).
    """

    device: torch.device
    device_memory: bool

    def set_capacity_limit(self, limit: int) -> None:
        """Set the effective capacity.

        Args:
            limit: The capacity in bytes to keep to, never above the configured one (a higher
                limit restores the configured capacity).
        """
        ...

    async def shrink_to_limit(self) -> int:
        """Free (demote) chunks until usage fits the effective capacity.

        Returns:
            The bytes freed.
        """
        ...


@runtime_checkable
class SupportsDemotion(Protocol):
    """A tier that hands what it evicts to ``demote_sink`` when one is set (write-back).

    Attributes:
        demote_sink: Awaited as ``sink(keys, chunks)`` with the chunks the tier evicts;
            None: evicted chunks are dropped.
    """

    demote_sink: DemoteSink | None


@runtime_checkable
class ReclaimsHeldMemory(Protocol):
    """A tier whose memory write-through fills hold while they wait for the tiers below.

    The memory tiers: when a store needs that memory it calls ``reclaim``.

    Attributes:
        reclaim: Awaited as ``reclaim(need, waited)``: drops such fills and returns the
            bytes their holds give back; None until the engine sets it (when fills to the
            tiers below hold this tier's memory).
    """

    reclaim: Callable[[int, bool], Awaitable[int]] | None


@runtime_checkable
class NamesVictims(Protocol):
    """A bounded tier that can say which chunks it would evict next (``tinylfu`` admission
    compares a candidate with them)."""

    def next_victims(self, chunk_nbytes: Sequence[int]) -> Sequence[CacheKey] | None:
        """The chunks the tier would evict to make room for chunks of ``chunk_nbytes`` bytes
        (its own overhead added), in eviction order: empty when it has room, None when it
        cannot say (or nothing would make room)."""
        ...


#: write errors that mean "the disk takes no more": full, over quota, or failing
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


def full_disk_error(tier: str, path: object, code: int | None) -> TierFullError | None:
    """The ``TierFullError`` for a write to ``path`` that failed with errno ``code``
    because the disk is full (None for any other error): it names the tier and the path."""
    if code not in FULL_DISK_ERRNOS:
        return None
    return TierFullError(f"tier {tier!r}: cannot write {str(path)!r}: [Errno {code}] {os.strerror(code)}; "
                         "the tier takes no more until space is freed (what it holds stays readable)")


def check_batch(keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> None:
    """A batched put needs one chunk per key (a ValueError saying how many of each)."""
    if len(keys) != len(chunks):
        raise ValueError(f"batched_put got {len(keys)} keys but {len(chunks)} chunks")


def check_destinations(keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> None:
    """A batched read into destinations needs one tensor per key (a ValueError otherwise)."""
    if len(keys) != len(outs):
        raise ValueError(f"batched_get_into got {len(keys)} keys but {len(outs)} destinations")
    for index, out in enumerate(outs):
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"batched_get_into destination {index}: expected a tensor, got {type(out).__name__}")


def fits_destination(out: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether a stored chunk of ``shape``/``dtype`` is the chunk ``out`` is waiting for."""
    return out.dtype == dtype and tuple(out.shape) == tuple(shape)


def fill_destination(out: torch.Tensor, chunk: torch.Tensor | None) -> bool:
    """Copy ``chunk`` into ``out`` when it fits; whether it did."""
    if chunk is None or not fits_destination(out, chunk.shape, chunk.dtype):
        return False
    copy_into(out, chunk)
    return True


class BlobBackend(StorageBackend):
    """Helper base for byte stores: implement four methods on string keys and bytes.

    ``get_bytes``, ``put_bytes``, ``delete_bytes`` and ``exists`` take the key's
    ``CacheKey.to_string`` form. Tensors are (de)serialized with ``tierkv.chunks.serde``
    (versioned header, checksum, no pickle). A value that fails to decode is deleted,
    counted in ``counters["corrupt_chunks"]`` and reported as a miss.
    """

    bounded: ClassVar[bool] = False

    @abc.abstractmethod
    async def get_bytes(self, key: str) -> bytes | memoryview | None:
        """The value stored under ``key``.

        Args:
            key: The key's string form.

        Returns:
            The value, or None when absent.
        """

    @abc.abstractmethod
    async def put_bytes(self, key: str, data: bytes | bytearray) -> None:
        """Store ``data`` under ``key`` atomically: a reader sees the old or the new value.

        Args:
            key: The key's string form.
            data: The serialized chunk.

        Raises:
            CapacityError: if the value cannot fit (``full_disk_error`` makes the one for a
                full disk).
        """

    @abc.abstractmethod
    async def delete_bytes(self, key: str) -> bool:
        """Remove ``key``.

        Args:
            key: The key's string form.

        Returns:
            True if it was there.
        """

    @abc.abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether ``key`` is stored.

        Args:
            key: The key's string form.

        Returns:
            True if it is stored.
        """

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        """Serialize ``chunk`` and store it with ``put_bytes``.

        Args:
            key: The chunk's key.
            chunk: The chunk's KV blob.

        Raises:
            CapacityError: if ``put_bytes`` finds no room.
            BackendClosedError: if the backend is closed.
        """
        self._ensure_open()
        await self.put_bytes(key.to_string(), serde.encode(chunk, key.fmt if key.fmt in ("vllm", "huggingface") else None))

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        """Read with ``get_bytes`` and deserialize.

        A value that fails to decode is counted, deleted and reported as a miss.

        Args:
            key: The chunk's key.

        Returns:
            The chunk as a tensor the caller owns, or None for a miss.

        Raises:
            BackendClosedError: if the backend is closed.
        """
        self._ensure_open()
        name = key.to_string()
        data = await self.get_bytes(name)
        if data is None:
            return None
        try:
            return serde.decode(data)
        except ChunkFormatError as exc:
            await self._drop_corrupt(name, exc)
            return None

    async def _drop_corrupt(self, name: str, exc: ChunkFormatError) -> None:
        """A value that failed to decode: count it, say why, delete it (it becomes a miss)."""
        self.count_corrupt([(name, exc)])
        await self.delete_bytes(name)

    async def contains(self, key: CacheKey) -> bool:
        """Whether ``key`` is stored, asked with ``exists``.

        Args:
            key: The chunk's key.

        Returns:
            True if it is stored.

        Raises:
            BackendClosedError: if the backend is closed.
        """
        self._ensure_open()
        return await self.exists(key.to_string())

    async def delete(self, key: CacheKey) -> bool:
        """Remove ``key`` with ``delete_bytes``.

        Args:
            key: The chunk's key.

        Returns:
            True if it was there.

        Raises:
            BackendClosedError: if the backend is closed.
        """
        self._ensure_open()
        return await self.delete_bytes(key.to_string())
