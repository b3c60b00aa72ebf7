"""Conformance suite for storage backends, ours and third parties'.

One module of about 740 lines, by choice: one class a backend author subclasses to run the whole
conformance suite; splitting it would make them subclass several and miss some.

Subclass ``BackendTests`` in a pytest module and implement ``make_backend``::

    class TestMyBackend(BackendTests):
        def make_backend(self, tmp_path, capacity=None):
            return MyBackend(name="mine", capacity=capacity, url=...)

Every test builds its backend inside its own event loop, so backends may create asyncio
primitives in ``__init__`` or lazily. Tests that need a property a backend does not
have (persistence, a capacity bound) skip with the reason; tests of an optional capability
skip unless the backend declares it by its Protocol (``tierkv.backend.InPlaceTier``,
``tierkv.backend.SupportsPressure``, ``tierkv.backend.SupportsDemotion``).

Byte stores can also implement the bypass hook ``BackendTests.corrupt_stored``
(damage a stored value behind the backend's back), which enables the tests of corrupt
data; without it those tests skip, saying so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tierkv.backend.coded import CodedBackend
from tierkv.backend.contract import InPlaceTier, NamesVictims, StorageBackend, SupportsDemotion, SupportsPressure
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.serde import SUPPORTED_DTYPES
from tierkv.config.loader import HealthConfig
from tierkv.errors import BackendClosedError, CapacityError
from tierkv.policy.admission import Admission, FrequencySketch
from tierkv.tiers.tier import Tier

T = TypeVar("T")


def make_key(index: int, model: str = "conformance") -> CacheKey:
    """A distinct key per index."""
    return CacheKey("vllm", model, 1, 0, f"{index:032x}")


def make_chunk(seed: int, shape: tuple[int, ...] = (2, 2, 16, 2, 8), dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A deterministic chunk whose values differ for every seed."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def compressible_chunk(seed: int) -> torch.Tensor:
    """A bf16 chunk whose values take few distinct values (multiples of 1/4): a lossless codec
    shrinks it whatever the backend (random bf16 barely compresses)."""
    return (make_chunk(seed, dtype=torch.float32) * 4).round().div(4).to(torch.bfloat16)


def chunk_nbytes(chunk: torch.Tensor) -> int:
    """Bytes of ``chunk``'s elements."""
    return chunk.numel() * chunk.element_size()


