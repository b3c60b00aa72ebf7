"""Cost-aware retrieval (issue 12): tier speeds, the recompute model, the plan per request,
deadlines and the single pass over the tiers."""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_fixtures import s3_tier_options

from tierkv import Engine
from tierkv.errors import ConfigError
from tierkv.policy.planner import HOST_MEMORY_SEED, RecomputeModel, SpeedSeed, TierSpeed, plan_prefix
from tierkv.testing.faults import FaultyBackend
from tierkv.testing.s3server import S3Server
from tierkv.testing.slowproxy import SlowProxy

CHUNK = 16
LLAMA_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # Llama-3-8B, bf16: 128 KiB per token


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 1, 8) / 16).contiguous()


def prompt(index: int, num_chunks: int) -> torch.Tensor:
    return torch.arange(num_chunks * CHUNK, dtype=torch.int64) + 100_000 * (index + 1)


def speeds(**tiers: tuple[float, float]) -> dict[str, TierSpeed]:
    return {name: TierSpeed(SpeedSeed(fixed_s, bytes_per_s)) for name, (fixed_s, bytes_per_s) in tiers.items()}


# -- the plan on synthetic speeds ------------------------------------------------------------------
def test_a_fast_tier_is_loaded_in_full() -> None:
    plan = plan_prefix(["cpu"] * 16, [256] * 16, LLAMA_BYTES_PER_TOKEN, speeds(cpu=(20e-6, 10e9)),
                       RecomputeModel(tokens_per_s=8000))
    assert plan.planned_tokens == plan.cached_tokens == 4096
    assert plan.chunks_per_tier == {"cpu": 16}
    assert plan.fetch_ms == pytest.approx(0.02 + 4096 * LLAMA_BYTES_PER_TOKEN / 10e9 * 1e3)
    assert plan.recompute_saved_ms == pytest.approx(4096 / 8000 * 1e3)


def test_a_tier_slower_than_recompute_is_not_loaded() -> None:
    # 512 MiB at 100 MB/s is 5.4 s; recomputing 4096 tokens at 8000 tokens/s is 0.5 s
    plan = plan_prefix(["s3"] * 16, [256] * 16, LLAMA_BYTES_PER_TOKEN, speeds(s3=(0.02, 100e6)),
                       RecomputeModel(tokens_per_s=8000))
    assert plan.planned_tokens == 0 and plan.chunks_per_tier == {}
    assert "recomputing is faster" in plan.reason


def test_mixed_tiers_load_the_fast_part_and_recompute_the_rest() -> None:
    tiers = ["cpu"] * 6 + ["s3"] * 10
    plan = plan_prefix(tiers, [256] * 16, LLAMA_BYTES_PER_TOKEN, speeds(cpu=(20e-6, 10e9), s3=(0.02, 100e6)),
                       RecomputeModel(tokens_per_s=8000))
    assert plan.planned_tokens == 6 * 256 and plan.chunks_per_tier == {"cpu": 6}
    assert "first part" in plan.reason


def test_tiers_are_read_in_parallel_so_the_slowest_one_counts() -> None:
    both = speeds(a=(0.0, 1e9), b=(0.0, 1e9))
    recompute = RecomputeModel(tokens_per_s=1e3)
    alternating = plan_prefix(["a", "b"] * 4, [256] * 8, 1000.0, both, recompute)
    one_tier = plan_prefix(["a"] * 8, [256] * 8, 1000.0, both, recompute)
    assert alternating.fetch_ms == pytest.approx(one_tier.fetch_ms / 2)


def test_chunks_the_caller_already_has_are_neither_fetched_nor_counted_as_saved() -> None:
    recompute = RecomputeModel(curve=[(1024, 10_000), (16384, 2_000)])  # quadratic: the tail costs more
    plan = plan_prefix(["cpu"] * 4, [256] * 4, 1000.0, speeds(cpu=(0.0, 1e12)), recompute, base_tokens=1024)
    assert plan.planned_tokens == plan.cached_tokens == 2048
    assert plan.recompute_saved_ms == pytest.approx((recompute.seconds(2048) - recompute.seconds(1024)) * 1e3)


