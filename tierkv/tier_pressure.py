"""Memory-pressure reactions of the memory tiers: each reading of a tier's probe (NVML for a
GPU tier, host memory for the cpu tier) becomes a decision (:func:`tierkv.policy.pressure_decision`)
applied to the tier: stop admitting, shrink to a limit, grow back.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from tierkv import policy
from tierkv.pressure import MemoryReading, PressureMonitor

if TYPE_CHECKING:
    from tierkv.router import TierRouter

logger = logging.getLogger("tierkv.engine")


class TierPressure:
    """Pressure state of one memory tier: applies each reading's decision to the tier."""

    def __init__(self, engine: TierRouter, level: int, high: float, low: float) -> None:
        self.engine = engine
        self.level = level
        self.high = high
        self.low = low
        self.admitting = True
        self.pressured = False
        self.monitor: PressureMonitor
        self.demoted_bytes = 0
        self.shrinks = 0
        self.pressured_since: float | None = None
        self.last_relief_s: float | None = None  # time from crossing high to getting under low
        self._shrinking: asyncio.Task[None] | None = None

    def on_reading(self, reading: MemoryReading) -> None:
        tier = self.engine.tiers[self.level]
        configured = tier.capacity or 0
        decision = policy.pressure_decision(reading.used_fraction, reading.total, tier.used_bytes, configured,
                                            self.high, self.low, self.pressured)
        if decision.pressured and not self.pressured:
            self.pressured_since = reading.at
            logger.info("tier %r: memory pressure %.1f%% >= %.1f%%: not admitting, shrinking to %d bytes",
                        tier.name, 100 * reading.used_fraction, 100 * self.high, decision.capacity)
        if not decision.pressured and self.pressured and self.pressured_since is not None:
            self.last_relief_s = reading.at - self.pressured_since
            self.pressured_since = None
        self.pressured = decision.pressured
        self.admitting = decision.admitting
        tier.set_capacity_limit(decision.capacity)  # type: ignore[attr-defined]
        if tier.used_bytes > decision.capacity and (self._shrinking is None or self._shrinking.done()):
            self._shrinking = asyncio.get_running_loop().create_task(self._shrink())
            self.engine._background.add(self._shrinking)
            self._shrinking.add_done_callback(self.engine._background_done)

    async def _shrink(self) -> None:
        tier = self.engine.tiers[self.level]
        freed = await tier.shrink_to_limit()  # type: ignore[attr-defined]
        self.demoted_bytes += freed
        self.shrinks += 1

    def describe(self) -> dict[str, Any]:
        return {**self.monitor.describe(), "pressured": self.pressured, "admitting": self.admitting,
                "high_watermark": self.high, "low_watermark": self.low,
                "effective_capacity_bytes": self.engine.tiers[self.level].capacity_bytes,
                "freed_bytes": self.demoted_bytes, "shrinks": self.shrinks, "last_relief_s": self.last_relief_s}


def nvml_status() -> str:
    """Whether NVML can be used here, and if not, why (reported once in stats)."""
    try:
        import pynvml
    except ImportError:
        return "nvml unavailable: pynvml is not installed (pip install 'tierkv[nvml]')"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        return f"nvml unavailable: {exc}"
    return f"nvml ok: {count} device(s)"
