"""Where the main job (benchmarks/run.py) is while it runs, and about how long each part takes.

Each part prints its number, its start (minutes into the job) and an estimate: the seconds it
took on the reference machine (``REFERENCE_S``: a 2-core VM, AMD EPYC with AVX2 only, the
models in float32), scaled by how this machine compares with that one at what the part mostly
waits on: copying memory (``copy_gbps``: tiers, codecs, the pool) or computing a model
(``model_gflops``: a matmul in the dtype the model parts pick, benchmarks/cpu_dtype.py, on one
core as each vLLM replica has). Both calibrations take about half a second. An estimate is a
guide, not a promise; at the end each part's seconds stand beside its estimate.

The job is sized to end within ``BUDGET_S`` on every CPU kind: its parts do fixed work, except
the two-replica part, which runs as many replays of its trace (1 to 3) as fit its share of the
budget here (``replica_runs``): on the reference machine one, where vLLM prefills several times
faster (AVX-512, AMX in bf16) three; ``tox -e bench-replicas`` takes the medians of five.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

BUDGET_S = 15 * 60.0  # the main job's time on any CPU kind
# seconds each part took on the reference machine, in `tox -e bench`'s main job (two runs,
# each scaled to the reference's speeds, averaged)
REFERENCE_S: dict[str, float] = {
    "core": 15, "prompt": 107, "policy": 15, "admission": 55, "compression": 126, "kernels": 1, "node": 70,
    "serving": 600, "cost": 65, "matrix": 68,
}
# the two-replica part: starting its three configurations' replicas (importing vLLM six times:
# scaled as copying is, not as the model), then each run (one replay per configuration, the
# servers settled before each, and their stop after the last)
REFERENCE_REPLICA_START_S = 170.0
REFERENCE_REPLICA_RUN_S = 120.0
REPLICAS_SHARE_S = 300.0  # its share of BUDGET_S, in seconds on this machine
REFERENCE_COPY_GBPS = 10.2  # the reference machine's copy of 256 MiB (best of four)
REFERENCE_MODEL_GFLOPS = 79.0  # its float32 matmul on one core (best of 20; one VM read 43 to 79)
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
    replica_runs: int = 3
    started: float = field(default_factory=time.perf_counter)
    took: dict[str, float] = field(default_factory=dict)

    @classmethod
    def calibrated(cls, parts: Sequence[str], replica_runs: int | None = None) -> Progress:
        """The job's parts, with this machine's speeds measured; ``replica_runs``: the
        two-replica part's runs (None: as many as fit its share of the budget, 1 to 3)."""
        progress = cls(parts, calibrate(), calibrate_model())
        progress.replica_runs = replica_runs or progress.replica_runs_within(REPLICAS_SHARE_S)
        total = sum(progress.estimate(part) for part in parts)
        print(f"main job: {len(parts)} parts ({', '.join(parts)}); this machine copies at {progress.copy_gbps:.1f} "
              f"GB/s and computes at {progress.model_gflops:.0f} GFLOPS on a core (the reference machine: "
              f"{REFERENCE_COPY_GBPS}, {REFERENCE_MODEL_GFLOPS:.0f}): about {total / 60:.0f} minutes", flush=True)
        return progress

    def scale(self, part: str, by_model: bool | None = None) -> float:
        """How much longer ``part`` takes here than on the reference machine: the ratio of
        the speeds at what it waits on (a model's compute or copying; ``by_model`` says which
        where given), within 4x either way."""
        if part in MODEL_PARTS if by_model is None else by_model:
            scale = REFERENCE_MODEL_GFLOPS / max(self.model_gflops, 1e-3)
        else:
            scale = REFERENCE_COPY_GBPS / max(self.copy_gbps, 1e-3)
        return max(0.25, min(scale, 4.0))

    def replica_runs_within(self, seconds: float) -> int:
        """How many runs of the two-replica part fit in ``seconds`` here (1 to 3)."""
        start = REFERENCE_REPLICA_START_S * self.scale("replicas", by_model=False)
        runs = (seconds - start) // (REFERENCE_REPLICA_RUN_S * self.scale("replicas"))
        return int(max(1, min(3, runs)))

    def estimate(self, part: str) -> float:
        """Seconds ``part`` should take here: its reference time, scaled (``scale``)."""
        if part == "replicas":
            return (REFERENCE_REPLICA_START_S * self.scale(part, by_model=False)
                    + self.replica_runs * REFERENCE_REPLICA_RUN_S * self.scale(part))
        return REFERENCE_S.get(part, 60.0) * self.scale(part)

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
