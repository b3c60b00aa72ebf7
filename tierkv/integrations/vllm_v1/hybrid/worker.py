"""The worker side of the vLLM connector for hybrid models: each KV cache group's blocks bound
to a connector of its own, loads and saves planned per group (``.scheduler``), and
the joint lookup worker 0 answers.

Attention groups (full, sliding window) use the paged-layer connectors of the one-group path
(``.layouts.connector_for``, the CPU page maps), one per group over that group's layers;
Mamba groups use ``.state_pages.StatePageConnector``. Every group's chunks go through
one tierkv engine (one set of tiers, one capacity) under keys of their own
(``.groups.KVGroup.identity``).

A load of several groups is one asynchronous unit: it succeeds when every group got every
token it asked for, and is reported failed (vLLM recomputes the request) otherwise; a load
that times out or is abandoned stops writing first (``.worker._GuardedSink``). A save
job stores each group's chunks, skipping those already cached, and is reported done to the
scheduler (which then unpins its blocks) whether it stored, skipped or failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierkv.backend.contract import InPlaceTier
from tierkv.chunks.identity import RequestIdentity
from tierkv.connectors.engine_io import ConnectorSource
from tierkv.engine.blocking import Engine
from tierkv.errors import RetentionRefusedError
from tierkv.integrations.vllm_v1.cpu_pages import MappedPageConnector
from tierkv.integrations.vllm_v1.hybrid.groups import KVGroup, joint_hit
from tierkv.integrations.vllm_v1.hybrid.scheduler import NULL_BLOCK, GroupPart, HybridLoad, HybridSave
from tierkv.integrations.vllm_v1.hybrid.state_pages import StatePageConnector, content_bytes
from tierkv.integrations.vllm_v1.kv_events import GroupTag, KVEventLog
from tierkv.integrations.vllm_v1.layouts import PagedLayerConnector, connector_for, slot_mapping
from tierkv.integrations.vllm_v1.scheduler import LookupResult
from tierkv.routing.locate import FILL_QUEUE

logger = logging.getLogger(__name__)

Connector = PagedLayerConnector | MappedPageConnector | StatePageConnector


@dataclass
class BoundGroup:
    """A KV group and the connector over its layers."""

    group: KVGroup
    connector: Connector


def bind_groups(groups: Sequence[KVGroup], kv_caches: dict[str, torch.Tensor], layout: str, num_kv_heads: int,
                head_size: int, kernel_block: int) -> list[BoundGroup]:
    """A connector per group over its layers (attention groups in ``layout``)."""
    bound = []
    for group in groups:
        layers = [kv_caches[name] for name in group.layer_names]
        if group.kind == "mamba":
            connector: Connector = StatePageConnector(layers, content_bytes(group.state_shapes, group.state_dtypes))
        else:
            connector = connector_for(layers, layout, group.num_kv_heads or num_kv_heads, group.head_size or head_size,
                                      kernel_block)
        bound.append(BoundGroup(group, connector))
    return bound


_EVENT_KINDS = {"full": "full_attention", "sliding": "sliding_window", "mamba": "mamba", "mla": "mla_attention"}


def group_tag(group: KVGroup) -> GroupTag:
    """How vLLM's KV events name ``group`` (its index, vLLM's kind, a sliding group's window)."""
    kind = "sliding_window_mla" if group.kind == "sliding" and group.mla else _EVENT_KINDS.get(group.kind, "unknown")
    return GroupTag(group.index, kind, group.window if group.kind == "sliding" else None,
                    state_only=group.kind == "mamba")


def memory_sources(engine: Engine) -> frozenset[str]:
    """Where a chunk is in memory: the memory tiers (``InPlaceTier``) and the engine's fill
    queue. A load from them is short; vLLM counts such hits as ``host``."""
    return frozenset({backend.name for backend in engine.tiers if isinstance(backend, InPlaceTier)} | {FILL_QUEUE})


