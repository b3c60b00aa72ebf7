"""The engine's cost-model calls: how much of a cached prefix is worth loading (``plan``), the
policy switch (``cost_aware``), and what teaches the model the serving engine's prefill speed
(``observe_recompute``, ``observe_step``). A mixin of ``tierkv.engine.async_engine.AsyncEngine``,
whose docs list these methods with the rest of its API; the model itself is
``tierkv.policy.planner``, its use on located prefixes ``tierkv.engine.prefix_plans``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.chunks.keys import CacheKey, TokenIds, as_token_array
from tierkv.engine.prefix_plans import PrefixPlans
from tierkv.policy.planner import PrefixPlan
from tierkv.routing.locate import Levels
from tierkv.routing.router import TierRouter


class CostModelCalls:
    """The plan and the recompute speed behind it, over ``plans`` (see the module docstring)."""

    router: TierRouter
    plans: PrefixPlans
    _iter_keys: Callable[[np.ndarray, RequestIdentity], Iterator[CacheKey]]

    async def _prefix_levels(self, token_array: np.ndarray, identity: RequestIdentity) -> Levels:
        return await self.plans.prefix_levels(self._iter_keys(token_array, identity))

    def _prefix_levels_nowait(self, token_array: np.ndarray, identity: RequestIdentity) -> Levels | None:
        return self.plans.prefix_levels_nowait(self._iter_keys(token_array, identity))

    def _record_lookup(self, token_array: np.ndarray, levels: Levels,
                       identity: RequestIdentity) -> PrefixPlan:
        """The length a scheduler should count as cached: the planned prefix (see ``plan``)."""
        return self.plans.record(len(token_array), levels, lambda: next(self._iter_keys(token_array, identity)))

    @property
    def cost_aware(self) -> bool:
        """Whether a cached prefix is loaded only as far as that beats recomputing it.

        ``cost_aware`` in the config, or as last set; by default, once a recompute speed is
        known. Set it to switch the policy at runtime: True, False, or None (the default);
        anything else raises ``TypeError``. Every measured speed is kept.
        """
        return self.plans.cost_aware

    @cost_aware.setter
    def cost_aware(self, value: bool | None) -> None:
        """Switch the policy at runtime (None: the default), keeping every measured speed."""
        self.plans.set_cost_aware(value)

    def observe_recompute(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """Refine the recompute speed the cost model uses from one measured prefill.

        Integrations call this around every prefill they run. Values that are not positive
        (``context_tokens``: negative) or not finite are ignored.

        Args:
            new_tokens: How many tokens the serving model computed.
            context_tokens: How many cached tokens it attended to before them.
            seconds: How long that took.
        """
        self.plans.recompute.observe(new_tokens, context_tokens, seconds)

    def observe_step(self, parts: Sequence[tuple[int, int]], seconds: float) -> None:
        """Refine the recompute speed from one forward step of a serving engine's batch.

        The step costs the sum of its requests' prefills (see ``RecomputeModel.observe_step``);
        the vLLM connector calls this for every step vLLM runs.

        Args:
            parts: Each request's ``(new tokens, cached context)`` in the step (a decode is
                ``(1, context)``), as the serving engine's scheduler planned them.
            seconds: How long the step's forward pass took.
        """
        self.plans.recompute.observe_step(parts, seconds)

    def recompute_tokens_per_s(self, num_tokens: int) -> float | None:
        """The serving model's prefill speed from scratch, as the cost model knows it.

        Args:
            num_tokens: The prompt length the speed is asked at.

        Returns:
            Tokens per second (configured or measured); None while unknown.
        """
        model = self.plans.recompute
        return model.tokens_per_s(num_tokens) if model.known else None

    def worth_storing(self, num_tokens: int) -> bool:
        """Whether a prompt could ever load faster than it recomputes, from the fastest tier.

        Args:
            num_tokens: The prompt's length.

        Returns:
            False where a save of it can never pay; True while the cost model knows too little
                (no recompute speed, no chunk size) or ``cost_aware`` is off.
        """
        return self.plans.worth_storing(num_tokens)

    def plan_nowait(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> PrefixPlan | None:
        """``plan`` answered from in-memory indexes, from any thread.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            What ``plan`` returns, or None when a tier needs I/O to answer (then await ``plan``).

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        levels = self._prefix_levels_nowait(token_array, identity)
        if levels is None:
            return None
        return self._record_lookup(token_array, levels, identity)

    async def plan(self, tokens: TokenIds, identity: RequestIdentity = PLAIN) -> PrefixPlan:
        """How much of the cached prefix of ``tokens`` is worth loading.

        For each prefix length, the expected fetch time (the tiers holding its chunks, at their
        measured speeds, read in parallel) against the recompute time it saves; the best length
        wins. Without a known recompute speed (or with ``cost_aware: false``) the plan is the
        whole cached prefix. The plan is also what ``stats()["last_lookup"]`` shows.

        Args:
            tokens: The prompt's token ids.
            identity: The request's identity, as given to ``store``.

        Returns:
            The plan: cached and planned tokens, the expected fetch time against the recompute
                time it saves, chunks per tier and the reason.

        Raises:
            ValueError: if ``tokens`` is not a 1-D sequence of integer ids.
            BackendClosedError: if the engine is closed.
        """
        self.router.ensure_open()
        token_array = as_token_array(tokens)
        return self._record_lookup(token_array, await self._prefix_levels(token_array, identity), identity)

    def plan_located(self, tier_names: Sequence[str | None], num_tokens: int, first_chunk: int = 0) -> PrefixPlan:
        """The plan (see ``plan``) for cached chunks already located.

        For an integration that located a page range itself; nothing is asked of the tiers.

        Args:
            tier_names: The tier of each cached chunk, as ``locate_keys`` answers, from chunk
                ``first_chunk`` on.
            num_tokens: The prompt's length in tokens.
            first_chunk: The index of the first chunk in ``tier_names``; the chunks before it
                are the caller's already (not loaded, not counted).

        Returns:
            The plan for those chunks.
        """
        return self.plans.plan(tier_names, num_tokens, first_chunk)
