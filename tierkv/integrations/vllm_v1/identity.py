"""What a vLLM request's KV depends on besides its token ids, and the engine's identity.

The request (``request_identity``): its LoRA adapter (a digest of the adapter's files,
never vLLM's per-process integer id), its ``cache_salt``, and its multimodal inputs (each
``mm_features`` item's content hash at its placeholder tokens). A request given as prompt
embeddings, or with an adapter whose files tierkv cannot read, is *unidentified*: the
connector neither loads nor stores it. A user's hook (``identity_hook`` in the extra
config) may add parts or refuse a request.

The engine (``engine_identity``): the model's revision (the tierkv config's
``model_revision``, else a digest of the model directory, else the name and vLLM's
``revision`` with a warning), the KV cache dtype, the model dtype and quantization, and the
KV geometry.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from tierkv.chunks.identity import MediaSpan, RequestIdentity
from tierkv.chunks.revisions import adapter_identity, directory_revision
from tierkv.errors import ConfigError

logger = logging.getLogger(__name__)

IdentityHook = Callable[[Any, RequestIdentity], "RequestIdentity | None"]
"""``hook(vllm_request, identity) -> identity or None``: the identity tierkv keys the request
with (e.g. ``dataclasses.replace(identity, extra=(...,))``), or None to leave it uncached."""


def load_hook(spec: str | None) -> IdentityHook | None:
    """The callable named ``"package.module:function"`` (ConfigError naming what was expected)."""
    if spec is None:
        return None
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"kv_connector_extra_config.identity_hook: expected 'package.module:function', got {spec!r}")
    module_name, _, attribute = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"kv_connector_extra_config.identity_hook: cannot load {spec!r}: {exc}") from exc
    if not callable(hook):
        raise ConfigError(f"kv_connector_extra_config.identity_hook: {spec!r} is not callable")
    return hook  # type: ignore[no-any-return]


def _adapter(lora_request: Any) -> str | None:
    """The adapter's identity, or None when its files cannot be read."""
    path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "path", None)
    if path and not os.path.isdir(path):
        path = _hub_snapshot(path, None, "adapter_config.json")  # a hub id vLLM resolves from the hub cache
    if not path or not os.path.isdir(path):
        return None
    try:
        return adapter_identity(path)
    except (OSError, ValueError) as exc:
        logger.warning("tierkv: cannot identify LoRA adapter %r at %s (%s): its requests are not cached",
                       getattr(lora_request, "lora_name", "?"), path, exc)
        return None


def _media(request: Any) -> tuple[MediaSpan, ...] | None:
    spans = []
    for feature in getattr(request, "mm_features", None) or ():
        content = getattr(feature, "mm_hash", None) or getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not content or position is None:
            return None
        spans.append(MediaSpan(str(content), int(position.offset), int(position.length)))
    return tuple(spans)


def request_identity(request: Any, hook: IdentityHook | None = None) -> RequestIdentity | None:
    """The identity of a vLLM ``Request``; None when tierkv cannot tell what its KV depends on."""
    if getattr(request, "prompt_embeds", None) is not None or getattr(request, "prompt_token_ids", None) is None:
        return None
    adapter = None
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        adapter = _adapter(lora)
        if adapter is None:
            return None
    media = _media(request)
    if media is None:
        return None
    salt = getattr(request, "cache_salt", None)
    identity = RequestIdentity(adapter=adapter, salt=salt if salt else None, media=media)
    return hook(request, identity) if hook is not None else identity


def model_revision(model: str, revision: str | None, configured: str | None) -> str:
    """The revision in every key: ``configured`` (the tierkv config's ``model_revision``), else a
    digest of the model directory (its config and weight files' content), else the name and
    vLLM's ``revision`` (a hub model not in a local directory; then a re-trained checkpoint
    under the same name and revision is not told apart: say so once)."""
    if configured:
        return configured
    if os.path.isdir(model):
        return directory_revision(model)
    snapshot = _hub_snapshot(model, revision)
    if snapshot is not None:
        return directory_revision(snapshot)
    logger.warning("tierkv: %r is not a local directory; keys carry its name and revision %r only (set "
                   "model_revision in the tierkv config to bind a checkpoint)", model, revision)
    return f"name:{model}@{revision or 'default'}"


def engine_identity(model: str, model_dtype: str, geometry: tuple[int, int, int] | None, cache_dtype: str = "auto",
                    quantization: str | None = None, revision: str | None = None,
                    configured_revision: str | None = None) -> tuple[str, str | None, tuple[tuple[str, str], ...]]:
    """(model revision, KV cache dtype unless the model's, identity pairs) of a vLLM serving
    ``model``: what every key binds besides the model name and ranks. ``geometry``: (layers,
    KV heads, head size) of this worker. Another process reading what the connector stored
    (e.g. with ``tierkv.Engine`` directly) builds its metadata from the same values."""
    pairs = [("model_dtype", model_dtype.removeprefix("torch.")), ("quantization", quantization or "none")]
    if geometry is not None:
        layers, heads, head_size = geometry
        pairs.append(("geometry", f"{layers}x{heads}x{head_size}"))
    cache_dtype = {"fp8": "fp8_e4m3"}.get(cache_dtype, cache_dtype)  # vLLM's "fp8" is e4m3: one format, one key
    return (model_revision(model, revision, configured_revision), None if cache_dtype == "auto" else cache_dtype,
            tuple(pairs))


def _hub_snapshot(model: str, revision: str | None, marker: str = "config.json") -> str | None:
    """The local Hugging Face hub snapshot directory of ``model`` (holding ``marker``), if cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, marker, revision=revision)
    except Exception:  # no hub client, or a name it rejects
        return None
    return os.path.dirname(found) if isinstance(found, str) else None
