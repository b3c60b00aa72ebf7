"""Does vLLM's KV space fit a CPU node beside tierkv's host tiers? Checked once, at registration.

vLLM's CPU worker sizes its own KV space from most of the node's memory when
``VLLM_CPU_KVCACHE_SPACE`` is not set (it logs "Auto set (21.01/23.54) GiB for KV cache" on a
23.5 GiB node) and allocates it lazily: the pages are taken as requests fill blocks. A ``cpu``
tier or an ``shm`` pool beside it then takes memory the KV space was counted on, and the kernel's
OOM killer ends the worker on its first prompts, long after it started. The connector sees
vLLM's KV tensors when vLLM registers them, so it adds the figures up front
(``check_node_memory``): where vLLM's KV space and tierkv's host tiers leave less than a reserve
for the OS, the model's weights and its activations, vLLM refuses to start with a message that
names both figures and the settings to change.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tierkv.backend.options import format_size
from tierkv.errors import ConfigError

RESERVE_SHARE, RESERVE_MIN = 0.10, 1 << 30
"""What the check leaves for everything else: a tenth of the node's memory, at least 1 GiB."""


def node_memory_bytes() -> int | None:
    """The memory this process's node (or container) has: MemTotal, capped by a cgroup's
    ``memory.max``; None where neither can be read."""
    total: int | None = None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        total = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as handle:
                raw = handle.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            total = int(raw) if total is None else min(total, int(raw))
        break
    return total


def host_tier_bytes(tiers: Iterable[Any]) -> dict[str, int]:
    """Per tier that keeps its chunks in this node's host memory (a ``cpu`` tier, an ``shm``
    pool on a memory file system), its capacity."""
    found = {}
    for tier in tiers:
        device = getattr(tier, "device", None)
        capacity = getattr(tier, "capacity", None)
        if isinstance(device, torch.device) and device.type == "cpu" and capacity:
            found[str(tier.name)] = int(capacity)
    return found


def kv_cache_bytes(kv_caches: Iterable[torch.Tensor]) -> int:
    """The bytes of vLLM's KV tensors that live in host memory (distinct storages once)."""
    seen, total = set(), 0
    for tensor in kv_caches:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def check_node_memory(kv_bytes: int, tiers: Sequence[Any], node_bytes: int | None = None) -> None:
    """Raise ``ConfigError`` when vLLM's KV space (``kv_bytes`` of host memory) and tierkv's host
    tiers leave less than the reserve (``RESERVE_SHARE`` of the node, ``RESERVE_MIN`` at least)
    of the node's memory (``node_bytes``; read when None, and nothing is checked where it cannot
    be)."""
    node = node_memory_bytes() if node_bytes is None else node_bytes
    host = host_tier_bytes(tiers)
    if not node or not (kv_bytes and host):
        return
    reserve = max(RESERVE_MIN, int(node * RESERVE_SHARE))
    need = kv_bytes + sum(host.values())
    if need + reserve <= node:
        return
    tiers_text = ", ".join(f"{name!r} {format_size(size)}" for name, size in host.items())
    raise ConfigError(
        f"tierkv: vLLM's KV cache ({format_size(kv_bytes)}) and tierkv's host tiers ({tiers_text}) need "
        f"{format_size(need)} of this node's {format_size(node)} of memory, leaving less than the "
        f"{format_size(reserve)} the OS, the model's weights and its activations need: the kernel would kill "
        f"vLLM's worker once its KV cache fills. Lower vLLM's KV space (VLLM_CPU_KVCACHE_SPACE in GiB, or "
        f"--kv-cache-memory-bytes; unset, vLLM's CPU build takes most of the node's memory) or the tiers' "
        f"capacity ({os.environ.get('TIERKV_CONFIG') or 'the tierkv config'})")
