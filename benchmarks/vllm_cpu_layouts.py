"""vLLM CPU cache layouts: an 8K-token load and store through tierkv's connectors, per layout,
against a memcpy of the same bytes timed in the same run.

Shape: 8 layers, 8 KV heads, head size 128, 8,192 tokens in vLLM's CPU cache of 128-token
blocks (blocks in shuffled order, as vLLM hands them out), for each order vLLM's CPU attention
writes (``cpu``: the vec / vec16 / neon / vsx / vxe / rvv ISAs, K transposed; ``cpu_amx``: the
amx ISA's tiles) in bf16 and as an fp8 cache (one byte per element). "load" moves a chunk into
the cache (``to_gpu``, what a hit costs), "store" out of it (``from_gpu``). The baseline is
``torch.Tensor.copy_`` between two contiguous tensors of the chunk's bytes: what a load would
cost if the cache were laid out like the chunk. Ratio = memcpy time / ours (1.0 = memcpy speed).

Run: ``python benchmarks/vllm_cpu_layouts.py [--repeats N] [--json PATH]``; builds tierkv's
extension first if it can (without it the pure-torch paths are timed, and the rows say so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core import interleaved  # noqa: E402

from tierkv import ops  # noqa: E402
from tierkv.integrations.vllm_v1.layouts import connector_for, slot_mapping  # noqa: E402

LAYERS, HEADS, HEAD_SIZE, BLOCK, TOKENS = 8, 8, 128, 128, 8192


def time_layout(layout: str, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    blocks = TOKENS // BLOCK + 8
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randint(0, 100, (blocks, HEADS, BLOCK, 2 * HEAD_SIZE), generator=generator).to(dtype)
              for _ in range(LAYERS)]
    order = np.random.default_rng(0).permutation(blocks)[: TOKENS // BLOCK].tolist()
    slots = slot_mapping(order, BLOCK, TOKENS)
    connector = connector_for(layers, layout, HEADS, HEAD_SIZE, BLOCK)
    chunk = torch.randint(0, 100, (LAYERS, 2, TOKENS, HEADS, HEAD_SIZE), generator=generator).to(dtype)
    source, target = chunk.clone(), torch.empty_like(chunk)
    load, memcpy_load = interleaved(lambda: connector.to_gpu(chunk, 0, TOKENS, slot_mapping=slots),
                                    lambda: target.copy_(source), repeats)
    back = torch.empty_like(chunk)
    store, memcpy_store = interleaved(lambda: connector.from_gpu(back, 0, TOKENS, slot_mapping=slots),
                                      lambda: target.copy_(source), repeats)
    if not torch.equal(back.view(torch.uint8), chunk.view(torch.uint8)):
        raise AssertionError(f"{layout} {dtype}: the store read back other bytes than the load wrote")
    size = chunk.numel() * chunk.element_size()
    return {"layout": layout, "dtype": str(dtype).removeprefix("torch."), "bytes": size,
            "load_ms": load * 1e3, "store_ms": store * 1e3, "memcpy_ms": min(memcpy_load, memcpy_store) * 1e3,
            "load_vs_memcpy": min(memcpy_load, memcpy_store) / load,
            "store_vs_memcpy": min(memcpy_load, memcpy_store) / store,
            "kernel": "extension" if ops.paged_copy_strided_available(chunk) else "pure torch"}


def run(repeats: int = 7) -> list[dict[str, Any]]:
    ops.build_extension()
    return [time_layout(layout, dtype, repeats) for layout in ("cpu", "cpu_amx")
            for dtype in (torch.bfloat16, torch.uint8)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = run(args.repeats)
    print(f"{'layout':9} {'dtype':9} {'MiB':>5} {'load ms':>8} {'store ms':>9} {'memcpy ms':>10} "
          f"{'load/memcpy':>12} {'store/memcpy':>13}  kernel")
    for row in rows:
        print(f"{row['layout']:9} {row['dtype']:9} {row['bytes'] / 2**20:5.0f} {row['load_ms']:8.1f} "
              f"{row['store_ms']:9.1f} {row['memcpy_ms']:10.1f} {row['load_vs_memcpy']:11.2f}x "
              f"{row['store_vs_memcpy']:12.2f}x  {row['kernel']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
