"""The storage hierarchy end to end on real tiers: write policies, promotion, demotion,
prefetch, memory pressure, tier faults, and many concurrent callers."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from waiting import wait_until

from tierkv import Engine
from tierkv.engine import AsyncEngine
from tierkv.policy.pressure import ScriptedProbe
from tierkv.testing.faults import FaultyBackend

CHUNK = 16
CHUNK_BYTES = 3 * 2 * CHUNK * 2 * 8 * 4  # float32 vllm chunk: 6 KiB


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    """KV that is a pure function of the token ids: two prompts sharing a prefix share its KV,
    so any chunk served for the wrong key (or a torn one) is visible."""
    t = tokens.to(torch.float32)[None, None, :, None, None]
    layer = torch.arange(3, dtype=torch.float32)[:, None, None, None, None]
    kv = torch.arange(2, dtype=torch.float32)[None, :, None, None, None]
    rest = torch.arange(16, dtype=torch.float32).reshape(1, 1, 1, 2, 8)
    return (t * 1000 + layer * 100 + kv * 50 + rest).contiguous()


def prompt(index: int, num_chunks: int = 1) -> torch.Tensor:
    return torch.arange(num_chunks * CHUNK, dtype=torch.int64) + 10_000 * (index + 1)


def config(tmp_path: Path, cpu: str = "64MiB", policy: str = "write_through", **extra: Any) -> dict[str, Any]:
    return {"model": "tiering", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": policy, **extra,
            "tiers": [{"name": "host", "backend": "cpu", "capacity": cpu},
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "1GiB"}]}


def disk_only(tmp_path: Path) -> dict[str, Any]:
    return {"model": "tiering", "chunk_size": CHUNK, "kv_format": "vllm",
            "tiers": [{"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "1GiB"}]}




def on_loop(eng: Engine, coro: Any) -> Any:
    return eng.run(coro)


def tier(eng: Engine, name: str) -> Any:
    return next(t for t in eng.tiers if t.name == name)


# -- write policies ---------------------------------------------------------------------------
def test_write_back_small_memory_tier_keeps_every_chunk_on_disk(tmp_path: Path) -> None:
    prompts = [prompt(i, 2) for i in range(20)]  # 40 chunks; the host tier holds 4
    with Engine(config(tmp_path, cpu=f"{4 * CHUNK_BYTES}B", policy="write_back")) as eng:
        for tokens in prompts:
            assert eng.store(tokens, kv_of(tokens)) == 2
        host = eng.stats()["tiers"]["host"]
        assert host["used_bytes"] <= 4 * CHUNK_BYTES
        assert host["evictions"] >= 36 and host["demotions"] >= 36
        # write-back: the disk tier got only what was demoted, never a direct put
        assert eng.stats()["fill_queue"]["completed_chunks"] == 0
        for tokens in prompts:
            out, mask = eng.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens))
    # after close (which demotes nothing more: memory is simply gone) the disk alone has it all
    with Engine(disk_only(tmp_path)) as disk:
        for tokens in prompts[:-2]:  # the last two prompts may still be only in host memory
            out, mask = disk.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens))


def test_write_back_writes_only_the_top_tier_until_flushed(tmp_path: Path) -> None:
    with Engine(config(tmp_path, policy="write_back")) as eng:
        tokens = prompt(0, 3)
        eng.store(tokens, kv_of(tokens))
        assert eng.locate(tokens) == ["host"] * 3
        assert not on_loop(eng, tier(eng, "disk").contains(eng.keys_for(tokens)[0])), "a store writes the top only"
        eng.flush()
        assert eng.locate(tokens) == ["host"] * 3, "flushed chunks stay in the top tier, clean"
        assert on_loop(eng, tier(eng, "disk").contains(eng.keys_for(tokens)[0])), "flush() wrote them down"


def test_write_through_flush_then_sigkill_leaves_every_acked_chunk_on_disk(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from test_tiering import config, kv_of, prompt
        from pathlib import Path
        from tierkv import Engine
        eng = Engine(config(Path({str(tmp_path)!r}), cpu="1GiB", policy="write_through"))
        for i in range(24):
            tokens = prompt(i, 3)
            assert eng.store(tokens, kv_of(tokens)) == 3
        eng.flush()
        print("flushed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "flushed" in result.stdout, result.stderr
    assert result.returncode == -9, (result.returncode, result.stderr)
    with Engine(disk_only(tmp_path)) as disk:
        for i in range(24):
            tokens = prompt(i, 3)
            out, mask = disk.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens)), f"prompt {i} lost"


def test_write_through_reads_see_chunks_still_in_the_fill_queue(tmp_path: Path) -> None:
    eng = Engine(config(tmp_path, policy="write_through"))
    try:
        disk = eng.wrap_tier("disk", FaultyBackend)
        disk.stall_s = 0.3  # the disk is slow: fills are still queued when we read
        tokens = prompt(0, 2)
        eng.store(tokens, kv_of(tokens))
        on_loop(eng, tier(eng, "host").delete(eng.keys_for(tokens)[0]))  # gone from memory, not yet on disk
        assert eng.locate(tokens)[0] in ("fill-queue", "disk")
        out, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(out, kv_of(tokens))
        disk.stall_s = 0
        eng.flush()
        assert on_loop(eng, disk.inner.contains(eng.keys_for(tokens)[1]))
    finally:
        eng.close()


def test_full_fill_queue_in_drop_mode_drops_and_counts_never_grows(tmp_path: Path) -> None:
    cfg = config(tmp_path, policy="write_through", background={"queue_bytes": f"{2 * CHUNK_BYTES}B",
                                                                "when_full": "drop"})
    with Engine(cfg) as eng:
        disk = eng.wrap_tier("disk", FaultyBackend)
        disk.stall_s = 0.2
        prompts = [prompt(i) for i in range(12)]
        peak = 0
        for tokens in prompts:
            # acknowledged by the host tier regardless (skip_existing=False: no lookup on the slow disk)
            assert eng.store(tokens, kv_of(tokens), skip_existing=False) == 1
            peak = max(peak, eng.stats()["fill_queue"]["bytes"])
        disk.stall_s = 0
        eng.flush()
        stats = eng.stats()
        dropped = stats["fill_queue"]["dropped_chunks"]
        assert dropped >= 1 and stats["tiers"]["disk"]["dropped_fills"] == dropped
        assert peak <= 2 * CHUNK_BYTES
        for tokens in prompts:  # every acknowledged chunk is still served (from memory)
            out, mask = eng.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens))


def test_full_fill_queue_in_wait_mode_applies_backpressure(tmp_path: Path) -> None:
    cfg = config(tmp_path, policy="write_through", background={"queue_bytes": f"{2 * CHUNK_BYTES}B",
                                                                "when_full": "wait"})
    with Engine(cfg) as eng:
        disk = eng.wrap_tier("disk", FaultyBackend)
        disk.stall_s = 0.02
        prompts = [prompt(i) for i in range(10)]
        for tokens in prompts:
            eng.store(tokens, kv_of(tokens))
            assert eng.stats()["fill_queue"]["bytes"] <= 2 * CHUNK_BYTES
        eng.flush()
        assert eng.stats()["fill_queue"]["dropped_chunks"] == 0
        for tokens in prompts:
            assert on_loop(eng, disk.inner.contains(eng.keys_for(tokens)[0]))


# -- promotion and prefetch ---------------------------------------------------------------------
@pytest.mark.parametrize("promote", [True, False])
def test_promotion_is_configurable_per_tier(tmp_path: Path, promote: bool) -> None:
    cfg = config(tmp_path)
    cfg["tiers"][0]["promote"] = promote
    with Engine(cfg) as eng:
        tokens = prompt(0, 2)
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        for key in eng.keys_for(tokens):
            on_loop(eng, tier(eng, "host").delete(key))
        out, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(out, kv_of(tokens))
        assert eng.locate(tokens) == (["host"] * 2 if promote else ["disk"] * 2)
        assert eng.stats()["tiers"]["host"]["promotions"] == (2 if promote else 0)


def test_prefetch_moves_the_prefix_up_and_retrieve_waits_only_for_it(tmp_path: Path) -> None:
    with Engine(config(tmp_path, cpu=f"{4 * CHUNK_BYTES}B", policy="write_back")) as eng:
        tokens = prompt(0, 3)
        eng.store(tokens, kv_of(tokens))
        for i in range(1, 3):  # push the prompt out of memory into the disk tier
            other = prompt(i, 2)
            eng.store(other, kv_of(other))
        assert eng.locate(tokens) == ["disk"] * 3
        assert eng.lookup(tokens) == 3 * CHUNK
        assert eng.stats()["last_lookup"]["chunks_per_tier"] == {"host": 0, "disk": 3}
        disk = eng.wrap_tier("disk", FaultyBackend)
        disk.stall_s = 0.2  # the prefetch is still in flight when retrieve arrives
        eng.prefetch(tokens)
        # returned while the (stalled) disk read is still in flight
        assert eng.stats()["inflight_prefetch_chunks"] == 3
        out, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(out, kv_of(tokens))
        # the retrieve waited for the prefetch instead of reading the disk a second time
        assert disk.calls_by_op["batched_get"] == 1
        assert eng.locate(tokens) == ["host"] * 3
        assert eng.stats()["tiers"]["host"]["promotions"] == 3


def test_prefetch_of_uncached_or_resident_tokens_is_a_no_op(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as eng:
        eng.prefetch(prompt(5, 2))
        tokens = prompt(0, 2)
        eng.store(tokens, kv_of(tokens))
        eng.prefetch(tokens)
        assert eng.stats()["inflight_prefetch_chunks"] == 0
        assert eng.stats()["tiers"]["host"]["promotions"] == 0


# -- memory pressure ----------------------------------------------------------------------------
def gpu_config(tmp_path: Path, policy: str = "write_back") -> dict[str, Any]:
    return {"model": "tiering", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": policy,
            "pressure": {"poll_interval_ms": 2, "gpu_high_watermark": 0.9, "gpu_low_watermark": 0.8},
            "tiers": [{"name": "gpu", "backend": "gpu", "device": "cpu", "capacity": f"{8 * CHUNK_BYTES}B"},
                      {"name": "host", "backend": "cpu", "capacity": "64MiB"},
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "1GiB"}]}


def test_pressure_stops_admission_demotes_and_grows_back(tmp_path: Path) -> None:
    total = 100 * CHUNK_BYTES
    probe = ScriptedProbe([(50 * CHUNK_BYTES, total)])  # the serving engine uses half the device
    with Engine(gpu_config(tmp_path), probes={"gpu": probe}) as eng:
        prompts = [prompt(i, 2) for i in range(4)]
        for tokens in prompts:
            eng.store(tokens, kv_of(tokens))
        assert eng.stats()["tiers"]["gpu"]["used_bytes"] == 8 * CHUNK_BYTES
        # the serving engine allocates: 95% in use, 15 chunks over the low watermark
        probe.push(95 * CHUNK_BYTES, total)
        wait_until(lambda: eng.stats()["tiers"]["gpu"]["pressure"]["pressured"], "the gpu tier to see pressure")
        wait_until(lambda: eng.stats()["tiers"]["gpu"]["used_bytes"] == 0, "the gpu tier to shrink")
        stats = eng.stats()["tiers"]["gpu"]
        assert not stats["pressure"]["admitting"] and stats["capacity_bytes"] == 0
        assert stats["demotions"] == 8 and stats["pressure"]["freed_bytes"] == 8 * CHUNK_BYTES
        assert stats["pressure"]["last_used_fraction"] == 0.95
        new = prompt(9, 1)
        eng.store(new, kv_of(new))
        assert eng.locate(new) == ["host"]  # not admitted by the gpu tier under pressure
        assert eng.stats()["tiers"]["gpu"]["skipped_pressure"] >= 1
        for tokens in prompts:  # demoted, not lost
            out, mask = eng.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens))
        # the serving engine frees its memory: the tier admits and grows back
        probe.push(30 * CHUNK_BYTES, total)
        wait_until(lambda: eng.stats()["tiers"]["gpu"]["pressure"]["admitting"], "the gpu tier to admit again")
        wait_until(lambda: eng.stats()["tiers"]["gpu"]["capacity_bytes"] == 8 * CHUNK_BYTES,
                   "the gpu tier to grow back to its configured capacity")
        assert eng.stats()["tiers"]["gpu"]["pressure"]["last_relief_s"] is not None
        newer = prompt(10, 1)
        eng.store(newer, kv_of(newer))
        assert eng.locate(newer) == ["gpu"]


def test_pressure_that_empties_a_tier_is_said_once_and_counted(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A tier pressure leaves no room says so once, with what to change (not once per store);
    its stats count it, and a later stretch of pressure is said again."""
    total = 100 * CHUNK_BYTES
    probe = ScriptedProbe([(50 * CHUNK_BYTES, total)])
    with caplog.at_level(logging.WARNING, logger="tierkv.engine"), \
            Engine(gpu_config(tmp_path), probes={"gpu": probe}) as eng:
        first = prompt(19, 2)
        eng.store(first, kv_of(first))
        probe.push(99 * CHUNK_BYTES, total)
        wait_until(lambda: eng.stats()["tiers"]["gpu"]["capacity_bytes"] == 0, "the gpu tier to give its memory back")
        for index in range(5):
            tokens = prompt(20 + index, 1)
            eng.store(tokens, kv_of(tokens))
        said = [r for r in caplog.records if "stores nothing until memory frees" in r.getMessage()]
        assert len(said) == 1 and "VLLM_CPU_KVCACHE_SPACE" in said[0].getMessage()
        assert eng.stats()["tiers"]["gpu"]["pressure"]["emptied"] == 1
        probe.push(30 * CHUNK_BYTES, total)
        wait_until(lambda: eng.stats()["tiers"]["gpu"]["pressure"]["admitting"], "the pressure to pass")
        probe.push(99 * CHUNK_BYTES, total)
        wait_until(lambda: eng.stats()["tiers"]["gpu"]["pressure"]["emptied"] == 2, "the second stretch to be said")


