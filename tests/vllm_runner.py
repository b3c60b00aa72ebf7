"""Run prompts, one after another, through a real vLLM (CPU build), with or without tierkv.

Used by tests/test_vllm_v1.py and benchmarks/vllm_ttft.py: each vLLM runs in a process of its
own (vLLM keeps process-wide state). Reads a JSON spec, prints one ``TIERKV-RESULT`` line:
per prompt, the greedy output token ids, the wall time of its generate call, and the
connector's stats file as it stood after the call.

    {"model": DIR, "prompts": [[ids], ...], "max_tokens": 8,
     "tierkv": null | kv_connector_extra_config, "role": "kv_both", "max_model_len": 4096}
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str) -> int:
    with open(spec_path) as handle:
        spec = json.load(handle)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    extra = spec.get("tierkv")
    stats_file = (extra or {}).get("stats_file")
    if extra is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm_v1",
            kv_role=spec.get("role", "kv_both"), kv_connector_extra_config=extra)
    max_len = int(spec.get("max_model_len", 4096))
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
              enable_prefix_caching=False, max_model_len=max_len, max_num_batched_tokens=max_len,
              disable_log_stats=True, **kwargs)
    params = SamplingParams(max_tokens=int(spec.get("max_tokens", 8)), temperature=0.0)
    results = []
    for prompt in spec["prompts"]:
        started = time.perf_counter()
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        stats = None
        if stats_file and os.path.exists(stats_file):
            with open(stats_file) as handle:
                stats = json.load(handle)
        results.append({"tokens": list(output.outputs[0].token_ids), "seconds": seconds, "stats": stats})
    del llm
    print("TIERKV-RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
