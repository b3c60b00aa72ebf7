#!/usr/bin/env python
"""One prepared check of every CUDA path of tierkv (issue 36), under 10 minutes on one H100.

    python benchmarks/gpu_check.py --out DIR [--dry-run] [--quick]

On a CUDA machine it builds ``cuda_ext`` for the device's architecture, runs every CUDA test of the
suite (a CUDA test that skips there is a failure), runs a memory-pressure scenario on the real
device (NVML readings, a second process allocating device memory), runs compute-sanitizer over
the kernel tests, and times the kernels, the connectors and a matmul beside a store copy as
ratios. Without CUDA (or with ``--dry-run``) it runs the CPU parts and reports every CUDA part as
skipped with the reason ("no CUDA device"), so CI keeps the script honest.

Each part runs in its own process group with its own timeout, all under one budget (570 s by
default); the results go to ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` (the table is printed
too), each part's output to ``DIR/logs/``. Exit code 0 when no part failed; on a CUDA machine a
CUDA part that was skipped counts as failed unless ``--quick`` skipped it.

The GPU machine has no network. What tierkv needs beyond its image (only ``lmdb``) travels as
wheels in ``benchmarks/gpu_wheels/`` (``scripts/gpu_wheels.sh``) and is installed from there with
pip, or unpacked into a private directory when pip cannot install. tierkv itself runs from this
checkout (``PYTHONPATH``); its backends are found through entry points, so when the checkout is
not installed a minimal ``tierkv-*.dist-info`` declaring them is written to that directory.

The parts live in the package ``benchmarks/gpu_checks/``, one module per job (issue 49; its
``__init__`` lists them); this script is what a person, CI and each part process run
(``--part``), and it keeps ``write_dist_info`` importable from here for
``benchmarks/node_cache_gpu.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/ holds the package of parts; it is sys.path[0] when this runs as a script, and is added
# at the end (shadowing nothing) when a test loads this file by path
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

from gpu_checks.cli import main  # noqa: E402
from gpu_checks.dependencies import write_dist_info  # noqa: E402,F401  (node_cache_gpu.py imports it from here)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
