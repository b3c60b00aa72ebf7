"""A truth for KV connector tests: vLLM fed its own pages back, at a hit the test names.

``PageCopyConnector`` is a vLLM v1 KV connector that knows nothing of tierkv: it copies whole
blocks of every layer's cache tensor, whatever their layout (a block is a block: every vLLM
attention backend keeps blocks on the first dimension of a layer's tensor), into the worker
process's memory when a request marked ``save_as`` ends, and copies them back into the blocks
vLLM gives a request marked ``load_from`` with the number of tokens to offer. A request's
``kv_transfer_params``::

    {"page_copy": {"save_as": "P"}}                   # keep this request's pages as "P"
    {"page_copy": {"load_from": "P", "tokens": 599}}  # serve its first 599 tokens from "P"

Where vLLM's own prefix cache cannot make the hit a test needs (vLLM turns prefix caching off
for MLA without AMX; a hit that ends inside a block), this is the truth a tierkv hit of the same
length is compared with: the same pages, the same hit, no tierkv. Whole blocks are copied,
so the block holding a hit's last token also brings the stored request's later tokens: vLLM
writes its own for the tokens it computes before any attention reads them, and attention never
reads past a token's position.

One model, one KV cache group (the connector does not declare ``SupportsHMA``: vLLM turns its
hybrid manager off), one worker process; pages live in that process until it ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

_PAGES: dict[str, list[torch.Tensor]] = {}
"""The worker process's kept pages: name -> per layer ``[blocks, *page]``."""


@dataclass
class PageCopyMetadata(KVConnectorMetadata):
    """One step's copies: ``saves`` (request id, block ids, tokens, name) before ``loads``
    (block ids, tokens, name)."""

    saves: list[tuple[str, list[int], int, str]] = field(default_factory=list)
    loads: list[tuple[list[int], int, str]] = field(default_factory=list)


def _params(request: Request) -> dict[str, Any]:
    return dict((getattr(request, "kv_transfer_params", None) or {}).get("page_copy") or {})


def _layer_index(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else 0


class PageCopyConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        self._block_size = int(vllm_config.cache_config.block_size)
        self._loads: dict[str, tuple[list[int], int, str]] = {}
        self._saves: list[tuple[str, list[int], int, str]] = []
        self._layers: list[torch.Tensor] = []
        self._sent: set[str] = set()

    # -- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = _params(request)
        tokens = int(params.get("tokens", 0)) if params.get("load_from") else 0
        return max(0, tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = _params(request)
        if num_external_tokens > 0 and params.get("load_from"):
            self._loads[request.request_id] = (list(blocks.get_block_ids()[0]), int(params["tokens"]),
                                               str(params["load_from"]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = PageCopyMetadata(saves=self._saves, loads=list(self._loads.values()))
        self._saves, self._loads = [], {}
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        name = _params(request).get("save_as")
        if not name:
            return False, None
        self._saves.append((request.request_id, list(block_ids), int(request.num_prompt_tokens), str(name)))
        return True, None  # the blocks stay until the worker has copied them (get_finished)

    # -- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = [kv_caches[name] for name in sorted(kv_caches, key=lambda n: (_layer_index(n), n))]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PageCopyMetadata)
        for request_id, block_ids, tokens, name in metadata.saves:
            blocks = torch.as_tensor(block_ids[: -(-tokens // self._block_size)])
            _PAGES[name] = [layer[blocks].clone() for layer in self._layers]
            self._sent.add(request_id)
        for block_ids, tokens, name in metadata.loads:
            count = -(-tokens // self._block_size)
            kept = _PAGES[name]
            if kept[0].shape[0] < count:
                raise ValueError(f"page copy: {name!r} holds {kept[0].shape[0]} blocks, a {tokens}-token hit needs "
                                 f"{count}")
            blocks = torch.as_tensor(block_ids[:count])
            for layer, pages in zip(self._layers, kept):
                layer[blocks] = pages[:count]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        return (sent or None), None
