"""Tiny random-weight hybrid models that vLLM's CPU build runs with its hybrid KV cache manager:
one per family tierkv caches (sliding window + full attention, Gated DeltaNet + full attention,
Mamba2 + attention), saved with ``save_pretrained`` so vLLM loads them from a directory with no
download.

Their weights are drawn with a wide spread (``initializer_range`` 0.15 by default): with
transformers' 0.02 a blanked Mamba state moves the first token's logprobs by under 0.01, and a
wrong load would pass for a right one. Every model has a vocabulary of 1,024, a hidden size of
256, 4 layers and 4 heads of 64 (2 KV heads), a sliding window of 128 where it has one, and is
saved in bfloat16.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAMILIES = ("gemma3", "gpt_oss", "qwen3_next", "nemotron_h")
"""The hybrid families, by the name tests and benchmarks use."""

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
"""The MLA families (one latent KV cache group): DeepSeek V2 and V3 attention with the only
latent vLLM's CPU MLA kernels take (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64), 2 dense layers
(no experts: a mixture of experts makes the cached pages depend on the batch that computed
them, which no cache can reproduce bit for bit), 4 heads; V3 adds its query LoRA."""

_COMMON: dict[str, Any] = {"vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
                           "intermediate_size": 512, "tie_word_embeddings": False}


def _gemma3() -> tuple[Any, Any]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**_COMMON, sliding_window=128, query_pre_attn_scalar=64,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"])
    return config, Gemma3ForCausalLM


def _gpt_oss() -> tuple[Any, Any]:
    from transformers import GptOssConfig, GptOssForCausalLM

    common = {key: value for key, value in _COMMON.items() if key != "intermediate_size"}
    config = GptOssConfig(**common, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2)
    return config, GptOssForCausalLM


def _qwen3_next() -> tuple[Any, Any]:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**_COMMON, layer_types=["linear_attention"] * 3 + ["full_attention"],
                             linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
                             linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                             decoder_sparse_step=1)
    return config, Qwen3NextForCausalLM


def _nemotron_h() -> tuple[Any, Any]:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    common = {key: value for key, value in _COMMON.items() if key != "num_hidden_layers"}
    config = NemotronHConfig(**common, hybrid_override_pattern="M-M*", mamba_num_heads=8, mamba_head_dim=64,
                             ssm_state_size=16, conv_kernel=4, chunk_size=64, n_groups=1, mamba_hidden_act="silu")
    return config, NemotronHForCausalLM


_MLA: dict[str, Any] = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512,
                        "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "first_k_dense_replace": 2,
                        "moe_intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "max_position_embeddings": 4096,
                        "tie_word_embeddings": False}


def _deepseek_v2() -> tuple[Any, Any]:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    return DeepseekV2Config(**_MLA, q_lora_rank=None, topk_method="greedy"), DeepseekV2ForCausalLM


def _deepseek_v3() -> tuple[Any, Any]:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3Config(**_MLA, q_lora_rank=128), DeepseekV3ForCausalLM


_MAKERS: dict[str, Callable[[], tuple[Any, Any]]] = {"gemma3": _gemma3, "gpt_oss": _gpt_oss,
                                                     "qwen3_next": _qwen3_next, "nemotron_h": _nemotron_h,
                                                     "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3}


def save_hybrid_model(family: str, path: str | os.PathLike[str], seed: int = 0,
                      initializer_range: float = 0.15) -> Path:
    """A tiny random-weight model of ``family`` (one of ``FAMILIES`` or ``MLA_FAMILIES``) saved
    under ``path`` in bfloat16, with its weights drawn at ``initializer_range``."""
    import torch

    if family not in _MAKERS:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join((*FAMILIES, *MLA_FAMILIES))}")
    config, model_class = _MAKERS[family]()
    config.initializer_range = initializer_range
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_class(config)
    finally:
        torch.random.set_rng_state(state)
    model.to(torch.bfloat16).save_pretrained(path)
    _save_tokenizer_free_files(Path(path))
    return Path(path)


def _save_tokenizer_free_files(path: Path) -> None:
    """vLLM runs these with ``skip_tokenizer_init``: prompts are token ids. Nothing else to write."""
    del path
