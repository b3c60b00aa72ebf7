"""The parts of the GPU check (``benchmarks/gpu_check.py``, issue 36), one module per job (issue 49).

The entry script only puts ``benchmarks/`` on ``sys.path`` and calls ``gpu_checks.cli.main``;
each part process re-runs that script with ``--part``, so a bare GPU machine runs the check from
the checkout with no install. The modules, from the bottom up:

- ``context``: results a part reports, the run's context, the environment of child processes
- ``processes``: bounded subprocesses in their own process groups
- ``dependencies``: shipped wheels and the entry-point dist-info (no network on the device)
- ``pytest_runs``: pytest in a subprocess, JUnit counts, the device's no-skip rule
- ``environment``: the first part (Python, torch, CUDA, tools, backends)
- ``suite``: the suite's CUDA tests, their selection, the CPU reference ops tests
- ``ext_build``: building ``cuda_ext`` for the device's architecture
- ``sanitizers``: compute-sanitizer memcheck and racecheck over the kernel tests
- ``pressure_devices`` and ``pressure``: the memory-pressure scenario, on the device and rehearsed on the CPU
- ``timings``: gather/scatter, connector and matmul-overlap ratios
- ``parts``: the parts in order and the worker running one; ``runner``: all of them in one budget
- ``report``: ``gpu_check.json``, ``gpu_check.md`` and the exit code; ``cli``: the command line
"""
