#!/usr/bin/env python
"""The node cache on a GPU host: the ``shm`` pool registered as pinned memory, and a GPU
connector's round trip through it, timed against a plain pinned copy (issue 47's device check).

    python benchmarks/node_cache_gpu.py --out DIR [--gib 1] [--device cuda|cpu]

- registration: a pool is created and attached; its data area must be page-locked for CUDA
  (``tier.pinned``, ``tensor.is_pinned()``), and the time attaching took is reported;
- round trip: a vLLM-shaped paged cache on the device (Llama-3-8B KV: 32 layers x 8 KV heads x
  128, bfloat16, 16-token blocks), ``--gib`` of it stored through ``PagedConnector`` and
  ``PagedConnectorV2`` into an engine whose only tier is the pool, then retrieved into a second
  cache and compared byte for byte; the same through a pinned ``cpu`` tier; and a plain copy of
  the same bytes between the device and a pinned host buffer, both ways. GB/s, best of
  ``--repeats``, each pass storing new tokens; ratios against the pinned copy.

``--device cpu`` runs the same steps on the host (nothing is pinned), so the script is checked
without a GPU. Results go to ``DIR/node_cache_gpu.json`` and are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

LAYERS, HEADS, HEAD_SIZE, BLOCK, CHUNK = 32, 8, 128, 16, 256


def declare_backends() -> None:
    """Make the built-in backends findable from this checkout (the registry reads entry points)."""
    from gpu_check import write_dist_info

    site = Path(tempfile.mkdtemp(prefix="tierkv-site-"))
    write_dist_info(site)
    sys.path.insert(0, str(site))


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def paged_cache(tokens: int, device: str, seed: int) -> list[Any]:
    import torch

    blocks = -(-tokens // BLOCK)
    generator = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn((2, blocks, BLOCK, HEADS, HEAD_SIZE), generator=generator, device=device,
                        dtype=torch.float32).to(torch.bfloat16) for _ in range(LAYERS)]


def round_trip(kind: str, connector_name: str, tokens: int, device: str, repeats: int) -> dict[str, Any]:
    import torch

    from tierkv import Engine
    from tierkv.connectors import PagedConnector, PagedConnectorV2, retrieve_paged, store_paged

    nbytes = tokens * LAYERS * 2 * HEADS * HEAD_SIZE * 2
    path = f"/dev/shm/tierkv-gpu-{uuid.uuid4().hex[:10]}.pool"
    tier = ({"name": "node", "backend": "shm", "capacity": int(nbytes * 1.5), "path": path} if kind == "shm"
            else {"name": "host", "backend": "cpu", "capacity": int(nbytes * 1.5)})
    config = {"model": "llama-8b-shaped", "chunk_size": CHUNK, "cost_aware": False, "tiers": [tier]}
    connector_class = {"PagedConnector": PagedConnector, "PagedConnectorV2": PagedConnectorV2}[connector_name]
    connector = connector_class(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD_SIZE)
    source, target = paged_cache(tokens, device, 1), paged_cache(tokens, device, 2)
    slots = torch.arange(tokens, device=device)
    stores, retrieves = [], []
    started = time.perf_counter()
    with Engine(config) as engine:
        attach_s = time.perf_counter() - started
        backend = engine.tiers[0]
        pinned = bool(getattr(backend, "pinned", False))
        for round_ in range(repeats):
            ids = torch.arange(tokens) + 1_000_000 * (round_ + 1) + (7 if kind == "shm" else 0)
            synchronize(device)
            started = time.perf_counter()
            store_paged(engine, connector, ids, kvcaches=source, slot_mapping=slots)
            synchronize(device)
            stores.append(time.perf_counter() - started)
            started = time.perf_counter()
            mask = retrieve_paged(engine, connector, ids, kvcaches=target, slot_mapping=slots)
            synchronize(device)
            retrieves.append(time.perf_counter() - started)
            assert bool(mask[:-1].all()), f"{kind}: the round trip missed"
        exact = all(torch.equal(a, b) for a, b in zip(source, target))
        data = getattr(backend, "pool", None)
        data_pinned = bool(data.data.is_pinned()) if data is not None and device.startswith("cuda") else None
    Path(path).unlink(missing_ok=True)
    return {"tier": kind, "connector": connector_name, "GiB": round(nbytes / 2**30, 3), "pinned": pinned,
            "data_is_pinned": data_pinned, "attach_s": round(attach_s, 3), "exact": exact,
            "store_GBps": round(nbytes / min(stores) / 1e9, 2), "retrieve_GBps": round(nbytes / min(retrieves) / 1e9, 2)}


def pinned_copy(tokens: int, device: str, repeats: int) -> dict[str, float]:
    import torch

    nbytes = tokens * LAYERS * 2 * HEADS * HEAD_SIZE * 2
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    host.zero_()
    times: dict[str, list[float]] = {"d2h": [], "h2d": []}
    for _ in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        host.copy_(on_device, non_blocking=True)
        synchronize(device)
        times["d2h"].append(time.perf_counter() - started)
        started = time.perf_counter()
        on_device.copy_(host, non_blocking=True)
        synchronize(device)
        times["h2d"].append(time.perf_counter() - started)
    return {op: round(nbytes / min(values[1:]) / 1e9, 2) for op, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run with --device cpu to exercise the script)")
        return 0
    declare_backends()
    tokens = int(args.gib * 2**30) // (LAYERS * 2 * HEADS * HEAD_SIZE * 2) // CHUNK * CHUNK
    baseline = pinned_copy(tokens, args.device, args.repeats)
    rows = []
    for kind in ("shm", "cpu"):
        for connector in ("PagedConnector", "PagedConnectorV2"):
            row = round_trip(kind, connector, tokens, args.device, args.repeats)
            row["store_vs_pinned_copy"] = round(row["store_GBps"] / baseline["d2h"], 3)
            row["retrieve_vs_pinned_copy"] = round(row["retrieve_GBps"] / baseline["h2d"], 3)
            rows.append(row)
    from tierkv import ops

    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "pinned_copy_GBps": baseline, "kernels": ops.extension_status(), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "node_cache_gpu.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({key: value for key, value in result.items() if key != "rows"}, indent=2))
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
