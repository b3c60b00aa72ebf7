"""Names and places for tierkv's own threads inside a serving engine's process.

A serving engine's operators look at ``top -H`` or ``/proc/PID/task/*/comm`` to see where a
process's CPU goes; Python's thread names do not reach the kernel (before 3.14), so every
thread tierkv starts in an engine's worker takes a kernel name starting ``tierkv-``. The copy
threads of the engine's loop are a bounded pool of its own (``io_executor``), not asyncio's
default of up to 32: on a machine where each engine process has one core, every extra thread
is one more to take that core from the forward pass.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import functools
import threading

_PR_SET_NAME = 15
_libc: ctypes.CDLL | None = None


def name_native_thread(name: str) -> None:
    """Give the calling thread the kernel name ``name`` (15 bytes at most; Linux only, a no-op
    elsewhere or when the call fails)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        return


def _name_worker(prefix: str) -> None:
    name_native_thread(f"{prefix}-{threading.current_thread().name.rsplit('_', 1)[-1]}")


def io_executor(workers: int, prefix: str = "tierkv-io") -> concurrent.futures.ThreadPoolExecutor:
    """A pool of ``workers`` threads named ``prefix-N`` (Python and kernel names), for the
    copies and blocking calls of an engine's loop."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix,
                                                 initializer=functools.partial(_name_worker, prefix))
