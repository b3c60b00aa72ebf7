"""Installed-looking distributions (a module and its dist-info with entry points) written
into a folder, for the tests of backend discovery through entry points; and a third-party
backend's source to put in one."""

from __future__ import annotations

from pathlib import Path

PLUGIN = '''
from tierkv.backend import StorageBackend
from tierkv.backend.options import Option

class DictBackend(StorageBackend):
    """A third-party backend: a plain dict."""
    bounded = False
    options = {"label": Option("str", "default")}

    def __init__(self, name, capacity=None, label="default"):
        super().__init__(name, capacity)
        self.label = label
        self.data = {}

    async def put(self, key, chunk):
        self._ensure_open()
        self.data[key] = chunk.detach().clone()

    async def get(self, key):
        self._ensure_open()
        value = self.data.get(key)
        return None if value is None else value.clone()

    async def contains(self, key):
        self._ensure_open()
        return key in self.data

    async def delete(self, key):
        self._ensure_open()
        return self.data.pop(key, None) is not None

class NotABackend:
    pass
'''


def make_distribution(root: Path, dist: str, module: str, entry_points: dict[str, str], source: str) -> None:
    """Write an installed-looking distribution (module + dist-info) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[tierkv.backends]\n{lines}\n")


def make_dict_plugin(root: Path) -> None:
    """The ``tierkv-dict`` distribution: ``dict`` (a working backend), ``notabackend`` (not a
    StorageBackend) and ``broken`` (a module that does not exist)."""
    make_distribution(root, "tierkv-dict", "tierkv_dict", {
        "dict": "tierkv_dict:DictBackend",
        "notabackend": "tierkv_dict:NotABackend",
        "broken": "tierkv_dict_missing_module:Thing",
    }, PLUGIN)
