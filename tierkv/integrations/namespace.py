"""Moved to ``tierkv.chunks.namespaces`` (key namespaces are a property of keys); kept so
``from tierkv.integrations.namespace import ...`` keeps working."""

from tierkv.chunks.namespaces import in_namespace, named_key, namespaced_keys

__all__ = ["in_namespace", "named_key", "namespaced_keys"]
