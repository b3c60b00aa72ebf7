"""Module paths from before the sub-packages keep importing, with a DeprecationWarning.

Until 0.1 every module sat flat in ``tierkv/`` (``tierkv.keys``, ``tierkv.serde``,
``tierkv.router`` ...); a backend package written then imports ``from tierkv import serde``
or ``from tierkv.keys import CacheKey``. Those imports still work: this finder answers an
old name with the module now at its new path (the same module object, so classes compare
equal) and warns once per name with the path to use instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module name -> its module now (the layers of docs/design.md)
MOVED: dict[str, str] = {
    "keys": "chunks.keys", "identity": "chunks.identity", "revisions": "chunks.revisions",
    "namespaces": "chunks.namespaces", "serde": "chunks.serde", "kvlayout": "chunks.kvlayout",
    "memory": "chunks.memory", "copies": "chunks.copies", "transfer": "chunks.transfer",
    "ownership": "chunks.ownership",
    "admission": "policy.admission", "planner": "policy.planner", "pressure": "policy.pressure",
    "health": "policy.health",
    "options": "backend.options", "registry": "backend.registry", "codecs": "backend.codecs",
    "coded": "backend.coded",
    "tier_config": "config.tier_config",
    "tier": "tiers.tier", "tier_pressure": "tiers.tier_pressure",
    "router": "routing.router", "locate": "routing.locate", "reads": "routing.reads",
    "fill": "routing.fill", "offload": "routing.offload", "write_back": "routing.write_back",
    "async_engine": "engine.async_engine", "prefix_plans": "engine.prefix_plans",
    "chunk_layout": "engine.chunk_layout", "metadata": "engine.metadata",
}
# ``tierkv.policy.residency`` (the old bookkeeping module) is now a package: its names are re-found
# in ``tierkv.policy.residency`` by the package itself; ``tierkv.engine``, ``tierkv.config``
# and ``tierkv.backend`` re-export what their old modules made public.


class _Existing(importlib.abc.Loader):
    """Hands back a module that is already imported, under its old name."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed under its new name."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``tierkv.<old name>`` as the module at its new path."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != "tierkv" or name not in MOVED:
            return None
        new = f"tierkv.{MOVED[name]}"
        warnings.warn(f"{fullname} moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        return importlib.machinery.ModuleSpec(fullname, _Existing(module), origin=module.__spec__.origin
                                              if module.__spec__ else None)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (after the path finders: a real module wins)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
