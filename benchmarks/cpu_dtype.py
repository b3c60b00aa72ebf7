"""The model dtype the CPU TTFT benchmarks (vLLM, SGLang) run in.

bf16 only where the CPU computes it natively (AVX512-BF16 or AMX): elsewhere a bf16 prefill
runs several times slower than float32 (measured on an AVX2-only machine: 25 s vs 4.6 s for a
1K-token prefill of the 8-layer benchmark model), and an 8K prompt outlasts vLLM's step timeout.
"""

from __future__ import annotations

from pathlib import Path

CHOICES = ("auto", "bfloat16", "float32")


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def model_dtype(choice: str) -> str:
    """``choice`` (one of ``CHOICES``), with ``auto`` resolved for this CPU."""
    if choice not in CHOICES:
        raise ValueError(f"dtype: expected one of {', '.join(CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "bfloat16" if native_bf16() else "float32"


def element_bytes(dtype: str) -> int:
    """Bytes per KV element of the model dtype."""
    return 2 if dtype == "bfloat16" else 4
