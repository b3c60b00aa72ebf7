"""Paged KV caches for the copy-kernel tests (ops, connectors, vLLM layouts): the layouts
serving engines use, filled with random values, compared byte for byte; and the extension
built once per session."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tierkv import ops
from tierkv.testing.requirements import missing


def build_extension_for_tests(config: pytest.Config) -> None:
    """Build (or load the cached build of) the extension once per session, or skip with why."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        missing("a C++ compiler (c++ or g++ on PATH)", "the extension cannot be built on this machine")
    cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or (
        str(Path(cache.mkdir("tierkv_ext"))) if cache is not None else tempfile.mkdtemp(prefix="tierkv_ext-"))
    assert ops.build_extension(root), ops.extension_status()["reason"]


def random_values(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    if dtype in (torch.int8, torch.uint8):
        low, high = (-128, 128) if dtype == torch.int8 else (0, 256)
        return torch.randint(low, high, shape, dtype=dtype, device=device)
    return torch.randn(shape, device=device).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def make_cache(layout: str, layers: int, blocks: int, block_size: int, heads: int, head_size: int,
               dtype: torch.dtype, device: str = "cpu") -> list:
    """A paged cache in one of the layouts serving engines use."""
    if layout == "pairs":
        return [(random_values((blocks, block_size, heads, head_size), dtype, device),
                 random_values((blocks, block_size, heads, head_size), dtype, device)) for _ in range(layers)]
    if layout == "fused":
        return [random_values((2, blocks, block_size, heads, head_size), dtype, device) for _ in range(layers)]
    # flash-attention layout [num_blocks, 2, block_size, ...]: K and V are strided views
    caches = [random_values((blocks, 2, block_size, heads, head_size), dtype, device) for _ in range(layers)]
    return [(cache[:, 0], cache[:, 1]) for cache in caches]


def clone_cache(cache: list) -> list:
    return [tuple(t.clone() for t in layer) if isinstance(layer, tuple) else layer.clone() for layer in cache]


def cache_bytes_equal(a: list, b: list) -> bool:
    ka, va = ops.split_paged_cache(a)
    kb, vb = ops.split_paged_cache(b)
    return all(same_bytes(x, y) for x, y in zip(ka + va, kb + vb))
