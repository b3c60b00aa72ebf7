"""vLLM's KV lookup buffer and KV store buffer, kept in tierkv's tiers.

vLLM's disaggregated-prefill connectors move KV between instances through two small
interfaces: a *lookup buffer* (``insert(input_tokens, roi, key, value, hidden)`` and
``drop_select(input_tokens, roi)``, where ``roi`` is a boolean mask over the tokens that
the KV covers) and a *store buffer* (``put(key: str, value)`` / ``get(key)``). The
classes here honour those interfaces with an ``tierkv.Engine`` underneath, so the
transferred KV can live in any configured tier (host memory, LMDB, S3) instead of a
fixed-size in-process buffer. vLLM is not a dependency; when it is installed, the classes
are also registered as virtual subclasses of vLLM's own base classes.

Keys are deterministic (SHA-256 of the region-of-interest tokens, or of the string key),
so a consumer in another process that shares a tier finds what a producer inserted.
Dropping an entry or putting ``None`` deletes the keys from every tier
(``Engine.batched_delete``); an entry inserted without ``hidden`` has no hidden part.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict

import torch

from tierkv.chunks.keys import CacheKey, as_token_array
from tierkv.chunks.namespaces import named_key
from tierkv.engine.blocking import Engine

LOOKUP_NAMESPACE = "vllm-lookup"
STORE_NAMESPACE = "vllm-store"
_LOOKUP_PARTS = ("input_tokens", "roi", "key", "value", "hidden")


class KVCacheBufferBase(ABC):
    """A KV cache buffer (vLLM's ``KVCacheBufferBase``): something that can be closed."""

    @abstractmethod
    def close(self) -> None:
        """Release what the buffer holds on to."""


class KVLookupBufferBase(KVCacheBufferBase):
    """vLLM's lookup-buffer interface: KV keyed by (input tokens, region-of-interest mask)."""

    @abstractmethod
    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               hidden: torch.Tensor | None) -> None:
        """``buffer[input_tokens, roi] = [key, value, hidden]``."""

    @abstractmethod
    def drop_select(self, input_tokens: torch.Tensor | None,
                    roi: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Pop the entry for (input_tokens, roi); with both None, pop any entry."""


class KVStoreBufferBase(KVCacheBufferBase):
    """vLLM's store-buffer interface: tensors under string keys; ``None`` deletes."""

    @abstractmethod
    def put(self, key: str, value: torch.Tensor | None) -> None:
        """Store ``value`` under ``key`` (``None``: delete)."""

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None:
        """The tensor stored under ``key``, or None."""


def _roi_tokens(input_tokens: torch.Tensor, roi: torch.Tensor | None) -> torch.Tensor:
    """The tokens selected by ``roi``, validating both; names what was expected on error."""
    if not isinstance(input_tokens, torch.Tensor) or input_tokens.dim() != 1:
        shape = tuple(input_tokens.shape) if isinstance(input_tokens, torch.Tensor) else type(input_tokens).__name__
        raise ValueError(f"input_tokens must be a 1-D tensor of token ids, got {shape}")
    if roi is None:
        return input_tokens
    if not isinstance(roi, torch.Tensor) or roi.dim() != 1 or roi.numel() != input_tokens.numel():
        shape = tuple(roi.shape) if isinstance(roi, torch.Tensor) else type(roi).__name__
        raise ValueError(f"roi must be a 1-D mask with one entry per input token ({input_tokens.numel()}), got {shape}")
    if roi.dtype != torch.bool:
        if roi.dtype.is_floating_point or not bool(((roi == 0) | (roi == 1)).all()):
            raise ValueError(f"roi must be a boolean (or 0/1 integer) mask, got dtype {roi.dtype}")
        roi = roi.bool()
    return input_tokens[roi.to(input_tokens.device)]


class TierKVLookupBuffer(KVLookupBufferBase):
    """vLLM lookup buffer over an engine.

    An entry is identified by the tokens its ``roi`` selects, so ``drop_select`` with the
    same tokens and mask (or any tokens/mask selecting the same ids) finds it, in this
    process or another one sharing a tier. ``drop_select(None, None)`` pops the oldest entry
    inserted *through this object* (the only entries it can enumerate). Returns
    ``[input_tokens, roi, key, value, hidden]`` as inserted (on the CPU), or five Nones when
    there is no such entry. Thread-safe within a process: an entry is returned once.
    """

    def __init__(self, engine: Engine, *, owns_engine: bool = False) -> None:
        self._engine = engine
        self._owns_engine = owns_engine
        self._template = engine.keys_for([0])[0]
        self._lock = threading.Lock()
        self._inserted: OrderedDict[bytes, None] = OrderedDict()

    def _keys(self, entry_id: bytes) -> list[CacheKey]:
        return [named_key(self._template, LOOKUP_NAMESPACE, entry_id, part) for part in _LOOKUP_PARTS]

    @staticmethod
    def _entry_id(tokens: torch.Tensor) -> bytes:
        return as_token_array(tokens.detach().cpu()).tobytes()

    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               hidden: torch.Tensor | None) -> None:
        selected = _roi_tokens(input_tokens, roi)
        for name, tensor in (("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
        if hidden is not None and not isinstance(hidden, torch.Tensor):
            raise ValueError(f"hidden must be a tensor or None, got {type(hidden).__name__}")
        roi_mask = torch.ones(input_tokens.numel(), dtype=torch.bool) if roi is None else roi.detach().cpu().bool()
        parts = [input_tokens.detach().cpu(), roi_mask, key, value]
        entry_id = self._entry_id(selected)
        keys = self._keys(entry_id)
        with self._lock:
            if hidden is None:
                self._engine.batched_delete(keys[-1:])  # no hidden part: none from an earlier insert either
            else:
                parts.append(hidden)
            self._engine.batched_put(keys[: len(parts)], parts)
            self._inserted[entry_id] = None
            self._inserted.move_to_end(entry_id)

    def drop_select(self, input_tokens: torch.Tensor | None,
                    roi: torch.Tensor | None) -> list[torch.Tensor | None]:
        with self._lock:
            if input_tokens is None:
                if roi is not None:
                    raise ValueError("drop_select: roi given without input_tokens; pass both or neither")
                if not self._inserted:
                    return [None] * len(_LOOKUP_PARTS)
                entry_id = next(iter(self._inserted))
            else:
                entry_id = self._entry_id(_roi_tokens(input_tokens, roi))
            keys = self._keys(entry_id)
            parts = self._engine.batched_get(keys)
            self._inserted.pop(entry_id, None)
            if parts[2] is None or parts[3] is None:
                return [None] * len(_LOOKUP_PARTS)
            self._engine.batched_delete(keys)
        return parts

    def close(self) -> None:
        """Forget the local entry list; closes the engine only when this buffer owns it."""
        with self._lock:
            self._inserted.clear()
        if self._owns_engine:
            self._engine.close()


class TierKVStoreBuffer(KVStoreBufferBase):
    """vLLM store buffer over an engine: ``put(key, tensor)``, ``get(key)``, ``put(key, None)`` deletes."""

    def __init__(self, engine: Engine, *, owns_engine: bool = False) -> None:
        self._engine = engine
        self._owns_engine = owns_engine
        self._template = engine.keys_for([0])[0]

    def _key(self, key: str) -> CacheKey:
        if not isinstance(key, str):
            raise ValueError(f"store buffer keys must be str, got {type(key).__name__}")
        return named_key(self._template, STORE_NAMESPACE, key)

    def put(self, key: str, value: torch.Tensor | None) -> None:
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"store buffer values must be tensors or None, got {type(value).__name__}")
        if value is None:
            self._engine.batched_delete([self._key(key)])
        else:
            self._engine.batched_put([self._key(key)], [value])

    def get(self, key: str) -> torch.Tensor | None:
        (value,) = self._engine.batched_get([self._key(key)])
        return value

    def close(self) -> None:
        """Closes the engine only when this buffer owns it."""
        if self._owns_engine:
            self._engine.close()


def _register_with_vllm() -> None:
    """Make isinstance checks against vLLM's own base classes pass when vLLM is installed."""
    try:
        from vllm.distributed.kv_transfer.kv_lookup_buffer import base as vllm_base  # type: ignore[import-not-found]
    except Exception:  # vLLM absent (the usual case here) or an incompatible version
        return
    for ours, name in ((TierKVLookupBuffer, "KVLookupBufferBase"), (TierKVStoreBuffer, "KVStoreBufferBase")):
        theirs = getattr(vllm_base, name, None)
        if theirs is not None and hasattr(theirs, "register"):
            theirs.register(ours)


_register_with_vllm()
