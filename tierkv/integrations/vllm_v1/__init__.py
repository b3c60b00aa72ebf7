"""tierkv as a vLLM v1 KV connector (``kv_connector_module_path="tierkv.integrations.vllm_v1"``).

``TierKVConnector`` is imported on first use, so the parts that do not need vLLM (layouts,
the scheduler-side planner, the lookup channel) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierKVConnector":
        from tierkv.integrations.vllm_v1.connector import TierKVConnector

        return TierKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
