"""The optional C++/CUDA extension (``cuda_ext/``): building it on request, loading a prebuilt
one, deciding per call whether it runs, and reporting what was loaded and why not.

Never built implicitly on import (it takes ~30 s): ``python -m tierkv.ops build`` (or
``build_extension``) builds it once per source hash and torch version; later processes
load the cached library. A serving integration calls ``build_in_background`` when it
starts, so a user gets the kernels without a manual step (the pure-torch paths serve until
the build lands; ``TIERKV_BUILD_EXT=0`` turns that off). ``TIERKV_NO_EXT=1`` forces the reference.
Builds go through ``tierkv.ops.build_cache``: a lock that dies with its holder, a staging
directory per build, and only a finished library in the cache, so an interrupted build never
blocks the next one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import torch

from tierkv.ops import build_cache

logger = logging.getLogger("tierkv.ops")

Tensor = torch.Tensor

_lock = threading.Lock()
_state: dict[str, Any] = {"attempted": False, "loaded": False, "cuda": False, "reason": "not loaded yet", "path": None}


def _dispatch(tensor: Tensor) -> bool:
    """Whether the extension should run an op on ``tensor``'s device (``TIERKV_NO_EXT`` is read
    on every call, so it can be flipped at run time, e.g. to compare against the reference)."""
    if _env_disabled():
        return False
    if not _state["attempted"]:
        _try_load_prebuilt()
    if not _state["loaded"]:
        return False
    if tensor.device.type == "cpu":
        return True
    return tensor.device.type == "cuda" and bool(_state["cuda"])


def source_dir() -> Path:
    """Where the extension sources are: the checkout's ``cuda_ext/``, else the copy a wheel installs
    under ``<prefix>/share/tierkv/cuda_ext``."""
    candidates = [Path(__file__).resolve().parents[2] / "cuda_ext"]
    for prefix in (sysconfig.get_paths().get("data"), sys.prefix, sysconfig.get_config_var("userbase")):
        if prefix:
            candidates.append(Path(prefix) / "share" / "tierkv" / "cuda_ext")
    for candidate in candidates:
        if (candidate / "tierkv_ops.cpp").is_file():
            return candidate
    return candidates[0]


def _sources(with_cuda: bool) -> list[Path]:
    root = source_dir()
    found = sorted(root.glob("*.cpp"))
    if with_cuda:
        found += sorted(root.glob("*.cu"))
    return found


def _cuda_buildable() -> tuple[bool, str]:
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    if cpp_extension.CUDA_HOME is None:
        return False, "nvcc / CUDA_HOME not found"
    return True, "torch has CUDA and nvcc was found"


def _openmp_flags() -> list[str]:
    """at::parallel_for is header code that runs on one thread unless the extension is compiled
    with OpenMP; on Linux the link resolves to the libgomp.so.1 torch already loaded (same soname)."""
    return ["-fopenmp"] if sys.platform.startswith("linux") else []


def _build_name(with_cuda: bool) -> str:
    digest = hashlib.sha256()
    digest.update(" ".join(_openmp_flags()).encode())
    for path in _sources(with_cuda) + sorted(source_dir().glob("*.h")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return f"tierkv_ops_{'cuda' if with_cuda else 'cpu'}_{digest.hexdigest()[:12]}"


def _default_build_root() -> Path:
    from torch.utils.cpp_extension import _get_build_directory  # noqa: F401  (documents where torch caches)

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions"
    )
    return Path(root)


def _env_disabled() -> bool:
    return os.environ.get("TIERKV_NO_EXT", "").strip().lower() not in ("", "0", "false", "no")


def _disabled() -> str | None:
    if _env_disabled():
        return "disabled by TIERKV_NO_EXT"
    if not _sources(False):
        return f"extension sources not found in {source_dir()}"
    return None


def _try_load_prebuilt(build_root: Path | None = None) -> bool:
    """Load an already built extension for these sources and this torch, never compiling."""
    with _lock:
        if _state["loaded"]:
            return True
        _state["attempted"] = True
        reason = _disabled()
        if reason:
            _state["reason"] = reason
            return False
        root = build_root or _default_build_root()
        with_cuda, _ = _cuda_buildable()
        for cuda in ((True, False) if with_cuda else (False,)):
            path = build_cache.library_path(root, _build_name(cuda))
            if path.is_file():
                return _load_library(path, cuda)
        _state["reason"] = (
            build_cache.describe(root, _build_name(with_cuda))
            or f"not built for this torch ({torch.__version__}) and these sources: run `python -m tierkv.ops build`"
        )
        return False


def _load_library(path: Path, cuda: bool) -> bool:
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        _state.update(loaded=False, reason=f"failed to load {path}: {exc}")
        logger.warning("tierkv extension at %s failed to load, using the reference: %s", path, exc)
        return False
    _state.update(loaded=True, cuda=cuda, path=str(path), reason="loaded")
    return True


def build_extension(build_root: str | os.PathLike[str] | None = None, verbose: bool = False,
                    wait_s: float | None = None) -> bool:
    """Compile (if needed) and load the extension; returns whether it is loaded.

    CPU kernels are built wherever a C++ compiler exists; CUDA kernels too when torch is a
    CUDA build and nvcc is found. The build is cached per source hash and torch version in
    ``build_root`` (default ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), so a
    second call is a quick load. Another process's build of the same sources is waited for
    at most ``wait_s`` seconds (default ``build_cache.wait_bound``), saying so; what an
    interrupted build left is removed first. Failures are recorded in ``extension_status``,
    not raised.
    """
    reason = _disabled()
    if reason:
        with _lock:
            _state.update(attempted=True, reason=reason)
        return False
    if _state["loaded"]:
        return True
    root = Path(build_root) if build_root is not None else _default_build_root()
    with_cuda, why_cuda = _cuda_buildable()
    name = _build_name(with_cuda)
    try:
        with build_cache.build_lock(root, name, build_cache.wait_bound() if wait_s is None else wait_s):
            library = build_cache.library_path(root, name)
            if library.is_file():  # built meanwhile by the process we waited for
                with _lock:
                    return _load_library(library, with_cuda)
            build_cache.clear_leftovers(root, name)
            staging = build_cache.staging_dir(root, name)
            _compile(name, with_cuda, staging, verbose)
            library = build_cache.install(staging, root, name)
    except build_cache.BuildBusy as exc:
        with _lock:
            _state.update(attempted=True, loaded=False, reason=str(exc))
        logger.warning("tierkv: %s; using the reference", exc)
        return False
    except Exception as exc:  # a missing compiler or a build error: keep working from the reference
        with _lock:
            _state.update(attempted=True, loaded=False, reason=f"build failed: {exc}")
        logger.warning("building the tierkv extension failed, using the reference: %s", exc)
        return False
    with _lock:
        _state.update(attempted=True, loaded=True, cuda=with_cuda, path=str(library), reason="loaded")
        if not with_cuda:
            _state["cuda_reason"] = why_cuda
    return True


def _compile(name: str, with_cuda: bool, staging: Path, verbose: bool) -> None:
    """Build (and load) the library in ``staging``, a directory no other build uses."""
    from torch.utils import cpp_extension

    staging.mkdir(parents=True, exist_ok=True)
    openmp = _openmp_flags()
    cpp_extension.load(
        name=name,
        sources=[str(path) for path in _sources(with_cuda)],
        extra_cflags=["-O3", *openmp] + (["-DTIERKV_WITH_CUDA"] if with_cuda else []),
        extra_cuda_cflags=["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DTIERKV_WITH_CUDA"],
        extra_include_paths=[str(source_dir())],
        extra_ldflags=openmp,
        build_directory=str(staging),
        is_python_module=False,
        verbose=verbose,
    )


def build_in_background(on_done: Any = None) -> threading.Thread | None:
    """Load the extension if it was built, else build it on a daemon thread (cached for every
    later process) and call ``on_done(loaded: bool)`` when that ends; None when nothing is
    started (already loaded, disabled, or ``TIERKV_BUILD_EXT=0``)."""
    if _try_load_prebuilt() or _disabled() or os.environ.get("TIERKV_BUILD_EXT", "1").strip() in ("0", "false", "no"):
        return None

    def build() -> None:
        loaded = build_extension()
        if on_done is not None:
            on_done(loaded)

    thread = threading.Thread(target=build, name="tierkv-build-ext", daemon=True)
    thread.start()
    return thread


def extension_status() -> dict[str, Any]:
    """What was loaded and why not: for ``tierkv info`` and bug reports."""
    if not _state["attempted"]:
        _try_load_prebuilt()
    with_cuda, why_cuda = _cuda_buildable()
    reason = "disabled by TIERKV_NO_EXT" if _env_disabled() else _state["reason"] if not _state["loaded"] else "loaded"
    return {
        "loaded": bool(_state["loaded"]),
        "in_use": bool(_state["loaded"]) and not _env_disabled(),
        "cpu_kernels": bool(_state["loaded"]),
        "cuda_kernels": bool(_state["loaded"] and _state["cuda"]),
        "reason": reason,
        "cuda_reason": "built with CUDA kernels" if _state["cuda"] else why_cuda,
        "library": _state["path"],
        "sources": str(source_dir()),
    }
