"""How much of a located cached prefix to load: the engine's side of the cost model.

Turns the levels ``tierkv.routing.locate`` found for a prompt's chunks into a
``tierkv.policy.planner.PrefixPlan`` (tier names, chunk sizes, the router's measured tier
speeds, the chunk layout's bytes per token, the recompute model), remembers the last lookup
for ``stats()``, and refines the recompute speed from measured prefills.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tierkv.chunks.keys import CacheKey
from tierkv.config.loader import EngineConfig
from tierkv.engine.chunk_layout import ChunkLayout
from tierkv.policy import residency as policy
from tierkv.policy.planner import PrefixPlan, RecomputeModel, TierSpeed, load_everything, plan_prefix
from tierkv.routing.locate import FILL_QUEUE_LEVEL, Levels
from tierkv.routing.router import TierRouter


class PrefixPlans:
    """Plans for located prefixes (see the module docstring)."""

    def __init__(self, router: TierRouter, layout: ChunkLayout, config: EngineConfig) -> None:
        self.router = router
        self.layout = layout
        self.config = config
        self.chunk_size = config.chunk_size
        self._policy = config.cost_aware  # None: on once a recompute speed is known
        self.recompute = RecomputeModel(config.recompute.tokens_per_s, config.recompute.curve or None)
        self._last: tuple[int, int, Levels, PrefixPlan] | None = None

    @property
    def cost_aware(self) -> bool:
        """Whether a cached prefix is loaded only as far as that beats recomputing it
        (``cost_aware`` in the config, or as last set; by default, once a recompute speed is known)."""
        if self._policy is not None:
            return self._policy
        return self.recompute.known

    def set_cost_aware(self, value: bool | None) -> None:
        """Switch the policy at runtime (None: back to the default); what was measured (tier
        speeds, recompute speed) is kept, so both policies plan from the same estimates."""
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"cost_aware: expected True, False or None (on once a recompute speed is known), "
                            f"got {value!r}")
        self._policy = value

    async def prefix_levels(self, keys: Iterator[CacheKey]) -> Levels:
        """Levels of a prompt's chunks (``keys`` made as needed): the first chunk is located on
        its own, and when no tier holds it (a new prompt) the rest is neither hashed nor asked."""
        levels = await self.router.levels(list(itertools.islice(keys, 1)))
        if levels and levels[0] is not None:
            levels += await self.router.levels(list(keys))
        return levels

    def prefix_levels_nowait(self, keys: Iterator[CacheKey]) -> Levels | None:
        """``prefix_levels`` from in-memory indexes only; None when a tier needs I/O."""
        levels = self.router.levels_nowait(list(itertools.islice(keys, 1)))
        if levels and levels[0] is not None:
            rest = self.router.levels_nowait(list(keys))
            levels = None if rest is None else levels + rest
        return levels

    def record(self, num_tokens: int, levels: Levels, first_key: Callable[[], CacheKey]) -> PrefixPlan:
        """The plan of a lookup of ``num_tokens`` tokens whose chunks are at ``levels``: the
        length a scheduler should count as cached; kept for ``stats()``. A lookup that finds
        a chunk before the layout is known starts learning it from that chunk (``first_key``)."""
        hit_chunks = policy.first_missing([level is not None for level in levels])
        cached = min(hit_chunks * self.chunk_size, num_tokens)
        prefix_plan = self.plan(self.router.names(levels[:hit_chunks]), num_tokens)
        self._last = (num_tokens, cached, levels[:hit_chunks], prefix_plan)
        # learning starts after this plan is made: on the caller's thread (a lookup from memory
        # indexes) the loop could otherwise learn the layout midway, and the plan would depend on it
        if self.layout.value is None and levels and levels[0] not in (None, FILL_QUEUE_LEVEL):
            self.layout.learn_soon(first_key(), levels[0])
        return prefix_plan

    def plan(self, tier_names: Sequence[str | None], num_tokens: int, first_chunk: int = 0,
             speeds: Mapping[str, TierSpeed] | None = None) -> PrefixPlan:
        """The plan for the cached chunks held by ``tier_names`` (a tier's name, or
        ``tierkv.routing.locate.FILL_QUEUE``, per chunk), which start at chunk ``first_chunk`` of
        the prompt (the chunks before it are the caller's already: not loaded, not counted);
        ``speeds``: the tiers' speeds to plan with (default: the router's measured ones)."""
        base = min(first_chunk * self.chunk_size, num_tokens)
        names = [name for name in tier_names if name is not None]
        sizes = [min(self.chunk_size, num_tokens - (first_chunk + i) * self.chunk_size) for i in range(len(names))]
        if not self.cost_aware:
            return load_everything(names, sizes, "cost_aware is off" if self._policy is False else
                                   "no recompute speed known (recompute: in the config, or measured prefills)", base)
        bytes_per_token = self.layout.bytes_per_token()
        speeds = self.router.speeds() if speeds is None else speeds
        if bytes_per_token is None:
            # the bytes are not known yet, but each read's fixed cost is: if even reads of a
            # byte per token lose to recomputing, so do the real ones
            floor = plan_prefix(names, sizes, 1.0, speeds, self.recompute, base)
            if floor.planned_tokens == base:
                return floor
            return load_everything(names, sizes, "chunk size in bytes not known yet (nothing stored or read; "
                                   "give EngineMetadata.kv_shape to plan from the start)", base)
        return plan_prefix(names, sizes, bytes_per_token, speeds, self.recompute, base)

    def worth_storing(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` could ever be loaded faster than recomputed: its
        chunks, all of them in the first (fastest) tier at the fastest that tier is known to be
        (``TierSpeed.best_case``: its seed or its measured line, whichever is faster in each
        term), planned as a lookup would plan them. A save is a bet on reads to come, and those
        reads measure the tier again; judged by the measured line alone, a few reads slowed by
        a busy machine stopped every save, and with nothing stored nothing was read to correct
        it. True while the cost model is off or knows too little (recompute speed, chunk bytes)."""
        if not self.cost_aware or not self.router.tiers or num_tokens <= 0:
            return True
        chunks = -(-num_tokens // self.chunk_size)
        first = self.router.tiers[0].name
        plan = self.plan([first] * chunks, num_tokens, speeds={first: self.router.speeds()[first].best_case()})
        return plan.planned_tokens > 0

    def last_lookup(self) -> dict[str, Any] | None:
        """The last recorded lookup: tokens, cached tokens, chunks per tier, the plan."""
        if self._last is None:
            return None
        num_tokens, cached, levels, prefix_plan = self._last
        per_tier = {tier.name: 0 for tier in self.router.tiers}
        for name in self.router.names(levels):
            if name in per_tier:  # not the fill queue
                per_tier[name] += 1
        return {"tokens": num_tokens, "cached_tokens": cached, "chunks_per_tier": per_tier,
                "plan": prefix_plan.summary()}
