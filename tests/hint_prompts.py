"""Small prompts and their KV for the retention tests (the node pool's and the memory tiers'):
16-token chunks of 4 KiB, each prompt's KV a function of its tokens, so a served chunk is
checked against the truth by recomputing it."""

from __future__ import annotations

import torch

from tierkv import Engine

CHUNK = 16
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 8 * 4  # 4 KiB: a 16-chunk tier is 64 KiB


def kv_of(tokens: torch.Tensor) -> torch.Tensor:
    """The KV stored for ``tokens`` ([2 layers, K/V, tokens, 2 heads, 8]), derived from them."""
    t = tokens.to(torch.float32)[None, None, :, None, None]
    return (t + torch.arange(2 * 2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 2, 8) / 64).contiguous()


def prompt(index: int, chunks: int = 4) -> torch.Tensor:
    """Prompt ``index``: ``chunks`` whole chunks of tokens no other prompt shares."""
    return torch.arange(chunks * CHUNK) + 10_000 * (index + 1)


def store(engine: Engine, *indices: int) -> None:
    """Store the prompts ``indices`` with their KV, and wait until they landed."""
    for index in indices:
        engine.store(prompt(index), kv_of(prompt(index)))
    engine.flush()
