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
    """Weighted least squares of ``y = sum(coef[i] * x[i])`` with every coefficient >= 0 (both
    are costs), newest samples weighing most (weights halve every ``half_life`` samples), plus
    prior points whose weight shrinks by ``prior_decay`` with every sample (the prior speaks
    until data does)."""

    def __init__(self, terms: int, half_life: float, prior: Sequence[tuple[Sequence[float], float]], weight: float,
                 prior_decay: float = 1.0, drop_first: Sequence[int] = ()) -> None:
        self.terms = terms
        self.drop_first = list(drop_first)  # which terms to give up first when the data cannot tell them apart
        self.decay = 0.5 ** (1.0 / half_life)
        self.prior = [([float(v) for v in x], float(y)) for x, y in prior]
        self.prior_weight = weight
        self.prior_decay = prior_decay
        self.xx = [[0.0] * terms for _ in range(terms)]
        self.xy = [0.0] * terms
        self.samples = 0

    def add(self, x: Sequence[float], y: float) -> None:
        d = self.decay
        for i in range(self.terms):
            self.xy[i] = self.xy[i] * d + x[i] * y
            for j in range(self.terms):
                self.xx[i][j] = self.xx[i][j] * d + x[i] * x[j]
        self.samples += 1

    def solve(self) -> list[float]:
        xx = [row[:] for row in self.xx]
        xy = self.xy[:]
        w = self.prior_weight * self.prior_decay ** self.samples
        for x, y in self.prior:
            for i in range(self.terms):
                xy[i] += w * x[i] * y
                for j in range(self.terms):
                    xx[i][j] += w * x[i] * x[j]
        active = [i for i in range(self.terms) if xx[i][i] > 0]
        while active:  # drop the terms that come out negative and refit the rest (a tiny NNLS)
            coef = _solve([[xx[i][j] for j in active] for i in active], [xy[i] for i in active])
            if coef is not None and all(c >= 0 for c in coef):
                result = [0.0] * self.terms
                for i, c in zip(active, coef):
                    result[i] = c
                return result
            if coef is None:
                victim = next((i for i in self.drop_first if i in active), active[-1])
                active = [i for i in active if i != victim]
            else:
                active = [i for i, c in zip(active, coef) if c > 0]
        return [0.0] * self.terms


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting, scaled; None when singular."""
    n = len(b)
    scale = [math.sqrt(a[i][i]) or 1.0 for i in range(n)]  # columns of very different magnitude
    m = [[a[i][j] / (scale[i] * scale[j]) for j in range(n)] + [b[i] / scale[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] / scale[i] for i in range(n)]


class TierSpeed:
    """Running estimate of one tier's get time: ``fixed_s + nbytes / bytes_per_s``."""

    def __init__(self, seed: SpeedSeed, half_life: float = 32.0) -> None:
        if seed.fixed_s < 0 or seed.bytes_per_s <= 0:
            raise ValueError(f"a speed seed needs fixed_s >= 0 and bytes_per_s > 0, got {seed}")
        self.seed = seed
        x = float(_REFERENCE_BYTES)
        # two prior points on the seed's line: it governs until real gets outweigh it
        self._fit = _DecayedFit(2, half_life, [((1.0, 0.0), seed.fixed_s), ((1.0, x), seed.fixed_s + x / seed.bytes_per_s)],
                                weight=0.5, prior_decay=0.7)
        self._fixed_s, self._per_byte = seed.fixed_s, 1.0 / seed.bytes_per_s

    def observe(self, nbytes: int, seconds: float) -> None:
        """A get batch of ``nbytes`` took ``seconds``."""
        if nbytes <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        self._fit.add((1.0, float(nbytes)), seconds)
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

    A measured prefill also pays a fixed per-call overhead (fitted apart, never counted as
    saved: the model runs for the last token whatever is loaded), so tiny prefills do not
    make every token look expensive.

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
        # terms: a per-call overhead (measured prefills only: it is paid whether or not a prefix
        # is loaded, so it never counts as saved), a*L, b*L^2
        if tokens_per_s is not None and not curve:
            prior = [((0.0, tokens, 0.0), tokens / speed) for tokens, speed in points]  # linear: one throughput
        else:
            prior = [((0.0, tokens, float(tokens) * tokens), tokens / speed) for tokens, speed in points]
        self.configured = bool(points)
        self._fit = _DecayedFit(3, half_life, prior, weight=1.0, prior_decay=0.9, drop_first=(0, 2))
        _, self._a, self._b = self._fit.solve()  # the overhead is paid either way: never saved

    @property
    def known(self) -> bool:
        return self.configured or self._fit.samples > 0

    def observe(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """Computing ``new_tokens`` after ``context_tokens`` cached ones took ``seconds``."""
        if new_tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        end = context_tokens + new_tokens
        self._fit.add((1.0, float(new_tokens), float(end * end - context_tokens * context_tokens)), seconds)
        _, self._a, self._b = self._fit.solve()  # the overhead is paid either way: never saved

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
