"""SGLang tests: run in the tox ``sglang`` env (SGLang 0.5.23 with the CPU torch), skipped elsewhere.

The CPU stand-ins of ``tests/sglang_stubs.py`` are applied here, before SGLang is imported
(and in SGLang's own processes through ``tests/integrations/sglang_hicache/site/sitecustomize.py``).
The folder is not called ``sglang``: pytest puts ``tests/integrations`` on ``sys.path``, where a
folder of that name would pass for the ``sglang`` package wherever SGLang is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from tierkv.chunks.keys import CacheKey

_TESTS = str(Path(__file__).resolve().parents[2])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
if HAVE_SGLANG:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang_stubs

    sglang_stubs.install()


def tier_entry(kind: str, root: Path, **extra: Any) -> dict[str, Any]:
    if kind == "cpu":
        return {"name": "host", "backend": "cpu", "capacity": "64MiB", **extra}
    if kind == "lmdb":
        return {"name": "disk", "backend": "lmdb", "capacity": "256MiB", "path": str(root / "lmdb"), **extra}
    if kind == "fs":
        return {"name": "files", "backend": "fs", "path": str(root / "fs"), **extra}
    raise AssertionError(kind)


def damage_page(root: Path, kind: str, key: CacheKey) -> None:
    """Flip the last byte of one stored page in an lmdb / fs tier under ``root`` (no process may
    have the tier open: the tier is opened here, damaged, and closed)."""
    if kind == "lmdb":
        from tierkv_backends.lmdb import LMDBBackend, encode_key

        backend = LMDBBackend(name="disk", capacity=256 << 20, path=str(root / "lmdb"))
        with backend._env.begin(write=True, db=backend._data) as txn:
            value = bytearray(txn.get(encode_key(key)))
            value[-1] ^= 0xFF
            txn.put(encode_key(key), bytes(value))
        backend._env.close()
        return
    from tierkv_backends.fs import FSBackend

    path = FSBackend(name="files", capacity=None, path=str(root / "fs"))._file(
        FSBackend(name="files", capacity=None, path=str(root / "fs"))._digest(key.to_string()))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
