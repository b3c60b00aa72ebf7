"""Stable identities of model and adapter directories: what tells one revision of the weights
from another under the same name or path.

A digest of a directory's config files and the *content* of its weight files (XXH3-128 over
every byte; names and sizes alone cannot tell a re-trained checkpoint of the same shape
from the old one). Reading every weight byte costs one pass over the files at start-up (the
serving engine has just read them, so they are usually in the page cache), so each file's
digest is remembered in ``~/.cache/tierkv/revisions.json`` (``TIERKV_REVISION_CACHE``)
under its path, size, inode and change time: a restart costs one ``stat`` per file, and a
file rewritten in place or replaced gets a new change time and is read again. A weight file
that is a Hugging Face hub cache link into ``blobs/<sha256>`` is named by that content hash
and never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path

import xxhash

logger = logging.getLogger("tierkv.revisions")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".msgpack", ".h5")
"""Files whose content is the model's (or adapter's) weights."""
_CONFIG_NAMES = ("config.json", "adapter_config.json", "quantize_config.json", "quant_config.json", "params.json")
_HUB_BLOB = re.compile(r"[0-9a-f]{64}\Z")
_STEP = 8 << 20
_lock = threading.Lock()


def _cache_path() -> Path:
    configured = os.environ.get("TIERKV_REVISION_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierkv" / "revisions.json"


def _load_cache(path: Path) -> dict[str, list[object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_cache(path: Path, cache: dict[str, list[object]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump(cache, handle)
        os.replace(handle.name, path)
    except OSError as exc:  # a read-only home: digests are recomputed next start, nothing breaks
        logger.debug("tierkv: cannot write the revision cache %s: %s", path, exc)


def _file_digest(path: Path) -> str:
    """XXH3-128 of the file's bytes, read in 8 MiB steps."""
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(_STEP)
        view = memoryview(buffer)
        while True:
            read = handle.readinto(buffer)
            if not read:
                break
            digest.update(view[:read])
    return digest.hexdigest()


def _weight_digest(path: Path, cache: dict[str, list[object]]) -> tuple[str, bool]:
    """(content digest of one weight file, whether the cache was changed)."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if target.parent.name == "blobs" and _HUB_BLOB.match(target.name):
            return "sha256:" + target.name, False
    stat = path.stat()
    fingerprint: list[object] = [stat.st_size, stat.st_ino, stat.st_dev, stat.st_mtime_ns, stat.st_ctime_ns]
    key = os.path.realpath(path)
    known = cache.get(key)
    if isinstance(known, list) and known[:-1] == fingerprint:
        return str(known[-1]), False
    digest = "xxh3:" + _file_digest(path)
    cache[key] = [*fingerprint, digest]
    return digest, True


def directory_revision(path: str | os.PathLike[str]) -> str:
    """A digest of the directory's config files and its weight files' names and content.

    ValueError naming the path when it is not a directory or holds no weight or config file
    (nothing to tell revisions apart by).
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"model revision: expected a model or adapter directory, got {str(root)!r}")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                          p.relative_to(root).parts))
    weights = [p for p in files if p.suffix in WEIGHT_SUFFIXES]
    configs = [p for p in files if p.name in _CONFIG_NAMES]
    if not weights and not configs:
        raise ValueError(f"model revision: {str(root)!r} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}) "
                         f"and no config file ({', '.join(_CONFIG_NAMES)})")
    digest = hashlib.sha256(b"tierkv-revision-v1\0")
    for config in configs:
        digest.update(f"{config.relative_to(root).as_posix()}\0".encode())
        digest.update(hashlib.sha256(config.read_bytes()).digest())
    with _lock:
        cache_file = _cache_path()
        cache = _load_cache(cache_file)
        changed = False
        for weight in weights:
            file_digest, updated = _weight_digest(weight, cache)
            changed |= updated
            digest.update(f"{weight.relative_to(root).as_posix()}\0{file_digest}\0".encode())
        if changed:
            _save_cache(cache_file, cache)
    return digest.hexdigest()[:32]


_adapters: dict[str, str] = {}


def adapter_identity(path: str | os.PathLike[str]) -> str:
    """The identity of a LoRA adapter directory (its config and weights: the same in every
    process and on every machine that has the same adapter files), remembered per path for
    the life of the process."""
    key = os.path.realpath(path)
    known = _adapters.get(key)
    if known is None:
        known = _adapters[key] = "adapter:" + directory_revision(key)
    return known