def every_bit_pattern(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A [2, 2, 8, 2, n] chunk of ``dtype`` from random bytes: every bit pattern the dtype has
    (NaNs, infinities, subnormals), bool as 0 / 1."""
    raw = torch.randint(0, 256, (2, 2, 8, 2, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(2, 2, 8, 2, 8 // torch.empty((), dtype=dtype).element_size())


def same_bytes(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe), including dtype and shape."""
    if a is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class BackendTests:
    """Subclass and implement ``make_backend`` to check a backend against the contract.

    The contract is [StorageBackend][tierkv.backend.StorageBackend]'s. Put the subclass in a
    pytest module (its name must start with ``Test``); every ``test_*`` method is then a
    test of your backend. A test that needs a property the backend does not have
    (persistence, a capacity bound) or an optional capability it does not declare (by its
    Protocol) skips, saying why.

    Attributes:
        capacity_in_chunks: The capacity, in chunks of the default shape, that the eviction
            tests give the backend.
    """

    #: capacity, in chunks of the default shape, used by the eviction tests
    capacity_in_chunks: int = 4

    def make_backend(self, tmp_path: Path, capacity: int | None = None) -> StorageBackend:
        """A new backend instance: the one method a subclass must implement.

        Args:
            tmp_path: pytest's per-test directory, for a backend that keeps files.
            capacity: The capacity in bytes the test needs, or None for the backend's default.

        Returns:
            The backend, not yet used. A persistent backend must reopen the same data for the
                same ``tmp_path``.

        Raises:
            NotImplementedError: always, unless a subclass overrides it.
        """
        raise NotImplementedError

    def corrupt_stored(self, backend: StorageBackend, key: CacheKey) -> None:
        """Flip a byte of the payload stored under ``key``, bypassing ``backend`` (optional hook).

        A byte store implements it to enable the tests of corrupt data; without it they skip.

        Args:
            backend: The backend the test made, holding the chunk.
            key: The chunk to damage.

        Raises:
            NotImplementedError: unless a subclass overrides it (the corrupt-data tests then skip).
        """
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------
    def run(self, body: Callable[[], Awaitable[T]]) -> T:
        """Run a coroutine function on a fresh event loop (``asyncio.run``).

        Args:
            body: A coroutine function taking no argument.

        Returns:
            What ``body()`` returned.
        """
        return asyncio.run(body())  # type: ignore[arg-type]

    def chunk_capacity(self) -> int:
        """The capacity in bytes of ``capacity_in_chunks`` default chunks, plus 1 KiB of slack.

        Returns:
            A number of bytes.
        """
        return self.capacity_in_chunks * chunk_nbytes(make_chunk(0)) + 1024

    async def _closing(self, backend: StorageBackend, body: Callable[[StorageBackend], Awaitable[T]]) -> T:
        try:
            return await body(backend)
        finally:
            await backend.close()

    def with_backend(self, tmp_path: Path, body: Callable[[StorageBackend], Awaitable[T]], capacity: int | None = None) -> T:
        """Run ``body`` with a new backend on a fresh event loop, closing the backend after.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
            body: A coroutine function taking the backend.
            capacity: The capacity in bytes for ``make_backend``; None: its default.

        Returns:
            What ``body`` returned.
        """
        async def main() -> T:
            return await self._closing(self.make_backend(tmp_path, capacity), body)
        return asyncio.run(main())

    # -- single-key contract -------------------------------------------------------------
    def test_put_get_roundtrip(self, tmp_path: Path) -> None:
        """A chunk put comes back bit-exact from ``get``.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            chunk = make_chunk(1)
            await backend.put(make_key(1), chunk)
            assert same_bytes(await backend.get(make_key(1)), chunk)
        self.with_backend(tmp_path, body)

    def test_missing_key_is_none(self, tmp_path: Path) -> None:
        """A missing key is a miss, never an exception.

        ``get`` returns None, ``contains`` and ``delete`` return False.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            assert await backend.get(make_key(404)) is None
            assert await backend.contains(make_key(404)) is False
            assert await backend.delete(make_key(404)) is False
        self.with_backend(tmp_path, body)

    def test_contains_and_delete(self, tmp_path: Path) -> None:
        """``contains`` sees a stored chunk, and ``delete`` removes it (True), after which it is gone.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            await backend.put(make_key(2), make_chunk(2))
            assert await backend.contains(make_key(2))
            assert await backend.delete(make_key(2)) is True
            assert not await backend.contains(make_key(2))
            assert await backend.get(make_key(2)) is None
        self.with_backend(tmp_path, body)

    def test_drop_scope_removes_one_scope_and_keeps_the_rest(self, tmp_path: Path) -> None:
        """``drop_scope`` removes every chunk of one scope (a tenant's) and nothing else; a
        backend that cannot find its chunks by scope (it returns None) keeps every chunk.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        def scoped(index: int, scope: str) -> CacheKey:
            return CacheKey("vllm", "conformance", 1, 0, f"{index:032x}", scope)

        async def body(backend: StorageBackend) -> None:
            doomed = [scoped(index, "a" * 16) for index in range(3)]  # 16 hex digits, as an engine's scopes
            kept = [scoped(index, "b" * 16) for index in range(3)] + [make_key(7)]
            for seed, key in enumerate(doomed + kept):
                await backend.put(key, make_chunk(seed))
            dropped = await backend.drop_scope("conformance", "a" * 16)
            if dropped is None:
                assert all(await backend.batched_contains(doomed + kept)), "None: nothing was dropped"
            else:
                assert dropped == len(doomed)
                assert not any(await backend.batched_contains(doomed))
                assert [await backend.get(key) for key in doomed] == [None] * len(doomed)
            for seed, key in enumerate(kept, start=len(doomed)):
                assert same_bytes(await backend.get(key), make_chunk(seed)), f"{key} of another scope was lost"
        self.with_backend(tmp_path, body)

    def test_overwrite_replaces_value(self, tmp_path: Path) -> None:
        """A second ``put`` under one key replaces the first value.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            await backend.put(make_key(3), make_chunk(3))
            await backend.put(make_key(3), make_chunk(33))
            assert same_bytes(await backend.get(make_key(3)), make_chunk(33))
        self.with_backend(tmp_path, body)

    def test_put_copies_and_get_returns_own_tensor(self, tmp_path: Path) -> None:
        """``put`` copies the chunk, and ``get`` returns a tensor the caller owns.

        Changing the tensor given to ``put``, or the one ``get`` returned, changes nothing stored.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            chunk = make_chunk(4)
            original = chunk.clone()
            await backend.put(make_key(4), chunk)
            chunk.zero_()  # the caller reuses its buffer
            first = await backend.get(make_key(4))
            assert same_bytes(first, original)
            assert first is not None
            first.zero_()  # the caller scribbles on what it got
            assert same_bytes(await backend.get(make_key(4)), original)
        self.with_backend(tmp_path, body)

    def test_non_contiguous_chunk(self, tmp_path: Path) -> None:
        """A non-contiguous chunk (a token slice of a larger blob, as the engine cuts chunks) round-trips.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            blob = make_chunk(5, shape=(2, 2, 40, 2, 8))
            view = blob.narrow(2, 8, 16)  # a token slice, as the engine cuts chunks
            assert not view.is_contiguous()
            await backend.put(make_key(5), view)
            assert same_bytes(await backend.get(make_key(5)), view.contiguous())
        self.with_backend(tmp_path, body)

    def test_dtypes_roundtrip_bit_exact(self, tmp_path: Path) -> None:
        """Every dtype tierkv stores, every bit pattern (NaNs included), round-trips bit-exact.

        One key each: a backend moves bytes, so one session covers them all.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            chunks = {dtype: every_bit_pattern(dtype, seed=7) for dtype in SUPPORTED_DTYPES}
            keys = {dtype: make_key(600 + index) for index, dtype in enumerate(SUPPORTED_DTYPES)}
            for dtype, chunk in chunks.items():
                await backend.put(keys[dtype], chunk)
            for dtype, chunk in chunks.items():
                assert same_bytes(await backend.get(keys[dtype]), chunk), f"{dtype} came back changed"
        self.with_backend(tmp_path, body)

    # -- batches ----------------------------------------------------------------------------
    def test_batched_order_duplicates_and_misses(self, tmp_path: Path) -> None:
        """Batches keep input order, a later duplicate in a batch wins, and misses are None.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            keys = [make_key(10), make_key(11), make_key(10)]
            chunks = [make_chunk(100), make_chunk(11), make_chunk(10)]
            assert await backend.batched_put(keys, chunks) == 3
            got = await backend.batched_get([make_key(11), make_key(99), make_key(10), make_key(11)])
            assert same_bytes(got[0], make_chunk(11))
            assert got[1] is None
            assert same_bytes(got[2], make_chunk(10)), "a later duplicate in a batch must win"
            assert same_bytes(got[3], make_chunk(11))
            assert await backend.batched_contains([make_key(99), make_key(10)]) == [False, True]
        self.with_backend(tmp_path, body)

    def test_batched_put_length_mismatch(self, tmp_path: Path) -> None:
        """``batched_put`` with more keys than chunks raises ``ValueError``.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            with pytest.raises(ValueError, match="keys"):
                await backend.batched_put([make_key(1), make_key(2)], [make_chunk(1)])
        self.with_backend(tmp_path, body)

    def test_empty_batches(self, tmp_path: Path) -> None:
        """Empty batches return empty lists.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            assert await backend.batched_get([]) == []
            assert await backend.batched_contains([]) == []
        self.with_backend(tmp_path, body)

    # -- reads into the caller's memory ---------------------------------------------------------
    def test_get_into_contiguous_and_strided_destinations(self, tmp_path: Path) -> None:
        """``batched_get_into`` fills a contiguous destination and a strided slice of a larger blob.

        No byte outside the slice changes.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            chunks = [make_chunk(40), make_chunk(41)]
            await backend.batched_put([make_key(40), make_key(41)], chunks)
            blob = torch.full((2, 2, 48, 2, 8), -7.0, dtype=torch.bfloat16)
            outs = [torch.empty_like(chunks[0]), blob.narrow(2, 16, 16)]  # the second as a token slice of a blob
            assert not outs[1].is_contiguous()
            assert await backend.batched_get_into([make_key(40), make_key(41)], outs) == [True, True]
            assert same_bytes(outs[0], chunks[0]) and same_bytes(outs[1], chunks[1])
            assert bool((blob[:, :, :16] == -7).all()) and bool((blob[:, :, 32:] == -7).all()), \
                "bytes outside the destination slice changed"
        self.with_backend(tmp_path, body)

    def test_get_into_misses_leave_destinations_untouched(self, tmp_path: Path) -> None:
        """A miss, or a chunk of another shape or dtype, is False and leaves its destination as it was.

        The stored chunk is still readable after a mismatched read.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            await backend.put(make_key(42), make_chunk(42))
            absent = torch.full((2, 2, 16, 2, 8), 3.0, dtype=torch.bfloat16)
            wrong_shape = torch.full((2, 2, 8, 2, 8), 3.0, dtype=torch.bfloat16)
            wrong_dtype = torch.full((2, 2, 16, 2, 8), 3.0, dtype=torch.float32)
            hits = await backend.batched_get_into([make_key(404), make_key(42), make_key(42)],
                                                  [absent, wrong_shape, wrong_dtype])
            assert hits == [False, False, False], "a chunk of another shape or dtype is not this destination's chunk"
            for out in (absent, wrong_shape, wrong_dtype):
                assert bool((out == 3).all())
            assert same_bytes(await backend.get(make_key(42)), make_chunk(42)), "a mismatched read lost the chunk"
        self.with_backend(tmp_path, body)

    def test_get_into_dtypes_bit_exact(self, tmp_path: Path) -> None:
        """Reads into the caller's memory, for every dtype and bit pattern, in one batch.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            chunks = [every_bit_pattern(dtype, seed=9) for dtype in SUPPORTED_DTYPES]
            keys = [make_key(700 + index) for index in range(len(chunks))]
            await backend.batched_put(keys, chunks)
            outs = [torch.empty_like(chunk) for chunk in chunks]
            assert await backend.batched_get_into(keys, outs) == [True] * len(chunks)
            for dtype, out, chunk in zip(SUPPORTED_DTYPES, outs, chunks):
                assert same_bytes(out, chunk), f"{dtype} came back changed"
        self.with_backend(tmp_path, body)

    def test_get_into_length_mismatch(self, tmp_path: Path) -> None:
        """``batched_get_into`` with more keys than destinations raises ``ValueError``; an empty batch is fine.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            with pytest.raises(ValueError, match="destinations"):
                await backend.batched_get_into([make_key(1), make_key(2)], [torch.empty(1)])
            assert await backend.batched_get_into([], []) == []
        self.with_backend(tmp_path, body)

    def test_corrupt_value_is_a_miss_and_is_dropped(self, tmp_path: Path) -> None:
        """A damaged value is a miss, is deleted and is counted; its neighbour is still a hit.

        Needs the ``corrupt_stored`` hook (skips without it). A backend that does not declare
        ``streams_into_destination`` must leave the damaged chunk's destination untouched.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            chunk = make_chunk(44)
            await backend.batched_put([make_key(44), make_key(45)], [chunk, make_chunk(45)])
            try:
                self.corrupt_stored(backend, make_key(44))
            except NotImplementedError:
                pytest.skip(f"{type(self).__name__} has no corrupt_stored hook (memory tiers keep no checksum)")
            out = torch.full_like(chunk, 5.0)
            second = torch.empty_like(chunk)
            hits = await backend.batched_get_into([make_key(44), make_key(45)], [out, second])
            assert hits == [False, True], "a damaged chunk must be a miss, its neighbour still a hit"
            assert same_bytes(second, make_chunk(45))
            if not type(backend).streams_into_destination:
                assert bool((out == 5).all()), "a verify-first backend wrote a destination it reported missing"
            assert await backend.get(make_key(44)) is None
            assert not await backend.contains(make_key(44)), "the corrupt value should have been deleted"
            assert backend.stats()["corrupt_chunks"] >= 1
        self.with_backend(tmp_path, body)

    # -- capacity -----------------------------------------------------------------------------
    def test_capacity_evicts_least_recently_used(self, tmp_path: Path) -> None:
        """A bounded backend stays within its capacity by evicting the least recently used chunk.

        A ``get`` counts as a use; evictions show in ``stats()``. Skips for an unbounded backend.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            if not backend.bounded or backend.capacity_bytes is None:
                pytest.skip(f"{type(backend).__name__} is not capacity-bounded")
            total = self.capacity_in_chunks * 3
            for index in range(total):
                await backend.put(make_key(index), make_chunk(index))
                if index == 1:
                    assert await backend.get(make_key(0)) is not None  # touch 0: it is now recent
                assert backend.used_bytes <= backend.capacity_bytes
            assert same_bytes(await backend.get(make_key(total - 1)), make_chunk(total - 1))
            assert await backend.get(make_key(1)) is None, "the least recently used chunk should be gone"
            assert backend.stats()["evictions"] > 0
        self.with_backend(tmp_path, body, capacity=self.chunk_capacity())

    def test_chunk_larger_than_capacity_raises_and_keeps_data(self, tmp_path: Path) -> None:
        """A chunk larger than the capacity raises ``CapacityError`` and loses nothing stored before.

        Skips for a backend without a capacity bound.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            if backend.capacity_bytes is None:
                pytest.skip(f"{type(backend).__name__} has no capacity bound")
            await backend.put(make_key(1), make_chunk(1))
            huge = make_chunk(2, shape=(2, 2, 16 * (self.capacity_in_chunks + 2), 2, 8))
            with pytest.raises(CapacityError, match="capacity|room|fit"):
                await backend.put(make_key(2), huge)
            assert same_bytes(await backend.get(make_key(1)), make_chunk(1))
        self.with_backend(tmp_path, body, capacity=self.chunk_capacity())

    # -- concurrency ------------------------------------------------------------------------------
    def test_concurrent_callers(self, tmp_path: Path) -> None:
        """Concurrent puts and gets of different keys on one loop each see their own chunk.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            async def writer(index: int) -> None:
                await backend.put(make_key(index), make_chunk(index))
                assert same_bytes(await backend.get(make_key(index)), make_chunk(index))
            await asyncio.gather(*(writer(i) for i in range(24)))
            got = await backend.batched_get([make_key(i) for i in range(24)])
            for index, chunk in enumerate(got):
                assert same_bytes(chunk, make_chunk(index))
        self.with_backend(tmp_path, body)

    # -- lifecycle -----------------------------------------------------------------------------------
    def test_use_after_close_raises(self, tmp_path: Path) -> None:
        """``close`` is idempotent, and ``get``, ``put``, ``contains`` and ``batched_get`` raise ``BackendClosedError`` after it.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def main() -> None:
            backend = self.make_backend(tmp_path, None)
            await backend.put(make_key(1), make_chunk(1))
            await backend.close()
            await backend.close()  # idempotent
            for call in (backend.get(make_key(1)), backend.put(make_key(2), make_chunk(2)),
                         backend.contains(make_key(1)), backend.batched_get([make_key(1)])):
                with pytest.raises(BackendClosedError):
                    await call
        asyncio.run(main())

    def test_persistence_across_reopen(self, tmp_path: Path) -> None:
        """A persistent backend reopened on the same ``tmp_path`` still holds what it stored.

        Skips for a backend that is not ``persistent``.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def first() -> bool:
            backend = self.make_backend(tmp_path, None)
            if not backend.persistent:
                await backend.close()
                return False
            await backend.batched_put([make_key(i) for i in range(3)], [make_chunk(i) for i in range(3)])
            await backend.close()
            return True

        if not asyncio.run(first()):
            pytest.skip("backend is not persistent")

        async def second(backend: StorageBackend) -> None:
            got = await backend.batched_get([make_key(i) for i in range(3)])
            for index, chunk in enumerate(got):
                assert same_bytes(chunk, make_chunk(index))
        self.with_backend(tmp_path, second)

    def test_stats_are_plain_data(self, tmp_path: Path) -> None:
        """``stats()`` reports ``used_bytes`` and ``evictions``.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            await backend.put(make_key(1), make_chunk(1))
            stats: dict[str, Any] = backend.stats()
            assert stats["used_bytes"] >= 0
            assert "evictions" in stats
        self.with_backend(tmp_path, body)

    # -- optional capabilities, by Protocol ----------------------------------------------------------
    def test_in_place_put_with_and_hold(self, tmp_path: Path) -> None:
        """InPlaceTier: ``put_with`` lets a writer fill the tier's memory, ``hold`` lends it back.

        A miss is held as None. Skips for a backend that is not an ``InPlaceTier``.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            if not isinstance(backend, InPlaceTier):
                pytest.skip(f"{type(backend).__name__} is not an InPlaceTier")
            chunks = {make_key(60): make_chunk(60), make_key(61): make_chunk(61)}

            async def write(views: dict[CacheKey, torch.Tensor]) -> None:
                for key, view in views.items():
                    view.copy_(chunks[key].to(view.device))
            layouts = [(tuple(c.shape), c.dtype) for c in chunks.values()]
            assert await backend.put_with(list(chunks), layouts, write) == 2
            holds = backend.hold([make_key(60), make_key(404), make_key(61)], pin=True)
            try:
                assert holds[1] is None, "a miss is held as None"
                for hold, key in ((holds[0], make_key(60)), (holds[2], make_key(61))):
                    assert hold is not None and same_bytes(hold.chunk.cpu(), chunks[key])
            finally:
                for hold in holds:
                    if hold is not None:
                        hold.release()
            assert same_bytes(await backend.get(make_key(61)), chunks[make_key(61)])
        self.with_backend(tmp_path, body)

    def test_pressure_shrinks_to_the_limit_and_grows_back(self, tmp_path: Path) -> None:
        """SupportsPressure: a lower capacity limit is honoured by ``shrink_to_limit``.

        A higher limit never raises the capacity above the configured one. Skips for a
        backend that does not support memory pressure.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            if not isinstance(backend, SupportsPressure):
                pytest.skip(f"{type(backend).__name__} does not support memory pressure")
            configured = backend.capacity_bytes
            assert configured is not None
            for index in range(self.capacity_in_chunks):
                await backend.put(make_key(index), make_chunk(index))
            one = chunk_nbytes(make_chunk(0))
            backend.set_capacity_limit(one)
            assert backend.capacity_bytes == one
            freed = await backend.shrink_to_limit()
            assert freed >= (self.capacity_in_chunks - 1) * one
            assert backend.used_bytes <= one
            backend.set_capacity_limit(configured * 2)
            assert backend.capacity_bytes == configured, "the limit never exceeds the configured capacity"
            await backend.put(make_key(50), make_chunk(50))
            assert same_bytes(await backend.get(make_key(50)), make_chunk(50))
        self.with_backend(tmp_path, body, capacity=self.chunk_capacity())

    def test_demotion_hands_evicted_chunks_to_the_sink(self, tmp_path: Path) -> None:
        """SupportsDemotion: every chunk evicted to make room reaches ``demote_sink``, exact.

        Skips for a backend that does not demote.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            if not isinstance(backend, SupportsDemotion):
                pytest.skip(f"{type(backend).__name__} does not demote")
            demoted: dict[CacheKey, torch.Tensor] = {}

            async def sink(keys: list[CacheKey], chunks: list[torch.Tensor]) -> None:
                for key, chunk in zip(keys, chunks):
                    demoted[key] = chunk.detach().cpu().clone()
            backend.demote_sink = sink
            total = self.capacity_in_chunks * 2
            for index in range(total):
                await backend.put(make_key(index), make_chunk(index))
            assert demoted, "filling past capacity demoted nothing"
            for key, chunk in demoted.items():
                index = int(key.chunk_hash, 16)
                assert same_bytes(chunk, make_chunk(index))
                assert not await backend.contains(key), "a demoted chunk is gone from the tier"
            still = sum(await backend.batched_contains([make_key(i) for i in range(total)]))
            assert still + len(demoted) == total, "a chunk was evicted without being demoted"
        self.with_backend(tmp_path, body, capacity=self.chunk_capacity())

    def test_named_victims_are_the_chunks_a_put_evicts(self, tmp_path: Path) -> None:
        """NamesVictims (``tinylfu`` admission): the chunks named are the ones the next put evicts.

        Empty while there is room; once full, the chunks it names for the next chunk's bytes
        are held, and that put evicts them. Skips for a backend that does not name its victims.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            if not isinstance(backend, NamesVictims):
                pytest.skip(f"{type(backend).__name__} does not name its victims")
            one = chunk_nbytes(make_chunk(0))
            assert list(backend.next_victims([one]) or []) == [], "an empty tier has room"
            index = 0
            while not backend.next_victims([one]):
                await backend.put(make_key(index), make_chunk(index))
                index += 1
                assert index <= self.capacity_in_chunks * 2, "a full tier must name a victim"
            named = list(backend.next_victims([one]) or [])
            held = await backend.batched_contains(named)
            assert all(held), "it names chunks it holds"
            await backend.put(make_key(index), make_chunk(index))
            assert not any(await backend.batched_contains(named)), "the put evicted the named chunks"
            assert await backend.contains(make_key(index))
        self.with_backend(tmp_path, body, capacity=self.chunk_capacity())

    # -- codecs (tierkv.backend.coded): what a tier with `codec:` stores in this backend --------------------
    def test_coded_chunks_round_trip_and_lossy_ones_are_keyed_apart(self, tmp_path: Path) -> None:
        """``codec: lz4`` over this backend round-trips exact; ``fp8`` chunks live under other keys.

        Frames are stored and decode to the exact chunk (into given memory and as new
        tensors); a reader without the codec finds no chunk it would take for them; ``fp8``
        chunks live under other keys, so the exact chunk stays exact. Skips for an
        ``InPlaceTier`` (codecs are for byte tiers).

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            if isinstance(backend, InPlaceTier):
                pytest.skip(f"{type(backend).__name__} keeps chunks in place: codecs are for byte tiers")
            exact, lossy = CodedBackend(backend, "lz4"), CodedBackend(backend, "fp8")
            keys = [make_key(80), make_key(81)]
            chunks = [compressible_chunk(80), compressible_chunk(81)]
            assert await exact.batched_put(keys, chunks) == 2
            assert exact.coding["frames_written"] == 2 and exact.coding["bytes_stored"] < sum(map(chunk_nbytes, chunks))
            outs = [torch.zeros_like(chunk) for chunk in chunks]
            assert await exact.batched_get_into(keys, outs) == [True, True]
            assert all(same_bytes(out, chunk) for out, chunk in zip(outs, chunks))
            assert same_bytes(await exact.get(keys[1]), chunks[1])
            plain = torch.zeros_like(chunks[0])
            assert await backend.batched_get_into([keys[0]], [plain]) == [False], "a frame is not the chunk"
            assert await lossy.batched_contains(keys) == [False, False], "lossy keys are apart"
            await lossy.put(keys[0], chunks[0])
            approx = torch.zeros_like(chunks[0])
            assert await lossy.batched_get_into([keys[0]], [approx]) == [True]
            error = (approx.float() - chunks[0].float()).norm() / chunks[0].float().norm()
            assert 0 < error < 0.05, f"fp8 relative error {error:.4f}"
            assert same_bytes(await exact.get(keys[0]), chunks[0]), "the exact chunk is untouched"
        self.with_backend(tmp_path, body)

    # -- admission (tierkv.policy.admission): what the engine lets reach this backend ---------------------
    def test_admission_decides_what_reaches_this_backend(self, tmp_path: Path) -> None:
        """``reused(2)`` admission in front of this backend lets through only the chunks seen twice.

        Through the engine's tier handle: the chunks seen twice are stored and read back
        exact, the ones seen once never reach the backend.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            sketch = FrequencySketch()
            tier = Tier(backend, 1, False, HealthConfig(), Admission("reused", 2), sketch)
            keys = [make_key(60 + i) for i in range(4)]
            chunks = [make_chunk(60 + i) for i in range(4)]
            sketch.add(keys + keys[:2])  # the first two seen twice
            flags = tier.admit(keys, [chunk_nbytes(c) for c in chunks])
            assert flags == [True, True, False, False]
            await tier.put([k for k, f in zip(keys, flags) if f], [c for c, f in zip(chunks, flags) if f])
            assert await backend.batched_contains(keys) == flags
            for key, chunk in zip(keys[:2], chunks[:2]):
                assert same_bytes(await backend.get(key), chunk)
            counters = tier.metrics.counters
            assert (counters["admitted"], counters["rejected"]) == (2, 2)
        self.with_backend(tmp_path, body)

    def test_tinylfu_keeps_what_was_seen_more_than_the_newcomer(self, tmp_path: Path) -> None:
        """``tinylfu`` on a full tier keeps what was seen more often than the newcomer.

        A chunk seen less often than the next victim is turned away; one seen more often is
        admitted and the victim goes. Skips for a backend that does not name its victims.

        Args:
            tmp_path: pytest's per-test directory, given to ``make_backend``.
        """
        async def body(backend: StorageBackend) -> None:
            if not isinstance(backend, NamesVictims):
                pytest.skip(f"{type(backend).__name__} does not name its victims")
            sketch = FrequencySketch()
            tier = Tier(backend, 1, False, HealthConfig(), Admission("tinylfu"), sketch)
            one = chunk_nbytes(make_chunk(0))
            held: list[CacheKey] = []
            while not backend.next_victims([one]):
                key = make_key(70 + len(held))
                sketch.add([key] * 3)
                await backend.put(key, make_chunk(70 + len(held)))
                held.append(key)
                assert len(held) <= self.capacity_in_chunks * 2, "a full tier must name a victim"
            rare, popular = make_key(200), make_key(201)
            sketch.add([rare] + [popular] * 5)
            assert tier.admit([rare], [one]) == [False], "seen once against a victim seen three times"
            victims = list(backend.next_victims([one]) or [])
            assert tier.admit([popular], [one]) == [True]
            await tier.put([popular], [make_chunk(201)])
            assert await backend.contains(popular) and not any(await backend.batched_contains(victims))
        self.with_backend(tmp_path, body, capacity=self.chunk_capacity())
