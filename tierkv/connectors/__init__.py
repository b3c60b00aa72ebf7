"""GPU connectors: move KV between a serving engine's cache layout and tierkv's chunk blobs.

The interface follows LMCache's GPU connector (``from_gpu`` / ``to_gpu`` / ``get_shape``),
reimplemented. A connector reads a token range ``[start, end)`` of the *whole* token sequence
out of the serving engine's KV (``from_gpu``, for a store) or writes one back (``to_gpu``, for a
retrieve). The memory object is a blob tensor in the connector's format — ``vllm``
``[layers, 2, tokens, heads, head_size]`` or ``huggingface`` ``[layers, 2, heads, tokens,
head_size]`` — or any object with such a ``.tensor``.

* ``NestedTupleConnector``: KV is a tuple of per-layer ``(K, V)``, each ``[num_tokens, heads,
  head_size]`` (huggingface: ``[heads, num_tokens, head_size]``).
* ``PagedConnector``: a paged cache (per layer a ``(K, V)`` pair of ``[num_blocks, block_size,
  heads, head_size]`` or one fused ``[2, num_blocks, ...]`` tensor) and a *full* ``slot_mapping``
  (one slot per token of the whole sequence, ``-1`` for tokens not in the cache). All layers move
  in one ``tierkv.ops.paged_gather`` / ``paged_scatter`` call.
* ``PagedConnectorV2``: the same, through a reusable device staging buffer: one kernel
  gathers all layers into it, then one copy goes to the host (and the reverse).

All connectors work on CPU tensors too (then no staging is needed). The engine-level helpers
``store_with_connector`` / ``retrieve_with_connector`` (async) and ``store_paged`` /
``retrieve_paged`` (blocking ``tierkv.Engine``) store straight from, and retrieve
straight into, the serving engine's cache.
"""

from tierkv.connectors.engine_io import (
    ConnectorSink,
    ConnectorSource,
    retrieve_paged,
    retrieve_with_connector,
    store_paged,
    store_with_connector,
)
from tierkv.connectors.gpu import GPUConnector, NestedTupleConnector, PagedConnector, PagedConnectorV2

__all__ = [
    "ConnectorSink",
    "ConnectorSource",
    "GPUConnector",
    "NestedTupleConnector",
    "PagedConnector",
    "PagedConnectorV2",
    "retrieve_paged",
    "retrieve_with_connector",
    "store_paged",
    "store_with_connector",
]
