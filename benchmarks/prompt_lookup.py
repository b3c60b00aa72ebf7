"""The prompt benchmark's lookups: one blocking ``Engine.lookup`` per prompt beside the bare hash chain.

Hits, misses, and hits under a request identity (a tenant's salt and a LoRA adapter; an image
in the prompt), each against the SHA-256 chain over the same chunks: the floor of any
content-addressed prefix lookup.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from prompt_workload import CHUNK, DTYPE, tier_config

from tierkv import Engine, MediaSpan, RequestIdentity
from tierkv.chunks.identity import PLAIN

LOOKUP_CALLS = 200
LOOKUP_TARGET_US = 50.0


def _hash_chain(tokens: torch.Tensor) -> list[bytes]:
    """The lookups' floor: the SHA-256 chain over the prompt's 256-token chunks (int32 ids),
    which any content-addressed prefix cache computes, in a bare loop."""
    data = tokens.to(torch.int32).numpy().tobytes()
    step, previous, digests = CHUNK * 4, b"", []
    for start in range(0, len(data), step):
        previous = hashlib.sha256(previous + data[start : start + step]).digest()
        digests.append(previous)
    return digests


def lookup_us(tier: str, root: Path, prompt_tokens: int) -> dict[str, tuple[float, float]]:
    """Median microseconds of one blocking ``Engine.lookup`` of a 4,096-token prompt, each
    prompt asked once (a scheduler sees each request once): ``hit`` = fully cached prompts,
    ``miss`` = new prompts; ``hit, tenant+adapter`` and ``hit, one image`` = the cached
    prompts stored and looked up under a request identity (a salt and a LoRA adapter; a media
    input over tokens 1,024-1,599): what binding the identity adds to a lookup is their
    difference from ``hit``. Beside each, the bare hash chain of the same prompts (a miss
    hashes the first chunk only), timed in turns with the lookups. The KV stored is tiny:
    what a lookup costs does not depend on it."""
    config = tier_config(tier, root / "lookup", 2**30)
    cached = [torch.randint(0, 32_000, (prompt_tokens,)) for _ in range(LOOKUP_CALLS)]
    new = [torch.randint(0, 32_000, (prompt_tokens,)) for _ in range(LOOKUP_CALLS)]
    kv = torch.zeros(1, 2, prompt_tokens, 1, 8, dtype=DTYPE)
    tenant = RequestIdentity(adapter="adapter:" + "ab" * 16, salt="tenant-a")
    image = RequestIdentity(media=(MediaSpan("image:" + "cd" * 16, min(1024, prompt_tokens - 1), 576),))
    kinds = (("hit", cached, PLAIN), ("miss", new, PLAIN), ("hit, tenant+adapter", cached, tenant),
             ("hit, one image", cached, image))
    result = {}
    with Engine(config) as engine:
        for identity in (PLAIN, tenant, image):
            for tokens in cached:
                engine.store(tokens, kv, identity=identity)
        engine.flush()
        for kind, prompts, identity in kinds:
            samples, floor = [], []
            for tokens in prompts:
                start = time.perf_counter()
                engine.lookup(tokens, identity=identity)
                samples.append(time.perf_counter() - start)
                start = time.perf_counter()
                _hash_chain(tokens if kind == "hit" else tokens[:CHUNK])
                floor.append(time.perf_counter() - start)
            result[kind] = (statistics.median(samples) * 1e6, statistics.median(floor) * 1e6)
        if (engine.lookup(cached[0]) != prompt_tokens or engine.lookup(new[0]) != 0
                or engine.lookup(cached[0], identity=tenant) != prompt_tokens
                or engine.lookup(cached[0], identity=image) != prompt_tokens):
            raise RuntimeError("lookup benchmark: the cached prompt must hit and the new one miss")
    return result


def lookup_rows(tier: str, lookups: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    """Rows of ``lookup_us``'s figures, each against its target."""
    return [{"tier": tier, "op": f"lookup {kind}", "pass": "steady", "ours_us": us, "baseline": "sha256 chain",
             "baseline_us": floor, "ratio": floor / us,
             "target": f"<= {LOOKUP_TARGET_US:.0f} us", "meets": us <= LOOKUP_TARGET_US}
            for kind, (us, floor) in lookups.items()]
