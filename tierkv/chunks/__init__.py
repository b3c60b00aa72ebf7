"""What a chunk is and how it is named, held and copied: keys (prefix-chained hashes,
``CacheKey``), what a chunk's KV depends on besides its tokens (identity, revisions,
namespaces), the chunk format (serde), KV layouts, pooled host memory, copy counting,
sources and sinks of a store or retrieve, and ownership of held buffers.

Pure modules: no I/O, no event loop; every layer above builds on them.
"""
