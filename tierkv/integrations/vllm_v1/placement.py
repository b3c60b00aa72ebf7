"""Where tierkv's threads run inside a vLLM worker, and at what priority (``transfer_cpus``).

vLLM's CPU backend pins each worker's compute thread (and its OpenMP team) to cores. tierkv's
own threads in the worker (the engine's loop, its copy threads) must not take those cores from
the forward pass, and must not be starved where the forward pass waits on them. Under vLLM's
automatic binding the CPUs the worker is not pinned to are the ones vLLM reserves, and they go
there; under an explicit binding (several replicas on one machine) those CPUs are other
replicas' compute cores, and they stay on the worker's own, at a lower priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Mapping

from tierkv.engine.blocking import Engine
from tierkv.threads import io_executor, name_native_thread

IO_THREADS = 2
"""Copy threads per engine (the loop's executor): a save's gathers and a tier's blocking calls."""

TRANSFER_NICE = 10
"""The nice value of tierkv's loop and copy threads in a vLLM worker when they share the
worker's own cores (``own``). On a core the forward pass also wants, the scheduler gives them
about a tenth of it and does not preempt the forward pass to run them; when the forward pass
waits (for a synchronous load, for the next step) they get the whole core, so nothing vLLM
waits for is slowed. On vLLM's reserved cores (``spare``) they keep the worker's priority:
there they compete with vLLM's API server and engine core, not with the forward pass, and a
lower priority would only delay the loads the forward pass waits for. The lookup threads keep
the worker's priority everywhere: the scheduler waits for their answer."""


def spare_cpus() -> set[int] | None:
    """CPUs this process is not pinned to: vLLM's CPU backend pins each worker to its compute
    cores and reserves others for other work. None when the process may run anywhere."""
    try:
        own = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return None
    spare = set(range(os.cpu_count() or 0)) - own
    return spare or None


def resolved_placement(setting: str, environ: Mapping[str, str] = os.environ) -> str:
    """``own`` or ``spare``: what ``auto`` means under this environment (``own`` under an
    explicit ``VLLM_CPU_OMP_THREADS_BIND`` list, else ``spare``); other settings unchanged."""
    if setting != "auto":
        return setting
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    return "spare" if bind in ("", "auto") else "own"


def transfer_cpus(setting: str, environ: Mapping[str, str] = os.environ) -> set[int] | None:
    """Where tierkv's threads run in a vLLM worker (the ``transfer_cpus`` setting).

    ``spare``: the CPUs the worker is not pinned to. With vLLM's automatic binding
    (``VLLM_CPU_OMP_THREADS_BIND`` unset or ``auto``) those are the CPUs vLLM reserves for
    other work (``VLLM_CPU_NUM_OF_RESERVED_CPU``), so the copies stay off the forward pass.
    ``own``: the worker's own CPUs. When the operator binds each instance to its own cores
    (``VLLM_CPU_OMP_THREADS_BIND`` a list: several replicas on one machine) the CPUs outside
    this worker's are another replica's compute cores, and a tierkv thread there would take
    that replica's core and, preempted while it holds this process's GIL, stall this one's
    forward pass until that core runs it again; on its own CPUs a tierkv thread runs exactly
    when the forward pass waits for it. ``auto`` (default): ``own`` under an explicit binding,
    else ``spare``. None: no pinning (no spare CPU, or not Linux)."""
    if resolved_placement(setting, environ) == "spare":
        return spare_cpus()
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


async def _place_loop_thread(cpus: set[int] | None, io_workers: int, nice: int | None) -> None:
    """On the engine's loop thread: its kernel name, its CPUs, its nice value (None: the
    worker's), and a bounded pool of named copy threads (started from here, so they inherit
    the CPUs and the priority)."""
    name_native_thread("tierkv-engine")
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if nice is not None:
        with contextlib.suppress(OSError):  # lowering one's own priority is always allowed; a sandbox may say no
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    asyncio.get_running_loop().set_default_executor(io_executor(io_workers))


def place_engine_threads(engine: Engine, setting: str = "auto") -> set[int] | None:
    """Run the engine's loop thread and the threads it starts on the CPUs ``transfer_cpus``
    picks (at nice ``TRANSFER_NICE`` when those are the worker's own), with ``IO_THREADS`` copy
    threads; returns those CPUs (None: not pinned)."""
    cpus = transfer_cpus(setting)
    nice = TRANSFER_NICE if resolved_placement(setting) == "own" else None
    engine.run(_place_loop_thread(cpus, IO_THREADS, nice))
    return cpus
