"""Memory-pressure probes and the monitor that samples them.

The serving engine shares the GPU with the model and its own KV pool; tierkv may use
spare device memory but must give it back at once when the serving engine needs it.
The monitor samples device memory in use by *all* processes (NVML) and host available
memory, on an interval, and hands each reading to the tiers that watch it. Probes are
injectable so the policy can be driven by scripted readings in tests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger("tierkv.pressure")


class ProbeUnavailable(RuntimeError):
    """The probe cannot read memory on this machine (no driver, no GPU, no package)."""


@dataclass(frozen=True)
class MemoryReading:
    """Bytes in use and in total on one device (or host RAM)."""

    used: int
    total: int
    at: float  # time.monotonic() of the sample

    @property
    def used_fraction(self) -> float:
        return self.used / self.total if self.total else 0.0


class MemoryProbe(Protocol):
    """Anything with a name and a ``read()`` returning a MemoryReading."""

    name: str

    def read(self) -> MemoryReading: ...


class NVMLProbe:
    """Device memory in use by all processes, from NVML (package nvidia-ml-py)."""

    def __init__(self, device_index: int = 0) -> None:
        self.name = f"nvml:{device_index}"
        try:
            import pynvml
        except ImportError as exc:
            raise ProbeUnavailable("pynvml is not installed (pip install '.[nvml]' in tierkv's clone (the distribution is tierkv-engine))") from exc
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except pynvml.NVMLError as exc:
            raise ProbeUnavailable(f"NVML cannot be initialised: {exc}") from exc
        self._pynvml = pynvml

    def read(self) -> MemoryReading:
        try:
            info = self._pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        except self._pynvml.NVMLError as exc:
            raise ProbeUnavailable(f"NVML read failed: {exc}") from exc
        return MemoryReading(int(info.used), int(info.total), time.monotonic())


class HostMemoryProbe:
    """Host RAM in use (total minus MemAvailable), from /proc/meminfo or sysconf."""

    name = "host"

    def read(self) -> MemoryReading:
        try:
            fields = {}
            with open("/proc/meminfo") as handle:
                for line in handle:
                    key, value = line.split(":", 1)
                    fields[key] = int(value.split()[0]) * 1024
            total, available = fields["MemTotal"], fields["MemAvailable"]
        except (OSError, KeyError, ValueError):
            try:
                page = os.sysconf("SC_PAGE_SIZE")
                total = os.sysconf("SC_PHYS_PAGES") * page
                available = os.sysconf("SC_AVPHYS_PAGES") * page
            except (ValueError, OSError, AttributeError) as exc:
                raise ProbeUnavailable(f"host memory cannot be read: {exc}") from exc
        return MemoryReading(total - available, total, time.monotonic())


class ScriptedProbe:
    """Replays a fixed sequence of (used, total) readings, then repeats the last one.

    For tests and benchmarks: a serving engine allocating, then freeing.
    """

    def __init__(self, readings: Iterable[tuple[int, int]], name: str = "scripted") -> None:
        self.name = name
        self._readings: Iterator[tuple[int, int]] = iter(list(readings))
        self._last: tuple[int, int] | None = None

    def push(self, used: int, total: int) -> None:
        """Make the next reading (used, total)."""
        self._readings = iter([(used, total)])

    def read(self) -> MemoryReading:
        self._last = next(self._readings, self._last)
        if self._last is None:
            raise ProbeUnavailable("scripted probe has no readings")
        return MemoryReading(self._last[0], self._last[1], time.monotonic())


def open_device_probe(device: str) -> tuple[MemoryProbe | None, str]:
    """The NVML probe for a ``cuda:N`` device, or None and the reason it is unavailable."""
    if not device.startswith("cuda"):
        return None, f"tier device is {device!r}, not a CUDA device"
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    try:
        return NVMLProbe(index), "ok"
    except ProbeUnavailable as exc:
        return None, str(exc)


class PressureMonitor:
    """Samples a probe every ``interval_s`` and passes each reading to ``on_reading``.

    A probe that fails is reported once with its reason, and sampling stops: the tier
    keeps its static capacity. Without a probe, ``unavailable_reason`` is the state
    (for example ``"nvml unavailable: NVML Shared Library Not Found"``).
    """

    def __init__(self, probe: MemoryProbe | None, interval_s: float,
                 on_reading: Callable[[MemoryReading], object], unavailable_reason: str = "") -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.on_reading = on_reading
        self.last_reading: MemoryReading | None = None
        self.samples = 0
        self.state = "running" if probe is not None else unavailable_reason
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> MemoryReading | None:
        """Take one reading now and act on it."""
        if self.probe is None:
            return None
        try:
            reading = self.probe.read()
        except ProbeUnavailable as exc:
            self.state = f"{self.probe.name} unavailable: {exc}"
            logger.warning("memory probe %s: %s; keeping static capacity", self.probe.name, exc)
            self.probe = None
            return None
        self.last_reading = reading
        self.samples += 1
        self.on_reading(reading)
        return reading

    def start(self) -> None:
        if self.probe is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.probe is not None:
            self.sample()
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def describe(self) -> dict[str, object]:
        reading = self.last_reading
        return {
            "probe": self.probe.name if self.probe is not None else None,
            "state": self.state,
            "samples": self.samples,
            "last_used_bytes": reading.used if reading else None,
            "last_total_bytes": reading.total if reading else None,
            "last_used_fraction": round(reading.used_fraction, 4) if reading else None,
        }
