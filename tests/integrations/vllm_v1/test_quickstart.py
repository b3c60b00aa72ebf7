"""The CPU quickstart of docs/vllm.md runs as written and shows its second request's KV come
from tierkv (examples/vllm-quickstart/quickstart.py, a real vLLM process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_marks import RUN_S, VLLM_PROCESSES

from tierkv.testing.processes import start_group, stop_group

pytestmark = VLLM_PROCESSES
SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "vllm-quickstart" / "quickstart.py"


def test_the_quickstart_loads_the_repeat_from_tierkv() -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = start_group([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)
    try:
        stdout, stderr = process.communicate(timeout=RUN_S)
    finally:
        stop_group(process)  # vLLM's engine core and worker too, however this ends
    assert process.returncode == 0, stderr[-4000:]
    lines = [line for line in stdout.splitlines() if line.startswith("request ")]
    assert lines == ["request 1: tierkv loaded 0 of 1000 prompt tokens",
                     "request 2: tierkv loaded 999 of 1000 prompt tokens"], stdout[-2000:]