def _group_slots(part: GroupPart, block_size: int, limit: int) -> np.ndarray:
    """Slots of tokens ``[part.start, part.end)`` in the group's blocks (-1 elsewhere, and in
    null blocks: a sliding group's blocks below the window are vLLM's shared null block)."""
    slots = slot_mapping(part.block_ids, block_size, limit, first=part.start, last=part.end)
    blocks = np.where(slots >= 0, slots // block_size, -1)
    slots[blocks == NULL_BLOCK] = -1
    return slots


GroupRead = tuple[np.ndarray, Any, torch.Tensor, RequestIdentity, GroupPart]
"""One group's part of a load: its tokens, its guarded sink, its mask, its identity, the part."""


class HybridTransfers:
    """Loads, saves and the joint lookup of one worker over a hybrid model's groups."""

    def __init__(self, engine: Engine, groups: Sequence[BoundGroup], chunk: int, block_size: int,
                 stats: Counter[str], guarded_sink: Any, load_timeout_s: float | None,
                 on_saved: Callable[[], None] | None = None,
                 events: Callable[[], KVEventLog | None] | None = None) -> None:
        self.engine = engine
        self.groups = list(groups)
        self.chunk = chunk
        self.block_size = block_size
        self.stats = stats
        self._guarded_sink = guarded_sink  # the one-group path's sink class (a write grant per load)
        self.load_timeout_s = load_timeout_s
        self._lock = threading.Lock()
        # per request: the load, its future, its sinks, and when it is abandoned (monotonic; inf: never)
        self._loads: dict[str, tuple[HybridLoad, concurrent.futures.Future[bool], list[Any], float]] = {}
        self._saves: dict[int, concurrent.futures.Future[int]] = {}
        self._done_jobs: list[int] = []
        self.on_saved = on_saved  # told after each save job ends (the stats file)
        self._refused: set[str] = set()  # loads met with no groups bound (tierkv off): reported failed
        self._in_memory = memory_sources(engine)
        self._events = events  # the worker's KV event log, when vLLM publishes events

    def identities(self, base: RequestIdentity) -> list[RequestIdentity]:
        """The identity of each group's chunks for a request of identity ``base`` (what a hint
        applies to: every group's chunks of the prompt)."""
        return [bound.group.identity(base) for bound in self.groups]

    # -- the scheduler's lookup --------------------------------------------------------------------
    def lookup(self, tokens: np.ndarray, identity: RequestIdentity) -> LookupResult:
        """The joint hit (whole chunks, every group having what it needs there), and how much
        of it every group has in memory (``memory_sources``: the hit vLLM counts as ``host``)."""
        max_chunks = (len(tokens) - 1) // self.chunk
        if max_chunks <= 0:
            return LookupResult(0, 0)
        prefix = tokens[: max_chunks * self.chunk]
        where: dict[int, list[str | None]] = {}
        for bound in self.groups:
            keys = self.engine.keys_for(prefix, bound.group.identity(identity))
            names = self.engine.core.locate_keys_nowait(keys)
            if names is None:
                names = self.engine.run(self.engine.core.locate_keys(keys))
            where[bound.group.index] = list(names)
        groups = [b.group for b in self.groups]
        hit = joint_hit(groups, lambda group, index: where[group.index][index] is not None, max_chunks, self.chunk)
        in_memory = joint_hit(groups, lambda group, index: where[group.index][index] in self._in_memory,
                              max_chunks, self.chunk)
        return LookupResult(hit * self.chunk, min(in_memory, hit) * self.chunk)

    # -- loads ---------------------------------------------------------------------------------------
    def start_load(self, load: HybridLoad) -> None:
        """Start reading every group's part of the hit (reported by ``finished``; with no
        group bound, tierkv off, a failed load)."""
        if not self.groups:
            with self._lock:
                self._refused.add(load.req_id)
            return
        # every group's sink exists before the read starts: whoever abandons the load (finished,
        # from vLLM's thread) revokes all of them, however far the read on the loop has got
        sinks: list[Any] = []
        try:
            reads = self._group_reads(load)
            sinks = [read[1] for read in reads]
            future = self.engine.submit(self._load_all(reads))
        except Exception as exc:  # a load that cannot start is a failed one: vLLM recomputes it
            future = concurrent.futures.Future()
            future.set_exception(exc)
        deadline = time.monotonic() + self.load_timeout_s if self.load_timeout_s is not None else math.inf
        with self._lock:
            self._loads[load.req_id] = (load, future, sinks, deadline)

    def _group_reads(self, load: HybridLoad) -> list[GroupRead]:
        """Per group with a part in ``load``: its tokens, its guarded sink, its mask, its identity."""
        parts = {part.group: part for part in load.parts}
        reads = []
        for bound in self.groups:
            part = parts.get(bound.group.index)
            if part is None:
                continue
            limit = part.end
            kwargs: dict[str, Any] = {"kvcaches": bound.connector.views}
            if bound.group.kind == "mamba":
                kwargs["state_blocks"] = dict(part.state_blocks)
            else:
                kwargs["slot_mapping"] = _group_slots(part, self.block_size, limit)
            mask = torch.zeros(limit, dtype=torch.bool)
            mask[part.start:] = True
            reads.append((load.token_ids[:limit], self._guarded_sink(bound.connector, kwargs, part.start), mask,
                          bound.group.identity(load.identity), part))
        return reads

    async def _load_all(self, reads: list[GroupRead]) -> bool:
        return all(await asyncio.gather(*(self._read_part(*read) for read in reads)))

    async def _read_part(self, tokens: np.ndarray, sink: Any, mask: torch.Tensor, identity: RequestIdentity,
                         part: GroupPart) -> bool:
        ret_mask = await self.engine.core.retrieve_to(tokens, sink, mask, plan=False, identity=identity)
        covered = ret_mask[part.start:part.end]
        return bool(covered.all()) and not sink.abandoned

    # -- saves ---------------------------------------------------------------------------------------
    def save(self, save: HybridSave) -> None:
        """Start storing the job's chunks of every group; reported done by ``take_done_jobs``
        (at once with no group bound)."""
        if not self.groups:
            with self._lock:
                self._done_jobs.append(save.job)
            return
        try:
            future = self.engine.submit(self._save_all(save))
        except Exception as exc:
            logger.warning("tierkv: save of request %s not started: %s: %s", save.req_id, type(exc).__name__, exc)
            self.stats["save_failures"] += 1
            with self._lock:
                self._done_jobs.append(save.job)
            return
        future.add_done_callback(functools.partial(self._save_done, save))
        with self._lock:
            self._saves[save.job] = future

    async def _save_all(self, save: HybridSave) -> int:
        parts = {part.group: part for part in save.parts}
        written = 0
        for bound in self.groups:
            part = parts.get(bound.group.index)
            if part is None:
                continue
            written += await self._save_part(save, bound, part)
        if save.retain_s:
            await self._retain(save)
        return written

    async def _retain(self, save: HybridSave) -> None:
        """The request's retention hint, once the job's chunks are in: every group's chunks of
        the prompt so far (a later job of the same request extends it to its own chunks)."""
        retained = []
        for identity in self.identities(save.identity):
            try:
                retained.append(await self.engine.core.retain(save.token_ids, save.retain_s, identity))
            except RetentionRefusedError as exc:
                self.stats["hint_retain_refused"] += 1
                logger.warning("tierkv: request %s: retention refused: %s", save.req_id, exc)
        covered = max(retained, default=0)  # the longest prefix some group's tiers retained
        self.stats["hint_retained_tokens"] += max(0, min(covered, save.end) - save.start)  # this job's own chunks

    async def _save_part(self, save: HybridSave, bound: BoundGroup, part: GroupPart) -> int:
        identity = bound.group.identity(save.identity)
        keys = self.engine.keys_for(save.token_ids[: part.end], identity)
        chunks = range(part.start // self.chunk, part.end // self.chunk)
        wanted = list(chunks)
        names = self.engine.core.locate_keys_nowait([keys[i] for i in wanted])
        if names is not None:  # already cached chunks are not written again
            wanted = [i for i, name in zip(wanted, names) if name is None]
        stored = await self._store_chunks(bound, part, keys, wanted) if wanted else 0
        self._announce(save, bound.group, keys, chunks)
        return stored

    async def _store_chunks(self, bound: BoundGroup, part: GroupPart, keys: Sequence[Any], wanted: list[int]) -> int:
        """Store chunks ``wanted`` of one group's part straight from its blocks."""
        kwargs: dict[str, Any] = {"kvcaches": bound.connector.views}
        if bound.group.kind == "mamba":
            kwargs["state_blocks"] = dict(part.state_blocks)
        else:
            kwargs["slot_mapping"] = _group_slots(part, self.block_size, part.end)
        source = ConnectorSource(bound.connector, kwargs, part.end)
        ranges = [(i * self.chunk, (i + 1) * self.chunk) for i in wanted]
        return await self.engine.core.store_from([keys[i] for i in wanted], source, ranges)

    def _announce(self, save: HybridSave, group: KVGroup, keys: Sequence[Any], chunks: range) -> None:
        """vLLM KV events for one group's chunks of a landed save job (as vLLM announces its own
        blocks: per group; a node pool's log describes one-group chunks only and ignores them)."""
        events = self._events() if self._events is not None else None
        if events is None or not save.block_hashes:
            return
        events.stored(keys, self.chunk, save.token_ids, save.block_hashes, save.lora_name, group_tag(group), chunks)

    def _save_done(self, save: HybridSave, future: concurrent.futures.Future[int]) -> None:
        if future.cancelled() or future.exception() is not None:
            self.stats["save_failures"] += 1
            logger.warning("tierkv: save of request %s failed (a future miss): %r", save.req_id,
                           None if future.cancelled() else future.exception())
        else:
            self.stats["chunks_saved"] += future.result()
            self.stats["hybrid_tokens_saved"] += save.end - save.start
        with self._lock:
            self._saves.pop(save.job, None)
            self._done_jobs.append(save.job)
        if self.on_saved is not None:
            self.on_saved()

    def take_done_jobs(self) -> list[int]:
        """Save jobs finished since the last call (their blocks may go back to vLLM)."""
        with self._lock:
            done, self._done_jobs = self._done_jobs, []
        return done

    # -- completion ----------------------------------------------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(loads now over, those of them that failed). A load of a request vLLM finished, or
        one still running ``load_timeout_s`` after it started (a hung tier), is abandoned: no
        chunk is written once this returns, and vLLM recomputes what it would have filled."""
        now = time.monotonic()
        with self._lock:
            over = {req_id: entry for req_id, entry in self._loads.items()
                    if entry[1].done() or req_id in finished_req_ids or now >= entry[3]}
            for req_id in over:
                del self._loads[req_id]
            failed, self._refused = self._refused, set()
        refused = set(failed)
        for req_id, (load, future, sinks, _) in over.items():
            if not future.done():  # aborted while it waited for its KV, or past its deadline
                for sink in sinks:
                    sink.abandon()
                future.cancel()
                if req_id in finished_req_ids:
                    self.stats["loads_abandoned"] += 1
                else:
                    self.stats["load_timeouts"] += 1
                    self.stats["tokens_load_failed"] += load.hit - load.computed
                    self.stats["load_failures"] += 1
                    logger.warning("tierkv: load of request %s still running after %.1f s: abandoned (vLLM recomputes "
                                   "it)", req_id, self.load_timeout_s)
                failed.add(req_id)
                continue
            ok = False
            try:
                ok = bool(future.result())
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed
                logger.warning("tierkv: load of request %s failed (vLLM recomputes it): %s: %s", req_id,
                               type(exc).__name__, exc)
            if ok:
                self.stats["tokens_loaded"] += load.hit - load.computed
                self.stats["requests_loaded"] += 1
                for part in load.parts:
                    self.stats[f"tokens_loaded_group{part.group}"] += part.end - part.start
            else:
                for sink in sinks:
                    sink.abandon()
                self.stats["tokens_load_failed"] += load.hit - load.computed
                self.stats["load_failures"] += 1
                failed.add(req_id)
        return set(over) | refused, failed

    def pending_saves(self) -> list[concurrent.futures.Future[int]]:
        """The save jobs still running."""
        with self._lock:
            return list(self._saves.values())

    def wait_for_saves(self, timeout: float | None) -> None:
        concurrent.futures.wait(self.pending_saves(), timeout=timeout)
