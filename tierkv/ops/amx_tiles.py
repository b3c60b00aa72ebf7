"""Ask Linux for Intel AMX tile state before anything runs an AMX kernel in this process.

Linux hands a process the AMX tile registers (the ``XTILEDATA`` state component, 8 KiB per
thread) only after it asks for them with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``;
an AMX instruction run before that is an illegal instruction and the process dies with SIGILL.
oneDNN asks for itself before its bf16 matmuls, so a serving engine whose first forward is a
prefill never meets this. vLLM's CPU attention kernels (``cpu_attention_with_kv_cache``, ISA
``amx``) do not ask: with a KV cache hit, a fresh vLLM process's first forward can be a one-token
step that goes straight into that kernel, and the worker dies. tierkv's vLLM connector makes the
request in every worker before its first load (``request_amx_tiles``).

The permission is per process (every thread, present and future, gets it) and is kept across
``fork``; asking again is harmless. On a CPU without AMX, or off x86-64 Linux, nothing is asked.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import platform
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


class AMXTiles(enum.IntEnum):
    """What ``request_amx_tiles`` found: the code tierkv's vLLM connector shows in its stats
    (``amx_tile_state``)."""

    REFUSED = -1
    """The CPU has AMX and Linux refused the request (a kernel older than 5.16, or a seccomp
    filter): vLLM's AMX kernels will crash this process unless something else got the state."""
    NOT_ON_THIS_CPU = 0
    """No AMX here (or not x86-64 Linux): nothing to ask for."""
    GRANTED = 1
    """This process may run AMX instructions."""


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's probe where it has one, else ``/proc/cpuinfo``)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        import torch

        probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
        if probe is not None:
            return bool(probe())
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        return False
    return False


def _syscall() -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.syscall
    call.restype = ctypes.c_long
    return call  # type: ignore[no-any-return]


def amx_tiles_permitted() -> bool:
    """Whether this process already holds permission for the AMX tile state
    (``ARCH_GET_XCOMP_PERM``); False off x86-64 Linux."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    features = ctypes.c_ulong(0)
    if _syscall()(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return False  # a kernel without dynamic XSTATE: no AMX for anyone
    return bool(features.value & (1 << _XFEATURE_XTILEDATA))


def request_amx_tiles() -> AMXTiles:
    """Ask Linux for the AMX tile state for this whole process, where the CPU has AMX.

    Call it before the first AMX kernel can run (tierkv's vLLM connector: in each worker, at
    start, before any load). Never raises: a refusal is logged, with the OS's reason, and returned."""
    if not cpu_has_amx():
        return AMXTiles.NOT_ON_THIS_CPU
    if _syscall()(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0 or amx_tiles_permitted():
        return AMXTiles.GRANTED
    error = ctypes.get_errno()
    logger.warning("tierkv: this CPU has AMX but Linux refused this process the AMX tile state (%s; Linux 5.16 or "
                   "newer grants it): an AMX kernel run here dies with SIGILL", os.strerror(error) if error else "?")
    return AMXTiles.REFUSED
