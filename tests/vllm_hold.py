"""``python tests/vllm_hold.py SPEC``: :mod:`tierkv.testing.vllm_runner`'s run, except that a
prompt's ``pause_s`` ends as soon as the file named by ``TIERKV_TEST_GO`` exists (``pause_s``
stays the bound). A replica holds before a prompt until the test says go, for instance until
another replica it runs beside has finished, instead of sleeping a guessed time.
"""

from __future__ import annotations

import os
import sys
import time


class _Hold:
    """Stands in for the runner's ``time`` module: its pause waits for the go file."""

    perf_counter = staticmethod(time.perf_counter)

    @staticmethod
    def sleep(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        go = os.environ["TIERKV_TEST_GO"]
        while time.monotonic() < deadline and not os.path.exists(go):
            time.sleep(0.1)


if __name__ == "__main__":  # vLLM's processes are spawned: they import this file, and must not run it
    from tierkv.testing import vllm_runner

    vllm_runner.time = _Hold  # type: ignore[assignment]
    sys.exit(vllm_runner.main(sys.argv[1]))
