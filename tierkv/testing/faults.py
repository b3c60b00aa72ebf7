"""Fault-injecting wrapper for tests and benchmarks: a real backend that can be told to fail,
stall, refuse writes as a full disk would, or serve its reads at a capped bandwidth (a slow
disk or network tier)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence

import torch

from tierkv.backend.contract import StorageBackend
from tierkv.chunks.keys import CacheKey
from tierkv.errors import TierFullError, TierUnavailableError


class FaultyBackend(StorageBackend):
    """Wraps a real backend; while ``failing`` every call raises, while ``stall_s`` is set
    every call (every call of ``stall_ops`` when set: op names as in ``calls_by_op``) first
    waits that long, or until ``stall_s`` is set back to 0 (a slow or hung remote store), while ``full`` is set
    every write raises ``tierkv.errors.TierFullError`` as a disk out of space does
    (reads keep working), while ``bytes_per_s`` is set a read also takes the bytes it
    returned over that bandwidth. Its in-memory index (if the inner backend has one) answers
    as the inner backend's does."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner.name, inner.capacity)
        self.inner = inner
        self.persistent = inner.persistent  # type: ignore[misc]
        self.bounded = inner.bounded  # type: ignore[misc]
        self.streams_into_destination = inner.streams_into_destination  # type: ignore[misc]
        self.failing = False
        self.full = False
        self.stall_s = 0.0
        self.stall_ops: set[str] | None = None
        self.bytes_per_s: float | None = None
        self.calls = 0
        self.calls_by_op: Counter[str] = Counter()

    async def _maybe_fail(self, op: str) -> None:
        self.calls += 1
        self.calls_by_op[op] += 1
        started = time.monotonic()
        stalled = self.stall_ops is None or op in self.stall_ops
        while stalled and self.stall_s and time.monotonic() - started < self.stall_s:  # stall_s = 0 releases it
            await asyncio.sleep(0.01)
        if self.failing:
            raise TierUnavailableError(f"tier {self.name!r}: injected failure")

    def _maybe_full(self) -> None:
        if self.full:
            raise TierFullError(f"tier {self.name!r}: cannot write '<injected>': [Errno 28] No space left on device; "
                                "the tier takes no more until space is freed (what it holds stays readable)")

    async def put(self, key: CacheKey, chunk: torch.Tensor) -> None:
        await self._maybe_fail("put")
        self._maybe_full()
        await self.inner.put(key, chunk)

    async def get(self, key: CacheKey) -> torch.Tensor | None:
        await self._maybe_fail("get")
        return await self.inner.get(key)

    async def contains(self, key: CacheKey) -> bool:
        await self._maybe_fail("contains")
        return await self.inner.contains(key)

    async def delete(self, key: CacheKey) -> bool:
        await self._maybe_fail("delete")
        return await self.inner.delete(key)

    async def drop_scope(self, model_name: str, scope: str) -> int | None:
        await self._maybe_fail("drop_scope")
        return await self.inner.drop_scope(model_name, scope)

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        await self._maybe_fail("batched_put")
        self._maybe_full()
        return await self.inner.batched_put(keys, chunks)

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        await self._maybe_fail("batched_get")
        chunks = await self.inner.batched_get(keys)
        await self._throttle(sum(c.nbytes for c in chunks if c is not None))
        return chunks

    async def batched_get_into(self, keys: Sequence[CacheKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        await self._maybe_fail("batched_get")  # counted with batched_get: both are one read of the batch
        got = await self.inner.batched_get_into(keys, outs)
        await self._throttle(sum(out.nbytes for out, hit in zip(outs, got) if hit))
        return got

    def batched_contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        return self.inner.batched_contains_nowait(keys)

    async def _throttle(self, nbytes: int) -> None:
        if self.bytes_per_s and nbytes:
            await asyncio.sleep(nbytes / self.bytes_per_s)

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        await self._maybe_fail("batched_contains")
        return await self.inner.batched_contains(keys)

    async def close(self) -> None:
        await self.inner.close()
        await super().close()

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def stats(self) -> dict[str, object]:
        return {**self.inner.stats(), "injected_calls": self.calls}
