"""One page of SGLang's host KV pool as a tierkv chunk, for each host-pool layout.

SGLang's host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) keeps all pages in
one buffer whose order depends on ``--hicache-mem-layout``; ``get_data_page(index,
flat=False)`` gives one page as a view in that order. tierkv stores every page in one
canonical chunk layout, whatever the pool's, so a cache written under one layout is read
under another, and a chunk reads like any tierkv chunk (``[layers, 2, tokens, heads,
head_size]``, tierkv's ``vllm`` format):

==================  ==============================  ==========================
layout              SGLang's page (MHA)             chunk view
==================  ==============================  ==========================
layer_first         ``[2, L, page, H, D]``          ``transpose(0, 1)``
page_first          ``[2, page, L, H, D]``          ``permute(2, 0, 1, 3, 4)``
page_first_direct   ``[2, 1, L, page, H, D]``       ``[:, 0].transpose(0, 1)``
==================  ==============================  ==========================

MLA pages (one latent vector per token and layer, ``[L, page, 1, D]`` and the like) become
``[L, 1, page, 1, D]``. Every chunk view is a strided view of the pool's memory (no copy):
tiers read and write it in its contiguous runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct")

_MHA: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "layer_first": lambda page: page.transpose(0, 1),
    "page_first": lambda page: page.permute(2, 0, 1, 3, 4),
    "page_first_direct": lambda page: page[:, 0].transpose(0, 1),
}
_MHA_NATIVE = {
    "layer_first": lambda L, ps, H, D: (2, L, ps, H, D),
    "page_first": lambda L, ps, H, D: (2, ps, L, H, D),
    "page_first_direct": lambda L, ps, H, D: (2, 1, L, ps, H, D),
}
_MLA: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "layer_first": lambda page: page.unsqueeze(1),
    "page_first": lambda page: page.transpose(0, 1).unsqueeze(1),
    "page_first_direct": lambda page: page[0].unsqueeze(1),
}
_MLA_NATIVE = {
    "layer_first": lambda L, ps, D: (L, ps, 1, D),
    "page_first": lambda L, ps, D: (ps, L, 1, D),
    "page_first_direct": lambda L, ps, D: (1, L, ps, 1, D),
}


class PageLayout:
    """Chunk views of the pages of one SGLang host pool."""

    def __init__(self, host_pool: Any) -> None:
        self.pool = host_pool
        self.layout = str(getattr(host_pool, "layout", ""))
        if self.layout not in LAYOUTS:
            raise ValueError(f"tierkv stores SGLang host pools in the {list(LAYOUTS)} layouts, got "
                             f"{self.layout!r} (set --hicache-mem-layout to one of them)")
        self.page_size = int(host_pool.page_size)
        self.layer_num = int(host_pool.layer_num)
        self.dtype: torch.dtype = host_pool.dtype
        self.mla = hasattr(host_pool, "kv_cache_dim")
        if self.mla:
            self.head_num, self.head_dim = 1, int(host_pool.kv_cache_dim)
            self._canonical = _MLA[self.layout]
            self._native = _MLA_NATIVE[self.layout](self.layer_num, self.page_size, self.head_dim)
            self.kind = "mla"
        else:
            self.head_num, self.head_dim = int(host_pool.head_num), int(host_pool.head_dim)
            v_head_dim = int(getattr(host_pool, "v_head_dim", self.head_dim))
            if v_head_dim != self.head_dim:
                raise ValueError(f"tierkv stores MHA pages whose K and V widths match; this pool has K {self.head_dim} "
                                 f"and V {v_head_dim}")
            self._canonical = _MHA[self.layout]
            self._native = _MHA_NATIVE[self.layout](self.layer_num, self.page_size, self.head_num, self.head_dim)
            self.kind = "mha"
        self.chunk_shape: tuple[int, ...] = (self.layer_num, 1 if self.mla else 2, self.page_size,
                                             self.head_num, self.head_dim)
        self.page_nbytes = self.dtype.itemsize
        for dim in self.chunk_shape:
            self.page_nbytes *= dim

    def geometry(self) -> str:
        """What a stored page's bytes mean (part of every key: other shapes never read them)."""
        return (f"{self.kind}:layers={self.layer_num}:heads={self.head_num}:head_dim={self.head_dim}:"
                f"page={self.page_size}:dtype={str(self.dtype).removeprefix('torch.')}")

    def page_index(self, host_indices: torch.Tensor, page: int) -> int:
        """Host-pool index of the first token of the ``page``-th page of ``host_indices``."""
        return int(host_indices[page * self.page_size])

    def check_indices(self, host_indices: torch.Tensor, num_pages: int) -> None:
        if host_indices.numel() < num_pages * self.page_size:
            raise ValueError(f"{num_pages} pages need {num_pages * self.page_size} host indices, got "
                             f"{host_indices.numel()}")

    def view(self, index: int) -> torch.Tensor:
        """The page starting at host index ``index`` as a chunk (a view of the pool)."""
        if index % self.page_size:
            raise ValueError(f"host index {index} is not at a page start (page size {self.page_size})")
        return self._canonical(self.pool.get_data_page(index, flat=False))

    def from_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page in the pool's own order (SGLang's generic ``get_data_page`` /
        ``get_dummy_flat_data_page``) viewed as a chunk."""
        if flat.numel() * flat.element_size() != self.page_nbytes:
            raise ValueError(f"a page of this pool is {self.page_nbytes} bytes, got a tensor of "
                             f"{flat.numel() * flat.element_size()} bytes")
        if flat.dtype != self.dtype:
            raise ValueError(f"a page of this pool is {self.dtype}, got {flat.dtype}")
        return self._canonical(flat.reshape(self._native))