def test_pressure_in_write_through_frees_memory_without_losing_chunks(tmp_path: Path) -> None:
    total = 100 * CHUNK_BYTES
    probe = ScriptedProbe([(10 * CHUNK_BYTES, total)])
    with Engine(gpu_config(tmp_path, policy="write_through"), probes={"gpu": probe}) as eng:
        prompts = [prompt(i, 2) for i in range(4)]
        for tokens in prompts:
            eng.store(tokens, kv_of(tokens))
        eng.flush()
        probe.push(99 * CHUNK_BYTES, total)
        wait_until(lambda: eng.stats()["tiers"]["gpu"]["used_bytes"] == 0, "the gpu tier to shrink")
        for tokens in prompts:
            out, mask = eng.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens))


def test_stats_report_nvml_state_and_per_tier_counters(tmp_path: Path) -> None:
    with Engine(gpu_config(tmp_path)) as eng:
        tokens = prompt(0, 2)
        eng.store(tokens, kv_of(tokens))
        eng.retrieve(tokens)
        stats = eng.stats()
    nvml = stats["pressure"]["nvml"]
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = True
    except Exception:  # no package, no library, no driver: all mean "unavailable"
        driver = False
    if driver:
        assert nvml.startswith("nvml ok")
    else:
        assert nvml.startswith("nvml unavailable: ") and len(nvml) > len("nvml unavailable: ")
    gpu = stats["tiers"]["gpu"]
    # a gpu tier on a cpu device has no NVML probe: static capacity, and it says why
    assert "not a CUDA device" in gpu["pressure"]["state"]
    for name in ("hits", "misses", "evictions", "promotions", "demotions", "bytes_in", "bytes_out",
                 "dropped_fills", "corrupt_chunks"):
        assert name in gpu, name
    assert gpu["hits"] == 2 and gpu["get_latency"]["count"] == 1
    assert stats["hit_tokens"] == 2 * CHUNK and stats["hit_rate"] == 1.0
    # the host tier is watched by the host-memory probe
    assert stats["tiers"]["host"]["pressure"]["probe"] == "host"


