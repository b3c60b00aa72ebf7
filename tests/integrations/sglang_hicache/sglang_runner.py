"""Runs a real ``sglang.Engine`` on the CPU with HiCache and an L3 backend, in a process of its
own, and reports what it did as JSON (shared by the SGLang tests and ``benchmarks/sglang_ttft.py``).

Usage: ``python sglang_runner.py SPEC.json OUT.json``. The spec names the model folder, the
L3 backend (``none``, ``file``, ``mooncake`` or ``tierkv`` with its extra config), the
prompts (token ids) and the steps: ``{"gen": i}`` generates from prompt ``i`` (greedy),
``{"flush": true}`` empties SGLang's GPU and host caches (``flush_cache()``) after the L3
writes in flight have landed, so the next request's prefix can only come from L3. Each
``gen`` reports its output ids, the top-k log-probabilities of each generated token
(``"logprobs": k`` in the spec, default 5; ``{token id: logprob}`` per step), cached tokens
and wall time.

It must run with the CPU stand-ins of ``tests/sglang_stubs.py`` loaded in every process
(``SGLANG_CPU_TEST_STUBS=1`` and ``tests/integrations/sglang_hicache/site`` on ``PYTHONPATH``): :func:`run_spec` sets that up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SITE = Path(__file__).resolve().parent / "site"
_SETTLE_S = 0.2


def make_model(path: Path, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
               head_dim: int | None = None, vocab: int = 512, seed: int = 0, intermediate: int | None = None) -> Path:
    """A random-weight Llama saved with ``save_pretrained`` (no tokenizer: prompts are token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim or hidden // heads, max_position_embeddings=16384, torch_dtype="bfloat16",
                         # ~0.15, not the default 0.02: at 0.02 a random Llama answers every prompt with the same
                         # tokens, so equal outputs would prove nothing about the KV it was given
                         initializer_range=0.15)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model_path": spec["model"], "device": "cpu", "attention_backend": "torch_native",
        "disable_cuda_graph": True, "skip_tokenizer_init": True, "page_size": spec.get("page_size", 16),
        "enable_hierarchical_cache": True, "hicache_io_backend": "direct",
        "hicache_mem_layout": spec.get("layout", "layer_first"),
        "hicache_storage_prefetch_policy": "wait_complete", "log_level": "error",
        "max_total_tokens": spec.get("max_total_tokens", 32768), "random_seed": 0,
    }
    if spec.get("chunked_prefill_size"):
        kwargs["chunked_prefill_size"] = spec["chunked_prefill_size"]
    backend = spec.get("backend", "none")
    if backend == "tierkv":
        kwargs["hicache_storage_backend"] = "dynamic"
        kwargs["hicache_storage_backend_extra_config"] = json.dumps(spec["extra_config"])
    elif backend in ("file", "mooncake"):
        kwargs["hicache_storage_backend"] = backend
        if spec.get("extra_config"):
            kwargs["hicache_storage_backend_extra_config"] = json.dumps(spec["extra_config"])
    elif backend != "none":
        raise ValueError(f"backend: expected none, file, mooncake or tierkv, got {backend!r}")
    kwargs.update(spec.get("engine_args", {}))
    return kwargs


def _flush(engine: Any) -> bool:
    """flush_cache() once SGLang accepts it (it refuses while requests or writes are pending)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(_SETTLE_S)  # L3 writes of the last request are queued after it returns
        result = engine.flush_cache()
        ok = getattr(result, "success", result)
        if ok:
            time.sleep(_SETTLE_S)
            return True
    return False


def _generate(engine: Any, input_ids: list[int], sampling: dict[str, Any], cache_salt: str | None,
              extra_key: str | None, top: int) -> dict[str, Any]:
    """One greedy generation; ``cache_salt`` (a tenant) and ``extra_key`` (what SGLang sets
    from a request's LoRA adapter) seed SGLang's page hashes. ``Engine.generate`` takes no
    ``extra_key``, so that request goes through the engine's tokenizer manager as
    ``Engine.generate`` itself sends it."""
    logprobs = {"return_logprob": True, "top_logprobs_num": top} if top else {}
    if extra_key is None:
        return dict(engine.generate(input_ids=input_ids, sampling_params=sampling, cache_salt=cache_salt, **logprobs))
    from sglang.srt.managers.io_struct import GenerateReqInput

    request = GenerateReqInput(input_ids=input_ids, sampling_params=sampling, cache_salt=cache_salt,
                               extra_key=extra_key, **logprobs)
    return dict(engine.loop.run_until_complete(engine.tokenizer_manager.generate_request(request, None).__anext__()))


def main(spec_path: str, out_path: str) -> None:
    import sglang

    spec = json.loads(Path(spec_path).read_text())
    prompts: list[list[int]] = spec["prompts"]
    results: list[dict[str, Any]] = []
    engine = sglang.Engine(**engine_kwargs(spec))
    try:
        sampling = {"temperature": 0.0, "max_new_tokens": spec.get("max_new_tokens", 8), "ignore_eos": True}
        for step in spec["steps"]:
            if "flush" in step:
                results.append({"flush": _flush(engine)})
                continue
            started = time.perf_counter()
            out = _generate(engine, prompts[step["gen"]], sampling, step.get("cache_salt"), step.get("extra_key"),
                            int(spec.get("logprobs", 5)))
            seconds = time.perf_counter() - started
            meta = out.get("meta_info", {})
            top = meta.get("output_top_logprobs") or []  # per step: [(logprob, token id, text), ...]
            results.append({"gen": step["gen"], "output_ids": out.get("output_ids"), "seconds": seconds,
                            "logprobs": [{str(entry[1]): float(entry[0]) for entry in row} for row in top],
                            "cached_tokens": meta.get("cached_tokens"),
                            "cached_tokens_details": meta.get("cached_tokens_details"),
                            "prompt_tokens": meta.get("prompt_tokens")})
            if step.get("settle_s"):
                time.sleep(step["settle_s"])
    finally:
        engine.shutdown()
    Path(out_path).write_text(json.dumps({"results": results}))


def run_spec(spec: dict[str, Any], workdir: Path, timeout_s: float = 600) -> list[dict[str, Any]]:
    """Run ``spec`` in a new process (with the CPU stand-ins); its step results. The process
    leads a process group of its own, stopped whole however the call ends (a timeout, a
    failure, pytest-timeout's interrupt): SGLang's scheduler and detokenizer processes are in
    it, and would outlive a kill of the runner alone (:mod:`tierkv.testing.processes`)."""
    from tierkv.testing.processes import start_group, stop_group

    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = workdir / "spec.json", workdir / "out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, "SGLANG_CPU_TEST_STUBS": "1", "SGLANG_USE_CPU_ENGINE": "1",
           "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    log = workdir / "sglang.log"
    with open(log, "w") as handle:
        proc = start_group([sys.executable, __file__, str(spec_path), str(out_path)], env=env, stdout=handle,
                           stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"SGLang run did not end within {timeout_s:.0f} s; log tail:\n"
                               f"{log.read_text()[-4000:]}") from None
        finally:
            stop_group(proc)
    if returncode != 0 or not out_path.exists():
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"SGLang run failed (exit {returncode}); log tail:\n{tail}")
    return json.loads(out_path.read_text())["results"]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
