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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.chunks.keys import CacheKey
from tierkv.errors import RetentionRefusedError, TierUnavailableError


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
