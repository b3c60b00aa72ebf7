"""Kernel benchmark: paged gather/scatter, extension vs baselines measured in the same run.

Shape: 32 layers, 8 KV heads, head size 128, bfloat16, 256-token chunks (32 MiB), a paged cache
of 16-token blocks with the chunk's blocks in shuffled order (as a serving engine allocates them).

- CPU: the extension's C++ kernels (``torch.ops.tierkv.paged_gather`` / ``paged_scatter``, all
  layers in one call) vs the pure-torch reference (``index_select`` / ``index_copy_`` per layer
  and K/V), interleaved so machine noise hits both. Target: ratio >= 1 (not slower).
- GPU (only where one is present; otherwise "skipped: no GPU"): effective bandwidth of the
  CUDA gather/scatter as a fraction of a device-to-device copy of the same bytes (target >= 0.8),
  and a device->host chunk store through ``PagedConnectorV2`` (gather + one copy) as a fraction of
  a pinned ``cudaMemcpyAsync`` of the same bytes (target >= 0.9).

Run: ``python benchmarks/kernels.py [--repeats N]`` (builds the extension first if needed);
from code: ``run_kernels(repeats) -> list[dict]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core import interleaved  # noqa: E402

from tierkv import ops  # noqa: E402
from tierkv.connectors import PagedConnectorV2  # noqa: E402

LAYERS, HEADS, HEAD_SIZE, CHUNK_TOKENS, BLOCK_SIZE = 32, 8, 128, 256, 16
DTYPE = torch.bfloat16
CHUNK_BYTES = LAYERS * 2 * CHUNK_TOKENS * HEADS * HEAD_SIZE * DTYPE.itemsize


def paged_setup(device: str, num_blocks: int = 64) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """A paged cache, the chunk's slot mapping (shuffled blocks) and a chunk buffer."""
    keys = [torch.randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, device=device).to(DTYPE) for _ in range(LAYERS)]
    values = [torch.randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, device=device).to(DTYPE) for _ in range(LAYERS)]
    blocks = torch.randperm(num_blocks)[: CHUNK_TOKENS // BLOCK_SIZE]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)[None, :]).flatten().to(device)
    chunk = torch.empty(LAYERS, 2, CHUNK_TOKENS, HEADS, HEAD_SIZE, dtype=DTYPE, device=device)
    return keys, values, slots, chunk


def _row(section: str, op: str, ours: float, base: float, baseline: str, target: float) -> dict[str, Any]:
    ratio = base / ours
    return {"section": section, "op": op, "chunk_MiB": CHUNK_BYTES / 2**20, "ours_ms": ours * 1e3,
            "baseline_ms": base * 1e3, "ours_GBps": CHUNK_BYTES / ours / 1e9,
            "baseline_GBps": CHUNK_BYTES / base / 1e9, "ratio": ratio, "target": f">= {target}",
            "meets": ratio >= target, "baseline": baseline}


def bench_cpu(repeats: int) -> list[dict[str, Any]]:
    if not ops.extension_status()["in_use"]:
        return [{"section": "cpu", "skipped": f"extension not loaded: {ops.extension_status()['reason']}"}]
    keys, values, slots, chunk = paged_setup("cpu")
    pairs = list(zip(keys, values))
    ext_chunk, ref_chunk = chunk, chunk.clone()
    gather = interleaved(lambda: torch.ops.tierkv.paged_gather(keys, values, slots, ext_chunk, False),
                         lambda: ops.paged_gather_reference(pairs, slots, ref_chunk), repeats)
    if not torch.equal(ext_chunk, ref_chunk):
        raise AssertionError("extension gather differs from the reference")
    scatter = interleaved(lambda: torch.ops.tierkv.paged_scatter(ext_chunk, keys, values, slots, False),
                          lambda: ops.paged_scatter_reference(ref_chunk, pairs, slots), repeats)
    baseline = "pure-torch reference (index_select / index_copy_ per layer and K/V)"
    return [_row("cpu", "paged_gather", *gather, baseline, 1.0), _row("cpu", "paged_scatter", *scatter, baseline, 1.0)]


def _cuda_median(fn: Any, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def bench_gpu(repeats: int) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        print("GPU kernels: skipped: no GPU")
        return [{"section": "gpu", "skipped": "no GPU"}]
    if not ops.extension_status()["cuda_kernels"]:
        return [{"section": "gpu", "skipped": f"no CUDA kernels: {ops.extension_status()['cuda_reason']}"}]
    keys, values, slots, chunk = paged_setup("cuda", num_blocks=1024)
    pairs = list(zip(keys, values))
    source = torch.empty_like(chunk)
    d2d = _cuda_median(lambda: chunk.copy_(source), repeats)
    gather = _cuda_median(lambda: ops.paged_gather(pairs, slots, out=chunk), repeats)
    scatter = _cuda_median(lambda: ops.paged_scatter(chunk, pairs, slots), repeats)
    host = torch.empty(chunk.shape, dtype=DTYPE, pin_memory=True)
    d2h = _cuda_median(lambda: host.copy_(chunk, non_blocking=True), repeats)
    connector = PagedConnectorV2(LAYERS, HEADS, HEAD_SIZE)
    store = _cuda_median(lambda: connector.from_gpu(host, 0, CHUNK_TOKENS, kvcaches=pairs, slot_mapping=slots,
                                                    sync=False), repeats)
    return [_row("gpu", "paged_gather", gather, d2d, "device-to-device copy of the same bytes", 0.8),
            _row("gpu", "paged_scatter", scatter, d2d, "device-to-device copy of the same bytes", 0.8),
            _row("gpu", "store via PagedConnectorV2 (d2h)", store, d2h, "pinned cudaMemcpyAsync d2h", 0.9)]


def run_kernels(repeats: int = 15) -> list[dict[str, Any]]:
    """All kernel rows (CPU then GPU), building the extension first if it is not loaded."""
    if not ops.extension_status()["loaded"]:
        ops.build_extension()
    return [*bench_cpu(repeats), *bench_gpu(repeats)]


def print_kernel_rows(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if "skipped" in row:
            print(f"{row['section']}: skipped: {row['skipped']}")
        else:
            print(f"{row['section']:4} {row['op']:34} ours {row['ours_GBps']:6.2f} GB/s  baseline "
                  f"{row['baseline_GBps']:6.2f} GB/s  ratio {row['ratio']:.2f} (target {row['target']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    rows = run_kernels(args.repeats)
    print_kernel_rows(rows)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
