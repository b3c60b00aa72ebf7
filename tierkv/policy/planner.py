"""Is loading a cached prefix faster than recomputing it? The cost model, pure (no I/O).

One module of about 560 lines, by choice: three small pure models (a tier's speed, the recompute
curve, coding) and the plan over them, kept together so the whole cost model reads in one place;
none of them is used without the plan.

A hit that takes longer to fetch than the prefill it saves makes time to first token worse;
users of other KV-cache layers report exactly that (a file tier at 8K tokens slower than
recompute). tierkv decides per request:

- ``TierSpeed`` keeps a running estimate of one tier's gets: a fixed cost per batch plus
  bytes over bandwidth, fitted to the gets the tier actually served (recent ones weigh more),
  pulled towards a per-backend seed while samples are few;
- ``RecomputeModel`` is the serving model's prefill time, ``S(new, context)`` for ``new``
  tokens after ``context`` cached ones: ``a*new + b*new^2 + c*new*context`` (attention is
  quadratic; ``c``, the price of cached context, is learned: on some stacks a prefill over a
  cache takes a slower path than one from scratch), from the configured ``recompute:`` section
  and refined by measured prefills;
- ``plan_prefix`` picks the prefix length ``P`` (a whole number of chunks) that minimises
  ``fetch(P) + S(N - P, P)``: fetch the first ``P`` tokens from the tiers holding them (tiers
  read in parallel: the slowest one counts), compute the rest after them. A tier the plans
  keep skipping is now and then given one chunk (bounded in cost) so its speed is re-measured.
  A tier that keeps its chunks coded (``tierkv.backend.coded``) is costed at the bytes it
  actually moves plus the time to decode them: ``transfer(stored) + decode``.

Why the second term is not ``T(N) - T(P)``: in the cost sweep (HF demo model on the CPU, 4,096
tokens, half of them in a cpu tier, the rest behind +200 ms and 20 MB/s) the plan loaded the
hot half and recomputed the second, expecting to save ``T(4096) - T(2048)``; but the second half
over a 2,048-token cache cost about as much as the whole prompt from scratch, so the partial
load lost to loading everything (1.35x). The fetch estimate was right.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SpeedSeed:
    """What a tier of this kind costs before it has served anything: seconds per batch and
    bytes per second."""

    fixed_s: float
    bytes_per_s: float


class Coding(Protocol):
    """What coding does to a tier's reads (``tierkv.backend.coded.CodedBackend``)."""

    def split(self, nbytes: int) -> tuple[int, float]:
        """Chunks of ``nbytes`` bytes as (bytes moved from the tier, seconds decoding them)."""
        ...


HOST_MEMORY_SEED = SpeedSeed(fixed_s=20e-6, bytes_per_s=8e9)
"""A copy out of host memory (the cpu tier, the fill queue)."""

_DISTINCT_SIZES = 1e-2
"""How far apart the sizes of a tier's gets must be (as 1 - the squared correlation of their
sizes with a constant, weighted) before a fit may split their time into fixed cost and
bandwidth; below it the seed's line is scaled to the gets instead."""


class _DecayedFit:
    """Weighted least squares of ``y = sum(coef[i] * x[i])`` with every coefficient >= 0 (both
    are costs), newest samples weighing most (weights halve every ``half_life`` samples), plus
    prior points whose weight shrinks by ``prior_decay`` with every sample (the prior speaks
    until data does)."""

    def __init__(self, terms: int, half_life: float, prior: Sequence[tuple[Sequence[float], float]] = (),
                 weight: float = 0.0, prior_decay: float = 1.0, drop_first: Sequence[int] = ()) -> None:
        self.terms = terms
        self.drop_first = list(drop_first)  # which terms to give up first when the data cannot tell them apart
        self.decay = 0.5 ** (1.0 / half_life)
        self.prior = [([float(v) for v in x], float(y)) for x, y in prior]
        self.prior_weight = weight
        self.prior_decay = prior_decay
        self.xx = [[0.0] * terms for _ in range(terms)]
        self.xy = [0.0] * terms
        self.samples = 0

    def clear(self) -> None:
        """Drop every sample so far (the thing measured changed); the prior stays."""
        self.xx = [[0.0] * self.terms for _ in range(self.terms)]
        self.xy = [0.0] * self.terms

    def add(self, x: Sequence[float], y: float) -> None:
        d = self.decay
        for i in range(self.terms):
            self.xy[i] = self.xy[i] * d + x[i] * y
            for j in range(self.terms):
                self.xx[i][j] = self.xx[i][j] * d + x[i] * x[j]
        self.samples += 1

    def solve(self, without: Sequence[int] = ()) -> list[float]:
        """The coefficients (each >= 0); the terms in ``without`` held at 0."""
        xx = [row[:] for row in self.xx]
        xy = self.xy[:]
        w = self.prior_weight * self.prior_decay ** self.samples
        for x, y in self.prior:
            for i in range(self.terms):
                xy[i] += w * x[i] * y
                for j in range(self.terms):
                    xx[i][j] += w * x[i] * x[j]
        active = [i for i in range(self.terms) if xx[i][i] > 0 and i not in without]
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


