"""Test-only stand-ins that let SGLang 0.5.23 run on a CPU-only machine (never used by tierkv).

SGLang's HiCache is written for CUDA. On this CPU-only CI machine a handful of its pieces
cannot load or run; each stand-in below replaces exactly one of them, and nothing else:

* ``sgl_kernel``: SGLang imports it at module level (a CUDA-only wheel; there is no CPU
  build of it for 0.5.23), but none of its ops runs on the path the tests use
  (``attention_backend="torch_native"``, ``hicache_io_backend="direct"``). An import stub
  suffices; calling any of its ops raises, so a test that did reach one would fail loudly.
* ``torchvision``: the registry's torchvision wheel is built against CUDA torch and breaks
  import with ``operator torchvision::nms does not exist`` under the CPU torch. The tox env
  does not install it; when it is present anyway, the two operator schemas it expects are
  defined before it loads.
* Pinned host memory: host pools call ``cudaHostRegister`` and allocate with
  ``pin_memory=True``; with no CUDA both are no-ops here (plain pageable CPU memory).
* Host-memory headroom: SGLang refuses a host pool unless 10 GiB of RAM stay free beyond it
  (sized for GPU servers); on the 24 GiB CI machine, shared with the tests' other processes,
  that refuses even a tiny pool. The stand-in keeps 1 GiB free instead.
* The ``direct`` host <-> device KV copies (``transfer_kv_direct``,
  ``transfer_kv_all_layer_direct_lf_pf``, ``transfer_kv_per_layer_direct_pf_lf``) are only
  defined for CUDA/HIP/XPU; pure-torch versions with the same semantics stand in.

:func:`install` applies them; it must run before SGLang is imported, in every process SGLang
starts (``tests/integrations/sglang_hicache/site/sitecustomize.py`` calls it when ``SGLANG_CPU_TEST_STUBS=1``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

import torch

_installed = False


# -- sgl_kernel: an import stub ------------------------------------------------------------------
class _Unavailable:
    """Any name taken from the stub: more names can be taken from it (``scalar_types.uint4b8``,
    used in module-level tables), calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a CUDA kernel; the CPU test stub of sgl_kernel has none")

    def __repr__(self) -> str:
        return f"<sgl_kernel stub {self._name}>"


class _KernelStubModule(types.ModuleType):
    """``sgl_kernel`` and its submodules: every attribute is an :class:`_Unavailable`."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self.__name__}.{name}")


class _KernelStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _KernelStubModule(spec.name)
        module.__path__ = []  # a package: submodules resolve through this finder too
        module.__version__ = "0.4.10"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


# -- torchvision: the operator schemas its import expects ----------------------------------------
def _define_torchvision_ops() -> None:
    if importlib.util.find_spec("torchvision") is None:
        return
    for name in ("nms", "qnms"):  # schemas only: torchvision registers its fake kernels on them
        try:
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined (a torchvision matching this torch)


# -- the direct host <-> device KV copies, in pure torch ----------------------------------------
def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Per layer: ``dst[dst_indices] = src[src_indices]`` (token rows of same-layout buffers)."""
    src_idx = src_indices.to(torch.long).cpu()
    dst_idx = dst_indices.to(torch.long).cpu()
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_idx.to(dst.device)] = src[src_idx.to(src.device)].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Device layer-first (per-layer ``[tokens, heads, dim]``) -> host page_first_direct
    ``[pages, layers, page, heads, dim]``; ``src_ptrs`` = K layers + V layers, ``dst_ptrs`` = [K, V]."""
    num_layers = len(src_ptrs) // 2
    src_idx = src_indices.to(torch.long).cpu()
    dst_idx = dst_indices.to(torch.long).cpu()
    for kv, dst in enumerate(dst_ptrs):
        for layer in range(num_layers):
            rows = src_ptrs[kv * num_layers + layer][src_idx.to(src_ptrs[0].device)].to(dst.device)
            dst[dst_idx // page_size, layer, dst_idx % page_size] = rows


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                                       page_size: int) -> None:
    """Host page_first_direct ``[pages, layers, page, heads, dim]`` -> device layer ``layer_id``;
    ``src_ptrs`` = [K, V], ``dst_ptrs`` = [K layer, V layer]."""
    src_idx = src_indices.to(torch.long).cpu()
    dst_idx = dst_indices.to(torch.long).cpu()
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_idx.to(dst.device)] = src[src_idx // page_size, layer_id, src_idx % page_size].to(dst.device)


_DIRECT_OPS = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
}


def _patch_sglang_host_pools() -> None:
    """After SGLang's host-pool modules load: no pinning, 1 GiB host headroom, the direct copies in pure torch."""
    from sglang.srt.mem_cache.pool_host import base, common, mha

    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 1 << 30

    for name, fn in _DIRECT_OPS.items():
        setattr(mha, name, fn)
    common._cuda_host_register = lambda *args, **kwargs: None
    common._cuda_host_unregister = lambda *args, **kwargs: None
    if hasattr(mha, "_cuda_host_unregister"):
        mha._cuda_host_unregister = common._cuda_host_unregister
    original_init = mha.MHATokenToKVPoolHost.__init__
    if getattr(original_init, "_tierkv_stub", False):
        return

    def init_unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        original_init(self, *args, **kwargs)
    init_unpinned._tierkv_stub = True  # type: ignore[attr-defined]
    mha.MHATokenToKVPoolHost.__init__ = init_unpinned  # type: ignore[method-assign]


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Applies :func:`_patch_sglang_host_pools` right after SGLang's ``pool_host.mha`` loads."""

    target = "sglang.srt.mem_cache.pool_host.mha"

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_then_patch(module: types.ModuleType) -> None:
            original_exec(module)
            sys.modules[fullname] = module
            _patch_sglang_host_pools()
        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Apply every stand-in (idempotent). Call before SGLang is imported."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.meta_path.insert(0, _KernelStubFinder())
    _define_torchvision_ops()
    if "sglang.srt.mem_cache.pool_host.mha" in sys.modules:
        _patch_sglang_host_pools()
    else:
        sys.meta_path.insert(0, _PatchAfterImport())
