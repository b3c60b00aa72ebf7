"""Hints about prompts to come: retain a prefix for a while, drop one that will not come back.

Agentic traffic pauses for tools between turns (seconds to minutes) and comes back to the
same prefix; a session ends and its prefix never comes back. A hint says so ahead of the
eviction policy, with a bounded budget:

- **retain**: the prefix's chunks in every tier that keeps leases (``retain(keys, seconds)``: the
  node pool, the memory tiers) stay through evictions for ``seconds``; retained chunks are evicted after every
  other, so under pressure a lease is a bias, never a deadlock, and a tier caps what may be
  retained (``retain_share``), refusing a lease past it whole;
- **drop**: the prefix's chunks leave every tier (readers in flight keep their bytes); or every
  chunk of a request identity (a tenant's salt, an adapter: one scope) leaves every tier that
  can find its chunks by scope (the node pool, the memory tiers, lmdb, s3; ``fs`` names its
  files by a digest of their key and keeps them until evicted);
- **prefetch** (``AsyncEngine.prefetch``): the prefix moves up from the lower tiers ahead of the
  request.

Each returns what it did in tokens, and the engine counts them (``stats()["hints"]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.chunks.keys import CacheKey, KeyMaker, TokenIds, as_token_array
from tierkv.engine.metadata import EngineMetadata
from tierkv.errors import RetentionRefusedError, TierUnavailableError
from tierkv.policy import residency as policy
from tierkv.routing.router import TierRouter


@dataclass
class HintCounts:
    """What hints did, in tokens (an engine's ``stats()["hints"]``)."""

    retained_tokens: int = 0
    released_tokens: int = 0
    retain_refused: int = 0
    dropped_tokens: int = 0
    dropped_scope_chunks: int = 0
    prefetched_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)  # tokens retained per tier

    def as_dict(self) -> dict[str, Any]:
        return {"retained_tokens": self.retained_tokens, "released_tokens": self.released_tokens,
                "retain_refused": self.retain_refused, "dropped_tokens": self.dropped_tokens,
                "dropped_scope_chunks": self.dropped_scope_chunks,
                "prefetched_tokens": self.prefetched_tokens, "retained_by_tier": dict(self.by_tier)}


def leasing_tiers(tiers: Sequence[Any]) -> list[Any]:
    """The tiers that keep leases (a ``retain(keys, seconds)`` method)."""
    return [tier for tier in tiers if callable(getattr(tier, "retain", None))]


def retain_keys(tiers: Sequence[Any], keys: Sequence[CacheKey], seconds: float, chunk_size: int, tokens: int,
                counts: HintCounts) -> int:
    """Retain ``keys`` (the chunks of a ``tokens``-token prefix) in every leasing tier (release
    them: ``seconds`` 0); the tokens of the longest run of leading chunks some tier holds. A
    tier's refusal is counted (``retain_refused``) and raised (``RetentionRefusedError``) when no
    tier retained anything."""
    best = 0
    refused: RetentionRefusedError | None = None
    for tier in leasing_tiers(tiers):
        try:
            found = tier.retain(keys, seconds)
        except RetentionRefusedError as exc:
            counts.retain_refused += 1
            refused = exc
            continue
        leading = next((index for index, held in enumerate(found) if not held), len(found))
        covered = min(tokens, leading * chunk_size)
        if seconds:
            counts.by_tier[tier.name] = counts.by_tier.get(tier.name, 0) + covered
        best = max(best, covered)
    if seconds:
        counts.retained_tokens += best
    else:
        counts.released_tokens += best
    if refused is not None and not best:
        raise refused
    return best


async def drop_scope(tiers: Sequence[Any], model_name: str, scope: str) -> int:
    """Drop every chunk of ``scope`` of model ``model_name`` from every tier that can find its
    chunks by scope (``StorageBackend.drop_scope``: the node pool, the memory tiers, lmdb, s3);
    how many. The others (``fs``: files named by a digest of their key) keep them until their
    eviction takes them.

    Every tier is asked even when one fails (an unreachable object store does not keep the
    tenant's chunks on the local disk); the failures are raised together afterwards.

    Raises:
        TierUnavailableError: naming each tier whose drop failed (the others dropped theirs).
    """
    dropped = 0
    failed: list[tuple[str, Exception]] = []
    for tier in tiers:
        drop = getattr(tier, "drop_scope", None)
        if not callable(drop):
            continue
        try:
            dropped += await drop(model_name, scope) or 0
        except Exception as exc:  # noqa: BLE001 - reported below, after every other tier dropped its own
            failed.append((getattr(tier, "name", type(tier).__name__), exc))
    if failed:
        names = ", ".join(f"{name!r} ({type(exc).__name__}: {exc})" for name, exc in failed)
        raise TierUnavailableError(f"dropping scope {scope!r}: {len(failed)} tier(s) failed: {names}; "
                                   f"{dropped} chunk(s) dropped from the others") from failed[0][1]
    return dropped


