"""Where the main job (benchmarks/run.py) is while it runs, and about how long each part takes.

Each part prints its number, its start (minutes into the job) and an estimate: the seconds it
took on the reference machine (``REFERENCE_S``: a 2-core VM with AVX-512 and AVX512-BF16),
scaled by how fast this machine copies memory against that one (``calibrate``, a quarter of
a second). The parts that run a model pick float32 where the CPU has no native bf16
(benchmarks/cpu_dtype.py), so their time tracks the machine's memory speed more than its
bf16 arithmetic; an estimate is a guide, not a promise. At the end, each part's seconds beside
its estimate.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

# seconds each part took on the reference machine, in `tox -e bench`'s main job
REFERENCE_S: dict[str, float] = {
    "core": 10, "prompt": 150, "policy": 5, "admission": 25, "compression": 135, "kernels": 5, "node": 35,
    "replicas": 270, "serving": 420, "cost": 170, "matrix": 40,
}
REFERENCE_COPY_GBPS = 22.6  # the reference machine's copy of 256 MiB


def calibrate() -> float:
    """This machine's GB/s copying 256 MiB, best of four tries."""
    source = torch.empty(1 << 28, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(4):
        began = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - began)
    return source.numel() / best / 1e9


@dataclass
class Progress:
    """The parts of one job, in order; ``part(name)`` wraps each."""

    parts: Sequence[str]
    copy_gbps: float = REFERENCE_COPY_GBPS
    started: float = field(default_factory=time.perf_counter)
    took: dict[str, float] = field(default_factory=dict)

    @classmethod
    def calibrated(cls, parts: Sequence[str]) -> Progress:
        progress = cls(parts, calibrate())
        total = sum(progress.estimate(part) for part in parts)
        print(f"main job: {len(parts)} parts ({', '.join(parts)}); this machine copies at {progress.copy_gbps:.1f} "
              f"GB/s (the reference machine: {REFERENCE_COPY_GBPS}): about {total / 60:.0f} minutes", flush=True)
        return progress

    def estimate(self, part: str) -> float:
        """Seconds ``part`` should take here: its reference time, scaled by the copy speed (never
        below the reference: a machine that copies faster is not assumed faster at the rest)."""
        scale = REFERENCE_COPY_GBPS / max(self.copy_gbps, 1e-3)
        return REFERENCE_S.get(part, 60.0) * max(1.0, min(scale, 10.0))

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        index = list(self.parts).index(name) + 1 if name in self.parts else 0
        elapsed = time.perf_counter() - self.started
        print(f"\n[{index}/{len(self.parts)}] {name}: starting at {elapsed / 60:.1f} min, about "
              f"{self.estimate(name) / 60:.1f} min", flush=True)
        began = time.perf_counter()
        try:
            yield
        finally:
            self.took[name] = time.perf_counter() - began
            print(f"[{index}/{len(self.parts)}] {name}: {self.took[name]:.0f} s", flush=True)

    def summary(self) -> None:
        total = time.perf_counter() - self.started
        print(f"\n== the main job took {total / 60:.1f} min ==")
        for name, seconds in self.took.items():
            print(f"  {name:<12} {seconds:6.0f} s  (estimate {self.estimate(name):.0f} s)")
