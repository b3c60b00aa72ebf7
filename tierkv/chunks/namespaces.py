"""Key namespaces that keep adapter data apart from the engine's prefix-chained chunks.

The engine's keys name token prefixes. Segments stored for blending, vLLM buffer entries
and named tensors use the same tiers but must never be mistaken for a prefix chunk (or
for each other), so their keys carry the engine's model name with a ``::<namespace>``
suffix. The model name stays in the key, so caches of different models still never mix.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

from tierkv.chunks.keys import CacheKey

_HASH_HEX_CHARS = 32


def in_namespace(key: CacheKey, namespace: str) -> CacheKey:
    """``key`` moved into ``namespace`` (same chunk hash, model name suffixed)."""
    return dataclasses.replace(key, model_name=f"{key.model_name}::{namespace}")


def namespaced_keys(keys: Sequence[CacheKey], namespace: str) -> list[CacheKey]:
    """Every key of ``keys`` moved into ``namespace``."""
    return [in_namespace(key, namespace) for key in keys]


def named_key(template: CacheKey, namespace: str, *parts: bytes | str) -> CacheKey:
    """A deterministic key for a name made of ``parts`` (SHA-256, same in every process).

    ``template`` supplies the format, model, world size and worker id (any key the engine
    made, e.g. ``engine.keys_for([0])[0]``).
    """
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return dataclasses.replace(in_namespace(template, namespace), chunk_hash=digest.hexdigest()[:_HASH_HEX_CHARS])
