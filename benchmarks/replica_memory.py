"""Whether a replica benchmark's servers all fit in this machine's memory at once.

benchmarks/replicas_nohit.py keeps every configuration's replicas up for the whole benchmark
(each ratio then compares servers timed minutes apart). With a served model's shape in float32
(a 1B Llama: 3.4 GB of weights per replica) eight replicas need ~40 GB: on a 24 GiB machine the
kernel's OOM killer takes a vLLM worker mid-run. This module estimates what one replica holds
(its weights in the dtype it serves, vLLM's KV space, its three processes' own runtime) against
``MemAvailable``, so the benchmark starts one configuration's replicas at a time where all of
them would not fit, and refuses where even one configuration's would not.
"""

from __future__ import annotations

import json
from pathlib import Path

from cpu_dtype import element_bytes

RUNTIME_BYTES = 1 << 30
"""A replica's processes besides its weights and KV space: vLLM's API server (~0.45 GB), its
engine core (~0.5 GB) and the worker's own runtime (measured here with vLLM 0.32's CPU build)."""

HEADROOM = 0.8
"""The share of ``MemAvailable`` the replicas may take: the rest is the client, the OS's page
cache, the pool or LMCache's server, and the spread of the estimate."""


def memory_available() -> int:
    """``MemAvailable`` from /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def replica_bytes(model: Path, dtype: str, kv_cache_bytes: int) -> int:
    """What one replica of ``model`` served in ``dtype`` holds: its weights (the saved
    safetensors, scaled from the saved dtype to ``dtype``), ``kv_cache_bytes`` and
    ``RUNTIME_BYTES``."""
    saved_dtype = json.loads((model / "config.json").read_text()).get("dtype", "float32")
    saved = sum(path.stat().st_size for path in model.glob("*.safetensors"))
    weights = saved * element_bytes(dtype) // (2 if saved_dtype in ("bfloat16", "float16") else 4)
    return weights + kv_cache_bytes + RUNTIME_BYTES


def replicas_at_once(configs: int, per_config: int, model: Path, dtype: str, kv_cache_bytes: int) -> bool:
    """True when ``configs`` configurations of ``per_config`` replicas each fit at once, False
    when only one configuration's do; raises SystemExit, naming the figures, when not even that."""
    one = replica_bytes(model, dtype, kv_cache_bytes)
    budget = int(memory_available() * HEADROOM)
    if per_config * one > budget:
        raise SystemExit(f"replicas: {per_config} replicas of this model need ~{per_config * one / 2**30:.1f} GiB, "
                         f"more than {HEADROOM:.0%} of the {budget / HEADROOM / 2**30:.1f} GiB available: "
                         "pick a smaller --shapes entry or free memory")
    return configs * per_config * one <= budget
