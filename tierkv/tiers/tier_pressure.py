"""Memory-pressure reactions of the memory tiers: each reading of a tier's probe (NVML for a
tier of device memory, host memory for the others) becomes a decision
(``tierkv.policy.residency.pressure_decision``) applied to the tier: stop admitting, shrink to a
limit, grow back. It knows the tier (a ``tierkv.backend.SupportsPressure``) and a
function that runs its shrinks in the background, nothing of the router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tierkv.backend.contract import StorageBackend, SupportsPressure
from tierkv.config.loader import PressureConfig
from tierkv.policy import residency as policy
from tierkv.policy.pressure import HostMemoryProbe, MemoryProbe, MemoryReading, PressureMonitor, open_device_probe

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]
"""Runs a coroutine in the background (the router's task set, flushed and logged by it)."""

logger = logging.getLogger("tierkv.engine")


class TierPressure:
    """Pressure state of one memory tier: applies each reading's decision to the tier."""

    def __init__(self, tier: StorageBackend, spawn: Spawn, high: float, low: float) -> None:
        if not isinstance(tier, SupportsPressure):
            raise TypeError(f"tier {tier.name!r}: expected a tier supporting memory pressure "
                            f"(set_capacity_limit, shrink_to_limit), got {type(tier).__name__}")
        self.tier: Any = tier  # a StorageBackend that is SupportsPressure
        self.spawn = spawn
        self.high = high
        self.low = low
        self.admitting = True
        self.pressured = False
        self.monitor: PressureMonitor
        self.demoted_bytes = 0
        self.shrinks = 0
        self.pressured_since: float | None = None
        self.last_relief_s: float | None = None  # time from crossing high to getting under low
        self.emptied = 0  # times pressure left the tier room for nothing
        self._said_empty = False  # said so once for this stretch of pressure
        self._shrinking: asyncio.Task[Any] | None = None

    def on_reading(self, reading: MemoryReading) -> None:
        tier = self.tier
        configured = tier.capacity or 0
        decision = policy.pressure_decision(reading.used_fraction, reading.total, tier.used_bytes, configured,
                                            self.high, self.low, self.pressured)
        if decision.pressured and not self.pressured:
            self.pressured_since = reading.at
            logger.info("tier %r: memory pressure %.1f%% >= %.1f%%: not admitting, shrinking to %d bytes",
                        tier.name, 100 * reading.used_fraction, 100 * self.high, decision.capacity)
        if decision.pressured and decision.capacity <= 0 and not self._said_empty:
            self.emptied += 1
            self._said_empty = True
            logger.warning("tier %r: host memory is %.1f%% used (high watermark %.1f%%): the tier gives back all of "
                           "its memory and stores nothing until memory frees. On a CPU node this is vLLM's KV space "
                           "and the tiers not fitting together: lower VLLM_CPU_KVCACHE_SPACE (vLLM's default takes "
                           "most of the node) or the tier's capacity. Said once; stats show 'emptied'.",
                           tier.name, 100 * reading.used_fraction, 100 * self.high)
        if not decision.pressured and self.pressured and self.pressured_since is not None:
            self.last_relief_s = reading.at - self.pressured_since
            self.pressured_since = None
            self._said_empty = False
        self.pressured = decision.pressured
        self.admitting = decision.admitting
        tier.set_capacity_limit(decision.capacity)
        if tier.used_bytes > decision.capacity and (self._shrinking is None or self._shrinking.done()):
            self._shrinking = self.spawn(self._shrink())

    async def _shrink(self) -> None:
        freed = await self.tier.shrink_to_limit()
        self.demoted_bytes += freed
        self.shrinks += 1

    def describe(self) -> dict[str, Any]:
        return {**self.monitor.describe(), "pressured": self.pressured, "admitting": self.admitting,
                "high_watermark": self.high, "low_watermark": self.low,
                "effective_capacity_bytes": self.tier.capacity_bytes,
                "freed_bytes": self.demoted_bytes, "shrinks": self.shrinks, "last_relief_s": self.last_relief_s,
                "emptied": self.emptied}


def watch(tier: StorageBackend, probe: MemoryProbe | None, config: PressureConfig, spawn: Spawn
          ) -> TierPressure | None:
    """Start watching the memory of ``tier`` (None: it does not follow pressure). Without a
    given ``probe``, a tier of device memory gets NVML on its CUDA device (none on another
    device: static capacity, and the stats say why), any other the host-memory probe."""
    if not isinstance(tier, SupportsPressure):
        return None
    on_device = tier.device_memory
    reason = ""
    if probe is None:
        if on_device:
            probe, why = open_device_probe(str(tier.device))
            reason = "" if probe else f"nvml unavailable: {why}; static capacity"
        else:
            probe = HostMemoryProbe()
    high, low = ((config.gpu_high_watermark, config.gpu_low_watermark) if on_device
                 else (config.host_high_watermark, config.host_low_watermark))
    if reason:
        logger.info("tier %r: %s", tier.name, reason)
    state = TierPressure(tier, spawn, high, low)
    state.monitor = PressureMonitor(probe, config.poll_interval_ms / 1000, state.on_reading, reason)
    state.monitor.start()
    return state


def nvml_status() -> str:
    """Whether NVML can be used here, and if not, why (reported once in stats)."""
    try:
        import pynvml
    except ImportError:
        return "nvml unavailable: pynvml is not installed (pip install '.[nvml]' in tierkv's clone (the distribution is tierkv-engine))"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        return f"nvml unavailable: {exc}"
    return f"nvml ok: {count} device(s)"
