"""vLLM's KV cache groups as tierkv sees them, and which chunks of each group a hit needs.

A hybrid model keeps several kinds of KV (vLLM's hybrid KV cache manager gives each kind of
layer its own group, with its own block table over one shared pool of blocks):

- ``full``: full attention, the KV of every token; a hit of ``L`` tokens needs every chunk
  below ``L``;
- ``sliding``: sliding-window attention (window ``W``), whose blocks below the window are
  freed as the request runs; a hit needs only the chunks holding the last
  ``cdiv(W - 1, block) * block`` tokens before ``L`` (vLLM's own rule);
- ``mla``: an MLA latent (DeepSeek), one vector per token, needed like full attention's KV
  (``.mla``); a sliding-window MLA group is ``sliding``;
- ``mamba``: a recurrent state per request (Mamba2's conv and SSM state, Gated DeltaNet's),
  checkpointed at block boundaries in vLLM's "align" mode; a hit needs the state after exactly
  ``L`` tokens, stored as the chunk that ends at ``L``.

Each group's chunks are keyed apart: the group's ``KVGroup.descriptor`` (its kind, block,
window or state shapes and dtypes, and its layers) joins the request's identity, so a chunk of
one group is never served for another, and a model whose groups change misses as a changed
revision does. A hit is **joint**: the longest chunk boundary at which every group has what it
needs (``joint_hit``), so a hit is never KV without its state, or state without its KV.

Pure bookkeeping, no vLLM import: ``groups_from_config`` reads vLLM's ``KVCacheConfig``
duck-typed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tierkv.chunks.identity import RequestIdentity

KINDS = ("full", "sliding", "mamba", "mla")


class UnsupportedKVGroupError(ValueError):
    """A KV cache group tierkv cannot cache (named, with why)."""


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups (see the module docstring)."""

    index: int
    kind: str
    layer_names: tuple[str, ...]
    block_size: int
    window: int = 0  # sliding: the attention window in tokens
    state_shapes: tuple[tuple[int, ...], ...] = ()  # mamba: the shape of each state tensor of a layer
    state_dtypes: tuple[str, ...] = ()
    state_type: str = ""  # mamba: vLLM's mamba_type (MAMBA2, GDN_ATTN, ...)
    num_kv_heads: int = 0  # attention: this worker's KV heads and their size
    head_size: int = 0
    mla: bool = False  # an MLA latent (full or sliding window): head_size is the latent's width
    details: str = field(default="", compare=False)  # what else the spec says (dtype, heads), for the descriptor

    @property
    def descriptor(self) -> str:
        """What a chunk of this group depends on besides its tokens and the engine: bound into
        its key (layer names included: a group of other layers is another group)."""
        parts = [self.kind, f"block={self.block_size}", f"layers={','.join(self.layer_names)}", self.details]
        if self.kind == "sliding":
            parts.append(f"window={self.window}")
        if self.kind == "mamba":
            parts += [f"type={self.state_type}", f"shapes={self.state_shapes}", f"dtypes={self.state_dtypes}"]
        return ";".join(parts)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.descriptor.encode()).hexdigest()[:24]

    def identity(self, base: RequestIdentity) -> RequestIdentity:
        """``base`` (the request's identity) with this group bound in: this group's keys."""
        return replace(base, extra=(*base.extra, f"kv-group:{self.digest}"))

    def window_tokens(self) -> int:
        """Sliding: the tokens before a hit whose KV the hit needs (vLLM's
        ``cdiv(window - 1, block)`` blocks)."""
        blocks = -(-(self.window - 1) // self.block_size)
        return blocks * self.block_size

    def chunks_needed(self, hit_chunks: int, chunk: int) -> range:
        """The chunk indices a hit of ``hit_chunks`` whole chunks needs from this group."""
        if hit_chunks <= 0:
            return range(0)
        if self.kind in ("full", "mla"):
            return range(hit_chunks)
        if self.kind == "sliding":
            first_token = max(0, hit_chunks * chunk - self.window_tokens())
            return range(first_token // chunk, hit_chunks)
        return range(hit_chunks - 1, hit_chunks)  # mamba: the state after exactly hit_chunks * chunk tokens


def joint_hit(groups: Sequence[KVGroup], present: Callable[[KVGroup, int], bool], max_chunks: int,
              chunk: int) -> int:
    """The longest hit, in whole chunks (at most ``max_chunks``), at which every group has each
    chunk it needs (``present(group, index)``); 0 when none."""
    for hit in range(max_chunks, 0, -1):
        if all(present(group, index) for group in groups for index in group.chunks_needed(hit, chunk)):
            return hit
    return 0


def hybrid_chunk_size(configured: int, block_size: int) -> int:
    """tierkv's chunk size for a hybrid model: ``configured`` when it is a multiple of vLLM's
    block size, else the nearest multiple above it (a Mamba state exists only at block
    boundaries, a sliding window is counted in blocks: a chunk must end on one)."""
    if block_size <= 0:
        raise ValueError(f"vLLM's block size must be positive, got {block_size}")
    return max(1, -(-configured // block_size)) * block_size


def _spec_kind(spec: Any) -> str:
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":
        specs = list(getattr(spec, "kv_cache_specs", {}).values())
        kinds = {_spec_kind(inner) for inner in specs}
        if len(kinds) != 1:
            raise UnsupportedKVGroupError(f"a group of mixed specs ({sorted(kinds)})")
        return kinds.pop()
    if name == "MambaSpec":
        return "mamba"
    if name in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
        return "sliding"
    if name == "MLAAttentionSpec":
        return "mla"
    if name in ("FullAttentionSpec", "ChunkedLocalAttentionSpec") and getattr(spec, "sliding_window", None):
        return "sliding"
    if name == "FullAttentionSpec":
        return "full"
    raise UnsupportedKVGroupError(f"vLLM KV cache spec {name} (tierkv caches full attention, sliding window, MLA "
                                  "latents and Mamba / linear-attention states)")


def group_from_spec(index: int, layer_names: Sequence[str], spec: Any) -> KVGroup:
    """A ``KVGroup`` from one of vLLM's ``KVCacheGroupSpec`` parts."""
    kind = _spec_kind(spec)
    block = int(spec.block_size)
    if kind == "mamba":
        if getattr(spec, "mamba_cache_mode", "align") != "align":
            raise UnsupportedKVGroupError(f"group {index}: mamba_cache_mode={spec.mamba_cache_mode!r}; tierkv needs "
                                          "'align' (states at block boundaries: vLLM's prefix caching)")
        mamba_type = getattr(spec, "mamba_type", "")
        return KVGroup(index, kind, tuple(layer_names), block,
                       state_shapes=tuple(tuple(int(d) for d in shape) for shape in spec.shapes),
                       state_dtypes=tuple(str(dtype) for dtype in spec.dtypes),
                       state_type=str(getattr(mamba_type, "name", mamba_type)))
    heads, head_size = int(getattr(spec, "num_kv_heads", 0) or 0), int(getattr(spec, "head_size", 0) or 0)
    details = f"heads={heads};head={head_size};dtype={getattr(spec, 'dtype', '?')}"
    window = int(getattr(spec, "sliding_window", 0) or 0) if kind == "sliding" else 0
    mla = "MLA" in _spec_name(spec)
    if mla:
        details += ";mla"
    return KVGroup(index, kind, tuple(layer_names), block, window=window, num_kv_heads=heads, head_size=head_size,
                   mla=mla, details=details)


def _spec_name(spec: Any) -> str:
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":
        inner = list(getattr(spec, "kv_cache_specs", {}).values())
        return type(inner[0]).__name__ if inner else name
    return name


def groups_from_config(kv_cache_config: Any) -> list[KVGroup]:
    """vLLM's ``KVCacheConfig.kv_cache_groups`` as ``KVGroup``s, in vLLM's order."""
    return [group_from_spec(index, list(group.layer_names), group.kv_cache_spec)
            for index, group in enumerate(kv_cache_config.kv_cache_groups)]


def block_size_of(groups: Sequence[KVGroup]) -> int:
    """vLLM's block size, the same in every group (its hybrid manager makes it so); raises
    ``UnsupportedKVGroupError`` when the groups disagree."""
    sizes = {group.block_size for group in groups}
    if len(sizes) != 1:
        raise UnsupportedKVGroupError(f"KV cache groups with different block sizes {sorted(sizes)}")
    return sizes.pop()


def is_hybrid(groups: Sequence[KVGroup]) -> bool:
    """Whether the groups need the hybrid path (anything but one full-attention or MLA group)."""
    return not (len(groups) == 1 and groups[0].kind in ("full", "mla"))
