"""``tierkv demo``: prefix reuse and CacheBlend on a small random-weight Llama, on the CPU.

Two scenarios, each timed against a full prefill of the same prompt in the same run:

1. two requests share a long prefix: the second reuses the first one's KV (prefix reuse);
2. a RAG-style request puts two previously seen documents in a new order: their KV is no
   longer a prefix, so prefix reuse finds nothing; CacheBlend reuses it anyway.

For each, the next-token logits are compared with the full prefill's. The model is built
from a ``LlamaConfig`` with random weights and a fixed seed: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

DEMO_VOCAB = 1024


def build_demo_model(seed: int = 0, num_layers: int = 4, hidden_size: int = 256, num_heads: int = 8,
                     num_kv_heads: int = 2, max_positions: int = 32768) -> Any:
    """A small Llama (GQA, RoPE) with random weights from ``seed``, float32, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=DEMO_VOCAB, hidden_size=hidden_size, intermediate_size=hidden_size * 11 // 4,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def demo_engine(chunk_size: int = 256, capacity: str = "2GiB") -> Any:
    """An engine with one host-memory tier, in the Hugging Face KV layout."""
    from tierkv import Engine

    return Engine({"model": "tierkv-demo-llama", "chunk_size": chunk_size, "kv_format": "huggingface",
                   "tiers": [{"name": "host", "backend": "cpu", "capacity": capacity}]})


def random_tokens(count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` token ids drawn from the demo model's vocabulary."""
    return torch.randint(0, DEMO_VOCAB, (count,), generator=generator)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Result of ``fn()`` and its wall time in seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


@torch.inference_mode()
def full_prefill_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token logits of a full prefill without any cache (the baseline and the reference)."""
    return model(tokens[None]).logits[0, -1]


def _compare(name: str, logits: torch.Tensor, reference: torch.Tensor) -> str:
    diff = (logits - reference).abs().max().item()
    same = bool(logits.argmax() == reference.argmax())
    return f"{name}: max |logits - full prefill| = {diff:.2e}, same next token: {same}"


def run_demo(prefix_tokens: int = 2048, document_tokens: int = 1024, question_tokens: int = 64,
             recompute_ratio: float = 0.15, seed: int = 0) -> list[str]:
    """Run both scenarios; returns the report lines (also printed by the CLI)."""
    from tierkv.integrations import hf

    model = build_demo_model(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    lines = [f"model: random-weight Llama, {len(model.model.layers)} layers, hidden {model.config.hidden_size}, "
             f"{torch.get_num_threads()} CPU threads"]
    full_prefill_logits(model, random_tokens(64, generator))  # warm-up, not timed
    with demo_engine() as engine:
        # 1. two requests sharing a long prefix
        prefix = random_tokens(prefix_tokens, generator)
        first = torch.cat([prefix, random_tokens(question_tokens, generator)])
        second = torch.cat([prefix, random_tokens(question_tokens, generator)])
        hf.prefill_with_reuse(model, engine, first)  # request 1 fills the cache
        reference, t_full = timed(lambda: full_prefill_logits(model, second))
        reuse, t_reuse = timed(lambda: hf.prefill_with_reuse(model, engine, second, store=False))
        lines += [
            f"[shared prefix] {second.numel()} tokens, {reuse.reused_tokens} reused from request 1",
            f"  TTFT without tierkv : {t_full * 1e3:8.1f} ms",
            f"  TTFT prefix reuse   : {t_reuse * 1e3:8.1f} ms  (speed-up {t_full / t_reuse:.1f}x)",
            "  " + _compare("prefix reuse", reuse.logits, reference),
        ]
        # 2. RAG: two documents seen before, now in the opposite order, then a question
        doc_a, doc_b = random_tokens(document_tokens, generator), random_tokens(document_tokens, generator)
        hf.store_documents(model, engine, [doc_a, doc_b])
        question = random_tokens(question_tokens, generator)
        prompt = torch.cat([doc_b, doc_a, question])
        reference, t_full = timed(lambda: full_prefill_logits(model, prompt))
        reuse, t_reuse = timed(lambda: hf.prefill_with_reuse(model, engine, prompt, store=False))
        blend, t_blend = timed(lambda: hf.blended_prefill(model, engine, [doc_b, doc_a, question], recompute_ratio))
        lines += [
            f"[RAG, documents reordered] {prompt.numel()} tokens; prefix reuse finds {reuse.reused_tokens}, "
            f"blending reuses {blend.reused_tokens} and recomputes {blend.recomputed_tokens} "
            f"(ratio {recompute_ratio})",
            f"  TTFT without tierkv : {t_full * 1e3:8.1f} ms",
            f"  TTFT prefix reuse   : {t_reuse * 1e3:8.1f} ms",
            f"  TTFT blending       : {t_blend * 1e3:8.1f} ms  (speed-up {t_full / t_blend:.1f}x)",
            "  " + _compare("blending", blend.logits, reference),
        ]
        zero = hf.blended_prefill(model, engine, [doc_b, doc_a, question], 0.0)
        lines.append("  " + _compare("no recompute (ratio 0)", zero.logits, reference))
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, added to ``parser`` (the ``tierkv demo`` subcommand)."""
    parser.add_argument("--prefix-tokens", type=int, default=2048, help="shared prefix length (scenario 1)")
    parser.add_argument("--document-tokens", type=int, default=1024, help="length of each document (scenario 2)")
    parser.add_argument("--question-tokens", type=int, default=64, help="uncached tokens at the end of each prompt")
    parser.add_argument("--recompute-ratio", type=float, default=0.15, help="CacheBlend recompute ratio")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    """Run both demo scenarios and print what tierkv saved; the exit status."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("tierkv demo needs transformers: pip install '.[hf]' in tierkv's clone (the distribution is tierkv-engine)")
        return 1
    for value, name in ((args.prefix_tokens, "--prefix-tokens"), (args.document_tokens, "--document-tokens"),
                        (args.question_tokens, "--question-tokens")):
        if value < 1:
            print(f"{name} must be >= 1, got {value}")
            return 2
    for line in run_demo(args.prefix_tokens, args.document_tokens, args.question_tokens, args.recompute_ratio,
                         args.seed):
        print(line)
    return 0
