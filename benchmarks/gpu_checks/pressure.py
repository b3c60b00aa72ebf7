"""The memory-pressure scenario: a gpu tier filled, squeezed from outside, relieved, nothing lost.

The device part runs it with NVML readings and a second process allocating device memory; the
rehearsal part runs the same code on the CPU (a gpu tier with device: cpu, a modelled device),
so the logic is checked in CI where there is no GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .context import Context, GiB, MiB, PartFailed
from .pressure_devices import DeviceSqueezer, ModelledDevice, Probe, Squeezer

if TYPE_CHECKING:
    import torch

    from tierkv import Engine


@dataclass(frozen=True)
class PressureSizes:
    """Geometry of the pressure scenario: chunks, the gpu tier, the watermarks above the start."""

    layers: int
    heads: int
    head_size: int
    chunk_tokens: int
    chunks_per_prompt: int
    prompts: int
    tier_bytes: int
    host_bytes: int
    low_over: int  # low watermark: this many bytes above the memory in use once the tier is allocated
    high_over: int  # high watermark: this many bytes above the low one
    step: int  # the second process allocates in steps of this many bytes
    max_squeeze: int
    check_hottest: bool  # the hottest chunks must stay (needs a tier of several slab segments)
    poll_ms: int = 5
    settle_s: float = 5.0  # how long the freed memory may take to show in the readings

    @property
    def chunk_bytes(self) -> int:
        return self.layers * 2 * self.chunk_tokens * self.heads * self.head_size * 2  # bfloat16

    @property
    def prompt_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.chunk_tokens * self.chunks_per_prompt, self.heads, self.head_size)


# 4 MiB chunks, 56 prompts of 4 chunks (896 MiB) in a 1 GiB tier of 8 slab segments of 128 MiB. Low
# watermark 1.5 GiB above the start (the tier's capacity is capped by the headroom under it, so the
# whole GiB must fit, with room for the engine's own start-up), high 0.5 GiB above that: the second
# process takes about 2 GiB of the H100's 80 GB, and the tier must shed 0.5 to 0.6 GiB of its coldest
# chunks, keeping the hottest.
DEVICE_PRESSURE = PressureSizes(layers=4, heads=8, head_size=128, chunk_tokens=256, chunks_per_prompt=4, prompts=56,
                                tier_bytes=GiB, host_bytes=2 * GiB, low_over=GiB + 512 * MiB, high_over=512 * MiB,
                                step=128 * MiB, max_squeeze=8 * GiB, check_hottest=True)
# the same logic in a few MiB, on a gpu tier with device: cpu and a modelled device
REHEARSAL_PRESSURE = PressureSizes(layers=2, heads=2, head_size=64, chunk_tokens=128, chunks_per_prompt=2,
                                   prompts=24, tier_bytes=8 * MiB, host_bytes=32 * MiB, low_over=10 * MiB,
                                   high_over=4 * MiB, step=MiB, max_squeeze=64 * MiB, check_hottest=False,
                                   poll_ms=2, settle_s=2.0)


def wait_for(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; whether it held."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(interval_s)
    return bool(condition())


class PressureLog(logging.Handler):
    """Collects the gpu tier's pressure transitions from tierkv's log ("memory pressure ...: not
    admitting"): proof that admission stopped even when relief follows within a poll or two."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "memory pressure" in message and "not admitting" in message:
            self.messages.append(message)

    def __enter__(self) -> PressureLog:
        logger = logging.getLogger("tierkv.engine")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("tierkv.engine")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def wait_for_stats(read: Callable[[], dict[str, Any]], condition: Callable[[dict[str, Any]], bool],
                   timeout_s: float) -> tuple[bool, dict[str, Any]]:
    """Poll ``read()`` until ``condition`` holds on a snapshot; whether it did and that snapshot
    (the state can move on right after: pressure relieved by the demotion it caused)."""
    end = time.monotonic() + timeout_s
    snapshot = read()
    while not condition(snapshot) and time.monotonic() < end:
        time.sleep(0.002)
        snapshot = read()
    return condition(snapshot), snapshot


class PressureScenario:
    """A gpu tier filled with chunks, then memory pressure from outside and its relief.

    Watermarks are set relative to the memory in use at the start (low: ``low_over`` above it
    once the tier is allocated, enough that the tier first gets its whole capacity; high:
    ``high_over`` above low), so the scenario takes a couple of GB of an 80 GB device, not tens.
    Every check is recorded (name, ok, detail) and all run even when one fails.
    """

    def __init__(self, sizes: PressureSizes, device: str, probe: Probe, squeezer: Squeezer,
                 engine_probes: dict[str, Any] | None = None) -> None:
        import torch

        self.sizes = sizes
        self.device = device
        self.probe = probe
        self.squeezer = squeezer
        self.engine_probes = engine_probes
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.log = PressureLog()
        generator = torch.Generator().manual_seed(36)
        self._pattern = torch.randint(-(1 << 15), 1 << 15, sizes.prompt_shape, dtype=torch.int16, generator=generator)

    # -- data -------------------------------------------------------------------------------
    def tokens(self, index: int) -> torch.Tensor:
        import torch

        count = self.sizes.chunk_tokens * self.sizes.chunks_per_prompt
        return torch.arange(count, dtype=torch.int64) + 1_000_000 * (index + 1)

    def kv(self, index: int) -> torch.Tensor:
        """The KV of prompt ``index``: random bits, different for every prompt and every chunk."""
        import torch

        return (self._pattern ^ index).view(torch.bfloat16)

    # -- bookkeeping ------------------------------------------------------------------------
    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def config(self, high: float, low: float) -> dict[str, Any]:
        sizes = self.sizes
        return {"model": "gpu-check-pressure", "chunk_size": sizes.chunk_tokens, "kv_format": "vllm",
                "write_policy": "write_back",
                "pressure": {"poll_interval_ms": sizes.poll_ms, "gpu_high_watermark": high, "gpu_low_watermark": low,
                             "host_high_watermark": 1.0, "host_low_watermark": 0.99},
                "tiers": [{"name": "gpu", "backend": "gpu", "device": self.device, "capacity": f"{sizes.tier_bytes}B"},
                          {"name": "host", "backend": "cpu", "capacity": f"{sizes.host_bytes}B"}]}

    @staticmethod
    def gpu(engine: Engine) -> dict[str, Any]:
        stats: dict[str, Any] = engine.stats()["tiers"]["gpu"]
        return stats

    def read_back(self, engine: Engine, prompts: Sequence[int]) -> list[int]:
        """The prompts whose KV does not come back whole and bit-exact."""
        import torch

        wrong = []
        for index in prompts:
            out, mask = engine.retrieve(self.tokens(index), return_tuple=False)
            expected = self.kv(index)
            if not bool(mask.all()) or not torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16)):
                wrong.append(index)
        return wrong

    def located(self, engine: Engine, index: int) -> list[str | None]:
        return engine.locate(self.tokens(index))

    # -- phases -----------------------------------------------------------------------------
    def watermarks(self) -> tuple[float, float, int]:
        """(high, low, total) from the memory in use now plus the tier about to be allocated."""
        reading = self.probe.read()
        start = reading.used + self.sizes.tier_bytes
        low = (start + self.sizes.low_over) / reading.total
        high = (start + self.sizes.low_over + self.sizes.high_over) / reading.total
        self.figures.update(baseline_used_gib=round(reading.used / GiB, 3), total_gib=round(reading.total / GiB, 3),
                            low_watermark=round(low, 5), high_watermark=round(high, 5))
        if high > 1.0:
            raise PartFailed(f"too little free device memory for the scenario (high watermark {high:.3f})",
                             self.figures)
        return high, low, reading.total

    def fill(self, engine: Engine) -> None:
        for index in range(self.sizes.prompts):
            engine.store(self.tokens(index), self.kv(index))
        on_gpu = sum(self.located(engine, i) == ["gpu"] * self.sizes.chunks_per_prompt
                     for i in range(self.sizes.prompts))
        self.figures["filled_bytes"] = self.gpu(engine)["used_bytes"]
        self.check("filled: every chunk in the gpu tier", on_gpu == self.sizes.prompts,
                   f"{on_gpu}/{self.sizes.prompts} prompts on gpu")

    def squeeze(self, high: float, total: int) -> None:
        """Allocate in steps until the probe reads at least the high watermark."""
        held = 0
        while self.probe.read().used < high * total:
            if held >= self.sizes.max_squeeze:
                raise PartFailed(f"{held / GiB:.2f} GiB allocated and still under the high watermark", self.figures)
            held = self.squeezer.allocate(self.sizes.step)
        self.figures.update(squeezed_gib=round(held / GiB, 3),
                            used_fraction_at_crossing=round(self.probe.read().used / total, 5))

    def under_pressure(self, engine: Engine, low: float, total: int) -> None:
        """Stops admitting, demotes the coldest chunks, gives the memory back, loses nothing."""
        sizes = self.sizes
        pressured, stats = wait_for_stats(lambda: self.gpu(engine), lambda s: s["pressure"]["pressured"]
                                          or bool(self.log.messages), 15)
        seen = (pressured and not stats["pressure"]["admitting"]) or bool(self.log.messages)
        self.check("stops admitting above the high watermark", seen,
                   f"logged: {self.log.messages[:1]}; pressure state {stats['pressure']}")
        shrunk, stats = wait_for_stats(lambda: self.gpu(engine), lambda s: s["pressure"]["shrinks"] >= 1
                                       and s["used_bytes"] <= s["capacity_bytes"], 20)
        self.figures.update(demotions=stats["demotions"], freed_mib=round(stats["pressure"]["freed_bytes"] / MiB, 1),
                            capacity_under_pressure_mib=round(stats["capacity_bytes"] / MiB, 1),
                            used_under_pressure_mib=round(stats["used_bytes"] / MiB, 1))
        self.check("demotes down to its limit", shrunk and stats["demotions"] > 0,
                   f"demotions {stats['demotions']}, used {stats['used_bytes']}, limit {stats['capacity_bytes']}")
        coldest = self.located(engine, 0)
        self.check("the coldest chunks went to the host tier", coldest == ["host"] * sizes.chunks_per_prompt,
                   f"coldest prompt in {coldest}")
        if sizes.check_hottest:
            hottest = self.located(engine, sizes.prompts - 1)
            self.check("the hottest chunks stayed in the gpu tier", hottest == ["gpu"] * sizes.chunks_per_prompt,
                       f"hottest prompt in {hottest}")
        back = wait_for(lambda: self.probe.read().used <= low * total, self.sizes.settle_s, 0.05)
        after = self.probe.read().used / total
        self.figures["used_fraction_after_demotion"] = round(after, 5)
        self.check("the demoted chunks' device memory went back (NVML at or below the low watermark)", back,
                   f"used fraction {after:.5f} vs low {low:.5f}" + ("" if back else
                   ": the tier freed its chunks but the memory stayed with this process (e.g. cached by "
                   "torch's allocator, no empty_cache), so the other process cannot have it"))
        self.store_under_pressure(engine)
        wrong = self.read_back(engine, [*range(sizes.prompts), sizes.prompts])
        self.check("no acknowledged chunk lost under pressure (all read back exact)", not wrong,
                   f"wrong prompts {wrong[:10]}")

    def store_under_pressure(self, engine: Engine) -> None:
        """A chunk stored while the tier is pressured goes to the host tier."""
        index = self.sizes.prompts
        before = self.gpu(engine)
        engine.store(self.tokens(index), self.kv(index))
        after = self.gpu(engine)
        where = self.located(engine, index)
        if before["pressure"]["pressured"] and after["pressure"]["pressured"]:
            self.check("not admitted under pressure", where == ["host"] * self.sizes.chunks_per_prompt
                       and after["skipped_pressure"] > before["skipped_pressure"], f"stored under pressure into {where}")
        else:  # relieved meanwhile (the demoted memory went back): admitting again is right
            self.figures["store_under_pressure"] = f"pressure relieved before the store; stored into {where}"

    def relief(self, engine: Engine, capacity_under_pressure: int) -> None:
        """After the other process frees its memory the tier admits and grows back."""
        self.squeezer.release()
        admitting, stats = wait_for_stats(lambda: self.gpu(engine), lambda s: not s["pressure"]["pressured"]
                                          and s["pressure"]["admitting"], 15)
        grew, stats = wait_for_stats(lambda: self.gpu(engine), lambda s: s["capacity_bytes"] > capacity_under_pressure,
                                     10)
        self.figures.update(capacity_after_relief_mib=round(stats["capacity_bytes"] / MiB, 1),
                            last_relief_s=stats["pressure"]["last_relief_s"])
        self.check("admits again once the memory is freed", admitting and grew, f"pressure state {stats['pressure']}")
        index = self.sizes.prompts + 1
        engine.store(self.tokens(index), self.kv(index))
        where = self.located(engine, index)
        self.check("grows back: a new chunk lands in the gpu tier", where == ["gpu"] * self.sizes.chunks_per_prompt,
                   f"stored into {where}")
        wrong = self.read_back(engine, range(self.sizes.prompts + 2))
        self.check("no acknowledged chunk lost after relief (all read back exact)", not wrong,
                   f"wrong prompts {wrong[:10]}")

    def run(self) -> dict[str, Any]:
        """All phases; PartFailed (with every check's outcome) when any check failed."""
        from tierkv import Engine

        try:
            high, low, total = self.watermarks()
            with self.log, Engine(self.config(high, low), probes=self.engine_probes) as engine:
                if isinstance(self.probe, ModelledDevice):
                    self.probe.tier = next(t for t in engine.tiers if t.name == "gpu")
                started = self.probe.read().used
                self.figures["start_used_fraction"] = round(started / total, 5)
                if not self.check("start-up stays below the low watermark", started < low * total,
                                  f"{started / total:.5f} vs {low:.5f}"):
                    raise PartFailed("the engine's start used more device memory than planned", self.figures)
                self.fill(engine)
                self.squeeze(high, total)
                self.under_pressure(engine, low, total)
                self.relief(engine, self.gpu(engine)["capacity_bytes"])
        finally:
            self.squeezer.close()
        self.figures["checks"] = self.checks
        failed = [c["check"] for c in self.checks if not c["ok"]]
        if failed:
            raise PartFailed(f"{len(failed)} of {len(self.checks)} checks failed: {'; '.join(failed)}", self.figures)
        return self.figures


def rehearsal_scenario(sizes: PressureSizes = REHEARSAL_PRESSURE) -> PressureScenario:
    """The scenario on a gpu tier with device: cpu, driven by a modelled device."""
    device = ModelledDevice(total=64 * sizes.tier_bytes, base=16 * sizes.tier_bytes)
    return PressureScenario(sizes, "cpu", device, device, engine_probes={"gpu": device})


def part_pressure_rehearsal(ctx: Context) -> dict[str, Any]:
    """The pressure scenario's logic on the CPU (gpu tier with device: cpu, a modelled device):
    the same code the device runs with NVML and a second process."""
    return rehearsal_scenario().run()


def part_pressure(ctx: Context) -> dict[str, Any]:
    """The pressure scenario on the real device: NVML readings, a second process allocating."""
    import torch

    from tierkv.policy.pressure import NVMLProbe, ProbeUnavailable

    torch.empty(1, device="cuda")  # this process's context is part of the baseline
    try:
        probe = NVMLProbe(0)
    except ProbeUnavailable as exc:
        raise PartFailed(f"NVML: {exc}") from exc
    return PressureScenario(DEVICE_PRESSURE, "cuda:0", probe, DeviceSqueezer()).run()
