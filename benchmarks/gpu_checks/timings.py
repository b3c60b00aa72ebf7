"""The timings part: issue 36's three ratios on the device (CUDA events, warmup, median).

tierkv's paged gather / scatter against a device-to-device copy of the same bytes, both paged
connectors (GPU cache <-> host tier) against raw pinned copies, and a prefill-sized matmul
alone against the same matmul while a store copies into the gpu tier. A missed target is
reported; a path that is not bit-exact fails the part.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .context import Context, MiB, PartFailed

if TYPE_CHECKING:
    import torch

    from tierkv import Engine


@dataclass(frozen=True)
class TimingSizes:
    """Shapes of the timings: a 32-layer, 8-KV-head, 128-dim bfloat16 prompt of 4,096 tokens."""

    layers: int = 32
    heads: int = 8
    head_size: int = 128
    tokens: int = 4096
    block_size: int = 16
    chunk_tokens: int = 256
    overlap_tokens: int = 8192  # the store copied beside the matmuls (1 GiB: longer than them)
    matmul: tuple[int, int, int] = (8192, 4096, 4096)
    matmuls: int = 20
    reps: int = 7
    warmup: int = 2

    @property
    def prompt_bytes(self) -> int:
        return self.layers * 2 * self.tokens * self.heads * self.head_size * 2


QUICK_TIMINGS = dataclasses.replace(TimingSizes(), reps=3, warmup=1)


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work (nothing to wait for elsewhere)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_once(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call of ``fn``: CUDA events on the current stream on a GPU (a call that
    blocks until its copies are done is timed to its return), perf_counter elsewhere."""
    import torch

    if not device.startswith("cuda"):
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def timed(fn: Callable[[], object], device: str, reps: int, warmup: int,
          setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call of ``fn`` over ``reps`` calls after ``warmup`` (see ``time_once``);
    ``setup`` runs before each call, untimed."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    seconds = []
    for _ in range(reps):
        if setup:
            setup()
        synchronize(device)
        seconds.append(time_once(fn, device))
    return seconds


def ratio(name: str, baseline_s: float, measured_s: float, target: float, higher_is_better: bool = True
          ) -> dict[str, Any]:
    """A ratio of the project's path to the raw one, its target and whether it was met."""
    value = baseline_s / measured_s if measured_s > 0 else 0.0
    return {"name": name, "value": round(value, 3), "target": f">= {target}", "met": value >= target,
            "baseline_ms": round(baseline_s * 1e3, 3), "measured_ms": round(measured_s * 1e3, 3)}


def paged_cache(sizes: TimingSizes, device: str, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A paged bf16 cache, per layer (K, V) of ``[blocks, block_size, heads, head_size]``."""
    import torch

    shape = (blocks, sizes.block_size, sizes.heads, sizes.head_size)
    return [(torch.randn(shape, device=device).to(torch.bfloat16), torch.randn(shape, device=device).to(torch.bfloat16))
            for _ in range(sizes.layers)]


def block_slots(sizes: TimingSizes, blocks: int, seed: int, device: str) -> torch.Tensor:
    """A serving engine's slot mapping: whole blocks in shuffled order, tokens in order within one."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(blocks, generator=generator)[: -(-sizes.tokens // sizes.block_size)]
    slots = (chosen[:, None] * sizes.block_size + torch.arange(sizes.block_size)).reshape(-1)[: sizes.tokens]
    return slots.to(device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads and signed zeros included)."""
    import torch

    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def time_gather_scatter(sizes: TimingSizes, device: str) -> dict[str, Any]:
    """tierkv.ops.paged_gather / paged_scatter of one prompt vs a device-to-device copy of its bytes."""
    import torch

    from tierkv import ops

    blocks = 2 * sizes.tokens // sizes.block_size
    cache = paged_cache(sizes, device, blocks)
    slots = block_slots(sizes, blocks, 1, device)
    chunk = torch.empty((sizes.layers, 2, sizes.tokens, sizes.heads, sizes.head_size), dtype=torch.bfloat16,
                        device=device)
    ops.paged_gather(cache, slots, out=chunk)
    exact = same_bytes(chunk, ops.paged_gather_reference(cache, slots))
    source, target = torch.empty_like(chunk), torch.empty_like(chunk)
    copy_s = statistics.median(timed(lambda: target.copy_(source), device, sizes.reps, sizes.warmup))
    gather_s = statistics.median(timed(lambda: ops.paged_gather(cache, slots, out=chunk), device, sizes.reps,
                                       sizes.warmup))
    scatter_s = statistics.median(timed(lambda: ops.paged_scatter(chunk, cache, slots), device, sizes.reps,
                                        sizes.warmup))
    return {"bytes": chunk.numel() * 2, "gather_exact": exact, "ratios": [
        ratio("paged_gather vs device copy", copy_s, gather_s, 0.8),
        ratio("paged_scatter vs device copy", copy_s, scatter_s, 0.8)]}


def host_tier_engine(sizes: TimingSizes) -> Engine:
    """An engine whose only tier is host memory (pinned when CUDA is present) for one prompt."""
    from tierkv import Engine

    capacity = sizes.prompt_bytes + sizes.prompt_bytes // 2
    return Engine({"model": "gpu-check-connectors", "chunk_size": sizes.chunk_tokens, "kv_format": "vllm",
                   "tiers": [{"name": "host", "backend": "cpu", "capacity": f"{capacity}B"}]})


def raw_copies(sizes: TimingSizes, device: str) -> tuple[float, float]:
    """Median seconds of a raw device -> pinned host copy and back (``copy_(non_blocking=True)``)."""
    import torch

    pinned = device.startswith("cuda")
    host = torch.empty(sizes.prompt_bytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(sizes.prompt_bytes, dtype=torch.uint8, device=device)
    d2h = statistics.median(timed(lambda: host.copy_(dev, non_blocking=pinned), device, sizes.reps, sizes.warmup))
    h2d = statistics.median(timed(lambda: dev.copy_(host, non_blocking=pinned), device, sizes.reps, sizes.warmup))
    return d2h, h2d


def time_connector(engine: Engine, connector: Any, sizes: TimingSizes, device: str) -> dict[str, Any]:
    """Store a prompt from a paged cache through ``connector`` into the host tier, and retrieve it
    into another cache with another slot mapping: median seconds, and whether it came back exact."""
    import torch

    from tierkv import ops
    from tierkv.connectors import retrieve_paged, store_paged

    blocks = 2 * sizes.tokens // sizes.block_size
    source, target = paged_cache(sizes, device, blocks), paged_cache(sizes, device, blocks)
    slots, target_slots = block_slots(sizes, blocks, 2, device), block_slots(sizes, blocks, 3, device)
    counter = itertools.count()
    current: list[torch.Tensor] = []
    chunks = sizes.tokens // sizes.chunk_tokens

    def next_prompt() -> None:
        if current:
            engine.batched_delete(engine.keys_for(current.pop()))
        current.append(torch.arange(sizes.tokens, dtype=torch.int64) + 10_000_000 * (next(counter) + 1))

    def store() -> None:
        written = store_paged(engine, connector, current[0], kvcaches=source, slot_mapping=slots)
        if written != chunks:
            raise PartFailed(f"{type(connector).__name__} stored {written} chunks, expected {chunks}")

    def retrieve() -> None:
        if not bool(retrieve_paged(engine, connector, current[0], kvcaches=target, slot_mapping=target_slots).all()):
            raise PartFailed(f"{type(connector).__name__}: the stored prompt did not come back whole")

    store_s = statistics.median(timed(store, device, sizes.reps, sizes.warmup, setup=next_prompt))
    retrieve_s = statistics.median(timed(retrieve, device, sizes.reps, sizes.warmup))
    exact = same_bytes(ops.paged_gather_reference(target, target_slots), ops.paged_gather_reference(source, slots))
    engine.batched_delete(engine.keys_for(current[0]))
    return {"store_s": store_s, "retrieve_s": retrieve_s, "exact": exact}


def time_connectors(sizes: TimingSizes, device: str) -> dict[str, Any]:
    """Both paged connectors (GPU cache <-> host tier) vs raw pinned copies of the same bytes."""
    from tierkv.connectors import PagedConnector, PagedConnectorV2

    d2h, h2d = raw_copies(sizes, device)
    figures: dict[str, Any] = {"bytes": sizes.prompt_bytes, "raw_d2h_GBps": round(sizes.prompt_bytes / d2h / 1e9, 2),
                               "raw_h2d_GBps": round(sizes.prompt_bytes / h2d / 1e9, 2), "exact": {}, "ratios": []}
    with host_tier_engine(sizes) as engine:
        figures["host_tier_pinned"] = engine.tiers[0].stats()["pinned"]
        for connector_class in (PagedConnector, PagedConnectorV2):
            name = connector_class.__name__
            measured = time_connector(engine, connector_class(sizes.layers, sizes.heads, sizes.head_size), sizes,
                                      device)
            figures["exact"][name] = measured["exact"]
            figures["ratios"] += [ratio(f"{name} store (GPU cache -> host tier) vs raw pinned copy", d2h,
                                        measured["store_s"], 0.9),
                                  ratio(f"{name} retrieve (host tier -> GPU cache) vs raw pinned copy", h2d,
                                        measured["retrieve_s"], 0.9)]
    return figures


def store_stream(engine: Engine) -> Any:
    """The gpu tier's copy stream (private: the only way to see whether a store's copies use it)."""
    tier = next(t for t in engine.tiers if t.name == "gpu")
    return getattr(tier, "_stream", None)


def matmuls_during(work: Callable[[], object], matmuls: Callable[[], None], stream: Any, device: str
                   ) -> tuple[list[float], bool]:
    """Seconds of each batch of matmuls that ran entirely while ``work`` (a store) ran on another
    thread, and whether tierkv's copy stream was ever seen busy meanwhile."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    synchronize(device)
    thread = threading.Thread(target=run, name="gpu-check-store")
    batches: list[float] = []
    stream_busy = False
    thread.start()
    while thread.is_alive():
        stream_busy = stream_busy or (stream is not None and not stream.query())
        seconds = time_once(matmuls, device)
        if thread.is_alive():
            batches.append(seconds)
    thread.join()
    if errors:
        raise PartFailed(f"the store beside the matmuls failed: {errors[0]!r}") from errors[0]
    return batches, stream_busy


def overlap_ratio(name: str, alone: float, batches: list[float], stream_busy: bool) -> dict[str, Any]:
    """The matmuls' slowdown beside a store, its target (<= 10%) and whether it was met."""
    entry: dict[str, Any] = {"name": name, "target": "<= 0.10", "batches": len(batches),
                             "copy_on_tierkv_stream": stream_busy, "baseline_ms": round(alone * 1e3, 3)}
    if not batches:
        return {**entry, "value": None, "met": False, "note": "no batch of matmuls ran while the store copied"}
    beside = statistics.median(batches)
    slowdown = beside / alone - 1
    return {**entry, "value": round(slowdown, 4), "met": slowdown <= 0.10, "measured_ms": round(beside * 1e3, 3)}


def time_matmul_overlap(sizes: TimingSizes, device: str = "cuda") -> dict[str, Any]:
    """A prefill-sized bf16 matmul (batches of ``matmuls`` on the current stream) alone vs while a
    store into the gpu tier copies: ``Engine.batched_put`` of pinned chunks (the tier's own copy,
    on its copy stream) and ``Engine.store`` of a pinned KV blob (copied in place into the tier's
    slabs); each says whether tierkv's copy stream was seen busy."""
    import torch

    from tierkv import Engine

    m, k, n = sizes.matmul
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    pinned = device.startswith("cuda")

    def matmuls() -> None:
        for _ in range(sizes.matmuls):
            torch.matmul(a, b, out=c)

    shape = (sizes.layers, 2, sizes.overlap_tokens, sizes.heads, sizes.head_size)
    blob = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pinned)
    chunk_shape = (sizes.layers, 2, sizes.chunk_tokens, sizes.heads, sizes.head_size)
    chunks = [torch.empty(chunk_shape, dtype=torch.bfloat16, pin_memory=pinned)
              for _ in range(sizes.overlap_tokens // sizes.chunk_tokens)]
    capacity = blob.numel() * 2 + 64 * MiB
    tier_device = "cuda:0" if pinned else "cpu"
    config = {"model": "gpu-check-overlap", "chunk_size": sizes.chunk_tokens, "kv_format": "vllm",
              "tiers": [{"name": "gpu", "backend": "gpu", "device": tier_device, "capacity": f"{capacity}B"}]}
    alone = statistics.median(timed(matmuls, device, sizes.reps, sizes.warmup))
    counter = itertools.count(1)
    found: dict[str, tuple[list[float], bool]] = {"batched_put": ([], False), "store": ([], False)}
    with Engine(config) as engine:
        stream = store_stream(engine)
        for rep in range(sizes.warmup + sizes.reps):
            for how in found:
                tokens = torch.arange(sizes.overlap_tokens, dtype=torch.int64) + 100_000_000 * next(counter)
                keys = engine.keys_for(tokens)
                work = (functools.partial(engine.batched_put, keys, chunks) if how == "batched_put"
                        else functools.partial(engine.store, tokens, blob))
                batches, busy = matmuls_during(work, matmuls, stream, device)
                engine.batched_delete(keys)
                if rep >= sizes.warmup:
                    found[how] = (found[how][0] + batches, found[how][1] or busy)
    return {"matmul": f"{m}x{k} @ {k}x{n} bf16, batches of {sizes.matmuls}", "store_bytes": blob.numel() * 2,
            "ratios": [overlap_ratio("matmul slowdown beside Engine.batched_put into the gpu tier", alone,
                                     *found["batched_put"]),
                       overlap_ratio("matmul slowdown beside Engine.store into the gpu tier", alone,
                                     *found["store"])]}


def run_timings(sizes: TimingSizes, device: str, overlap: bool) -> dict[str, Any]:
    """All timings; PartFailed when a path is not exact (a missed target is reported, not failed)."""
    figures = {"gather_scatter": time_gather_scatter(sizes, device), "connectors": time_connectors(sizes, device)}
    if overlap:
        figures["matmul_overlap"] = time_matmul_overlap(sizes, device)
    ratios = [r for section in figures.values() for r in section["ratios"]]
    figures["ratios"] = ratios
    inexact = [name for name, ok in {"paged_gather": figures["gather_scatter"]["gather_exact"],
                                     **figures["connectors"]["exact"]}.items() if not ok]
    if inexact:
        raise PartFailed(f"not bit-exact: {inexact}", figures)
    return figures


def part_timings(ctx: Context) -> dict[str, Any]:
    """The three ratios of issue 36 on the device (CUDA events, warmup, median)."""
    from tierkv import ops

    status = ops.extension_status()
    if not status["cuda_kernels"]:
        raise PartFailed(f"the extension's CUDA kernels are not loaded ({status['reason']}; {status['cuda_reason']}):"
                         " the timings would measure the pure-torch reference")
    figures = run_timings(QUICK_TIMINGS if ctx.quick else TimingSizes(), "cuda", overlap=True)
    missed = [r["name"] for r in figures["ratios"] if not r["met"]]
    figures["targets_met"] = f"{len(figures['ratios']) - len(missed)}/{len(figures['ratios'])}"
    figures["missed"] = missed
    return figures
