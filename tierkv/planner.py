"""Is loading a cached prefix faster than recomputing it? The cost model, pure (no I/O).

A hit that takes longer to fetch than the prefill it saves makes time to first token worse;
users of other KV-cache layers report exactly that (a file tier at 8K tokens slower than
recompute). tierkv decides per request:

- :class:`TierSpeed` keeps a running estimate of one tier's gets: a fixed cost per batch plus
  bytes over bandwidth, fitted to the gets the tier actually served (recent ones weigh more),
  pulled towards a per-backend seed while samples are few;
- :class:`RecomputeModel` is the serving model's prefill time for ``L`` tokens from scratch,
  ``T(L) = a*L + b*L^2`` (attention is quadratic), from the configured ``recompute:`` section
  and refined by measured prefills;
- :func:`plan_prefix` picks the prefix length ``P`` (a whole number of chunks) that minimises
  ``fetch(P) + T(N) - T(P)``: fetch the first ``P`` tokens from the tiers holding them (tiers
  read in parallel: the slowest one counts), recompute the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeedSeed:
    """What a tier of this kind costs before it has served anything: seconds per batch and
    bytes per second."""

    fixed_s: float
    bytes_per_s: float


HOST_MEMORY_SEED = SpeedSeed(fixed_s=20e-6, bytes_per_s=8e9)
"""A copy out of host memory (the cpu tier, the fill queue)."""

_REFERENCE_BYTES = 32 << 20  # the size the seed's prior is anchored at (one Llama-3-8B chunk)


class _DecayedFit:
    """Weighted least squares of ``y = a*x1 + b*x2`` (or ``a + b*x`` with x1 = 1), newest
    samples weighing most (weights halve every ``half_life`` samples), plus prior points whose
    weight shrinks by ``prior_decay`` with every sample (the prior speaks until data does)."""

    def __init__(self, half_life: float, prior: Sequence[tuple[float, float, float]], weight: float,
                 prior_decay: float = 1.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.prior = list(prior)
        self.prior_weight = weight
        self.prior_decay = prior_decay
        self.s11 = self.s12 = self.s22 = self.s1y = self.s2y = 0.0
        self.samples = 0

    def add(self, x1: float, x2: float, y: float) -> None:
        d = self.decay
        self.s11 = self.s11 * d + x1 * x1
        self.s12 = self.s12 * d + x1 * x2
        self.s22 = self.s22 * d + x2 * x2
        self.s1y = self.s1y * d + x1 * y
        self.s2y = self.s2y * d + x2 * y
        self.samples += 1

    def solve(self) -> tuple[float, float]:
        s11, s12, s22, s1y, s2y = self.s11, self.s12, self.s22, self.s1y, self.s2y
        w = self.prior_weight * self.prior_decay ** self.samples
        for x1, x2, y in self.prior:
            s11, s12, s22 = s11 + w * x1 * x1, s12 + w * x1 * x2, s22 + w * x2 * x2
            s1y, s2y = s1y + w * x1 * y, s2y + w * x2 * y
        det = s11 * s22 - s12 * s12
        a = b = -1.0
        if det > 1e-12 * max(s11 * s22, 1e-300):
            a = (s1y * s22 - s2y * s12) / det
            b = (s2y * s11 - s1y * s12) / det
        if a >= 0 and b >= 0:
            return a, b
        # a term came out negative (or cannot be told apart): both are costs, so fit one alone
        if a < 0 <= b and s22 > 0:
            return 0.0, max(s2y / s22, 0.0)
        return (max(s1y / s11, 0.0) if s11 > 0 else 0.0), 0.0


class TierSpeed:
    """Running estimate of one tier's get time: ``fixed_s + nbytes / bytes_per_s``."""

    def __init__(self, seed: SpeedSeed, half_life: float = 32.0) -> None:
        if seed.fixed_s < 0 or seed.bytes_per_s <= 0:
            raise ValueError(f"a speed seed needs fixed_s >= 0 and bytes_per_s > 0, got {seed}")
        self.seed = seed
        x = float(_REFERENCE_BYTES)
        # two prior points on the seed's line: it governs until real gets outweigh it
        self._fit = _DecayedFit(half_life, [(1.0, 0.0, seed.fixed_s), (1.0, x, seed.fixed_s + x / seed.bytes_per_s)],
                                weight=0.5, prior_decay=0.7)
        self._fixed_s, self._per_byte = seed.fixed_s, 1.0 / seed.bytes_per_s

    def observe(self, nbytes: int, seconds: float) -> None:
        """A get batch of ``nbytes`` took ``seconds``."""
        if nbytes <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        self._fit.add(1.0, float(nbytes), seconds)
        fixed, per_byte = self._fit.solve()
        self._fixed_s, self._per_byte = fixed, max(per_byte, 1e-15)

    def seconds(self, nbytes: int) -> float:
        """Expected time of a get batch of ``nbytes`` (0 bytes costs nothing: no request)."""
        return 0.0 if nbytes <= 0 else self._fixed_s + nbytes * self._per_byte

    @property
    def fixed_s(self) -> float:
        return self._fixed_s

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self._per_byte

    @property
    def samples(self) -> int:
        return self._fit.samples

    def snapshot(self) -> dict[str, float]:
        return {"fixed_ms": self._fixed_s * 1e3, "bandwidth_MBps": self.bytes_per_s / 1e6,
                "samples": self.samples, "seeded": self.samples == 0}


