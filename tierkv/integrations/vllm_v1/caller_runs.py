"""Copies of a synchronous load, run by the thread that waits for it.

A synchronous load holds up vLLM's forward pass: while it runs, vLLM's worker thread and its
OpenMP team (bound to the compute cores) sit idle. tierkv's own threads live on the core vLLM
keeps free (``tierkv.integrations.vllm_v1.placement.place_engine_threads``), so a copy
they made would run on one core while the compute cores wait. Instead, the tierkv thread that
has a chunk ready hands the copy into vLLM's blocks to the waiting thread (``CallerRuns.run``),
which runs it with every compute core (``CallerRuns.serve``: the extension's kernels use the
thread's whole OpenMP team, see ``tierkv.ops.set_copy_threads``); a batch of chunks is split
between it and the handing thread (``CallerRuns.run_split``), so the core kept free copies
too. Reading the tiers stays on tierkv's threads. Once the waiting thread stops serving (the load finished or timed out), what
is handed over afterwards runs on the handing thread, so nothing waits for a thread that left.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tierkv import ops

T = TypeVar("T")


class CallerRuns:
    """Work handed from tierkv's threads to the one thread serving it (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], concurrent.futures.Future[None]] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self._serving = True
        self.busy_s = 0.0  # seconds the serving thread spent running handed-over work
        self.team = 1  # threads the serving thread copies with (known once it serves)

    def run(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the serving thread and return when it ran (its exception re-raised
        here); on this thread when nobody serves any more."""
        done = self._hand_over(work)
        if done is None:
            work()
            return
        done.result()

    def run_split(self, items: Sequence[T], copy: Callable[[Sequence[T]], None]) -> None:
        """Run ``copy`` over ``items`` split in two at once: the serving thread's share (by the
        threads its copies use, its OpenMP team) handed over, the rest on this thread (the core
        vLLM keeps free would otherwise sit idle through a synchronous load). Returns when both
        parts ran; the first exception is re-raised here."""
        theirs, mine = self.team, ops.copy_threads()
        cut = len(items) if len(items) < 2 else max(1, round(len(items) * theirs / (theirs + mine)))
        handed, kept = items[:cut], items[cut:]
        done = self._hand_over(functools.partial(copy, handed))
        if done is None:
            copy(items)
            return
        try:
            if kept:
                copy(kept)
        finally:
            concurrent.futures.wait([done])  # the handed part reads the caller's chunks: never return before it
        done.result()

    def _hand_over(self, work: Callable[[], None]) -> concurrent.futures.Future[None] | None:
        """Queue ``work`` for the serving thread: its future, or None when nobody serves."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if not self._serving:
                return None
            self._queue.put((work, done))
        return done

    def serve(self, until: concurrent.futures.Future[Any], timeout: float | None) -> None:
        """Run what is handed over until ``until`` is done or ``timeout`` seconds passed, then
        stop serving (running what was handed over meanwhile)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ops.set_copy_threads(0)  # the copies run with this thread's whole OpenMP team (vLLM's compute cores)
        self.team = ops.copy_threads()
        until.add_done_callback(lambda _: self._queue.put(None))  # wakes the wait below the moment it is done
        try:
            while not until.done():
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    break
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    break
                if item is not None:
                    started = time.perf_counter()
                    _run(*item)
                    self.busy_s += time.perf_counter() - started
        finally:
            with self._lock:
                self._serving = False
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    _run(*item)


def _run(work: Callable[[], None], done: concurrent.futures.Future[None]) -> None:
    try:
        work()
    except BaseException as exc:  # handed back to the thread that handed the work over
        done.set_exception(exc)
    else:
        done.set_result(None)
