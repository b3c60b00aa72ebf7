"""Run prompts through a real vLLM, with or without tierkv, each vLLM in a process of its own.

For tests and benchmarks of the vLLM v1 connector (vLLM keeps process-wide state, so every
configuration gets a fresh process). ``run_vllm`` writes a JSON spec and runs
``python -m tierkv.testing.vllm_runner SPEC``, which prints one ``TIERKV-RESULT`` line: per
prompt, the greedy output token ids, (with ``"logprobs": k``) the top-k log-probabilities of
every generated token, the wall time of its generate call, how many prompt tokens vLLM did not
compute (``cached_tokens``: its own prefix cache's hit and the connector's), and the connector's
stats file as it stood after the call. The spec::

    {"model": DIR, "prompts": [[ids], ...], "max_tokens": 8, "logprobs": null | k,
     "tierkv": null | kv_connector_extra_config, "role": "kv_both", "max_model_len": 4096,
     "loras": {NAME: ADAPTER_DIR, ...}, "page_copy": false, "attention_backend": null,
     "tensor_parallel_size": 1}

``page_copy`` runs vLLM with ``tierkv.testing.page_copy``'s connector instead of tierkv's (the
truth of a hit vLLM's own cache cannot make; a prompt's ``kv_transfer_params`` steer it).

A prompt may also be ``{"ids": [...], "cache_salt": "tenant-a", "lora": NAME, "pause_s": 5}`` (a
tenant's salt, a LoRA adapter of ``loras``, an untimed pause before it; vLLM runs with
``enable_lora`` when ``loras`` is given), with ``"wait_for": [counter, n]`` (before it) or
``"then_wait_for": [counter, n]`` (after it, before its stats are read): an untimed wait until
the stats file shows the counter at ``n`` (a save runs after the prompt's call returns),
or ``{"embeds": [tokens, seed]}``: random prompt embeddings of that many tokens (vLLM runs
with ``enable_prompt_embeds`` when ``"prompt_embeds": true`` is in the spec).
``save_random_lora`` makes an adapter for such a model with peft.

``save_random_llama`` makes a model to serve: a Llama with random weights, saved with
transformers (no download); prompts are token ids, so no tokenizer is needed. With the
default ``initializer_range`` (0.02) a random Llama's greedy output hardly depends on its
context (every prompt yields the same tokens), so comparing outputs proves nothing; tests of
exactness use ``initializer_range=0.15``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierkv.testing.processes import start_group, stop_group

RESET_WITHIN_S = 120.0
"""How long ``reset_prefix_cache`` waits for vLLM to free the blocks of requests already
answered (their saves in flight) before it counts the reset as failed."""


def save_random_llama(path: str | os.PathLike[str], num_layers: int = 2, hidden_size: int = 256, num_heads: int = 4,
                      num_kv_heads: int = 2, seed: int = 0, initializer_range: float | None = None) -> Path:
    """A random-weight Llama (vocabulary 1024, bfloat16) saved under ``path``; weights drawn
    with ``initializer_range`` (transformers' default 0.02 when None)."""
    import torch

    from tierkv.demo import build_demo_model

    model = build_demo_model(seed=seed, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads)
    if initializer_range is not None:  # redraw every weight with the wider spread
        model.config.initializer_range = initializer_range
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            with torch.no_grad():
                model.apply(model._init_weights)
        finally:
            torch.random.set_rng_state(state)
    model.to(torch.bfloat16).save_pretrained(path)
    return Path(path)


def save_random_lora(model_dir: str | os.PathLike[str], path: str | os.PathLike[str], seed: int = 1, rank: int = 8,
                     targets: tuple[str, ...] = ("k_proj", "v_proj"), scale: float = 0.5) -> Path:
    """A LoRA adapter with random A and B on ``targets`` of the model in ``model_dir``, saved
    with peft's ``save_pretrained`` (no download). Its B is drawn too (peft starts it at zero,
    which would leave the K/V unchanged), with entries of about ``scale``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets),
                                                  lora_dropout=0.0, init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    peft_model.save_pretrained(path)
    return Path(path)


def loaded_per_prompt(results: list[dict[str, Any]]) -> list[int]:
    """Tokens the connector loaded during each prompt of a ``run_vllm`` (from its cumulative stats)."""
    before, counts = 0, []
    for result in results:
        now = (result["stats"] or {}).get("tokens_loaded", 0)
        counts.append(now - before)
        before = now
    return counts


def run_vllm(spec: dict[str, Any], workdir: Path, pythonpath: Path | None = None, timeout: float = 600,
             kv_cache_gib: int = 1, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``spec`` in a fresh process (with ``env`` added to the environment); the per-prompt
    results. Raises RuntimeError with the end of vLLM's output when the run fails. vLLM's
    processes are all gone when it returns or raises, however it ends (``finish_vllm``)."""
    return finish_vllm(start_vllm(spec, workdir, pythonpath, kv_cache_gib, env), timeout)


def start_vllm(spec: dict[str, Any], workdir: Path, pythonpath: Path | None = None, kv_cache_gib: int = 1,
               env: dict[str, str] | None = None, command: Sequence[str] | None = None) -> subprocess.Popen[str]:
    """Start ``run_vllm``'s process and return at once (a replica that runs beside another);
    ``finish_vllm`` waits for its results, and stops vLLM's processes. The process leads a
    process group of its own (``tierkv.testing.processes``): vLLM's engine core and worker
    are in it, so a caller that cannot wait for the results stops the whole group with
    ``tierkv.testing.processes.stop_group`` (in a ``finally``). ``command``: what runs
    the spec file instead of ``python -m tierkv.testing.vllm_runner`` (the file's path is
    appended)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file = workdir / "spec.json"
    spec_file.write_text(json.dumps(spec))
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "TOKENIZERS_PARALLELISM": "false",
                   **(env or {})}
    if pythonpath is not None:
        environment["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), environment.get("PYTHONPATH", "")) if p)
    runner = list(command) if command is not None else [sys.executable, "-m", "tierkv.testing.vllm_runner"]
    return start_group([*runner, str(spec_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=environment, cwd=workdir)


def finish_vllm(process: subprocess.Popen[str], timeout: float = 600) -> list[dict[str, Any]]:
    """The per-prompt results of a process ``start_vllm`` started, once it ended. Its whole
    process group is stopped on the way out, whatever happened (a timeout, an interrupt such as
    pytest-timeout's, a failed run): no engine core or worker outlives the call."""
    try:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(process)
            stdout, stderr = process.communicate()
            raise RuntimeError(f"vLLM run did not end within {timeout:.0f} s:\n{stderr[-6000:]}") from None
    finally:
        stop_group(process)
    lines = [line for line in stdout.splitlines() if line.startswith("TIERKV-RESULT ")]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed (exit {process.returncode}):\n{stderr[-6000:]}")
    return list(json.loads(lines[-1].split(" ", 1)[1]))


def main(spec_path: str) -> int:
    """Run the vLLM job described by the JSON spec at ``spec_path`` and write its results; the exit status."""
    with open(spec_path) as handle:
        spec = json.load(handle)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    extra = spec.get("tierkv")
    stats_file = (extra or {}).get("stats_file")
    if extra is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm_v1",
            kv_role=spec.get("role", "kv_both"), kv_connector_extra_config=extra)
    elif spec.get("page_copy"):  # the truth of a hit vLLM's own cache cannot make (tierkv.testing.page_copy)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PageCopyConnector", kv_connector_module_path="tierkv.testing.page_copy", kv_role="kv_both")
    if spec.get("attention_backend"):  # e.g. "CPU_MLA" on a CPU where vLLM would pick AMX_MLA
        kwargs["attention_config"] = {"backend": spec["attention_backend"]}
    if spec.get("tensor_parallel_size"):
        kwargs["tensor_parallel_size"] = int(spec["tensor_parallel_size"])
    max_len = int(spec.get("max_model_len", 4096))
    loras = dict(spec.get("loras") or {})
    if loras:
        kwargs.update(enable_lora=True, max_lora_rank=int(spec.get("max_lora_rank", 8)), max_loras=len(loras))
    if spec.get("prompt_embeds"):
        kwargs["enable_prompt_embeds"] = True
    if spec.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("kv_events"):  # vLLM's KV event publisher (ZMQ) on this endpoint; its replay buffer on "kv_events_replay"
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=spec["kv_events"], topic="kv",
                                                    replay_endpoint=spec.get("kv_events_replay"))
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=spec.get("dtype", "bfloat16"), seed=0,
              enable_prefix_caching=bool(spec.get("prefix_caching", False)), max_model_len=max_len,
              max_num_batched_tokens=int(spec.get("max_num_batched_tokens", max_len)),
              disable_log_stats=not spec.get("metrics"), **kwargs)
    lora_requests = {}
    if loras:
        from vllm.lora.request import LoRARequest

        lora_requests = {name: LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(loras.items())}
    top = spec.get("logprobs")
    params = SamplingParams(max_tokens=int(spec.get("max_tokens", 8)), temperature=0.0,
                            logprobs=int(top) if top else None)
    results = []
    for prompt in spec["prompts"]:
        described = prompt if isinstance(prompt, dict) else {"ids": prompt}
        time.sleep(float(described.get("pause_s", 0)))  # untimed: e.g. let write-through fills drain
        if described.get("wait_for"):  # until the stats file shows a counter reach a value (saves landed)
            wait_for_stat(stats_file, *described["wait_for"])
        started = time.perf_counter()
        if described.get("reset_first"):  # vLLM's reset_prefix_cache, connector included, before this prompt
            described = {**described, "reset": reset_prefix_cache(llm)}
        if "embeds" in described:
            import torch

            count, seed = described["embeds"]
            hidden = llm.llm_engine.model_config.get_hidden_size()
            embeds = torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed)) * 0.15
            request: Any = {"prompt_embeds": embeds.to(torch.bfloat16)}
        else:
            request = {"prompt_token_ids": described["ids"]}
        if described.get("cache_salt"):
            request["cache_salt"] = described["cache_salt"]
        lora = lora_requests[described["lora"]] if described.get("lora") else None
        prompt_params = params
        if described.get("kv_transfer_params"):  # e.g. tierkv's hints: {"tierkv": {"retain_s": 600}}
            prompt_params = params.clone()
            prompt_params.extra_args = {"kv_transfer_params": described["kv_transfer_params"]}
        output = llm.generate([request], prompt_params, use_tqdm=False, lora_request=lora)[0]
        seconds = time.perf_counter() - started
        if described.get("then_wait_for"):  # untimed: a save of this prompt's own lands before its stats
            wait_for_stat(stats_file, *described["then_wait_for"])
        stats = None
        if stats_file and os.path.exists(stats_file):
            with open(stats_file) as handle:
                stats = json.load(handle)
        completion = output.outputs[0]
        logprobs = [{str(token): float(entry.logprob) for token, entry in step.items()}
                    for step in (completion.logprobs or [])]
        results.append({"tokens": list(completion.token_ids), "logprobs": logprobs, "seconds": seconds,
                        "reset": described.get("reset"), "cached_tokens": int(output.num_cached_tokens or 0),
                        "stats": stats, "metrics": _tierkv_metrics(llm) if spec.get("metrics") else None})
    del llm
    print("TIERKV-RESULT " + json.dumps(results), flush=True)
    return 0