class HintCalls:
    """``prefetch``, ``retain``, ``drop`` and ``drop_identity`` (see the module docstring): a mixin
    of ``tierkv.engine.async_engine.AsyncEngine``, whose docs list them with the rest of its API."""

    router: TierRouter
    chunk_size: int
    hint_counts: HintCounts
    metadata: EngineMetadata
    key_maker: KeyMaker
    keys_for: Callable[..., list[CacheKey]]

    async def prefetch(self, tokens: TokenIds, identity: RequestIdentity = PLAIN, wait: bool = False) -> int:
        """Start moving the cached prefix of ``tokens`` up to the top tier.

        Returns once the moves have started (``wait``: once they and the engine's other
        background work have landed); a later retrieve of the same tokens waits only for the
        chunks still in flight.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.
            wait: Return only when the prefix is in the top tier.

        Returns:
            The tokens of the cached prefix (already in the top tier, or moving there).

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        token_array, keys = self._prompt_keys(tokens, identity)
        levels = await self.router.levels(keys)
        held = policy.first_missing([level is not None for level in levels])
        await self.router.prefetch(keys[:held], levels[:held])
        if wait:
            await self.router.wait_inflight(keys[:held])
            await self.router.flush()  # the promotions' writes into the top tier
        prefix = min(len(token_array), held * self.chunk_size)
        self.hint_counts.prefetched_tokens += prefix
        return prefix

    def _cut_key(self, token_array: np.ndarray, cut_at: int, identity: RequestIdentity) -> CacheKey:
        """The key of the partial chunk a save of ``token_array[:cut_at]`` stored, where that cut
        ends inside the prompt's last chunk (``ValueError`` elsewhere)."""
        chunk = self.chunk_size
        last_chunk = (len(token_array) - 1) // chunk
        if not (last_chunk * chunk < cut_at < len(token_array) and cut_at % chunk):
            raise ValueError(f"cut_at must end inside the prompt's last chunk, in ({last_chunk * chunk}, "
                             f"{len(token_array)}) and off a chunk boundary; got {cut_at}")
        return self.key_maker.cut_key(token_array, cut_at, identity)

    def _prompt_keys(self, tokens: TokenIds, identity: RequestIdentity) -> tuple[np.ndarray, list[CacheKey]]:
        """A hint's prompt as a token array, and its chunks' keys (the engine must be open)."""
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        return token_array, self.keys_for(token_array, identity)

    async def retain(self, tokens: TokenIds, seconds: float, identity: RequestIdentity = PLAIN,
                     cut_at: int | None = None) -> int:
        """Keep the cached prefix of ``tokens`` through evictions for ``seconds`` (0 releases it).

        A lease in every tier that keeps leases (the node pool ``shm``, the memory tiers ``cpu``
        and ``gpu``; not disk or object tiers): its chunks are evicted
        after every other chunk, so under pressure it is a bias, never a deadlock, and each such
        tier caps the share of its capacity retained chunks may take (``retain_share``).

        Args:
            tokens: The prompt's token ids.
            seconds: How long from now; a longer lease a chunk already has is kept; 0 releases.
            identity: The request's identity, as given to ``store``.
            cut_at: Where a save also stored the prompt cut inside its last chunk (a
                continuation tail, named by ``KeyMaker.cut_key``): that partial chunk is leased with
                the prefix's, refused or granted whole with them.

        Returns:
            The tokens of the leading chunks retained (0 where no tier keeps leases or holds
                the prefix).

        Raises:
            RetentionRefusedError: if the lease would pass a tier's cap (nothing was retained).
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids, ``seconds`` is
                negative, or ``cut_at`` is not inside the prompt's last chunk.
            BackendClosedError: if the engine is closed.
        """
        token_array, keys = self._prompt_keys(tokens, identity)
        if cut_at is not None:
            keys = [*keys, self._cut_key(token_array, cut_at, identity)]
        return retain_keys(self.router.backends, keys, seconds, self.chunk_size, len(token_array), self.hint_counts)

    async def drop(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> int:
        """Remove the cached chunks of ``tokens`` from every tier (a session that ended).

        A chunk being read keeps its bytes until its reader is done.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            The tokens of the chunks some tier held.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        token_array, keys = self._prompt_keys(tokens, identity)
        levels = await self.router.levels(keys)
        held = [index for index, level in enumerate(levels) if level is not None]
        await self.router.batched_delete([keys[index] for index in held])
        dropped = sum(min(self.chunk_size, len(token_array) - index * self.chunk_size) for index in held)
        self.hint_counts.dropped_tokens += dropped
        return dropped

    async def drop_identity(self, identity: RequestIdentity) -> int:
        """Remove every chunk of ``identity``'s requests (a tenant's salt, an adapter: one key
        scope) from the tiers that can find their chunks by scope (``StorageBackend.drop_scope``):
        the node pool (``shm``), the memory tiers, ``lmdb`` and ``s3``, every process's chunks
        in a shared one. ``fs`` keeps them until they are evicted there (its files are named by
        a digest of their key).

        Args:
            identity: The requests' identity, as given to ``store``.

        Returns:
            The chunks dropped.

        Raises:
            BackendClosedError: if the engine is closed.
            TierUnavailableError: naming each tier whose drop failed (every other tier
                dropped its chunks first).
        """
        self.router.ensure_open()
        await self.router.flush()  # fills in flight land first, so none writes a dropped chunk back
        dropped = await drop_scope(self.router.backends, self.metadata.model_name, self.key_maker.scope_name(identity))
        self.hint_counts.dropped_scope_chunks += dropped
        return dropped
