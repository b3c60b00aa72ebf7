"""tierkv's chunks as vLLM KV cache events, for routers that follow vLLM's event stream
(llm-d, Dynamo): ``BlockStored`` when a request's save lands in tierkv's first tier, with
vLLM's own block hashes of the request (what a vLLM-fed router matches) and ``medium`` = that
tier's name, and ``BlockRemoved`` when that tier evicts or drops a chunk.

The worker records events (``KVEventLog``) and hands them to vLLM after each step
(``get_kv_connector_kv_cache_events``); vLLM brings them to the scheduler side, where the
connector gathers them (``TierKVEvents``) and vLLM's publisher takes them (``take_events``).
With tensor parallelism every rank stores its shard, so an event is published once all ranks
reported it. Only the first tier's removals are reported: a chunk evicted from the cpu tier
may still sit on disk, and the event names the medium it left.

A hybrid model's chunks are announced per KV cache group, as vLLM announces its own blocks
(``group_idx``, ``kv_cache_spec_kind``, the window of a sliding group): an attention group's
chunk announces its blocks, a state group's chunk (a Mamba state at the chunk's end) the block
whose end it is. A one-group model's are group 0 of kind ``full_attention``, or
``mla_attention`` for an MLA model. An MLA model's chunks are saved by TP rank 0 alone where
every tier is shared (``.mla``): every other rank announces the same chunks when its save is
skipped, so the event is published once rank 0's save has landed too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tierkv.chunks.keys import CacheKey


class TierKVEvents(KVConnectorKVEvents):
    """Events of one or more workers (an event counts once every worker reported it)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> TierKVEvents:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


@dataclass(frozen=True)
class GroupTag:
    """What a hybrid model's events say of the KV cache group a chunk belongs to (vLLM's fields)."""

    index: int
    kind: str  # vLLM's KVCacheSpecKind value: full_attention, sliding_window, mamba, mla_attention
    sliding_window: int | None = None
    state_only: bool = False  # a state group: a chunk holds the state at its end, one block


class KVEventLog:
    """A worker's events since vLLM last took them, and which of vLLM's block hashes each of
    the first tier's chunks announced (bounded: the oldest announcements are forgotten)."""

    locality: str | None = None  # LOCAL or REMOTE to the publisher, where the tier says (None: unspecified)

    def __init__(self, medium: str, block_size: int, remembered_chunks: int = 1_000_000) -> None:
        self.medium = medium
        self.block_size = block_size
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        # a chunk's key (or digest) -> its group's index (None: one group) and the blocks it announced
        self._by_chunk: OrderedDict[Hashable, tuple[int | None, tuple[Any, ...]]] = OrderedDict()
        self._announced: dict[tuple[int | None, Any], int] = {}  # (group, block hash) -> chunks holding it
        self._limit = remembered_chunks

    def stored(self, chunk_keys: Sequence[CacheKey], chunk_size: int, token_ids: Any,
               block_hashes: Sequence[Any], lora_name: str | None, group: GroupTag | None = None,
               chunks: Iterable[int] | None = None) -> None:
        """A request's prompt is in the first tier, chunk ``i`` = ``chunk_keys[i]`` holding tokens
        ``[i * chunk_size, ...)``: announce its full vLLM blocks not announced yet (only the
        chunk indices ``chunks``, when given; a hybrid model's, as ``group``'s blocks)."""
        block_hashes = [maybe_convert_block_hash(h) for h in block_hashes]  # as vLLM publishes its own
        full = min(len(block_hashes), len(token_ids) // self.block_size)
        group_index = group.index if group is not None else None
        fresh: list[int] = []
        with self._lock:
            for index in (range(len(chunk_keys)) if chunks is None else chunks):
                key = chunk_keys[index]
                first = index * chunk_size // self.block_size
                last = min(full, -(-((index + 1) * chunk_size) // self.block_size))
                if group is not None and group.state_only:  # the state at the chunk's end: its last block
                    first = last - 1 if last == (index + 1) * chunk_size // self.block_size else last
                hashes = tuple(block_hashes[first:last])
                if key in self._by_chunk or not hashes:
                    continue
                self._by_chunk[key] = (group_index, hashes)
                for offset, block_hash in enumerate(hashes):
                    held = self._announced.get((group_index, block_hash), 0)
                    if held == 0:
                        fresh.append(first + offset)
                    self._announced[(group_index, block_hash)] = held + 1
            while len(self._by_chunk) > self._limit:
                self._forget(*self._by_chunk.popitem(last=False)[1])
            if fresh:
                fresh = sorted(set(fresh))
                for run in _runs(fresh):
                    self._events.append(self._stored_event(run, block_hashes, token_ids, lora_name, group))

    def _stored_event(self, run: list[int], block_hashes: list[Any], token_ids: Any, lora_name: str | None,
                      group: GroupTag | None) -> BlockStored:
        groups: dict[str, Any] = {} if group is None else {
            "group_idx": group.index, "kv_cache_spec_kind": group.kind,
            "kv_cache_spec_sliding_window": group.sliding_window}
        return BlockStored(
            block_hashes=[block_hashes[i] for i in run],
            parent_block_hash=block_hashes[run[0] - 1] if run[0] > 0 else None,
            token_ids=[int(t) for t in token_ids[run[0] * self.block_size:(run[-1] + 1) * self.block_size]],
            block_size=self.block_size, lora_id=None, medium=self.medium, lora_name=lora_name, **groups)

    def removed(self, key: Hashable) -> None:
        """The first tier no longer holds ``key`` (evicted, dropped under pressure, deleted)."""
        with self._lock:
            announced = self._by_chunk.pop(key, None)
            if announced is None:
                return
            group_index, hashes = announced
            gone = self._forget(group_index, hashes)
            if gone:
                self._events.append(BlockRemoved(block_hashes=gone, medium=self.medium, locality=self.locality,
                                                 group_idx=group_index))

    def _forget(self, group_index: int | None, hashes: tuple[Any, ...]) -> list[Any]:
        gone = []
        for block_hash in hashes:
            left = self._announced.get((group_index, block_hash), 0) - 1
            if left <= 0:
                self._announced.pop((group_index, block_hash), None)
                gone.append(block_hash)
            else:
                self._announced[(group_index, block_hash)] = left
        return gone

    def take(self) -> TierKVEvents | None:
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return None
        batch = TierKVEvents(num_workers=1)
        batch.add_events(events)
        return batch


def label_one_group(event: KVCacheEvent, kind: str) -> None:
    """Give an event of a one-group model vLLM's labels of its group (index 0 and ``kind``,
    ``full_attention`` or ``mla_attention``), as vLLM's own events of that group carry."""
    if getattr(event, "group_idx", 0) is not None:
        return
    event.group_idx = 0  # type: ignore[attr-defined]
    if isinstance(event, BlockStored):
        event.kv_cache_spec_kind = kind


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted block indices (each run is one BlockStored with its parent)."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs
