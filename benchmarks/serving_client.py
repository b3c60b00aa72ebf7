"""The serving benchmark's client: replays a trace (benchmarks/serving_workloads.py) against one or
more ``vllm serve`` processes through the OpenAI-compatible API, streaming, and reads their
Prometheus counters.

Each request is a ``/v1/completions`` call with the prompt as token ids (the benchmark's models
have no tokenizer), ``stream: true`` and ``return_token_ids: true``: time to first token is the
time to the first streamed chunk that carries a token, and the first token's id is kept to
compare configurations. A request is sent when the one it waits for (``after``) has answered and
a slot of the trace's concurrency is free.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from serving_workloads import Request, Trace

COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prompt_tokens_cached": "vllm:prompt_tokens_cached_total",
    "tierkv_tokens_loaded": "vllm:tierkv_tokens_loaded_total",
    "tierkv_load_failures": "vllm:tierkv_load_failures_total",
    # how long tierkv's synchronous loads held vLLM's batch, in all
    "tierkv_load_s": "vllm:tierkv_load_seconds_sum",
    # what any connector loaded (vLLM counts prompt tokens by where they came from)
    "external_loaded": 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}',
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


@dataclass
class Result:
    """What one request saw."""

    name: str
    group: str
    server: int
    prompt_tokens: int
    sent: float  # seconds since the trace started
    ttft: float
    latency: float
    first_token: int | None
    generated: int


async def _one(session: aiohttp.ClientSession, url: str, model: str, request: Request, max_tokens: int,
               started: float, server: int) -> Result:
    body = {"model": model, "prompt": list(request.prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}
    sent = time.perf_counter()
    first_at: float | None = None
    first_token: int | None = None
    generated = 0
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{request.name}: HTTP {reply.status}: {(await reply.text())[:500]}")
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            ids = choice.get("token_ids") or []
            if ids:
                if first_at is None:
                    first_at, first_token = time.perf_counter(), int(ids[0])
                generated += len(ids)
    ended = time.perf_counter()
    return Result(request.name, request.group, server, len(request.prompt), sent - started,
                  (first_at or ended) - sent, ended - sent, first_token, generated)


async def replay(trace: Trace, urls: Sequence[str], model: str, max_tokens: int = 8,
                 route: Callable[[int, Request], int] | None = None,
                 progress: Callable[[], None] | None = None,
                 answered: Callable[[int], None] | None = None) -> list[Result]:
    """Every request of ``trace`` against ``urls`` (``route(index, request)`` picks the server,
    the first by default; ``answered(server)`` is told when its request answered); the results
    in trace order."""
    route = route or (lambda index, request: 0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for request in trace.warmup:
            await _one(session, urls[0], model, request, max_tokens, time.perf_counter(), 0)
        done = [asyncio.Event() for _ in trace.requests]
        slots = asyncio.Semaphore(trace.concurrency or len(trace.requests) or 1)
        results: list[Result | None] = [None] * len(trace.requests)
        started = time.perf_counter()

        async def send(index: int, request: Request) -> None:
            try:
                if request.after >= 0:
                    await done[request.after].wait()
                async with slots:
                    server = route(index, request)
                    try:
                        results[index] = await _one(session, urls[server], model, request, max_tokens, started,
                                                    server)
                    finally:
                        if answered is not None:
                            answered(server)
                if progress is not None:
                    progress()
            finally:
                done[index].set()
        await asyncio.gather(*(send(index, request) for index, request in enumerate(trace.requests)))
    return [result for result in results if result is not None]


def scrape(text: str) -> dict[str, float]:
    """The ``COUNTERS`` in a Prometheus text page, summed over their labels (a counter named
    with a ``{label="value"}`` takes only the samples that carry it)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        for key, name in COUNTERS.items():
            metric, _, label = name.partition("{")
            if match.group(1) == metric and (not label or label.rstrip("}") in (match.group(2) or "")):
                totals[key] += float(match.group(3))
    return totals


async def counters(urls: Sequence[str]) -> dict[str, float]:
    """The counters of every server, added up."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as reply:
                for key, value in scrape(await reply.text()).items():
                    totals[key] += value
    return totals
