"""Where the main job (benchmarks/run.py) is while it runs, and about how long each part takes.

Each part prints its number, its start (minutes into the job) and an estimate: the seconds it
took on the reference machine (``REFERENCE_S``: a 2-core VM, AMD EPYC with AVX2 only, the
models in float32), scaled by how this machine compares with that one at what the part mostly
waits on: copying memory (``copy_gbps``: tiers, codecs, the pool) or computing a model
(``model_gflops``: a matmul in the dtype the model parts pick, benchmarks/cpu_dtype.py, on one
core as each vLLM replica has). Both calibrations take about half a second. An estimate is a
guide, not a promise; at the end each part's seconds stand beside its estimate.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

# seconds each part took on the reference machine, in `tox -e bench`'s main job
REFERENCE_S: dict[str, float] = {
    "core": 16, "prompt": 342, "policy": 14, "admission": 78, "compression": 263, "kernels": 1, "node": 62,
    "replicas": 513, "serving": 600, "cost": 179, "matrix": 74,
}
REFERENCE_COPY_GBPS = 10.0  # the reference machine's copy of 256 MiB (best of four)
REFERENCE_MODEL_GFLOPS = 70.0  # its float32 matmul on one core (best of 20; one VM read 43 to 77)
MODEL_PARTS = frozenset({"compression", "replicas", "serving", "cost"})
"""The parts whose time is mostly a model's compute (vLLM replicas, HF prefills)."""


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


def calibrate_model(size: int = 1024) -> float:
    """This machine's GFLOPS for a ``size``-square matmul on one core, in the dtype the model
    parts run (bf16 where the CPU computes it natively, else float32), best of 20 (a VM's
    neighbours move a single reading by a third or more)."""
    from cpu_dtype import model_dtype

    dtype = getattr(torch, model_dtype("auto"))
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # warm up
        best = float("inf")
        for _ in range(20):
            began = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - began)
    finally:
        torch.set_num_threads(threads)
    return 2 * size ** 3 / best / 1e9


@dataclass
class Progress:
    """The parts of one job, in order; ``part(name)`` wraps each."""

    parts: Sequence[str]
    copy_gbps: float = REFERENCE_COPY_GBPS
    model_gflops: float = REFERENCE_MODEL_GFLOPS
    started: float = field(default_factory=time.perf_counter)
    took: dict[str, float] = field(default_factory=dict)

    @classmethod
    def calibrated(cls, parts: Sequence[str]) -> Progress:
        progress = cls(parts, calibrate(), calibrate_model())
        total = sum(progress.estimate(part) for part in parts)
        print(f"main job: {len(parts)} parts ({', '.join(parts)}); this machine copies at {progress.copy_gbps:.1f} "
              f"GB/s and computes at {progress.model_gflops:.0f} GFLOPS on a core (the reference machine: "
              f"{REFERENCE_COPY_GBPS}, {REFERENCE_MODEL_GFLOPS:.0f}): about {total / 60:.0f} minutes", flush=True)
        return progress

    def estimate(self, part: str) -> float:
        """Seconds ``part`` should take here: its reference time, scaled by this machine's
        speed at what the part waits on (a model's compute or copying), within 4x either way."""
        if part in MODEL_PARTS:
            scale = REFERENCE_MODEL_GFLOPS / max(self.model_gflops, 1e-3)
        else:
            scale = REFERENCE_COPY_GBPS / max(self.copy_gbps, 1e-3)
        return REFERENCE_S.get(part, 60.0) * max(0.25, min(scale, 4.0))

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
