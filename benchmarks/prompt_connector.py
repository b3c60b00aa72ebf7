"""The prompt benchmark's connector rows: a PagedConnector round trip beside the bare paged kernels.

A CPU paged cache -> cpu tier -> another paged cache with a different slot mapping, against
``ops.paged_gather`` + ``ops.paged_scatter`` of the same tokens: the floor of that round trip.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from prompt_workload import BLOCK_SIZE, CHUNK, DTYPE, HEAD_SIZE, HEADS, LAYERS, TOKEN_BYTES, copy_counts, timed, touched

from tierkv import Engine, ops
from tierkv.connectors import PagedConnector, retrieve_paged, store_paged


def _paged_cache(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            block = torch.empty(num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=DTYPE)
            block.view(torch.int16).random_(-(2**15), 2**15 - 1)
            pair.append(block)
        layers.append((pair[0], pair[1]))
    return layers


def connector_rows(engine: Engine, tokens: torch.Tensor, passes: int) -> list[dict[str, Any]]:
    """PagedConnector: a CPU paged cache -> cpu tier -> another paged cache, vs the bare kernels."""
    num_tokens = tokens.numel()
    num_blocks = num_tokens // BLOCK_SIZE + 8
    source, target = _paged_cache(num_blocks), _paged_cache(num_blocks)

    def slots(seed: int) -> torch.Tensor:
        blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: num_tokens // BLOCK_SIZE]
        return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)[None, :]).flatten()

    source_slots, target_slots = slots(1), slots(2)
    connector = PagedConnector(LAYERS, HEADS, HEAD_SIZE)
    chunk = touched((LAYERS, 2, CHUNK, HEADS, HEAD_SIZE))

    def kernels() -> None:
        for start in range(0, num_tokens, CHUNK):
            view = chunk.narrow(2, 0, min(CHUNK, num_tokens - start))
            ops.paged_gather(source, source_slots[start:start + CHUNK], out=view)
            ops.paged_scatter(view, target, target_slots[start:start + CHUNK])

    def round_trip() -> None:
        store_paged(engine, connector, tokens, kvcaches=source, slot_mapping=source_slots)
        retrieve_paged(engine, connector, tokens, kvcaches=target, slot_mapping=target_slots)
        engine.batched_delete(engine.keys_for(tokens))

    ours, base, per_byte = [], [], []
    for _ in range(passes + 1):
        before = copy_counts(engine)
        ours.append(timed(round_trip))
        after = copy_counts(engine)
        per_byte.append(((after["store"][0] - before["store"][0]) + (after["retrieve"][0] - before["retrieve"][0]))
                        / max(1, (after["store"][1] - before["store"][1]) + (after["retrieve"][1] - before["retrieve"][1])))
        base.append(timed(kernels))
    nbytes = 2 * num_tokens * TOKEN_BYTES  # gathered once and scattered once
    rows = []
    for phase, a, b in (("first", ours[:1], base[:1]), ("steady", ours[1:], base[1:])):
        ratio = statistics.median(b) / statistics.median(a)
        row: dict[str, Any] = {"tier": "cpu", "op": "connector round trip", "pass": phase,
                               "ours_GBps": nbytes / statistics.median(a) / 1e9, "baseline": "paged kernels",
                               "baseline_GBps": nbytes / statistics.median(b) / 1e9, "ratio": ratio,
                               "copies_per_byte": per_byte[0 if phase == "first" else -1],
                               "kernels": "extension" if ops.extension_status()["in_use"] else "reference"}
        if phase == "steady":
            row.update(target=">= 0.7", meets=ratio >= 0.7)
        rows.append(row)
    return rows
