"""Hugging Face transformers end to end: cache store/retrieve, prefix reuse, blended prefill.

Needs the ``hf`` extra (``pip install '.[hf]' in tierkv's clone (the distribution is tierkv-engine)``). Works with the engine in either KV
format; a model's ``past_key_values`` (a ``DynamicCache``, batch size 1) are converted to
the engine's layout on the way in and back on the way out.

- ``metadata_for``: the engine's metadata for a model, with its ``kv_shape`` (a fresh
  process plans reads and sizes outputs before it has seen a chunk) and its identity (a
  digest of its weights, peft adapters included, and its KV geometry), so a peft-wrapped
  model never reads the base model's chunks nor a re-trained model the old one's;
- ``store_cache`` / ``retrieve_cache``: a prompt's KV into the engine and back;
- ``prefill_with_reuse``: retrieve the longest cached prefix, run the model only on the
  rest, store the prompt's KV; ``generate_with_reuse`` does the same inside ``generate``;
- ``store_documents`` + ``blended_prefill``: CacheBlend for Llama-family models
  (RoPE, pre-norm decoder layers with ``q/k/v/o_proj``): each document's KV is stored as a
  segment; a prompt made of documents in any order reuses it, recomputing only the
  ``recompute_ratio`` of tokens whose K deviates most (see ``tierkv.blend.executor``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
import xxhash

from tierkv.blend.executor import CacheBlendExecutor
from tierkv.blend.retriever import SegmentBlendRetriever
from tierkv.blend.segments import store_segments
from tierkv.config.loader import EngineConfig, load_config
from tierkv.engine.async_engine import EngineMetadata, KVShape
from tierkv.engine.blocking import Engine
from tierkv.engine.metadata import geometry_part

try:
    from transformers import DynamicCache
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("tierkv.integrations.hf needs transformers: pip install '.[hf]' in tierkv's clone (the distribution is tierkv-engine)") from exc


# -- the engine's metadata for a model ----------------------------------------------------------
def kv_shape_of(model: Any) -> KVShape:
    """``(num_layers, num_kv_heads, head_size, dtype)`` of a transformers model's KV cache."""
    config = getattr(model, "config", None)
    text: Any = getattr(config, "get_text_config", lambda: config)()  # multimodal models keep it apart
    try:
        layers = int(text.num_hidden_layers)
        attention_heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or attention_heads)
        head_size = int(getattr(text, "head_dim", None) or text.hidden_size // attention_heads)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"cannot read the KV shape of {type(model).__name__}: its config needs num_hidden_layers, "
                         f"num_attention_heads and hidden_size or head_dim ({exc})") from exc
    return layers, kv_heads, head_size, model.dtype


def weights_digest(model: Any) -> str:
    """XXH3-128 of every parameter and buffer of ``model`` (names, shapes, dtypes, bytes):
    what tells a model's weights, adapters included, from any other's. One pass over the
    weights (device weights are copied to the host a tensor at a time)."""
    digest = xxhash.xxh3_128()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        data = tensor.detach()
        digest.update(f"{name}:{tuple(data.shape)}:{data.dtype}\0".encode())
        if data.numel():
            flat = data.reshape(-1).contiguous().cpu()
            digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _active_adapters(model: Any) -> str | None:
    """The active peft adapter names of a peft-wrapped model (None for a plain model)."""
    active = getattr(model, "active_adapters", None)
    if active is None or not hasattr(model, "peft_config"):
        return None
    names = active() if callable(active) else active
    return ",".join(sorted([names] if isinstance(names, str) else names))