# -- tier faults --------------------------------------------------------------------------------
def faulty_config(tmp_path: Path, **health: Any) -> dict[str, Any]:
    return {"model": "tiering", "chunk_size": CHUNK, "kv_format": "vllm", "write_policy": "write_through",
            "health": {"failure_threshold": 2, "retry_after_s": 0.2, **health},
            "tiers": [{"name": "host", "backend": "cpu", "capacity": f"{2 * CHUNK_BYTES}B"},
                      {"name": "remote", "backend": "lmdb", "path": str(tmp_path / "remote"), "capacity": "1GiB"},
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "1GiB"}]}


def test_failing_tier_is_counted_skipped_retried_and_the_rest_keep_serving(tmp_path: Path) -> None:
    with Engine(faulty_config(tmp_path)) as eng:
        remote = eng.wrap_tier("remote", FaultyBackend)
        remote.failing = True
        prompts = [prompt(i) for i in range(8)]
        for tokens in prompts:
            assert eng.store(tokens, kv_of(tokens)) == 1
        eng.flush()
        stats = eng.stats()["tiers"]["remote"]
        assert stats["errors"] >= 2 and stats["dropped_fills"] >= 2
        assert not stats["health"]["healthy"] and "injected failure" in stats["health"]["last_error"]
        calls_when_marked = remote.calls
        for tokens in prompts:  # served from host or disk; the remote tier is skipped, not waited on
            out, mask = eng.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens))
        assert eng.stats()["tiers"]["remote"]["skipped_unhealthy"] >= 1
        assert remote.calls <= calls_when_marked + 1
        # it recovers: after retry_after_s one call goes through as a probe and succeeds
        remote.failing = False
        time.sleep(0.25)
        tokens = prompt(20)
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        assert eng.stats()["tiers"]["remote"]["health"]["healthy"]
        assert on_loop(eng, remote.inner.contains(eng.keys_for(tokens)[0]))


