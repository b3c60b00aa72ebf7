"""SGLang page hashes as tierkv keys.

SGLang names each page of a prompt by a chained hash of its tokens (a hex string; other
pools add a suffix such as ``.mamba``). tierkv keys carry the model, the tensor-parallel
world size and rank, and a chunk hash. A page key here is in its own namespace
(``NAMESPACE``, as in ``tierkv.chunks.namespaces``), so it never collides with the engine's
prefix-chunk keys, and its hash also covers the page geometry (layers, heads, head size,
page size, dtype, pipeline stage), the model's revision and tierkv's key format: caches of
different models, revisions, shapes or TP layouts never mix, even in one shared tier.

What else a page's KV depends on is already in SGLang's page hash: SGLang 0.5.23 seeds it
with the request's ``extra_key`` (its LoRA adapter id) and ``cache_salt``
(``sglang.srt.mem_cache.utils.get_storage_hash_str``), so salted and LoRA pages never share
a key here either (tested with a real SGLang in ``tests/hicache``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tierkv.chunks.identity import KEY_FORMAT, PLAIN, make_scope
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.namespaces import named_key

NAMESPACE = "sglang-hicache"
"""Namespace of SGLang HiCache pages (a suffix of the model name in every key)."""


@dataclass(frozen=True)
class PageKeySpace:
    """Maps SGLang page hashes to tierkv keys for one (model, revision, rank, geometry)."""

    model_name: str
    world_size: int
    rank: int
    geometry: str
    revision: str = ""

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("a page key space needs a non-empty model name")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")

    def template(self) -> CacheKey:
        return CacheKey("vllm", self.model_name, self.world_size, self.rank, "", self.scope)

    @functools.cached_property
    def scope(self) -> str:
        """The short digest of (key format, revision, geometry) every page key carries."""
        return make_scope((("revision", self.revision), ("geometry", self.geometry)), PLAIN).name

    def key(self, page_hash: str) -> CacheKey:
        """The tierkv key of one SGLang page."""
        if not isinstance(page_hash, str) or not page_hash:
            raise ValueError(f"an SGLang page key must be a non-empty string, got {page_hash!r}")
        return named_key(self.template(), NAMESPACE, KEY_FORMAT, self.revision, self.geometry, page_hash)

    def keys(self, page_hashes: list[str]) -> list[CacheKey]:
        template = self.template()
        return [named_key(template, NAMESPACE, KEY_FORMAT, self.revision, self.geometry, page_hash)
                for page_hash in page_hashes]
