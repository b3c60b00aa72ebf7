"""Adapters between serving engines and tierkv.

- :mod:`tierkv.integrations.vllm`: vLLM's KV lookup buffer and store buffer interfaces,
  backed by an :class:`tierkv.Engine` (vLLM itself is not needed).
- :mod:`tierkv.integrations.hf`: Hugging Face transformers ``DynamicCache`` store and
  retrieve, prefix reuse in ``generate``, and a CacheBlend prefill for Llama-family models
  (needs the ``hf`` extra: ``pip install 'tierkv[hf]'``).

The submodules are imported on demand so that ``import tierkv.integrations`` never pulls
in transformers.
"""