def test_recompute_curve_is_quadratic_and_interpolates_the_points() -> None:
    model = RecomputeModel(curve=[(1024, 20_000), (16384, 6_000)])
    assert model.tokens_per_s(1024) == pytest.approx(20_000, rel=0.02)
    assert model.tokens_per_s(16384) == pytest.approx(6_000, rel=0.02)
    assert 6_000 < model.tokens_per_s(4096) < 20_000


def test_recompute_is_unknown_until_configured_or_measured() -> None:
    model = RecomputeModel()
    assert not model.known
    for length in (256, 512, 1024, 2048):
        model.observe(length, 0, 1e-5 * length + 1e-9 * length * length)
    assert model.known
    assert model.seconds(4096) == pytest.approx(1e-5 * 4096 + 1e-9 * 4096**2, rel=0.05)


def test_speed_estimate_leaves_its_seed_and_follows_a_tier_whose_speed_changes() -> None:
    estimate = TierSpeed(SpeedSeed(fixed_s=1e-3, bytes_per_s=1e9))
    sizes = [(1 + i % 8) << 20 for i in range(200)]
    for nbytes in sizes:
        estimate.observe(nbytes, 0.005 + nbytes / 100e6)  # 5 ms + 100 MB/s
    assert estimate.bytes_per_s == pytest.approx(100e6, rel=0.1)
    assert estimate.fixed_s == pytest.approx(0.005, rel=0.2)
    for nbytes in sizes:
        estimate.observe(nbytes, 0.001 + nbytes / 400e6)  # the tier got faster
    assert estimate.bytes_per_s == pytest.approx(400e6, rel=0.1)
    assert estimate.fixed_s == pytest.approx(0.001, rel=0.3)


def test_a_tier_far_slower_than_its_seed_is_measured_within_a_few_gets() -> None:
    # the fs seed (300 us, 1.5 GB/s) behind a 20 MB/s link: once, every get "surprised" the
    # last one's guess and the fit came out as all fixed cost with infinite bandwidth, so the
    # planner thought two chunks cost what one does and recomputed what it should have loaded
    estimate = TierSpeed(SpeedSeed(fixed_s=300e-6, bytes_per_s=1.5e9))
    for mib in (0.5, 1.5, 0.5, 1.0, 2.0):
        nbytes = int(mib * 2**20)
        estimate.observe(nbytes, 0.002 + nbytes / 20e6)
    assert estimate.bytes_per_s == pytest.approx(20e6, rel=0.05)
    assert estimate.fixed_s == pytest.approx(0.002, rel=0.2)


def test_gets_of_one_size_scale_the_seed_line_rather_than_calling_it_all_fixed_cost() -> None:
    estimate = TierSpeed(SpeedSeed(fixed_s=1e-3, bytes_per_s=1e9))
    for _ in range(3):
        estimate.observe(1 << 20, 0.05)
    assert estimate.seconds(1 << 20) == pytest.approx(0.05, rel=0.01)
    assert estimate.seconds(4 << 20) > 2 * estimate.seconds(1 << 20)  # bytes still cost, as in the seed (2.5x)


def test_small_gets_measure_the_fixed_cost_not_the_bandwidth() -> None:
    # a vLLM worker's first loads were 32-token continuations: 32 KiB reads of host memory that
    # took 2 ms (the read's thread hops); scaling the whole seed line by that made a 1 MiB read
    # look 80 times dearer than the memory copy it is, and the plans recomputed what they should load
    estimate = TierSpeed(HOST_MEMORY_SEED)
    for _ in range(3):
        estimate.observe(32 << 10, 0.002)
    assert estimate.seconds(32 << 10) == pytest.approx(0.002, rel=0.01)
    assert estimate.seconds(1 << 20) == pytest.approx(0.002 + (1 << 20) / HOST_MEMORY_SEED.bytes_per_s, rel=0.02)


def test_one_slow_get_is_the_machines_noise_two_in_a_row_are_a_slower_tier() -> None:
    estimate = TierSpeed(SpeedSeed(fixed_s=1e-3, bytes_per_s=1e9))
    for i in range(20):
        nbytes = (1 + i % 4) << 20
        estimate.observe(nbytes, 0.002 + nbytes / 200e6)
    steady = estimate.seconds(4 << 20)
    estimate.observe(1 << 20, 1.0)  # the read's thread was descheduled for a second
    assert estimate.seconds(4 << 20) == pytest.approx(steady), "one slow get waits for the next one's verdict"
    estimate.observe(2 << 20, 0.002 + (2 << 20) / 200e6)  # the next one: as expected, so that was noise
    assert estimate.seconds(4 << 20) == pytest.approx(steady, rel=0.02)
    estimate.observe(1 << 20, 0.2)
    estimate.observe(1 << 20, 0.2)  # twice in a row: the tier got slower
    assert estimate.seconds(1 << 20) == pytest.approx(0.2, rel=0.01)


