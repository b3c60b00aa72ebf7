"""What a chunk looks like: the blob shape (with 0 tokens) and dtype of the chunks an engine
stores, known from ``EngineMetadata.kv_shape``, from the first store, or learned from the
first chunk a tier gives back.

It sizes a retrieve's fresh output, checks a caller's ``out`` and prices reads in the plan
(bytes per token). A fresh process over a persistent tier learns it by reading one chunk:
within the caller's deadline on a retrieve, in the background after a lookup.
"""

from __future__ import annotations

import asyncio
import time

import torch

from tierkv.chunks import kvlayout, transfer
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.kvlayout import nbytes_of
from tierkv.chunks.memory import empty_host
from tierkv.routing.router import TierRouter

Layout = tuple[tuple[int, ...], torch.dtype]


class ChunkLayout:
    """The layout of an engine's chunks (see the module docstring); ``value`` is None until known."""

    def __init__(self, router: TierRouter, fmt: str, value: Layout | None = None) -> None:
        self.router = router
        self.fmt = fmt
        self.value = value
        self._learning = False
        try:  # the loop the engine runs on, for learning the layout from any thread
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def from_chunk(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        """Learn the layout from a chunk of ``shape`` (any token count); the layout."""
        self.value = (kvlayout.with_tokens(shape, self.fmt, 0), dtype)
        return self.value

    def bytes_per_token(self) -> float | None:
        if self.value is None:
            return None
        shape, dtype = self.value
        return float(nbytes_of(kvlayout.with_tokens(shape, self.fmt, 1), dtype))

    async def fresh_sink(self, keys: list[CacheKey], ranges: list[tuple[int, int]], skip: int,
                         deadline: float | None = None) -> tuple[transfer.BlobSink | None, torch.Tensor | None]:
        """The output of a retrieve without ``out``: allocated once, for the cached tokens, and
        chunk 0 when it had to be read first to learn the layout (within ``deadline``; past
        it, or when chunk 0 is gone, no sink: nothing is retrieved)."""
        preloaded = None
        layout = self.value
        if layout is None:
            first = self.router.get(keys[:1])
            try:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                # a fresh output of the tier's, not memory anyone lent it: safe to abandon
                preloaded = (await (first if remaining is None else asyncio.wait_for(first, remaining)))[0]
            except TimeoutError:
                return None, None
            if preloaded is None:
                return None, None
            layout = self.from_chunk(tuple(preloaded.shape), preloaded.dtype)
        shape = kvlayout.with_tokens(layout[0], self.fmt, ranges[-1][1] - skip)
        return transfer.BlobSink(empty_host(shape, layout[1]), kvlayout.token_dim(self.fmt), skip), preloaded

    def learn_soon(self, key: CacheKey, level: int) -> None:
        """Read the chunk ``key`` of tier ``level`` in the background (once) to learn the layout;
        callable from any thread, never waits for the read."""
        try:
            self._loop = asyncio.get_running_loop()  # called on the loop: that is the engine's
        except RuntimeError:
            pass
        if self._learning or self._loop is None or self._loop.is_closed():
            return
        self._learning = True
        try:
            self._loop.call_soon_threadsafe(self.router.spawn, self._learn(key, level))
        except RuntimeError:  # the loop stopped meanwhile
            self._learning = False

    async def _learn(self, key: CacheKey, level: int) -> None:
        try:
            chunk = (await self.router.get_from(level, [key]))[0]  # within the health timeout, if one is set
            if chunk is not None and self.value is None:
                self.from_chunk(tuple(chunk.shape), chunk.dtype)
        finally:
            self._learning = False
