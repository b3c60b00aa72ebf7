"""What the connector needs of vLLM to run a hybrid model: its KV cache groups read once at
start-up (``HybridModel``), the pins a hybrid save holds in vLLM's block pool
(``BlockPins``) and the per-step report of finished save jobs that carries them back to
the scheduler (``TierKVWorkerMetadata``).

The connector (``connector.py``) delegates to these and to ``.scheduler`` /
``.worker`` in a line or two per vLLM call; the rules are in those modules.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from tierkv.config.loader import EngineConfig
from tierkv.integrations.vllm_v1.hybrid.groups import (
    KVGroup,
    UnsupportedKVGroupError,
    block_size_of,
    groups_from_config,
    hybrid_chunk_size,
    is_hybrid,
)
from tierkv.integrations.vllm_v1.hybrid.worker import HybridTransfers, bind_groups
from tierkv.integrations.vllm_v1.worker import WorkerTransfers, _GuardedSink

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridModel:
    """vLLM's KV cache groups as the connector uses them: ``groups`` is empty for a model of
    one full-attention or one MLA group (the one-group path); ``refused`` says why tierkv must
    stay off for this model (a group it cannot cache), else None."""

    groups: tuple[KVGroup, ...] = ()
    refused: str | None = None

    @classmethod
    def from_config(cls, kv_cache_config: Any) -> HybridModel:
        """Read vLLM's ``KVCacheConfig`` (None: vLLM gave none, the one-group path)."""
        if kv_cache_config is None:
            return cls()
        try:
            groups = groups_from_config(kv_cache_config)
            if not is_hybrid(groups):
                return cls()
            block_size_of(groups)
        except UnsupportedKVGroupError as exc:
            return cls(refused=str(exc))
        return cls(tuple(groups))

    @property
    def block_size(self) -> int:
        """vLLM's block, the same in every group."""
        return block_size_of(self.groups)

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """``config`` with its chunk a multiple of vLLM's block (said in the log when changed):
        a state and a window exist only at block boundaries."""
        if not self.groups:
            return config
        chunk = hybrid_chunk_size(config.chunk_size, self.block_size)
        if chunk != config.chunk_size:
            logger.info("tierkv: chunk_size %d -> %d for this hybrid model (a multiple of vLLM's block of %d tokens: "
                        "states and windows exist only at block boundaries)", config.chunk_size, chunk,
                        self.block_size)
        return dataclasses.replace(config, chunk_size=chunk)

    def first_attention_layers(self) -> tuple[str, ...]:
        """The layers of the first attention group: the connector finds the layout on them."""
        return next(group.layer_names for group in self.groups if group.kind != "mamba")

    def describe(self) -> str:
        return ", ".join(f"{group.kind} x{len(group.layer_names)}" for group in self.groups)


def bind_hybrid(worker: WorkerTransfers, model: HybridModel, kv_caches: dict[str, torch.Tensor], layout: str,
                num_kv_heads: int, head_size: int, kernel_block_size: int) -> None:
    """Bind a hybrid model's caches on ``worker``: one connector per KV cache group (attention
    groups in ``layout``, state groups as raw pages); from then on its lookups, loads and
    saves go through ``worker.hybrid``."""
    if model.block_size % kernel_block_size:
        raise ValueError(f"vLLM block size {model.block_size} is not a multiple of the cache's {kernel_block_size}")
    bound = bind_groups(model.groups, kv_caches, layout, num_kv_heads, head_size, kernel_block_size)
    worker.block_size = model.block_size
    worker.hybrid = HybridTransfers(worker.engine, bound, worker.engine.core.chunk_size, model.block_size,
                                    worker.stats, _GuardedSink, worker.load_timeout_s, worker.on_saved,
                                    events=lambda: worker.events)


def hybrid_of(worker: WorkerTransfers) -> HybridTransfers:
    """``worker``'s hybrid transfers, or, with tierkv off for it (nothing bound), transfers that
    fail every load and report every save job done at once (vLLM recomputes, pins go back)."""
    if worker.hybrid is None:
        worker.hybrid = HybridTransfers(worker.engine, [], worker.engine.core.chunk_size, 1, worker.stats,
                                        _GuardedSink, worker.load_timeout_s, worker.on_saved)
    return worker.hybrid


class BlockPins:
    """One reference on each block a hybrid save reads, in vLLM's block pool (``touch`` /
    ``free_blocks``), so no request reuses them before the save lands. Bound to the pool by
    the connector's ``bind_gpu_block_pool``; before that, pins are no-ops."""

    def __init__(self) -> None:
        self.pool: Any = None

    def pin(self, block_ids: Iterable[int]) -> None:
        if self.pool is not None:
            self.pool.touch([self.pool.blocks[block] for block in block_ids])

    def unpin(self, block_ids: Iterable[int]) -> None:
        if self.pool is not None:
            self.pool.free_blocks([self.pool.blocks[block] for block in block_ids])


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler after a step: the hybrid save jobs it finished (job ->
    how many workers), whose pinned blocks go back to vLLM once every worker has."""

    saved_jobs: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        jobs = dict(self.saved_jobs)
        for job, count in getattr(other, "saved_jobs", {}).items():
            jobs[job] = jobs.get(job, 0) + count
        return TierKVWorkerMetadata(jobs)

    @classmethod
    def of(cls, jobs: list[int]) -> TierKVWorkerMetadata | None:
        """This worker's report of ``jobs`` (None when there is nothing to report)."""
        return cls(dict.fromkeys(jobs, 1)) if jobs else None
