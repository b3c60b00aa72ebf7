"""Pure bookkeeping: eviction indexes, tier health, pressure decisions, the fill queue."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tierkv.chunks.keys import CacheKey
from tierkv.policy.health import CooldownBreaker
from tierkv.policy.residency import LRUIndex, S3FIFOIndex, make_index, pressure_decision
from tierkv.routing.fill import FillJob, FillQueue


def test_lru_victims_skip_pinned_and_protected() -> None:
    index: LRUIndex[str] = LRUIndex()
    for key in "abcd":
        index.add(key, 10)
    index.touch("a")
    index.pin("b")
    assert index.victims(15, 40, protect=["c"]) == ["d", "a"]
    assert index.victims(0, 40) == []
    assert index.victims(100, 40) is None
    index.unpin("b")
    assert index.victims(5, 40) == ["b"]


def test_s3fifo_evicts_one_hit_wonders_before_the_hot_set() -> None:
    index: S3FIFOIndex[str] = S3FIFOIndex()
    capacity = 100
    for key in ("hot1", "hot2"):
        index.add(key, 10)
        index.touch(key)
    # a scan of cold keys streams through; the hot keys are hit again and again
    for i in range(30):
        victims = index.victims(10, capacity)
        assert victims is not None
        for victim in victims:
            index.remove(victim)
        index.add(f"cold{i}", 10)
        index.touch("hot1")
        index.touch("hot2")
        assert index.used_bytes <= capacity
    assert "hot1" in index and "hot2" in index
    lru: LRUIndex[str] = make_index("lru")
    for key in ("hot1", "hot2"):
        lru.add(key, 10)
    for i in range(30):
        for victim in lru.victims(10, capacity) or []:
            lru.remove(victim)
        lru.add(f"cold{i}", 10)
    assert "hot1" not in lru, "plain LRU without touches loses the hot set to the scan (the contrast)"


def test_s3fifo_never_picks_pinned_and_reports_impossible() -> None:
    index: S3FIFOIndex[int] = S3FIFOIndex()
    for key in range(4):
        index.add(key, 10)
        index.pin(key)
    assert index.victims(10, 40) is None
    index.unpin(2)
    assert index.victims(10, 40) == [2]


def test_unknown_eviction_policy() -> None:
    with pytest.raises(ValueError, match="lru"):
        make_index("random")


def test_tier_health_breaker() -> None:
    health = CooldownBreaker(threshold=2, cooldown_s=10)
    health.record_failure(0.0, "boom")
    assert health.available(0.1) and health.healthy
    health.record_failure(1.0, "boom")
    assert not health.available(5.0) and not health.healthy
    assert health.available(11.5), "probed again after the cool-down"
    health.record_success()
    assert health.healthy and health.state()["failures"] == 2


def test_pressure_decision_hysteresis_and_growth() -> None:
    total = 100_000
    calm = pressure_decision(0.50, total, tier_used=10_000, configured=30_000, high=0.9, low=0.8, was_pressured=False)
    assert calm.admitting and calm.capacity == 30_000
    high = pressure_decision(0.95, total, tier_used=20_000, configured=30_000, high=0.9, low=0.8, was_pressured=False)
    assert not high.admitting and high.pressured
    assert high.capacity == 20_000 - 15_000, "shrink by the excess over the low watermark"
    between = pressure_decision(0.85, total, tier_used=5_000, configured=30_000, high=0.9, low=0.8, was_pressured=True)
    assert between.pressured and not between.admitting, "stays pressured until under the low watermark"
    relieved = pressure_decision(0.75, total, tier_used=5_000, configured=30_000, high=0.9, low=0.8, was_pressured=True)
    assert relieved.admitting and relieved.capacity == 5_000 + 5_000, "grows back into the headroom only"


def _job(i: int, nbytes: int) -> FillJob:
    return FillJob([CacheKey("vllm", "m", 1, 0, f"{i}")], [torch.zeros(nbytes, dtype=torch.uint8)], [1])


def test_fill_queue_drop_mode_counts_and_bounds_memory() -> None:
    async def main() -> None:
        queue = FillQueue(max_bytes=100, when_full="drop")
        assert await queue.put(_job(1, 60))
        assert not await queue.put(_job(2, 60)), "over the bound: dropped"
        assert queue.queued_bytes == 60 and queue.dropped_chunks == 1
        assert queue.pending(_job(1, 1).keys[0]) is not None
        jobs = await queue.take(1000)
        await queue.done(jobs)
        assert queue.queued_bytes == 0 and queue.pending(_job(1, 1).keys[0]) is None
        await queue.join()
    asyncio.run(main())


def test_fill_queue_wait_mode_applies_back_pressure() -> None:
    async def main() -> None:
        queue = FillQueue(max_bytes=100, when_full="wait")
        await queue.put(_job(1, 80))
        second = asyncio.create_task(queue.put(_job(2, 80)))
        await asyncio.sleep(0.01)
        assert not second.done(), "the put waits while the queue is full"
        await queue.done(await queue.take(80))
        assert await asyncio.wait_for(second, 1)
        assert queue.queued_bytes == 80 and queue.dropped_chunks == 0
    asyncio.run(main())