class RecomputeModel:
    """Prefill time of ``L`` tokens from scratch, ``T(L) = a*L + b*L^2``.

    ``tokens_per_s`` (one throughput) or ``curve`` (throughput at a few prompt lengths, as
    ``[(tokens, tokens_per_s), ...]``) set it; :meth:`observe` refines it from prefills that
    were timed (``new`` tokens computed after ``context`` cached ones took ``seconds``).
    Unknown (``known`` False) until one of the two has happened.
    """

    def __init__(self, tokens_per_s: float | None = None, curve: Sequence[tuple[int, float]] | None = None,
                 half_life: float = 16.0) -> None:
        points = [(int(tokens), float(speed)) for tokens, speed in (curve or [])]
        if tokens_per_s is not None:
            points.append((4096, float(tokens_per_s)))
        if any(tokens <= 0 or speed <= 0 for tokens, speed in points):
            raise ValueError(f"recompute: lengths and tokens_per_s must be positive, got {points}")
        if tokens_per_s is not None and not curve:
            prior = [(1.0 * tokens, 0.0, tokens / speed) for tokens, speed in points]  # linear: one throughput
        else:
            prior = [(1.0 * tokens, 1.0 * tokens * tokens, tokens / speed) for tokens, speed in points]
        self.configured = bool(points)
        self._fit = _DecayedFit(half_life, prior, weight=1.0, prior_decay=0.9)
        self._a, self._b = self._fit.solve() if points else (0.0, 0.0)

    @property
    def known(self) -> bool:
        return self.configured or self._fit.samples > 0

    def observe(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """Computing ``new_tokens`` after ``context_tokens`` cached ones took ``seconds``."""
        if new_tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        end = context_tokens + new_tokens
        self._fit.add(float(new_tokens), float(end * end - context_tokens * context_tokens), seconds)
        self._a, self._b = self._fit.solve()

    def seconds(self, num_tokens: int) -> float:
        """T(num_tokens): prefill from scratch."""
        return self._a * num_tokens + self._b * num_tokens * num_tokens

    def tokens_per_s(self, num_tokens: int) -> float:
        spent = self.seconds(num_tokens)
        return num_tokens / spent if spent > 0 else math.inf

    def snapshot(self) -> dict[str, float | bool]:
        return {"known": self.known, "measured_prefills": self._fit.samples,
                "tokens_per_s_at_1k": self.tokens_per_s(1024), "tokens_per_s_at_16k": self.tokens_per_s(16384)}


@dataclass(frozen=True)
class PrefixPlan:
    """How much of a cached prefix to load, and why."""

    cached_tokens: int
    planned_tokens: int
    fetch_ms: float
    recompute_saved_ms: float
    chunks_per_tier: Mapping[str, int]
    fetch_ms_per_tier: Mapping[str, float]
    reason: str

    def summary(self) -> dict[str, object]:
        return {"cached_tokens": self.cached_tokens, "planned_tokens": self.planned_tokens,
                "expected_fetch_ms": round(self.fetch_ms, 3), "expected_recompute_saved_ms": round(self.recompute_saved_ms, 3),
                "chunks_per_tier": dict(self.chunks_per_tier),
                "expected_fetch_ms_per_tier": {k: round(v, 3) for k, v in self.fetch_ms_per_tier.items()},
                "reason": self.reason}


def load_everything(chunk_tiers: Sequence[str], chunk_tokens: Sequence[int], reason: str,
                    base_tokens: int = 0) -> PrefixPlan:
    """The plan when cost does not decide: the whole cached prefix."""
    counts: dict[str, int] = {}
    for tier in chunk_tiers:
        counts[tier] = counts.get(tier, 0) + 1
    cached = base_tokens + sum(chunk_tokens)
    return PrefixPlan(cached, cached, 0.0, 0.0, counts, {}, reason)


def plan_prefix(chunk_tiers: Sequence[str], chunk_tokens: Sequence[int], bytes_per_token: float,
                speeds: Mapping[str, TierSpeed], recompute: RecomputeModel, base_tokens: int = 0) -> PrefixPlan:
    """The number of leading chunks whose loading saves the most time (see the module docstring).

    ``chunk_tiers[i]`` holds chunk ``i`` of the cached prefix (``chunk_tokens[i]`` tokens); the
    chunks follow ``base_tokens`` tokens the caller already has. Tiers are read in parallel, so
    the fetch of a prefix costs its slowest tier. Ties go to the longer prefix (it also spares
    the serving engine's compute). Token counts in the plan include ``base_tokens``.
    """
    if not chunk_tiers:
        return PrefixPlan(base_tokens, base_tokens, 0.0, 0.0, {}, {}, "nothing cached")
    base_cost = recompute.seconds(base_tokens)
    bytes_per_tier: dict[str, float] = {}
    best_gain, best_k, best_fetch = 0.0, 0, 0.0
    prefix = 0
    for k, (tier, tokens) in enumerate(zip(chunk_tiers, chunk_tokens), start=1):
        prefix += tokens
        bytes_per_tier[tier] = bytes_per_tier.get(tier, 0.0) + tokens * bytes_per_token
        fetch = max(speeds[name].seconds(int(nbytes)) for name, nbytes in bytes_per_tier.items())
        gain = recompute.seconds(base_tokens + prefix) - base_cost - fetch
        if gain >= best_gain - 1e-12:
            best_gain, best_k, best_fetch = gain, k, fetch
    planned = sum(chunk_tokens[:best_k])
    counts: dict[str, int] = {}
    per_tier_bytes: dict[str, float] = {}
    for tier, tokens in zip(chunk_tiers[:best_k], chunk_tokens[:best_k]):
        counts[tier] = counts.get(tier, 0) + 1
        per_tier_bytes[tier] = per_tier_bytes.get(tier, 0.0) + tokens * bytes_per_token
    fetch_per_tier = {tier: speeds[tier].seconds(int(nbytes)) * 1e3 for tier, nbytes in per_tier_bytes.items()}
    if best_k == len(chunk_tiers):
        reason = "loading all of it is faster than recomputing it"
    elif best_k == 0:
        reason = "recomputing is faster than fetching any of it"
    else:
        reason = "loading the first part and recomputing the rest is fastest"
    saved = (recompute.seconds(base_tokens + planned) - base_cost) * 1e3
    return PrefixPlan(base_tokens + sum(chunk_tokens), base_tokens + planned, best_fetch * 1e3, saved, counts,
                      fetch_per_tier, reason)