def model_identity(model: Any, revision: str | None = None, kv_shape: KVShape | None = None
                   ) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(revision, identity pairs) of a transformers model, peft-wrapped or not.

    The revision is ``revision`` when given (the config's ``model_revision``), else a digest
    of the weights in memory (``weights_digest``: a peft adapter's weights are
    parameters of the wrapped model, so base and adapter never share a key). The pairs bind
    the KV geometry and dtype (``kv_shape``, read from the model when not given) and the
    active adapters."""
    if revision is None:
        revision = "weights:" + weights_digest(model)
    pairs = [geometry_part(kv_shape or kv_shape_of(model))]
    adapters = _active_adapters(model)
    if adapters is not None:
        pairs.append(("adapters", adapters))
    return revision, tuple(pairs)


def metadata_for(model: Any, config: EngineConfig | Any, model_name: str | None = None) -> EngineMetadata:
    """The ``tierkv.EngineMetadata`` to build an ``tierkv.Engine`` for ``model`` with:
    the config's keys (``model_name`` overrides its ``model``), the model's ``kv_shape`` (a
    fresh process sizes outputs and plans reads before it has seen a chunk) and its identity
    (``model_identity``; the config's ``model_revision`` skips the pass over the weights,
    and then names the weights *and* any adapter: give each its own)."""
    base = EngineMetadata.from_config(load_config(config))
    kv_shape = kv_shape_of(model)
    revision, identity = model_identity(model, base.model_revision, kv_shape)
    return replace(base, model_name=model_name or base.model_name, kv_shape=kv_shape,
                   model_revision=revision, identity=identity)


def check_engine_for(model: Any, engine: Engine) -> None:
    """ValueError when ``model`` runs peft adapters that ``engine``'s keys do not bind (an
    engine built without ``metadata_for`` would hand a peft model the base model's KV)."""
    adapters = _active_adapters(model)
    if adapters is not None and ("adapters", adapters) not in engine.metadata.identity:
        raise ValueError(f"the model runs peft adapter(s) {adapters!r}, but the engine's keys do not bind them: build "
                         "the engine with tierkv.integrations.hf.metadata_for(model, config) (one engine per adapter)")


# -- DynamicCache <-> engine layout ------------------------------------------------------------
def cache_layers(past_key_values: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) of a ``DynamicCache`` (or legacy tuple), each ``[batch, heads, tokens, head_size]``."""
    if hasattr(past_key_values, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in past_key_values.layers]
    if hasattr(past_key_values, "key_cache"):
        return list(zip(past_key_values.key_cache, past_key_values.value_cache))
    if isinstance(past_key_values, (tuple, list)):
        return [(k, v) for k, v in past_key_values]
    raise ValueError(f"expected a DynamicCache or a tuple of per-layer (K, V), got {type(past_key_values).__name__}")


def make_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` holding per-layer (K, V) ``[batch, heads, tokens, head_size]``."""
    cache = DynamicCache()
    for index, (k, v) in enumerate(layers):
        cache.update(k, v, index)
    return cache


def cache_to_kv(past_key_values: Any, fmt: str, num_tokens: int | None = None) -> tuple[tuple[torch.Tensor, ...], ...]:
    """The first ``num_tokens`` tokens of a batch-1 cache as per-layer (K, V) in engine format ``fmt``."""
    out = []
    for k, v in cache_layers(past_key_values):
        if k.dim() != 4 or k.shape[0] != 1:
            raise ValueError(f"only batch size 1 caches can be stored, got K of shape {tuple(k.shape)}")
        k, v = k[0, :, :num_tokens], v[0, :, :num_tokens]
        out.append((k, v) if fmt == "huggingface" else (k.transpose(0, 1), v.transpose(0, 1)))
    return tuple(out)


def kv_to_cache(kv: Sequence[Sequence[torch.Tensor]], fmt: str, num_tokens: int | None = None) -> DynamicCache:
    """Per-layer (K, V) in engine format ``fmt`` (first ``num_tokens``) as a batch-1 ``DynamicCache``."""
    layers = []
    for k, v in kv:
        if fmt == "vllm":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        layers.append((k[:, :num_tokens].unsqueeze(0).contiguous(), v[:, :num_tokens].unsqueeze(0).contiguous()))
    return make_cache(layers)


def _token_list(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"only batch size 1 is supported, got input_ids of shape {tuple(input_ids.shape)}")
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be [tokens] or [1, tokens], got shape {tuple(input_ids.shape)}")
    return input_ids


def store_cache(engine: Engine, input_ids: torch.Tensor, past_key_values: Any) -> int:
    """Store the KV of the prompt ``input_ids`` (the cache may hold more tokens); returns chunks written."""
    tokens = _token_list(input_ids)
    return engine.store(tokens.cpu(), cache_to_kv(past_key_values, engine.metadata.fmt, tokens.numel()))


def retrieve_cache(engine: Engine, input_ids: torch.Tensor, max_tokens: int | None = None,
                   device: torch.device | str | None = None) -> tuple[DynamicCache | None, int]:
    """The cached KV of the longest cached prefix of ``input_ids`` (at most ``max_tokens``) and its length."""
    tokens = _token_list(input_ids)
    kv, mask = engine.retrieve(tokens.cpu())
    cached = int(mask.sum())
    if max_tokens is not None:
        cached = min(cached, max_tokens)
    if cached == 0:
        return None, 0
    if device is not None:
        kv = tuple((k.to(device), v.to(device)) for k, v in kv)
    return kv_to_cache(kv, engine.metadata.fmt, cached), cached


# -- prefix reuse ----------------------------------------------------------------------------------
@dataclass
class PrefillResult:
    """Logits of the next token after the prompt, the prompt's cache, and how many tokens were reused."""

    logits: torch.Tensor
    past_key_values: Any
    reused_tokens: int
    computed_tokens: int


@torch.inference_mode()
def prefill_with_reuse(model: Any, engine: Engine, input_ids: torch.Tensor, store: bool = True) -> PrefillResult:
    """Prefill ``input_ids`` reusing its cached prefix; the model runs only on the rest.

    At least the last token is always computed (its logits are the output). With ``store``,
    the prompt's KV is stored afterwards (chunks already cached are skipped). The prefill is
    timed and fed to the engine's cost model, so after the first prompts the engine knows
    how fast this model recomputes and loads only the part of a prefix that is faster to
    fetch than to compute.
    """
    tokens = _token_list(input_ids)
    check_engine_for(model, engine)
    device = next(model.parameters()).device
    cache, cached = retrieve_cache(engine, tokens, max_tokens=tokens.numel() - 1, device=device)
    new_tokens = tokens[cached:].to(device)[None]
    started = time.perf_counter()
    out = model(new_tokens, past_key_values=cache if cache is not None else DynamicCache(), use_cache=True)
    engine.observe_recompute(new_tokens.shape[1], cached, time.perf_counter() - started)  # the cost model's recompute speed
    if store:
        store_cache(engine, tokens, out.past_key_values)
    return PrefillResult(out.logits[0, -1], out.past_key_values, cached, tokens.numel() - cached)


@torch.inference_mode()
def generate_with_reuse(model: Any, engine: Engine, input_ids: torch.Tensor, store: bool = True,
                        **generate_kwargs: Any) -> torch.Tensor:
    """``model.generate`` for one prompt, starting from its cached prefix; stores the prompt's KV."""
    tokens = _token_list(input_ids)
    check_engine_for(model, engine)
    device = next(model.parameters()).device
    cache, _cached = retrieve_cache(engine, tokens, max_tokens=tokens.numel() - 1, device=device)
    output = model.generate(tokens[None].to(device), past_key_values=cache, use_cache=True,
                            return_dict_in_generate=True, **generate_kwargs)
    if store and output.past_key_values is not None:
        store_cache(engine, tokens, output.past_key_values)
    return output.sequences


# -- CacheBlend for Llama-family models ------------------------------------------------------------
def _decoder(model: Any) -> Any:
    decoder = getattr(model, "model", model)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            raise ValueError(f"blended prefill needs a Llama-family model (decoder with {name!r}); "
                             f"got {type(model).__name__}")
    return decoder


def rope_cos_sin_cache(model: Any, max_position: int) -> torch.Tensor:
    """The model's RoPE table in vLLM's ``[max_position, rot_dim]`` = ``[cos | sin]`` layout (float32).

    Taken from the model's own rotary embedding, so RoPE scaling (llama3, linear, …) is honoured.
    """
    rotary = _decoder(model).rotary_emb
    device = next(model.parameters()).device
    positions = torch.arange(max_position, device=device)[None]
    cos, sin = rotary(torch.empty(1, dtype=torch.float32, device=device), positions)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    half = cos.shape[-1] // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1).float() / scale


def document_kv(model: Any, tokens: torch.Tensor) -> DynamicCache:
    """Prefill one document on its own (positions from 0) and return its cache."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(tokens[None].to(device), past_key_values=DynamicCache(), use_cache=True).past_key_values


def store_documents(model: Any, engine: Engine, documents: Sequence[torch.Tensor]) -> int:
    """Prefill each document alone and store its KV as a blend segment; returns segments written."""
    check_engine_for(model, engine)
    fmt = engine.metadata.fmt
    kvs = [tuple((k.cpu(), v.cpu()) for k, v in cache_to_kv(document_kv(model, doc), fmt)) for doc in documents]
    return store_segments(engine, [doc.cpu() for doc in documents], kvs)


@dataclass
class BlendedPrefill:
    """Logits of the next token, the blended cache (all tokens), and how many tokens were recomputed."""

    logits: torch.Tensor
    past_key_values: DynamicCache
    recomputed_tokens: int
    reused_tokens: int


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _attend(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
            k_positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of short Q over long K/V by position; token-first in and out."""
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    if q.shape[0] == k.shape[0]:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=attn.scaling, enable_gqa=True)
    else:
        mask = k_positions[None, :] <= q_positions[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


@torch.inference_mode()
def blended_prefill(model: Any, engine: Engine, segments: Sequence[torch.Tensor], recompute_ratio: float = 0.15,
                    check_layer: int = 1) -> BlendedPrefill:
    """Prefill the prompt ``concat(segments)`` reusing every segment's stored KV (CacheBlend).

    Segments with no stored KV (typically the question at the end) are computed in full;
    cached ones are re-rotated to their new positions and only their ``recompute_ratio`` most
    deviating tokens are recomputed from ``check_layer`` on. Returns the next-token logits and
    a ``DynamicCache`` of the whole prompt that ``generate`` can continue from.
    """
    decoder = _decoder(model)
    check_engine_for(model, engine)
    if not segments:
        raise ValueError("blended_prefill needs at least one segment")
    device = next(model.parameters()).device
    prompt = torch.cat([_token_list(s) for s in segments]).to(device)
    num_tokens = prompt.numel()
    window = getattr(model.config, "sliding_window", None)
    if window is not None and num_tokens > window:
        raise ValueError(f"blended prefill does not implement sliding-window attention ({num_tokens} tokens > "
                         f"window {window})")
    starts = torch.tensor([s.numel() for s in segments]).cumsum(0)[:-1].tolist()
    task = SegmentBlendRetriever(engine, device=device).new_request([prompt.cpu()], [starts])
    positions = torch.arange(num_tokens, device=device)
    executor = CacheBlendExecutor(rope_cos_sin_cache(model, num_tokens + 1).to(device), recompute_ratio, check_layer)
    query_start_loc = torch.tensor([0, num_tokens], device=device)
    hidden = decoder.embed_tokens(prompt[None])[0]
    q_positions = positions
    layers_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer_id, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(x.shape[0], -1, attn.head_dim)
        k = attn.k_proj(x).view(x.shape[0], -1, attn.head_dim)
        v = attn.v_proj(x).view(x.shape[0], -1, attn.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = decoder.rotary_emb(x[None], q_positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        if cos.shape[-1] != attn.head_dim:
            raise ValueError(f"blended prefill needs full-dimension RoPE, got rot_dim {cos.shape[-1]} for head_dim "
                             f"{attn.head_dim}")
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        retrieved = task.result(layer_id)
        out = executor.blend(layer_id, retrieved.k, retrieved.v, retrieved.valid_mask, retrieved.original_positions,
                             q, k, v, q_positions, query_start_loc, 0)
        if out.query_start_loc is not None:
            hidden = hidden[out.local_indices]
        q_positions = out.positions
        layers_kv.append((out.k.transpose(0, 1)[None], out.v.transpose(0, 1)[None]))
        hidden = hidden + attn.o_proj(_attend(attn, out.q, out.k, out.v, q_positions, positions))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    logits = model.lm_head(decoder.norm(hidden[-1:]))[0]
    recomputed = executor.num_selected if executor.num_selected is not None else num_tokens
    return BlendedPrefill(logits, make_cache(layers_kv), recomputed, num_tokens - recomputed)
