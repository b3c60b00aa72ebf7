"""The CacheBlend interfaces: a retriever of per-segment KV and an executor that blends it.

Same contract as LMCache's blend interfaces (reimplemented here): a
``BlendRetriever`` starts fetching the cached KV of every segment (document) of a
batch of prompts and returns a ``BlendRetrieverTask``, whose ``result(layer_id)``
blocks only until that layer is ready; a ``BlendExecutor`` combines the retrieved KV
with the freshly computed KV of one layer and says which tokens later layers still compute.
Tensors are token-first (vLLM order): ``[num_tokens, num_heads, head_size]``, the tokens of
all requests of a batch concatenated, ``query_start_loc`` marking where each request starts.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class BlendOutput:
    """What one layer computes with after blending.

    :ivar q: short Q: only the tokens still being computed (selected).
    :ivar k: long K of every token of the input, retrieved KV with the fresh rows written in.
    :ivar v: long V, likewise.
    :ivar positions: positions (in the input) of the tokens in ``q``.
    :ivar local_indices: indices of the tokens of ``q`` within the fresh Q passed in
        (the caller keeps its hidden states at these rows).
    :ivar query_start_loc: where each request starts in ``q`` after a selection happened
        at this layer; None when this layer selected nothing new.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    local_indices: torch.Tensor
    query_start_loc: torch.Tensor | None


@dataclass
class BlendRetrieverResult:
    """One layer of retrieved KV for a whole batch.

    :ivar k: K ``[num_tokens, num_kv_heads, head_size]``, or None when nothing was retrieved.
    :ivar v: V, likewise.
    :ivar valid_mask: bool, on the CPU: which tokens have cached KV (rows of the others are
        undefined).
    :ivar original_positions: int64, on K's device: the position each retrieved token had when
        its KV was computed (0 where not valid).
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    valid_mask: torch.Tensor
    original_positions: torch.Tensor


class BlendRetrieverTask(metaclass=abc.ABCMeta):
    """A retrieval in progress, started by ``BlendRetriever.new_request``."""

    @abc.abstractmethod
    def result(self, layer_id: int) -> BlendRetrieverResult:
        """Block until layer ``layer_id`` is retrieved and return it (one row per input token)."""


class BlendRetriever(metaclass=abc.ABCMeta):
    """Starts the retrieval of the cached KV of every segment of a batch of prompts."""

    @abc.abstractmethod
    def new_request(self, full_prompts: list[torch.Tensor], indices: list[list[int]]) -> BlendRetrieverTask:
        """Start retrieving; ``indices[i]`` are the token offsets where segments start in ``full_prompts[i]``."""


class BlendExecutor(metaclass=abc.ABCMeta):
    """Blends retrieved KV with the fresh KV of one layer."""

    @abc.abstractmethod
    def blend(
        self,
        layer_id: int,
        retrieved_k: torch.Tensor | None,
        retrieved_v: torch.Tensor | None,
        valid_mask: torch.Tensor,
        original_positions: torch.Tensor,
        fresh_q: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        token_dim: int,
    ) -> BlendOutput:
        """Short Q + blended long K/V + positions of the tokens in Q, for layer ``layer_id``."""