def test_a_wrapped_tier_sees_every_call_and_the_tier_list_stays_read_only(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as eng:
        with pytest.raises(TypeError):
            eng.tiers[1] = eng.tiers[0]  # type: ignore[index]
        with pytest.raises(KeyError, match="no tier named 'ssd'.*'host', 'disk'"):
            eng.wrap_tier("ssd", FaultyBackend)
        with pytest.raises(ValueError, match="named 'host'.*expected the tier's own name"):
            eng.wrap_tier("disk", lambda backend: FaultyBackend(eng.tiers[0]))
        with pytest.raises(TypeError, match="must return a StorageBackend, got str"):
            eng.wrap_tier("disk", lambda backend: "not a backend")  # type: ignore[arg-type,return-value]
        disk = eng.wrap_tier("disk", FaultyBackend)
        assert eng.tiers[1] is disk
        tokens = prompt(3)
        eng.store(tokens, kv_of(tokens))
        eng.flush()
        assert disk.calls >= 1, "the fill went through the wrapper"
        on_loop(eng, tier(eng, "host").delete(eng.keys_for(tokens)[0]))
        before = disk.calls
        out, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(out, kv_of(tokens))
        assert disk.calls > before, "the read went through the wrapper"


def test_stalled_tier_times_out_into_misses_served_by_other_tiers(tmp_path: Path) -> None:
    with Engine(faulty_config(tmp_path, timeout_s=0.05)) as eng:
        remote = eng.wrap_tier("remote", FaultyBackend)
        prompts = [prompt(i) for i in range(4)]
        for tokens in prompts:
            eng.store(tokens, kv_of(tokens))
        eng.flush()
        remote.stall_s = 5.0  # hung: every call would take 5 s
        for tokens in prompts:
            out, mask = eng.retrieve(tokens, return_tuple=False)
            assert mask.all() and torch.equal(out, kv_of(tokens))
        assert "TimeoutError" in eng.stats()["tiers"]["remote"]["health"]["last_error"]


def test_failure_in_every_tier_is_an_error_and_loses_nothing_stored(tmp_path: Path) -> None:
    cfg = disk_only(tmp_path)
    with Engine(cfg) as eng:
        disk = eng.wrap_tier("disk", FaultyBackend)
        tokens = prompt(0, 2)
        eng.store(tokens, kv_of(tokens))
        disk.failing = True
        other = prompt(1)
        with pytest.raises(Exception, match="injected failure"):
            eng.store(other, kv_of(other))
        disk.failing = False
        out, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and torch.equal(out, kv_of(tokens))


# -- concurrency --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_concurrent_store_retrieve_prefetch_of_overlapping_prompts(tmp_path: Path, policy: str,
                                                                   eviction: str) -> None:
    cfg = config(tmp_path, cpu=f"{6 * CHUNK_BYTES}B", policy=policy,
                 background={"queue_bytes": f"{8 * CHUNK_BYTES}B", "when_full": "wait"})
    cfg["tiers"][0]["eviction"] = eviction
    # 6 shared system prompts of 2 chunks, each continued by 5 users with 1-3 chunks of their own
    systems = [prompt(i, 2) for i in range(6)]
    conversations = [torch.cat([systems[s], prompt(100 + 10 * s + u, 1 + (u % 3))])
                     for s in range(6) for u in range(5)]
    peaks = {"host": 0, "queue": 0}
    served = 0

    async def scenario() -> None:
        nonlocal served
        engine = AsyncEngine(cfg)

        async def user(worker: int) -> None:
            nonlocal served
            for step in range(12):
                tokens = conversations[(worker * 7 + step * 5) % len(conversations)]
                action = (worker + step) % 3
                if action == 0:
                    await engine.store(tokens, kv_of(tokens))
                elif action == 1:
                    await engine.prefetch(tokens)
                kv, mask = await engine.retrieve(tokens, return_tuple=False)
                got = int(mask.sum())
                if got:
                    assert torch.equal(kv, kv_of(tokens[:got])), f"worker {worker} got a wrong chunk"
                    served += got
                stats = engine.stats()
                peaks["host"] = max(peaks["host"], stats["tiers"]["host"]["used_bytes"])
                peaks["queue"] = max(peaks["queue"], stats["fill_queue"]["bytes"])
                await asyncio.sleep(0)

        try:
            await asyncio.gather(*(user(w) for w in range(16)))
            await engine.flush()
            for tokens in conversations:  # everything stored is still retrievable, exactly
                if await engine.lookup(tokens):
                    kv, mask = await engine.retrieve(tokens, return_tuple=False)
                    assert torch.equal(kv, kv_of(tokens[: int(mask.sum())]))
        finally:
            await engine.close()

    asyncio.run(scenario())
    assert served > 0
    assert peaks["host"] <= 6 * CHUNK_BYTES
    assert peaks["queue"] <= 8 * CHUNK_BYTES