EXPLORE_EVERY_PLANS = 16
"""A tier the plans skip is explored (one chunk more) at most once per this many plans that skipped it ..."""
EXPLORE_EVERY_S = 10.0
"""... and at most once per this many seconds without a read from it."""
EXPLORE_MAX_FRACTION = 0.02
"""... and only when that chunk is expected to cost at most this share of the request's time."""
_SURPRISE = 2.0  # a get this many times faster or slower than expected: the tier changed


class TierSpeed:
    """Running estimate of one tier's get time: ``fixed_s + nbytes / bytes_per_s``.

    A get that takes less than half the expected time, or two gets in a row that each take more
    than twice, mean the tier changed (another tenant left, a link got congested): the samples
    before them are dropped and the old line, corrected to the new gets, stands until gets of
    different sizes draw a new one. One slow get alone is held back until the next get's
    verdict, a fast one is not: a busy machine only adds time (a read thread descheduled looks
    like a tier a hundred times slower, and a line redrawn from it made plans skip the tier
    until it was explored again), it never makes a read faster than the tier can go.
    The first get after the seed or such a change is never a surprise itself: one get cannot
    split its time between fixed cost and bandwidth. The plan skips a slow tier
    entirely, so without help it would never be read again: ``due_for_exploration`` says
    when a plan may add one chunk from it (see ``plan_prefix``).
    """

    def __init__(self, seed: SpeedSeed, half_life: float = 32.0, clock: Callable[[], float] = time.monotonic,
                 explore_every_plans: int = EXPLORE_EVERY_PLANS, explore_every_s: float = EXPLORE_EVERY_S) -> None:
        if seed.fixed_s < 0 or seed.bytes_per_s <= 0:
            raise ValueError(f"a speed seed needs fixed_s >= 0 and bytes_per_s > 0, got {seed}")
        if explore_every_plans < 1 or explore_every_s < 0:
            raise ValueError(f"exploration needs explore_every_plans >= 1 and explore_every_s >= 0, "
                             f"got {explore_every_plans} and {explore_every_s}")
        self.seed = seed
        self._fit = _DecayedFit(2, half_life)
        self._fixed_s, self._per_byte = seed.fixed_s, 1.0 / seed.bytes_per_s
        self._shape = (self._fixed_s, self._per_byte)  # the line scaled to gets too alike to draw their own
        # gets since the seed or the last surprise: one get cannot tell fixed cost from
        # bandwidth, so until a second one the line is a guess that must not count as surprised
        # (else every get of a tier far from its seed "surprised" the last one's guess, and the
        # fit only ever knew one get: all of it fixed cost, bandwidth infinite)
        self._since_change = 0
        self._held: tuple[int, float] | None = None  # a surprisingly slow get (bytes, seconds) awaiting the next
        self._clock = clock
        self._explore_plans, self._explore_s = explore_every_plans, explore_every_s
        self._skipped = 0  # plans that left this tier out since it was last read or explored
        self._quiet_since = clock()  # the last read or exploration
        self.explorations = 0
        self.coding: Coding | None = None  # set when the tier keeps its chunks coded

    def observe(self, nbytes: int, seconds: float) -> None:
        """A get batch of ``nbytes`` took ``seconds``."""
        if nbytes <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        self._skipped, self._quiet_since = 0, self._clock()
        if self._since_change >= 2:  # only a line the new data has drawn can be surprised
            expected = self.transfer_seconds(nbytes)
            faster, slower = seconds < expected / _SURPRISE, seconds > expected * _SURPRISE
            if slower and self._held is None:
                # one slow get alone does not say the tier changed (a read thread descheduled on
                # a busy machine looks like a tier a hundred times slower): the next get decides,
                # and a next get at the expected speed drops it as the machine's noise
                self._held = (nbytes, seconds)
                return
            held, self._held = self._held, None
            if faster or (slower and held is not None):  # the tier changed
                self._shape = (self._fixed_s, self._per_byte)  # the old line, until new gets draw one
                self._fit.clear()
                self._since_change = 0
                if slower and held is not None:
                    self._add(*held)
        self._add(nbytes, seconds)

    def _add(self, nbytes: int, seconds: float) -> None:
        self._fit.add((1.0, float(nbytes)), seconds)
        self._since_change += 1
        self._fixed_s, self._per_byte = self._line()

    def _line(self) -> tuple[float, float]:
        """Fixed seconds and seconds per byte from the gets so far. Gets of one size cannot
        tell the two apart; then the seed's line (or, after a surprise, the line before it) is
        corrected to match them in the term that dominates it at their size: gets smaller than
        the line's knee (where fixed cost and bytes cost the same) measured its fixed cost,
        larger ones its bandwidth; the other term keeps its value (a tier twenty times slower
        than its seed on 1 MiB gets is taken as twenty times slower per byte; 32 KiB gets that
        take 2 ms, the thread hops of a host-memory read, say nothing of the memory's
        bandwidth). A prior point pulling the fit towards the seed would not do: its
        leverage at any size far from the gets' outweighs them, and the fit came out as all
        fixed cost, bandwidth infinite."""
        xx, xy = self._fit.xx, self._fit.xy
        spread = xx[0][0] * xx[1][1] - xx[0][1] ** 2
        if spread > _DISTINCT_SIZES * xx[0][0] * xx[1][1]:
            fixed, per_byte = self._fit.solve()
            if fixed > 0 or per_byte > 0:
                return fixed, max(per_byte, 1e-15)
        fixed, per_byte = self._shape
        weight, weighted_bytes = xx[0][0], xx[0][1]  # the gets' total weight, their weighted bytes
        if weight <= 0 or xy[0] <= 0:
            return fixed, per_byte
        fixed_part, bytes_part = fixed * weight, per_byte * weighted_bytes  # what the gets would have taken
        if xy[0] <= fixed_part + bytes_part:  # faster than the line: both terms scale down
            scale = xy[0] / (fixed_part + bytes_part)
            return fixed * scale, per_byte * scale
        excess = xy[0] - fixed_part - bytes_part
        if fixed_part >= bytes_part:  # fixed cost dominates at these gets' size: it takes the excess
            return fixed + excess / weight, per_byte
        return fixed, per_byte + excess / weighted_bytes

    def transfer_seconds(self, nbytes: int) -> float:
        """Expected time to move ``nbytes`` stored bytes in one get batch (0 bytes: no request)."""
        return 0.0 if nbytes <= 0 else self._fixed_s + nbytes * self._per_byte

    def best_case(self) -> TierSpeed:
        """The fastest this tier is known to be: each term the lesser of the seed's and the
        measured line's, with no history. For bets on reads to come (is a save worth storing?):
        gets timed while the machine was busy must not stop the saves whose reads would
        measure the tier again (nothing stored, nothing read, nothing re-measured)."""
        best = TierSpeed(SpeedSeed(min(self.seed.fixed_s, self._fixed_s), max(self.seed.bytes_per_s, self.bytes_per_s)))
        best.coding = self.coding
        return best

    def seconds(self, nbytes: int) -> float:
        """Expected time until a get batch of chunks of ``nbytes`` bytes is ready in memory: the
        transfer, and on a coded tier the transfer of the stored bytes plus their decoding."""
        if self.coding is None or nbytes <= 0:
            return self.transfer_seconds(nbytes)
        stored, decode_s = self.coding.split(nbytes)
        return self.transfer_seconds(stored) + decode_s

    def coded_share(self, nbytes: int) -> dict[str, float] | None:
        """How a read of ``nbytes`` splits on a coded tier (None on a plain one), for plans."""
        if self.coding is None:
            return None
        stored, decode_s = self.coding.split(nbytes)
        return {"stored_bytes": stored, "transfer_ms": round(self.transfer_seconds(stored) * 1e3, 3),
                "decode_ms": round(decode_s * 1e3, 3)}

    def skipped(self) -> None:
        """A plan left this tier's chunks out."""
        self._skipped += 1

    def due_for_exploration(self) -> bool:
        """Enough plans skipped this tier, for long enough, that its estimate may be stale."""
        return self._skipped >= self._explore_plans and self._clock() - self._quiet_since >= self._explore_s

    def explored(self) -> None:
        """A plan added a chunk of this tier to re-measure it (the next one waits its turn again)."""
        self._skipped, self._quiet_since = 0, self._clock()
        self.explorations += 1

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
                "samples": self.samples, "seeded": self.samples == 0, "explorations": self.explorations}


