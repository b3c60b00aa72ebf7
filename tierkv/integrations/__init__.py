"""Adapters between serving engines and tierkv.

- ``tierkv.integrations.vllm_v1``: a vLLM v1 KV connector (``kv_connector_module_path``):
  loads and saves against vLLM's paged cache (CPU layouts of every ISA, CUDA), vLLM's metrics,
  per-tier hit sources and KV events.
- ``tierkv.integrations.sglang``: SGLang HiCache's L3 storage backend
  (``--hicache-storage-backend dynamic``), reading and writing its host pools in place.
- ``tierkv.integrations.hf``: Hugging Face transformers ``DynamicCache`` store and
  retrieve, prefix reuse in ``generate``, and a CacheBlend prefill for Llama-family models
  (needs the ``hf`` extra: ``pip install '.[hf]' in tierkv's clone (the distribution is tierkv-engine)``).
- ``tierkv.integrations.vllm``: vLLM's older KV lookup buffer and store buffer interfaces,
  backed by an ``tierkv.Engine`` (vLLM itself is not needed).
- ``tierkv.integrations.namespace``: kept for old imports (moved to ``tierkv.chunks.namespaces``).

The submodules are imported on demand so that ``import tierkv.integrations`` never pulls
in transformers.
"""