# -- CUDA-only paths ----------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device: streams, events and pinned staging exist only there")


@cuda
def test_gpu_tier_on_cuda_round_trips_through_streams_and_pinned_staging(tmp_path: Path) -> None:
    cfg = gpu_config(tmp_path)
    cfg["tiers"][0]["device"] = "cuda:0"
    with Engine(cfg) as eng:
        gpu = tier(eng, "gpu")
        # device memory (pinned is a host-memory property); its copies run on its own stream,
        # from pageable sources through pinned staging
        assert gpu.device.type == "cuda" and not gpu.pinned and gpu.stats()["cuda_stream"]
        tokens = prompt(0, 2)
        eng.store(tokens, kv_of(tokens))
        assert eng.locate(tokens) == ["gpu", "gpu"]
        out, mask = eng.retrieve(tokens, return_tuple=False)
        assert mask.all() and out.device.type == "cpu" and torch.equal(out, kv_of(tokens))
        assert "nvml" in eng.stats()["pressure"]["nvml"]


@cuda
def test_host_tier_is_pinned_when_cuda_is_present(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as eng:
        assert tier(eng, "host").pinned
        tokens = prompt(0)
        eng.store(tokens, kv_of(tokens))
        out, _ = eng.retrieve(tokens, return_tuple=False)
        assert torch.equal(out, kv_of(tokens))


def test_write_back_demotes_only_dirty_chunks(tmp_path: Path) -> None:
    # memory tiers account whole slabs: a 6 KiB chunk takes an 8 KiB slab
    with Engine(config(tmp_path, cpu="16KiB", policy="write_back")) as eng:
        first, second = prompt(0, 2), prompt(1, 2)
        eng.store(first, kv_of(first))
        eng.store(second, kv_of(second))  # evicts first: 2 chunks demoted (dirty)
        assert eng.stats()["tiers"]["disk"]["puts"] == 2
        out, _ = eng.retrieve(first, return_tuple=False)  # promoted: evicts second (dirty)
        assert torch.equal(out, kv_of(first)) and eng.stats()["tiers"]["disk"]["puts"] == 4
        eng.retrieve(second)  # promoted: evicts first, which the disk already holds: no write
        stats = eng.stats()["tiers"]
        assert stats["disk"]["puts"] == 4 and stats["host"]["demotions"] == 4, "demotions: chunks written below"