_CONTEXT_PRIOR_WEIGHT = 0.01  # how firmly "context is as cheap as in a prefill from scratch" is held (relative error)
OVERHEAD_TOKENS = 16
"""A measured prefill of at most this many tokens is taken as the per-call overhead alone."""


def _weighted(x: Sequence[float], y: float, weight: float) -> tuple[list[float], float]:
    """A least-squares point scaled so that it weighs ``weight``."""
    root = math.sqrt(weight)
    return [v * root for v in x], y * root


class RecomputeModel:
    """Prefill time: ``S(new, context)``, computing ``new`` tokens after ``context`` cached ones.

    ``S(new, context) = a*new + b*new^2 + c*new*context``, so a prefill from scratch costs
    ``T(L) = S(L, 0) = a*L + b*L^2`` (attention is quadratic). ``c`` is the price of attending
    to cached context. In one kernel it would be ``2b`` (then ``S(N - P, P) = T(N) - T(P)``),
    but serving stacks often run prefills over a cache through a slower path than a prefill
    from scratch (HF transformers on the CPU: an explicit mask instead of a causal kernel, so
    the second half of a prompt after a loaded first half costs about as much as the whole
    prompt). ``c`` starts at ``2b``, held loosely, and follows the prefills measured with a
    context.

    A measured prefill also pays a fixed per-call overhead, paid whatever is loaded (the
    model runs at least for the last token), so never counted as saved. It is measured only
    where it is all there is, on prefills of at most ``OVERHEAD_TOKENS`` tokens (loading a
    whole prompt leaves one), and subtracted from the others. Fitted as a fourth term it
    could not be told apart from a suffix always measured at one size: in the cost sweep the
    fit wrote 36 of 100 ms of a 512-token suffix off as overhead (the real one was 10), and
    the plan kept recomputing half of a 1,024-token prompt that loading beat by 1.2x.

    ``tokens_per_s`` (one throughput) or ``curve`` (throughput at a few prompt lengths, as
    ``[(tokens, tokens_per_s), ...]``) set it; ``observe`` refines it from prefills that
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
        quadratic = bool(curve)
        # terms: a*new, b*new^2, c*new*context
        prior: list[tuple[Sequence[float], float]] = [
            ((tokens, float(tokens) * tokens if quadratic else 0.0, 0.0), tokens / speed) for tokens, speed in points]
        if quadratic:
            # c = 2b, loosely: halves of each curve length cost T(L) - T(L/2) after the first half
            scratch = _DecayedFit(3, half_life, prior, weight=1.0, drop_first=(2, 1))
            a, b, _ = scratch.solve()
            for tokens, _speed in points:
                half = tokens / 2
                saved = a * half + b * (tokens * tokens - half * half)
                if saved > 0:  # a relative error, so long curve points do not pin c down alone
                    x = (half / saved, half * half / saved, half * half / saved)
                    prior.append(_weighted(x, 1.0, _CONTEXT_PRIOR_WEIGHT))
        self.configured = bool(points)
        self._fit = _DecayedFit(3, half_life, prior, weight=1.0, prior_decay=0.9, drop_first=(2, 1))
        self._overhead = _DecayedFit(1, half_life)  # one constant term: the short prefills' decayed mean
        self._overhead_s = 0.0
        self._solve()

    def _solve(self) -> None:
        """Publish the fit's coefficients as one tuple: a serving engine observes its steps on
        one thread while lookups plan on another, and a reader sees the old ``(a, b, c)`` or the
        new one, never a mix (the fits themselves are touched by the observing thread alone)."""
        a, b, c = self._fit.solve()
        if a <= 0 and b <= 0 and self._fit.samples:
            # Steps heavy with long-context decodes can put all of their time on the context term,
            # which would make a prefill from scratch free (and every load look worthless). Tokens
            # always cost their MLPs: the context term yields to the per-token ones then.
            a, b, c = self._fit.solve(without=(2,))
            c = 2 * b
        if self._fit.xx[2][2] == 0:  # nothing says what context costs yet: as in a prefill from scratch
            c = 2 * b
        self._coef = (a, b, c)

    def _observe_overhead(self, seconds: float) -> None:
        self._overhead.add((1.0,), seconds)
        self._overhead_s = self._overhead.solve()[0]

    @property
    def known(self) -> bool:
        return self.configured or self._fit.samples > 0

    @property
    def overhead_s(self) -> float:
        """The per-call overhead measured so far (0 until a prefill of a few tokens was timed)."""
        return self._overhead_s

    def observe(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """Computing ``new_tokens`` after ``context_tokens`` cached ones took ``seconds``."""
        if new_tokens <= 0 or context_tokens < 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        if new_tokens <= OVERHEAD_TOKENS:
            self._observe_overhead(seconds)
            return
        spent = seconds - self.overhead_s
        if spent <= 0:  # no slower than an empty call: nothing to learn about tokens
            return
        new, context = float(new_tokens), float(context_tokens)
        self._fit.add((new, new * new, new * context), spent)
        self._solve()

    def observe_step(self, parts: Sequence[tuple[int, int]], seconds: float) -> None:
        """One forward step of a serving engine's batch took ``seconds``: ``parts`` is each
        request's ``(new tokens, cached context)`` in it (a decode is ``(1, context)``). The step
        costs the sum of its requests' ``S(new, context)`` (the model is linear in ``a, b, c``,
        so the batch's terms add up); a step of at most ``OVERHEAD_TOKENS`` new tokens in all (a
        few decodes) measures the per-call overhead, as a short prefill does."""
        new_total = sum(max(0, int(new)) for new, _ in parts)
        if new_total <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        if new_total <= OVERHEAD_TOKENS:
            self._observe_overhead(seconds)
            return
        spent = seconds - self.overhead_s
        if spent <= 0:
            return
        x = (float(new_total), float(sum(new * new for new, _ in parts if new > 0)),
             float(sum(new * max(0, context) for new, context in parts if new > 0)))
        self._fit.add(x, spent)
        self._solve()

    def seconds(self, num_tokens: int) -> float:
        """T(num_tokens): prefill from scratch."""
        return self.suffix_seconds(num_tokens, 0)

    def suffix_seconds(self, new_tokens: int, context_tokens: int) -> float:
        """S(new_tokens, context_tokens): computing ``new_tokens`` after ``context_tokens`` cached
        ones (without the per-call overhead)."""
        if new_tokens <= 0:
            return 0.0
        a, b, c = self._coef
        return a * new_tokens + b * new_tokens * new_tokens + c * new_tokens * context_tokens

    def tokens_per_s(self, num_tokens: int) -> float:
        spent = self.seconds(num_tokens)
        return num_tokens / spent if spent > 0 else math.inf

    def snapshot(self) -> dict[str, float | bool]:
        return {"known": self.known, "measured_prefills": self._fit.samples,
                "tokens_per_s_at_1k": self.tokens_per_s(1024), "tokens_per_s_at_16k": self.tokens_per_s(16384),
                "context_cost_vs_scratch": self._coef[2] / (2 * self._coef[1]) if self._coef[1] > 0 else 1.0,
                "overhead_ms": self.overhead_s * 1e3}


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
    coded_per_tier: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        return {"cached_tokens": self.cached_tokens, "planned_tokens": self.planned_tokens,
                "expected_fetch_ms": round(self.fetch_ms, 3), "expected_recompute_saved_ms": round(self.recompute_saved_ms, 3),
                "chunks_per_tier": dict(self.chunks_per_tier),
                "expected_fetch_ms_per_tier": {k: round(v, 3) for k, v in self.fetch_ms_per_tier.items()},
                "reason": self.reason,
                # coded tiers: the stored bytes the fetch moves, its transfer and its decode time
                **({"coded_per_tier": {k: dict(v) for k, v in self.coded_per_tier.items()}} if self.coded_per_tier else {})}


def load_everything(chunk_tiers: Sequence[str], chunk_tokens: Sequence[int], reason: str,
                    base_tokens: int = 0) -> PrefixPlan:
    """The plan when cost does not decide: the whole cached prefix."""
    counts: dict[str, int] = {}
    for tier in chunk_tiers:
        counts[tier] = counts.get(tier, 0) + 1
    cached = base_tokens + sum(chunk_tokens)
    return PrefixPlan(cached, cached, 0.0, 0.0, counts, {}, reason)


def plan_prefix(chunk_tiers: Sequence[str], chunk_tokens: Sequence[int], bytes_per_token: float,
                speeds: Mapping[str, TierSpeed], recompute: RecomputeModel, base_tokens: int = 0,
                prompt_tokens: int | None = None) -> PrefixPlan:
    """The number of leading chunks whose loading saves the most time (see the module docstring).

    ``chunk_tiers[i]`` holds chunk ``i`` of the cached prefix (``chunk_tokens[i]`` tokens); the
    chunks follow ``base_tokens`` tokens the caller already has; the prompt is ``prompt_tokens``
    long (default: it ends with the cached prefix). Loading ``P`` tokens costs their fetch (tiers
    are read in parallel, so the slowest tier counts) plus computing the rest of the prompt after
    them, ``S(prompt - P, P)``. Ties go to the longer prefix (it also spares the serving
    engine's compute). Token counts in the plan include ``base_tokens``.

    Exploration: when the best plan leaves out every chunk of a tier that is due for it
    (``TierSpeed.due_for_exploration``), and the next chunk is that tier's, the plan takes
    that one chunk too, if it is expected to cost at most ``EXPLORE_MAX_FRACTION`` of the
    request. Its normal read re-measures the tier, so a tier that got faster is used again.
    """
    if not chunk_tiers:
        return PrefixPlan(base_tokens, base_tokens, 0.0, 0.0, {}, {}, "nothing cached")
    cached_end = base_tokens + sum(chunk_tokens)
    total = max(cached_end, prompt_tokens if prompt_tokens is not None else cached_end)

    def compute(loaded: int) -> float:  # computing the prompt after ``loaded`` tokens
        return recompute.suffix_seconds(total - loaded, loaded)

    nothing = compute(base_tokens)
    bytes_per_tier: dict[str, float] = {}
    costs = [nothing]  # expected time of the request with the first k chunks loaded
    fetches = [0.0]
    best_k = 0
    prefix = base_tokens
    for k, (tier, tokens) in enumerate(zip(chunk_tiers, chunk_tokens), start=1):
        prefix += tokens
        bytes_per_tier[tier] = bytes_per_tier.get(tier, 0.0) + tokens * bytes_per_token
        fetch = max(speeds[name].seconds(int(nbytes)) for name, nbytes in bytes_per_tier.items())
        fetches.append(fetch)
        costs.append(fetch + compute(prefix))
        if costs[k] <= costs[best_k] + 1e-12:
            best_k = k
    chosen = best_k
    explored = ""
    skipped = set(chunk_tiers[best_k:]) - set(chunk_tiers[:best_k])
    for tier in skipped:
        speeds[tier].skipped()
    if best_k < len(chunk_tiers) and chunk_tiers[best_k] in skipped:
        tier = chunk_tiers[best_k]
        extra = costs[best_k + 1] - costs[best_k]
        if speeds[tier].due_for_exploration() and extra <= EXPLORE_MAX_FRACTION * costs[best_k]:
            chosen = best_k + 1
            speeds[tier].explored()
            explored = f"; one chunk more from {tier!r} re-measures it (expected +{max(extra, 0.0) * 1e3:.3g} ms)"
    planned = sum(chunk_tokens[:chosen])
    counts: dict[str, int] = {}
    per_tier_bytes: dict[str, float] = {}
    for tier, tokens in zip(chunk_tiers[:chosen], chunk_tokens[:chosen]):
        counts[tier] = counts.get(tier, 0) + 1
        per_tier_bytes[tier] = per_tier_bytes.get(tier, 0.0) + tokens * bytes_per_token
    fetch_per_tier = {tier: speeds[tier].seconds(int(nbytes)) * 1e3 for tier, nbytes in per_tier_bytes.items()}
    coded = {tier: share for tier, nbytes in per_tier_bytes.items()
             if (share := speeds[tier].coded_share(int(nbytes))) is not None}
    if best_k == len(chunk_tiers):
        reason = "loading all of it is faster than recomputing it"
    elif best_k == 0:
        reason = "recomputing is faster than fetching any of it"
    else:
        reason = "loading the first part and recomputing the rest is fastest"
    saved = (nothing - compute(base_tokens + planned)) * 1e3
    return PrefixPlan(cached_end, base_tokens + planned, fetches[chosen] * 1e3, saved, counts,
                      fetch_per_tier, reason + explored, coded)
