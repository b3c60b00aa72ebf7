"""TTFT on the CPU with the demo model: full prefill vs prefix reuse vs CacheBlend.

For each prompt length N (default 4,096 and 16,384 tokens), in one run:

- ``full``: a full prefill of the prompt (no tierkv), the baseline;
- ``prefix_reuse``: the first N - Q tokens were stored by an earlier request; only the
  last Q tokens are computed. ``cached_part_removed`` = (full - reuse) / prefill time of the
  cached part alone (measured too): the share of the cached part's prefill time removed;
- ``blend``: two stored documents of (N - Q) / 2 tokens in the opposite order + Q new
  tokens; prefix reuse finds nothing, CacheBlend at ``recompute_ratio`` reuses them.

Each timing is the median of ``repeats`` runs. Ratios are against ``full`` of the same run.
Usage: ``python benchmarks/blend.py [--tokens 4096 16384] [--repeats 1]``; from another
runner, ``from benchmarks.blend import run_blend; rows = run_blend()``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierkv.demo import build_demo_model, demo_engine, full_prefill_logits, random_tokens, timed


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    results = [timed(fn) for _ in range(repeats)]
    return results[-1][0], statistics.median(t for _, t in results)


def _measure(model: Any, generator: torch.Generator, num_tokens: int, question_tokens: int, recompute_ratio: float,
             repeats: int) -> dict[str, Any]:
    """The three TTFTs and their ratios for one prompt length."""
    from tierkv.integrations import hf

    cached = num_tokens - question_tokens
    with demo_engine(capacity="4GiB") as engine:
        prefix = random_tokens(cached, generator)
        prompt = torch.cat([prefix, random_tokens(question_tokens, generator)])
        hf.prefill_with_reuse(model, engine, prefix)  # the earlier request
        reference, t_full = _median_time(lambda: full_prefill_logits(model, prompt), repeats)
        _, t_cached_part = _median_time(lambda: full_prefill_logits(model, prefix), repeats)
        reuse, t_reuse = _median_time(lambda: hf.prefill_with_reuse(model, engine, prompt, store=False), repeats)
        doc_a, doc_b = random_tokens(cached // 2, generator), random_tokens(cached - cached // 2, generator)
        hf.store_documents(model, engine, [doc_a, doc_b])
        segments = [doc_b, doc_a, random_tokens(question_tokens, generator)]
        rag_prompt = torch.cat(segments)
        rag_reference, t_rag_full = _median_time(lambda: full_prefill_logits(model, rag_prompt), repeats)
        blend, t_blend = _median_time(
            lambda: hf.blended_prefill(model, engine, segments, recompute_ratio), repeats)
    return {
        "prompt_tokens": num_tokens,
        "cached_tokens": reuse.reused_tokens,
        "ttft_full_s": round(t_full, 4),
        "ttft_prefix_reuse_s": round(t_reuse, 4),
        "prefix_reuse_speedup": round(t_full / t_reuse, 2),
        "cached_part_prefill_s": round(t_cached_part, 4),
        "cached_part_removed": round((t_full - t_reuse) / t_cached_part, 3),
        "prefix_reuse_max_logit_err": float((reuse.logits - reference).abs().max()),
        "ttft_rag_full_s": round(t_rag_full, 4),
        "ttft_blend_s": round(t_blend, 4),
        "blend_speedup": round(t_rag_full / t_blend, 2),
        "blend_recompute_ratio": recompute_ratio,
        "blend_recomputed_tokens": blend.recomputed_tokens,
        "blend_max_logit_err": float((blend.logits - rag_reference).abs().max()),
        "threads": torch.get_num_threads(),
    }


def run_blend(tokens: Sequence[int] = (4096, 16384), question_tokens: int = 256, recompute_ratio: float = 0.15,
              repeats: int = 1, seed: int = 0) -> list[dict[str, Any]]:
    """One row per prompt length with the three TTFTs (seconds), their ratios, and logits errors."""
    model = build_demo_model(seed, max_positions=max(tokens) + 1)
    generator = torch.Generator().manual_seed(seed + 1)
    full_prefill_logits(model, random_tokens(64, generator))  # warm-up
    return [_measure(model, generator, n, question_tokens, recompute_ratio, repeats) for n in tokens]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--question-tokens", type=int, default=256)
    parser.add_argument("--recompute-ratio", type=float, default=0.15)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    for row in run_blend(args.tokens, args.question_tokens, args.recompute_ratio, args.repeats):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
