"""MLA (DeepSeek V2 / V3 / R1, Kimi K2 and their kin): vLLM's latent KV cache as tierkv stores it.

A multi-head latent attention layer caches one vector per token: the compressed KV
(``kv_lora_rank``, 512 in DeepSeek's models) followed by the RoPE part of the key
(``qk_rope_head_dim``, 64): 576 values, no K/V pair, no heads. Every vLLM MLA backend keeps a
layer's cache token-major inside a block, blocks first: vLLM 0.32 registers
``[num_blocks, 1, block_size, 576]`` and its MLA layer binds the squeezed
``[num_blocks, block_size, 576]`` (FlashMLA, FlashInfer, Triton and CUTLASS MLA on GPU; ``AMX_MLA``
on CPU, whose ``amx_mla_concat_and_cache`` takes only the 3D view; ``CPU_MLA``, written row by row
in ``do_kv_cache_update``). Both shapes are the ``mla`` layout here (``split_latent``).

**Chunks.** tierkv's ``vllm`` chunk format is ``[layers, 2, tokens, heads, head_size]``; an MLA
chunk holds each token's latent as its two halves (``[layers, 2, tokens, 1, 288]``: values
0-287, then 288-575), so every tier, codec, the node pool and the one-group connector move it
as they move any chunk, with no second format. A chunk's bytes are the latent's, once: half the
bytes per token and layer of a GQA model with one KV head of 576.

**Once per node, whatever the tensor parallelism.** An MLA cache is the same on every
tensor-parallel rank (vLLM replicates the latent; a rank shards only the heads that read it), so
an MLA chunk's key binds the model, revision, dtype and pipeline stage but not the TP rank
(``key_ranks``): every rank's engine makes the same keys. Where every tier is one other
processes see (``shm``, ``lmdb``, ``fs``, ``s3``, ``mooncake``, a plugin marked ``persistent``),
only TP rank 0 saves (``saves_on_rank``): one copy in the bytes and one in the copies, where
a per-rank cache would keep TP of each. Rank 0 also answers every lookup, from those shared tiers,
so a chunk it counts is one every rank can read: what a rank loads is never missing because
another rank's save has not landed (only an eviction between the lookup and the load can take
it, and that load is a miss vLLM recomputes). A ``cpu`` or ``gpu`` tier is the process's own:
with one in the stack every rank saves its own copy, as for any model. Decode context
parallelism (``decode_context_parallel_size`` > 1) shards the latent across ranks: its keys stay
per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MLA_LAYOUT = "mla"


def latent_width(vllm_config: Any) -> int | None:
    """The width of one token's latent (``kv_lora_rank`` + ``qk_rope_head_dim``) where vLLM runs
    the model with MLA, else None."""
    model = vllm_config.model_config
    if not getattr(model, "use_mla", False):
        return None
    return int(model.get_head_size())


def chunk_head_size(latent: int) -> int:
    """The head size of an MLA chunk: half the latent (see the module docstring)."""
    if latent % 2:
        raise ValueError(f"an MLA latent of {latent} values cannot be cut in two halves; tierkv stores even widths")
    return latent // 2


def split_latent(layer: torch.Tensor, heads: int, latent: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of each token's latent in one layer's MLA cache, as views
    ``[num_blocks, block_size, 1, latent / 2]`` (the ``mla`` layout: ``layer`` is
    ``[num_blocks, block_size, latent]`` or ``[num_blocks, 1, block_size, latent]``, each token's
    latent contiguous)."""
    if heads != 1:
        raise ValueError(f"an MLA cache has one latent per token, not {heads} KV heads")
    half = chunk_head_size(latent)
    rows = layer.squeeze(1) if layer.dim() == 4 and layer.shape[1] == 1 else layer
    if rows.dim() != 3 or rows.shape[1] != block_size or rows.shape[2] != latent or rows.stride(-1) != 1:
        raise ValueError(f"KV cache layout 'mla' expects a layer of [num_blocks, {block_size} tokens, {latent}] or "
                         f"[num_blocks, 1, {block_size} tokens, {latent}] with each latent contiguous, got shape "
                         f"{tuple(layer.shape)}, strides {layer.stride()}")
    tokens = rows.unsqueeze(2)  # [blocks, block, 1, latent]
    return tokens[..., :half], tokens[..., half:]


def block_size_of(layer: torch.Tensor, latent: int) -> int:
    """The block size an MLA layer's tensor is cut in (its token dimension, before the latent)."""
    if layer.dim() not in (3, 4) or layer.shape[-1] != latent:
        raise ValueError(f"an MLA cache layer of shape {tuple(layer.shape)}: expected [num_blocks, block_size, "
                         f"{latent}] or [num_blocks, 1, block_size, {latent}]")
    return int(layer.shape[-2])


def write_latent(impl: Any, layer: torch.Tensor, first: torch.Tensor, second: torch.Tensor, slots: torch.Tensor,
                 k_scale: torch.Tensor | None = None) -> None:
    """vLLM's own MLA cache write (``impl.do_kv_cache_update``, the call its forward pass makes)
    of latents given as their two halves (``[tokens, 1, latent / 2]`` each): for the layout check."""
    latent = torch.cat([first, second], dim=-1).reshape(first.shape[0], -1)
    rank = int(getattr(impl, "kv_lora_rank", latent.shape[-1] - int(getattr(impl, "qk_rope_head_dim", 64))))
    scale = k_scale if k_scale is not None else torch.ones((), dtype=torch.float32, device=layer.device)
    impl.do_kv_cache_update(latent[:, :rank].contiguous(), latent[:, rank:].unsqueeze(1).contiguous(),
                            bound_view(layer), slots, "auto", scale)


def bound_view(layer: torch.Tensor) -> torch.Tensor:
    """The view of a registered MLA cache layer that vLLM's MLA layer binds and hands its write op
    (``bind_kv_cache``): ``[num_blocks, 1, block_size, latent]`` squeezed to ``[num_blocks,
    block_size, latent]``, which is all ``AMX_MLA``'s op takes; a 3D layer as it is."""
    return layer.squeeze(1) if layer.dim() == 4 and layer.shape[1] == 1 else layer


def key_ranks(parallel_config: Any, worker_id: int, world_size: int) -> tuple[int, int, bool]:
    """``(worker_id, world_size, shared)`` for an MLA chunk's key: the pipeline stage and their
    count, not the tensor-parallel rank (the same latent on every TP rank: ``shared``), unless
    decode context parallelism shards the latent (then the worker's own, as given, not shared)."""
    if int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1) > 1:
        return worker_id, world_size, False
    tp = max(1, int(getattr(parallel_config, "tensor_parallel_size", 1) or 1))
    return worker_id // tp, max(1, world_size // tp), True


def saves_on_rank(tp_rank: int, tiers: Sequence[Any], shared: bool) -> bool:
    """Whether this TP rank saves an MLA model's chunks: rank 0 always; another rank where its
    keys are its own (not ``shared``) or a tier is the process's own (``cpu``, ``gpu``: another
    rank cannot read it), so that every rank's loads find what the lookups counted."""
    if not shared or tp_rank == 0:
        return True
    return not all(getattr(tier, "persistent", False) for tier in tiers)