def wait_for_stat(stats_file: str | None, name: str, at_least: int, within_s: float = RESET_WITHIN_S) -> None:
    """Wait until worker 0's stats file shows counter ``name`` at ``at_least`` or more (e.g.
    ``requests_saved``: the saves of the prompts before have landed, so the next prompt's
    lookup sees them whatever the machine's load); raises TimeoutError after ``within_s``."""
    if not stats_file:
        raise ValueError("wait_for needs the connector's stats_file")
    deadline = time.perf_counter() + within_s
    while True:
        try:
            with open(stats_file) as handle:
                if int(json.load(handle).get(name, 0)) >= at_least:
                    return
        except (OSError, ValueError):
            pass  # not written yet
        if time.perf_counter() >= deadline:
            raise TimeoutError(f"{name} did not reach {at_least} in {stats_file} within {within_s:.0f} s")
        threading.Event().wait(0.1)  # not time.sleep: tests/vllm_hold.py stands in for this module's time


def reset_prefix_cache(llm: Any, within_s: float = RESET_WITHIN_S) -> bool:
    """``llm.reset_prefix_cache(reset_connector=True)`` once vLLM can reset at all; whether the
    reset succeeded (False: vLLM's blocks stayed in use for ``within_s``, or the connector
    failed).

    vLLM resets its prefix cache only when no block is in use, and a finished request's blocks
    stay in use until the connector's save of them is reported done: a step after the request
    ended at the soonest, later on a busy machine. A reset sent right after ``generate``
    returned can find them in use and fail for vLLM's part alone. So vLLM's own reset is asked
    first, until it succeeds (those blocks are free: nothing is in flight), then the one with
    the connector, whose answer is then the connector's."""
    deadline = time.perf_counter() + within_s
    while not llm.reset_prefix_cache():
        if time.perf_counter() >= deadline:
            return False
        threading.Event().wait(0.2)  # not time.sleep: tests/vllm_hold.py stands in for this module's time
    return bool(llm.reset_prefix_cache(reset_connector=True))


def _tierkv_metrics(llm: Any) -> dict[str, float]:
    """tierkv's series in vLLM's Prometheus registry (what ``vllm serve`` shows on ``/metrics``):
    counters by name, a histogram by its count."""
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:tierkv_"):
            found[metric.name] = float(getattr(metric, "value", getattr(metric, "count", 0)))
        elif metric.name == "vllm:prompt_tokens_cached_by_source":  # vLLM's per-tier hit accounting
            found[f"{metric.name}:{metric.labels.get('source')}"] = float(getattr(metric, "value", 0))
    return found


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