class FakeClock:
    """Seconds that pass only when the test says so (the planner's exploration waits on time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_prefill_over_a_cache_teaches_the_model_what_context_costs() -> None:
    # HF on the CPU: the second half after a loaded first half costs about the whole prompt
    recompute = RecomputeModel(curve=[(1024, 1024 / 0.13), (4096, 4096 / 0.57), (16384, 16384 / 4.0)])
    assert recompute.suffix_seconds(2048, 2048) == pytest.approx(recompute.seconds(4096) - recompute.seconds(2048))
    tiers = ["host"] * 8 + ["slow"] * 8
    fast, slow = TierSpeed(SpeedSeed(20e-6, 8e9)), TierSpeed(SpeedSeed(0.2, 20e6))
    for _ in range(20):
        slow.observe(4_000_000, 0.2 + 4e6 / 20e6)
    before = plan_prefix(tiers, [256] * 16, 2048, {"host": fast, "slow": slow}, recompute)
    assert before.planned_tokens == 2048  # the old belief: the second half costs T(4096) - T(2048)
    recompute.observe(2048, 2048, 0.55)  # what it really cost
    assert recompute.suffix_seconds(2048, 2048) > 0.4
    after = plan_prefix(tiers, [256] * 16, 2048, {"host": fast, "slow": slow}, recompute)
    assert after.planned_tokens == 4096 and after.chunks_per_tier == {"host": 8, "slow": 8}


def test_the_per_call_overhead_comes_from_short_prefills_not_from_a_suffix_seen_at_one_size() -> None:
    # the cost sweep's point: 1,024 tokens, half in a cpu tier, half behind 50 ms + 50 MB/s.
    # A 512-token suffix really costs 100 ms of which 10 ms are the call's own overhead.
    recompute = RecomputeModel(curve=[(1024, 1024 / 0.102), (4096, 4096 / 0.80), (16384, 16384 / 7.8)])
    host, slow = TierSpeed(SpeedSeed(20e-6, 8e9)), TierSpeed(SpeedSeed(0.05, 50e6))
    for _ in range(12):
        recompute.observe(512, 512, 0.100)
    recompute.observe(1, 1023, 0.010)  # a whole prompt loaded: only the last token computed
    for _ in range(12):
        recompute.observe(512, 512, 0.100)
    assert recompute.overhead_s == pytest.approx(0.010)
    assert recompute.suffix_seconds(512, 512) == pytest.approx(0.090, rel=0.1)
    plan = plan_prefix(["host", "host", "slow", "slow"], [256] * 4, 2048, {"host": host, "slow": slow}, recompute)
    assert plan.planned_tokens == 1024, plan.reason  # 76 ms of fetch beats 90 ms of compute


def test_the_rest_of_the_prompt_after_the_cached_prefix_is_costed_with_its_context() -> None:
    recompute = RecomputeModel(curve=[(1024, 10_000), (16384, 2_000)])
    recompute.observe(1024, 1024, 10.0)  # context is very expensive here
    alone = plan_prefix(["cpu"] * 4, [256] * 4, 1000.0, speeds(cpu=(0.0, 1e12)), recompute)
    longer = plan_prefix(["cpu"] * 4, [256] * 4, 1000.0, speeds(cpu=(0.0, 1e12)), recompute, prompt_tokens=4096)
    assert alone.planned_tokens == 1024  # nothing is left to compute after it
    # 3072 more tokens attending to a loaded 1024 cost more than the whole prompt from scratch
    assert longer.planned_tokens == 0 and "recomputing" in longer.reason


def test_a_skipped_tier_is_explored_rarely_cheaply_and_used_again_once_faster() -> None:
    clock = FakeClock()
    slow = TierSpeed(SpeedSeed(1e-3, 1e9), clock=clock, explore_every_plans=4, explore_every_s=10.0)
    for i in range(40):
        nbytes = 256_000 * (1 + i % 4)
        slow.observe(nbytes, 1e-3 + nbytes / 0.9e6)  # a bit slower than recomputing: 0.285 s per chunk
    recompute = RecomputeModel(tokens_per_s=1000.0)  # 0.256 s per chunk of 256 tokens
    tiers, tokens = ["slow"] * 16, [256] * 16
    plans = []
    for _ in range(4):
        plans.append(plan_prefix(tiers, tokens, 1000.0, {"slow": slow}, recompute))
    assert [p.planned_tokens for p in plans] == [0, 0, 0, 0]  # enough plans, but not enough time
    clock.now += 11.0
    explored = plan_prefix(tiers, tokens, 1000.0, {"slow": slow}, recompute)
    assert explored.planned_tokens == 256 and explored.chunks_per_tier == {"slow": 1}
    assert "re-measures" in explored.reason and slow.explorations == 1
    again = plan_prefix(tiers, tokens, 1000.0, {"slow": slow}, recompute)
    assert again.planned_tokens == 0  # once per turn
    slow.observe(256_000, 1e-3 + 256_000 / 100e6)  # the exploration read: the tier got 100x faster
    assert plan_prefix(tiers, tokens, 1000.0, {"slow": slow}, recompute).planned_tokens == 16 * 256


def test_exploration_never_adds_a_chunk_that_costs_much_of_the_request() -> None:
    clock = FakeClock()
    slow = TierSpeed(SpeedSeed(1e-3, 1e9), clock=clock, explore_every_plans=1, explore_every_s=0.0)
    for i in range(40):
        slow.observe(256_000 * (1 + i % 4), 0.2 + 256_000 * (1 + i % 4) / 20e6)  # 200 ms per request: far too dear to try
    recompute = RecomputeModel(tokens_per_s=20_000.0)
    for _ in range(5):
        clock.now += 100.0
        plan = plan_prefix(["slow"] * 16, [256] * 16, 1000.0, {"slow": slow}, recompute)
        assert plan.planned_tokens == 0
    assert slow.explorations == 0


def test_exploration_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="explore_every_plans"):
        TierSpeed(SpeedSeed(1e-3, 1e9), explore_every_plans=0)


# -- the plan in the engine --------------------------------------------------------------------------
def fs_engine(tmp_path: Path, **extra: Any) -> Engine:
    return Engine({"model": "cost", "chunk_size": CHUNK, "kv_format": "vllm", **extra,
                   "tiers": [{"name": "disk", "backend": "fs", "path": str(tmp_path / "fs")}]})


def test_free_recompute_plans_nothing_and_retrieve_loads_nothing(tmp_path: Path) -> None:
    with fs_engine(tmp_path, recompute={"tokens_per_s": 1e12}) as eng:
        tokens = prompt(0, 4)
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        assert eng.cost_aware
        assert eng.lookup(tokens) == 0
        plan = eng.stats()["last_lookup"]["plan"]
        assert plan["cached_tokens"] == 4 * CHUNK and plan["planned_tokens"] == 0
        assert plan["expected_fetch_ms"] == 0 and "recomputing" in plan["reason"]
        kv, mask = eng.retrieve(tokens)
        assert kv == () and not mask.any()
        assert eng.stats()["tiers"]["disk"]["hits"] == 0  # nothing was read


def test_slow_recompute_plans_the_whole_prefix(tmp_path: Path) -> None:
    with fs_engine(tmp_path, recompute={"tokens_per_s": 10}) as eng:
        tokens = prompt(0, 4)
        eng.store(tokens, kv_of(tokens))
        assert eng.lookup(torch.cat([tokens, prompt(9, 1)])) == 4 * CHUNK
        plan = eng.stats()["last_lookup"]["plan"]
        assert plan["chunks_per_tier"] == {"disk": 4} and plan["expected_fetch_ms"] > 0
        assert plan["expected_recompute_saved_ms"] == pytest.approx(4 * CHUNK / 10 * 1e3)
        kv, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(kv, kv_of(tokens))


def test_cost_aware_false_loads_everything_whatever_recompute_costs(tmp_path: Path) -> None:
    with fs_engine(tmp_path, recompute={"tokens_per_s": 1e12}, cost_aware=False) as eng:
        tokens = prompt(0, 4)
        eng.store(tokens, kv_of(tokens))
        assert not eng.cost_aware
        assert eng.lookup(tokens) == 4 * CHUNK
        assert eng.stats()["last_lookup"]["plan"]["reason"] == "cost_aware is off"
        kv, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(kv, kv_of(tokens))


def test_without_a_recompute_speed_everything_cached_is_loaded(tmp_path: Path) -> None:
    with fs_engine(tmp_path) as eng:
        tokens = prompt(0, 3)
        eng.store(tokens, kv_of(tokens))
        assert not eng.cost_aware and eng.stats()["recompute"]["known"] is False
        assert eng.lookup(tokens) == 3 * CHUNK
        eng.observe_recompute(1024, 0, 1e-9)  # a measured prefill, absurdly fast: switches the plan on
        assert eng.cost_aware and eng.lookup(tokens) == 0


def test_a_batched_step_teaches_what_its_requests_would_have_taught_alone() -> None:
    """A serving engine's step computes several requests at once: the step costs the sum of their
    S(new, context), so steps of mixed batches fit the same a, b, c as single prefills; a step of
    a few decodes (16 new tokens at most) is the per-call overhead."""
    a, b, c, overhead = 2e-4, 1e-8, 3e-8, 0.004

    def truth(parts: list[tuple[int, int]]) -> float:
        return overhead + sum(a * n + b * n * n + c * n * ctx for n, ctx in parts)

    model = RecomputeModel()
    assert not model.known
    model.observe_step([(1, 500), (1, 900)], truth([(1, 500), (1, 900)]))  # two decodes: the overhead
    assert model.overhead_s == pytest.approx(truth([(1, 500), (1, 900)]))
    steps = [[(700, 0)], [(300, 0), (1, 400)], [(512, 512), (88, 0)], [(1000, 0), (256, 768), (1, 50)],
             [(128, 1920)], [(2048, 0)]]
    for _ in range(8):
        for parts in steps:
            model.observe_step(parts, truth(parts))
    assert model.known
    assert model.seconds(1024) == pytest.approx(a * 1024 + b * 1024 * 1024, rel=0.15)
    assert model.suffix_seconds(512, 1536) == pytest.approx(a * 512 + b * 512 * 512 + c * 512 * 1536, rel=0.2)
    model.observe_step([], 1.0)  # nothing computed: nothing learned
    model.observe_step([(300, 0)], float("nan"))
    assert model.seconds(1024) == pytest.approx(a * 1024 + b * 1024 * 1024, rel=0.15)


def test_steps_that_blame_context_alone_still_leave_a_prefill_its_cost() -> None:
    """Noisy steps of long-context batches can fit every second to the context term (a = b = 0):
    a prefill from scratch would then cost nothing, its speed would be infinite and no load
    would ever pay. (These timings, from a fuzz of the fit, did so; a vLLM worker then failed
    on the infinite speed it reported.) The per-token terms take the time back."""
    steps = [([(1024, 512), (100, 512)], 5e-05), ([(2048, 4096), (2048, 512), (1, 0)], 0.22694),
             ([(2, 4096)], 0.23218), ([(2048, 128), (511, 128), (1024, 4096)], 4e-05),
             ([(1024, 4096), (2, 512)], 5e-05), ([(2048, 4096), (2, 4096), (256, 512)], 0.00414),
             ([(1024, 4096)], 0.78644)]
    model = RecomputeModel()
    for parts, seconds in steps:
        model.observe_step(parts, seconds)
        assert model.seconds(1024) > 0
        assert math.isfinite(model.tokens_per_s(1024))


def test_a_prompt_that_could_never_load_faster_than_it_recomputes_is_not_worth_storing(tmp_path: Path) -> None:
    with fs_engine(tmp_path) as eng:
        assert eng.core.worth_storing(4 * CHUNK), "nothing known: store"
        eng.core.observe_step([(1024, 0)], 1e-9)  # an absurdly fast model: no tier beats it
        assert not eng.core.worth_storing(4 * CHUNK)
        assert eng.core.recompute_tokens_per_s(1024) > 1e9
    with fs_engine(tmp_path / "slow", recompute={"tokens_per_s": 10}) as eng:
        assert eng.core.worth_storing(4 * CHUNK) and eng.core.recompute_tokens_per_s(1024) == pytest.approx(10)
    with fs_engine(tmp_path / "off", recompute={"tokens_per_s": 1e12}, cost_aware=False) as eng:
        assert eng.core.worth_storing(4 * CHUNK), "cost_aware off: every prompt is stored"


def test_reads_timed_on_a_busy_machine_stop_loads_but_never_the_saves_that_would_remeasure_them(
        tmp_path: Path) -> None:
    # under CI's load a vLLM worker timed its first reads at ~10 ms; judged by that line no save
    # paid, nothing was stored, so nothing was ever read again to correct it: the cache stayed off
    with fs_engine(tmp_path, recompute={"tokens_per_s": 10_000}) as eng:  # 4 chunks: 6.4 ms to recompute
        disk = eng.wrap_tier(eng.tiers[0].name, FaultyBackend)
        tokens = prompt(0, 4)
        eng.store(tokens, kv_of(tokens))
        assert eng.plan(tokens).planned_tokens == 4 * CHUNK, "at the fs seed's speed, loading pays"
        disk.stall_s = 0.05
        assert int(eng.retrieve(tokens)[1].sum()) == 4 * CHUNK  # a read that takes 50 ms
        disk.stall_s = 0.0
        assert eng.plan(tokens).planned_tokens == 0, "as measured, a read costs more than the recompute"
        assert eng.core.worth_storing(4 * CHUNK), "the tier's best case still pays: keep storing"


def test_measured_tier_speed_shows_in_stats(tmp_path: Path) -> None:
    with fs_engine(tmp_path) as eng:
        assert eng.stats()["tiers"]["disk"]["speed"]["seeded"] is True
        tokens = prompt(0, 4)
        eng.store(tokens, kv_of(tokens))
        eng.retrieve(tokens)
        speed = eng.stats()["tiers"]["disk"]["speed"]
        assert speed["samples"] == 1 and speed["seeded"] is False
        assert speed["bandwidth_MBps"] > 0 and speed["fixed_ms"] >= 0


@pytest.mark.parametrize("recompute, message", [
    ({"tokens_per_s": -5}, "recompute.tokens_per_s"),
    ({"tokens_per_s": "fast"}, "recompute.tokens_per_s"),
    ({"curve": [[1024]]}, r"recompute.curve\[0\]"),
    ({"curve": "1024:5000"}, "recompute.curve"),
    ({"tokens_per_sec": 5}, "tokens_per_s"),
])
def test_bad_recompute_section_names_the_key(tmp_path: Path, recompute: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        fs_engine(tmp_path, recompute=recompute)


def test_cost_aware_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cost_aware: expected true, false"):
        fs_engine(tmp_path, cost_aware="yes")


# -- deadlines ---------------------------------------------------------------------------------------
@pytest.mark.slow  # waits out the stuck reads on close
def test_deadline_with_a_stuck_object_store_returns_the_prefix_that_arrived(
        s3_server: S3Server, black_hole: str) -> None:
    stuck = {"name": "remote", "backend": "s3", **s3_tier_options(
        s3_server, "never-answers", "stuck", endpoint_url=black_hole, check_on_start=False, retries=0,
        timeout_s=20.0, read_timeout_s=5.0)}
    config = {"model": "deadline", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_back",
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}, stuck]}
    with Engine(config) as eng:
        tokens = prompt(0, 4)
        eng.store(tokens[: 2 * CHUNK], kv_of(tokens[: 2 * CHUNK]))  # the host holds 2 of 4 chunks
        started = time.monotonic()
        kv, mask = eng.retrieve(tokens, return_tuple=False, deadline_s=0.3)
        elapsed = time.monotonic() - started
        # the store never answers and its reads time out after 5 s: returning before that is the
        # deadline's doing (a bound on the stuck read, not a timing of the deadline)
        assert elapsed < 4, f"retrieve took {elapsed:.1f}s: the 0.3 s deadline did not cut the stuck read short"
        assert mask[: 2 * CHUNK].all() and not mask[2 * CHUNK :].any()
        assert torch.equal(kv, kv_of(tokens[: 2 * CHUNK]))  # bit-exact
        remote = eng.stats()["tiers"]["remote"]
        assert remote["deadline_misses"] == 2 and remote["health"]["healthy"]  # slow, not failed


def test_deadline_uses_a_prefetch_only_as_far_as_it_is_done(tmp_path: Path) -> None:
    config = {"model": "deadline", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_through",
              "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"},
                        {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "64MiB"}]}
    with Engine(config) as eng:
        tokens = prompt(0, 3)
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        host = eng.tiers[0]
        eng.run(host.delete(eng.keys_for(tokens)[0]))  # chunk 0 only on disk now
        disk = eng.wrap_tier(eng.tiers[1].name, FaultyBackend)
        disk.stall_s, disk.stall_ops = 60.0, {"batched_get"}  # the prefetch's read of chunk 0 hangs until released
        eng.prefetch(tokens)
        started = time.monotonic()
        kv, mask = eng.retrieve(tokens, return_tuple=False, deadline_s=0.2)
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"retrieve took {elapsed:.1f}s: the 0.2 s deadline did not cut the stalled prefetch short"
        assert not mask.any() and kv == ()  # the first chunk is still moving: no usable prefix
        disk.stall_s = 0
        eng.flush()


def test_without_a_deadline_a_slow_tier_is_waited_for(tmp_path: Path) -> None:
    with fs_engine(tmp_path) as eng:
        tokens = prompt(0, 2)
        eng.store(tokens, kv_of(tokens))
        disk = eng.wrap_tier(eng.tiers[0].name, FaultyBackend)
        disk.stall_s = 0.2
        kv, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(kv, kv_of(tokens))
        kv, mask = eng.retrieve(tokens, return_tuple=False, deadline_s=0.05)
        assert not mask.any()
        assert eng.stats()["tiers"]["disk"]["deadline_misses"] == 2


# -- one pass over the tiers ---------------------------------------------------------------------------
def test_a_retrieve_from_s3_is_one_get_per_chunk_and_no_head(s3_server: S3Server, s3_bucket: str) -> None:
    prefix = f"onepass/{uuid.uuid4().hex}"
    tokens = prompt(0, 3)
    direct = {"name": "remote", "backend": "s3", **s3_tier_options(s3_server, s3_bucket, prefix)}
    config = {"model": "onepass", "chunk_size": CHUNK, "kv_format": "vllm", "tiers": [direct]}
    with Engine(config) as eng:
        eng.store(tokens, kv_of(tokens))
        eng.flush()
    with SlowProxy(s3_server.endpoint_url) as proxy:
        remote = {**direct, "endpoint_url": proxy.url, "check_on_start": False}
        host = {"name": "host", "backend": "cpu", "capacity": "16MiB", "promote": False}
        with Engine({**config, "tiers": [host, remote]}) as eng:
            proxy.reset_counts()
            longer = torch.cat([tokens, prompt(1, 2)])  # 3 cached chunks, then 2 nobody has
            kv, mask = eng.retrieve(longer, return_tuple=False)
            assert int(mask.sum()) == 3 * CHUNK and torch.equal(kv, kv_of(tokens))
            counts = dict(proxy.counts)
    # one GET per chunk asked (the 3 hits, and the 2 misses answered 404, asked in the same
    # parallel batch), and no HEAD before any of them
    assert counts == {"GET": 5}, counts


def test_cost_aware_switched_at_runtime_keeps_the_measured_speeds(tmp_path: Path) -> None:
    with fs_engine(tmp_path, recompute={"tokens_per_s": 1e12}) as eng:
        tokens = prompt(0, 4)
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        assert eng.cost_aware and eng.lookup(tokens) == 0
        eng.cost_aware = False  # load everything, whatever recomputing costs
        assert eng.lookup(tokens) == 4 * CHUNK
        assert eng.stats()["last_lookup"]["plan"]["reason"] == "cost_aware is off"
        kv, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(kv, kv_of(tokens))
        samples = eng.stats()["tiers"]["disk"]["speed"]["samples"]
        eng.cost_aware = True
        assert eng.lookup(tokens) == 0
        assert eng.stats()["tiers"]["disk"]["speed"]["samples"] == samples  # the read's measurement stays
        eng.cost_aware = None  # the default: on, since a recompute speed is configured
        assert eng.cost_aware and eng.lookup(tokens) == 0


def test_cost_aware_set_to_a_non_boolean_names_what_was_expected(tmp_path: Path) -> None:
    with fs_engine(tmp_path, recompute={"tokens_per_s": 10}) as eng:
        with pytest.raises(TypeError, match="cost_aware: expected True, False or None"):
            eng.cost_aware = "no"  # type: ignore[assignment]
        assert eng.cost_aware  # unchanged
