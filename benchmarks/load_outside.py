"""The same synchronous load as inside vLLM, timed in a plain process: the yardstick for the
worker's own ``sync_load_ms``.

A prompt of ``tokens`` tokens is stored into a cpu tier straight from a vLLM-shaped CPU cache
(``[blocks, heads, block_size, 2 * head_size]``, vLLM's order for this CPU's ISA), then
retrieved into other blocks of the cache through the same connector, sink and engine call the
vLLM worker makes (``retrieve_to`` with ``plan=False``): the median of ``repeats`` loads, and a
memcpy of the same bytes timed in the same process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from tierkv import Engine
from tierkv.connectors import ConnectorSink, store_paged
from tierkv.integrations.vllm_v1.layouts import connector_for, slot_mapping

BLOCK = 128


def isa_layout(dtype: torch.dtype) -> str:
    """The layout vLLM's CPU backend writes on this machine for ``dtype`` (its ``_get_attn_isa``)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from tierkv.integrations.vllm_v1.cpu_pages import layouts_for_isa

        return layouts_for_isa(_get_attn_isa(dtype, BLOCK, 128), dtype)[0]
    except Exception:  # no vLLM here: the vec order
        return "cpu"


def outside_load(tokens: int, layers: int, kv_heads: int, head_size: int, dtype: torch.dtype, chunk: int = 256,
                 repeats: int = 5) -> dict[str, Any]:
    blocks = 2 * (-(-tokens // BLOCK)) + 2
    generator = torch.Generator().manual_seed(0)
    cache = [torch.randint(-8, 8, (blocks, kv_heads, BLOCK, 2 * head_size), generator=generator).to(dtype)
             for _ in range(layers)]
    layout = isa_layout(dtype)
    connector = connector_for(cache, layout, kv_heads, head_size, BLOCK)
    order = np.random.default_rng(0).permutation(blocks)
    source = slot_mapping(order[: blocks // 2].tolist(), BLOCK, tokens)
    target = slot_mapping(order[blocks // 2:].tolist(), BLOCK, tokens, first=0, last=tokens - 1)
    prompt = np.arange(tokens, dtype=np.int64) % 30000 + 1
    size = layers * 2 * tokens * kv_heads * head_size * cache[0].element_size()
    config = {"model": "load-outside", "chunk_size": chunk, "cost_aware": False,
              "tiers": [{"name": "host", "backend": "cpu", "capacity": f"{2 * size // 2**20 + 64}MiB"}]}
    with Engine(config) as engine:
        store_paged(engine, connector, prompt, kvcaches=connector.views, slot_mapping=source)
        mask = torch.ones(tokens, dtype=torch.bool)
        seconds = []
        for _ in range(repeats):
            sink = ConnectorSink(connector, {"kvcaches": connector.views, "slot_mapping": target}, 0)
            started = time.perf_counter()
            got = engine.run(engine.core.retrieve_to(prompt, sink, mask, plan=False))
            seconds.append(time.perf_counter() - started)
            if int(got[: tokens - 1].sum()) != tokens - 1:
                raise AssertionError(f"the outside load covered {int(got.sum())} of {tokens - 1} tokens")
    a, b = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    b.fill_(1)
    copies = []
    for _ in range(repeats):
        started = time.perf_counter()
        a.copy_(b)
        copies.append(time.perf_counter() - started)
    return {"tokens": tokens, "layout": layout, "bytes": size, "load_ms": 1000 * statistics.median(seconds),
            "memcpy_ms": 1000 * statistics.median(copies)}
