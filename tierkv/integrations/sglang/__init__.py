"""tierkv as SGLang's HiCache L3 storage backend (``--hicache-storage-backend dynamic``).

SGLang's hierarchical cache keeps KV pages on the GPU, then in a host-memory pool, then in an
"L3" storage backend it loads by module path. ``tierkv.integrations.sglang.backend.TierKVStorage``
is that backend, over a tierkv engine: SGLang's pages go into tierkv's tiers (memory, LMDB,
files, S3) straight out of SGLang's host pool and come back straight into it.

* ``.config``: the extra-config JSON (SGLang's keys and tierkv's own);
* ``.keys``: SGLang page hashes -> tierkv keys (own namespace, model and TP rank in each);
* ``.layout``: one page of SGLang's host pool as a tierkv chunk view, per host-pool layout;
* ``.pages``: page sources and sinks, and reads / writes / lookups of pages by key;
* ``.backend``: the ``HiCacheStorage`` subclass (imports SGLang).

Only ``.backend`` needs SGLang installed (``pip install '.[sglang]' in tierkv's clone (the distribution is tierkv-engine)``).
"""

BACKEND_MODULE = "tierkv.integrations.sglang.backend"
BACKEND_CLASS = "TierKVStorage"

__all__ = ["BACKEND_CLASS", "BACKEND_MODULE"]
