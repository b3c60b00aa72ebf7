"""The engine's key-level calls: chunks under keys the caller made (``AsyncEngine.keys_for``),
each a thin pass to the router. A mixin of ``tierkv.engine.async_engine.AsyncEngine``, whose
docs list these methods with the rest of its API."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.chunks.keys import CacheKey
from tierkv.routing.router import TierRouter


class KeyLevelCalls:
    """``batched_put`` / ``get`` / ``contains`` / ``delete`` and ``locate_keys`` over ``router``."""

    router: TierRouter

    async def batched_put(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor]) -> int:
        """Store chunks under their keys, as the write policy says.

        The chunks go to the first tier that admits them; the call fails only when no tier
        took them. A tier that fails is counted, and skipped for a while after repeated
        failures.

        Args:
            keys: One key per chunk (``keys_for`` makes them).
            chunks: The chunks, each a KV blob of one chunk's tokens; the caller may reuse them
                once the call returns.

        Returns:
            How many chunks were acknowledged.

        Raises:
            ValueError: if ``keys`` and ``chunks`` differ in length.
            TierUnavailableError: if no tier took the chunks and some are cached nowhere.
            BackendClosedError: if the engine is closed, or closed under the call.
        """
        return await self.router.batched_put(keys, chunks)

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The chunk of each key, each from the highest tier holding it.

        Waits for the prefetches moving these keys; hits below the first tier are copied up
        into the tiers above that promote.

        Args:
            keys: The keys to read.

        Returns:
            The chunks in the order of ``keys``; None for a miss.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return await self.router.batched_get(keys)

    async def batched_contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by any tier (or waits in the fill queue).

        Args:
            keys: The keys to look for.

        Returns:
            One flag per key, in order.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return await self.router.batched_contains(keys)

    async def batched_delete(self, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys`` from every tier.

        The background fills already queued land first, so none writes a key back; a tier that
        fails is counted and skipped (the call removes what it can).

        Args:
            keys: The keys to remove.

        Returns:
            How many (key, tier) copies were removed.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return await self.router.batched_delete(keys)

    async def locate_keys(self, keys: Sequence[CacheKey]) -> list[str | None]:
        """The name of the highest tier holding each key.

        Args:
            keys: The keys to locate.

        Returns:
            Per key, in order, a tier's name, ``"fill-queue"``
                (``tierkv.routing.locate.FILL_QUEUE``) for a chunk acknowledged and not yet
                written, or None where no tier holds it.

        Raises:
            BackendClosedError: if the engine is closed.
        """
        return self.router.names(await self.router.levels(keys))

    def locate_keys_nowait(self, keys: Sequence[CacheKey]) -> list[str | None] | None:
        """``locate_keys`` answered from in-memory indexes, from any thread.

        Args:
            keys: The keys to locate.

        Returns:
            What ``locate_keys`` returns, or None when a tier available now needs I/O to answer
                (then await ``locate_keys``).
        """
        levels = self.router.levels_nowait(keys)
        return None if levels is None else self.router.names(levels)
