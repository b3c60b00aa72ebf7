"""CacheBlend: reuse the KV of documents wherever they appear, recomputing only a few tokens.

- ``store_segments`` stores each document's KV as its own segment;
- ``SegmentBlendRetriever`` fetches a prompt's segments in the background, per layer;
- ``CacheBlendExecutor`` re-rotates, scores, selects and blends at each layer.

See ``tierkv.integrations.hf`` for a complete blended prefill of a Llama-family model.
"""

from tierkv.blend.executor import CacheBlendExecutor
from tierkv.blend.interfaces import (
    BlendExecutor,
    BlendOutput,
    BlendRetriever,
    BlendRetrieverResult,
    BlendRetrieverTask,
)
from tierkv.blend.retriever import SegmentBlendRetriever, SegmentRetrievalTask, split_segments
from tierkv.blend.segments import fetch_segments, segment_keys, store_segments

__all__ = [
    "BlendExecutor",
    "BlendOutput",
    "BlendRetriever",
    "BlendRetrieverResult",
    "BlendRetrieverTask",
    "CacheBlendExecutor",
    "SegmentBlendRetriever",
    "SegmentRetrievalTask",
    "fetch_segments",
    "segment_keys",
    "split_segments",
    "store_segments",
]
