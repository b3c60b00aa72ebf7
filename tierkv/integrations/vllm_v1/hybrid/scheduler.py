"""The scheduler side of the vLLM connector for hybrid models (vLLM's hybrid KV cache manager:
several KV cache groups, ``.groups``): what each step loads into and saves out of every
group's blocks.

Pure bookkeeping, no vLLM import, tested with stand-ins for vLLM's objects. Rules:

- a hit is joint (``.groups.joint_hit``, answered by worker 0): the longest chunk
  boundary at which every group has what it needs, never beyond the prompt's last token;
- a load is planned per group once vLLM allocated the request's blocks: full attention from
  what vLLM already computed up to the hit; a sliding window only the tokens of its blocks in
  the window (vLLM allocates none below it); a Mamba group the state at the hit, into the block
  vLLM reads it from (``(hit - 1) // block``). Every hybrid load is asynchronous: vLLM copies a
  Mamba state into the running block before a synchronous load could land, and reports the
  failure of a load of several groups only per request (``failed_recving``);
- a chunk is saved in the step that computes its last token, from every group's blocks as they
  stand in that step (a sliding group's blocks below the window and a Mamba group's earlier
  states are freed by the steps after): attention KV from the blocks holding its tokens, a
  Mamba state when the step ends exactly on the chunk's end (only then does a block hold it);
- the blocks a save reads are pinned (one reference in vLLM's block pool) from the step that
  plans it until every worker says it landed, so no request reuses them meanwhile; the request
  itself never waits for its saves;
- a request's hints (``.request_hints``) apply to every group's chunks: its saves carry
  ``retain_s``; a request with ``drop`` saves nothing and, once its prompt is computed, drops
  the prompt (or its whole identity) from every group; a prefetch is planned once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.chunks.keys import as_token_array
from tierkv.integrations.vllm_v1.hybrid.groups import KVGroup
from tierkv.integrations.vllm_v1.request_hints import NO_HINTS, RequestHints
from tierkv.integrations.vllm_v1.scheduler import DropSpec, LookupResult, PrefetchSpec

NULL_BLOCK = 0


@dataclass(frozen=True)
class GroupPart:
    """One group's share of a load or a save: tokens ``[start, end)`` through ``block_ids``
    (position-indexed, vLLM's table for the group), or, for a Mamba group, the state at each
    chunk end in ``state_blocks`` (chunk end -> block)."""

    group: int
    start: int
    end: int
    block_ids: tuple[int, ...] = ()
    state_blocks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class HybridLoad:
    """Load the hit ``[computed, hit)`` of a request into every group's blocks."""

    req_id: str
    token_ids: np.ndarray
    computed: int
    hit: int
    parts: tuple[GroupPart, ...]
    identity: RequestIdentity = PLAIN


@dataclass(frozen=True)
class HybridSave:
    """Store the chunks ``[start, end)`` of a request's prompt from every group (one save job:
    its pinned blocks go back once every worker finished it)."""

    job: int
    req_id: str
    token_ids: np.ndarray
    start: int
    end: int
    parts: tuple[GroupPart, ...]
    identity: RequestIdentity = PLAIN
    retain_s: float = 0.0  # a hint: keep the chunks through evictions this long once saved
    block_hashes: tuple[Any, ...] = ()  # vLLM's hashes of the prompt's full blocks up to ``end`` (KV events)
    lora_name: str | None = None


@dataclass
class HybridStepPlan:
    """One step's hybrid loads, saves and hints (the hints as the one-group path's: the
    worker applies them to every group's identity)."""

    loads: list[HybridLoad] = field(default_factory=list)
    saves: list[HybridSave] = field(default_factory=list)
    unidentified: int = 0
    drops: list[DropSpec] = field(default_factory=list)
    prefetches: list[PrefetchSpec] = field(default_factory=list)


@dataclass
class _Request:
    tokens: np.ndarray
    identity: RequestIdentity | None
    saved_to: int = 0  # chunks below this token were saved (or skipped) already
    hints: RequestHints = NO_HINTS
    prefetch_planned: bool = False
    drop_planned: bool = False
    block_hashes: Sequence[Any] = ()  # vLLM's own list (it grows in place as blocks fill)
    lora_name: str | None = None


BlockPins = Callable[[Sequence[int]], None]
"""Takes (``pin``) or gives back (``unpin``) one reference on each block id in vLLM's pool."""


class HybridPlanner:
    """Answers vLLM's scheduler-side calls for a hybrid model (see the module docstring).

    ``lookup(tokens, identity) -> LookupResult``: the joint hit (worker 0's answer); ``chunk``:
    tierkv's chunk size, a multiple of ``block_size`` (vLLM's block of every group)."""

    def __init__(self, groups: Sequence[KVGroup], lookup: Callable[[np.ndarray, RequestIdentity], LookupResult], *,
                 chunk: int, block_size: int, load: bool = True, save: bool = True,
                 pin: BlockPins | None = None, unpin: BlockPins | None = None, num_workers: int = 1) -> None:
        if chunk % block_size:
            raise ValueError(f"tierkv's chunk ({chunk}) must be a multiple of vLLM's block ({block_size})")
        self.groups = list(groups)
        self._lookup = lookup
        self.chunk = chunk
        self.block_size = block_size
        self.load = load
        self.save = save
        self._pin = pin
        self._unpin = unpin
        self.num_workers = num_workers
        self._requests: dict[str, _Request] = {}
        self._matches: dict[str, tuple[int, int]] = {}  # req -> (computed, hit)
        self._hit_split: dict[str, int] = {}  # req -> tokens of its planned load every group has in memory
        self._pending_loads: list[HybridLoad] = []
        self._pending_prefetches: list[PrefetchSpec] = []
        self._no_load: set[str] = set()
        self._pinned: dict[int, tuple[list[int], int]] = {}  # save job -> (blocks, workers yet to finish it)
        self._next_job = 0
        self._unidentified: set[str] = set()
        self._unidentified_unreported = 0
        self.tokens_planned_to_load = 0
        self.tokens_planned_to_save = 0

    # -- vLLM: get_num_new_matched_tokens -----------------------------------------------------------
    def matched_tokens(self, req_id: str, prompt_token_ids: Sequence[int] | None, num_computed_tokens: int,
                       identity: RequestIdentity | None = PLAIN, hints: RequestHints = NO_HINTS, *,
                       block_hashes: Sequence[Any] = (), lora_name: str | None = None) -> tuple[int, bool]:
        """Tokens tierkv loads beyond ``num_computed_tokens`` (always asynchronously: see the
        module docstring). ``hints``: the request's (a prefetch is planned here, once);
        ``block_hashes``, ``lora_name``: what its saves' KV events carry."""
        if identity is None and req_id not in self._unidentified:
            self._unidentified.add(req_id)
            self._unidentified_unreported += 1
        if prompt_token_ids is None:
            return 0, False
        request = self._requests.get(req_id)
        if request is None or len(request.tokens) != len(prompt_token_ids):
            request = self._requests[req_id] = _Request(as_token_array(np.asarray(prompt_token_ids, dtype=np.int64)),
                                                        identity)
        request.identity, request.hints = identity, hints
        request.block_hashes, request.lora_name = block_hashes, lora_name
        if hints.prefetch is not None and identity is not None and not request.prefetch_planned:
            request.prefetch_planned = True
            tokens = as_token_array(np.asarray(hints.prefetch, dtype=np.int64)) if hints.prefetch else request.tokens
            self._pending_prefetches.append(PrefetchSpec(req_id, tokens, identity))
        if not self.load or identity is None or req_id in self._no_load or len(request.tokens) <= 1:
            return 0, False
        result = self._lookup(request.tokens, identity)
        if result.cached_tokens < 0:  # the workers turned tierkv off
            self.load = self.save = False
            return 0, False
        hit = min(result.cached_tokens, (len(request.tokens) - 1) // self.chunk * self.chunk)
        if hit <= num_computed_tokens:
            self._matches.pop(req_id, None)
            return 0, False
        self._matches[req_id] = (num_computed_tokens, hit)
        self._hit_split[req_id] = max(0, min(result.in_memory_tokens, hit) - num_computed_tokens)
        return hit - num_computed_tokens, True

    def hit_split(self, req_id: str, num_external_tokens: int) -> tuple[int, int]:
        """Of a request's ``num_external_tokens`` (its planned load), how many every group has in
        memory and how many come from the tiers below (asked once, after the load was planned)."""
        memory = min(self._hit_split.pop(req_id, 0), num_external_tokens)
        return memory, num_external_tokens - memory

    # -- vLLM: update_state_after_alloc -----------------------------------------------------------------
    def after_alloc(self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """Blocks are allocated (one table per group): plan each group's load."""
        if num_external_tokens <= 0:
            return
        match = self._matches.pop(req_id, None)
        request = self._requests.get(req_id)
        if match is None or request is None:
            return
        computed, hit = match
        hit = min(hit, computed + num_external_tokens)
        parts = tuple(part for group, table in zip(self.groups, block_ids)
                      if (part := self._load_part(group, tuple(table), computed, hit)) is not None)
        self._pending_loads.append(HybridLoad(req_id, request.tokens, computed, hit, parts, request.identity or PLAIN))

    def _load_part(self, group: KVGroup, table: tuple[int, ...], computed: int, hit: int) -> GroupPart | None:
        if group.kind == "mamba":
            block = table[(hit - 1) // self.block_size] if len(table) > (hit - 1) // self.block_size else NULL_BLOCK
            return GroupPart(group.index, hit - self.chunk, hit, table, ((hit, block),))
        start = computed
        if group.kind == "sliding":
            start = max(computed, hit - group.window_tokens())
        first_block = start // self.block_size
        while first_block * self.block_size < hit and table[first_block] == NULL_BLOCK:  # below the window
            first_block += 1
        start = max(start, first_block * self.block_size)
        return GroupPart(group.index, start, hit, table) if start < hit else None

    # -- vLLM: build_connector_meta ---------------------------------------------------------------------
    def build(self, scheduler_output: Any) -> HybridStepPlan:
        """The step's loads and the saves of the chunks its requests complete."""
        plan = HybridStepPlan(loads=self._pending_loads, unidentified=self._unidentified_unreported,
                              prefetches=self._pending_prefetches)
        self._pending_loads, self._unidentified_unreported, self._pending_prefetches = [], 0, []
        self.tokens_planned_to_load += sum(load.hit - load.computed for load in plan.loads)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        computed = _computed_before_step(scheduler_output)
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or request.identity is None or req_id not in computed:
                continue
            if request.hints.drop:  # the session's last turn: nothing saved, the prompt dropped once computed
                if not request.drop_planned and computed[req_id] + scheduled >= len(request.tokens):
                    request.drop_planned = True
                    plan.drops.append(DropSpec(req_id, request.tokens, request.identity, request.hints.drop_tenant))
                continue
            if not self.save or block_state is None:
                continue
            tables = block_state.get_block_ids(req_id)
            if tables is None:
                continue
            after = min(computed[req_id] + scheduled, len(request.tokens))
            save = self._plan_save(req_id, request, after, tables)
            if save is not None:
                plan.saves.append(save)
        return plan

    def _plan_save(self, req_id: str, request: _Request, after: int, tables: Sequence[Sequence[int]]
                   ) -> HybridSave | None:
        end = after // self.chunk * self.chunk
        start = request.saved_to
        if end <= start:
            return None
        request.saved_to = end
        parts, pinned = [], []
        for group, table in zip(self.groups, tables):
            part = self._save_part(group, tuple(table), start, end, after)
            if part is not None:
                parts.append(part)
                pinned += _blocks_of(part, self.block_size)
        if not parts:
            return None
        job = self._next_job
        self._next_job += 1
        pinned = sorted(set(pinned))
        if pinned and self._pin is not None:
            self._pin(pinned)
            self._pinned[job] = (pinned, self.num_workers)
        self.tokens_planned_to_save += end - start
        return HybridSave(job, req_id, request.tokens[:end], start, end, tuple(parts), request.identity or PLAIN,
                          request.hints.retain_s, tuple(request.block_hashes[: end // self.block_size]),
                          request.lora_name)

    def _save_part(self, group: KVGroup, table: tuple[int, ...], start: int, end: int, after: int
                   ) -> GroupPart | None:
        if group.kind == "mamba":  # the state exists only where this step ends, on a chunk boundary
            if after != end:
                return None
            index = (end - 1) // self.block_size
            block = table[index] if index < len(table) else NULL_BLOCK
            return GroupPart(group.index, end - self.chunk, end, table, ((end, block),)) if block != NULL_BLOCK else None
        # attention: whole chunks whose every block is still allocated (a sliding group's may not be)
        first = start
        while first < end:
            blocks = table[first // self.block_size : -(-(first + self.chunk) // self.block_size)]
            if len(blocks) * self.block_size >= self.chunk and NULL_BLOCK not in blocks:
                break
            first += self.chunk
        return GroupPart(group.index, first, end, table) if first < end else None

    # -- vLLM: update_connector_output -------------------------------------------------------------------
    def saves_done(self, jobs: dict[int, int]) -> None:
        """Workers finished these save jobs (job -> how many workers): once every worker has,
        the job's blocks go back to vLLM."""
        for job, count in jobs.items():
            pinned = self._pinned.get(job)
            if pinned is None:
                continue
            blocks, remaining = pinned[0], pinned[1] - count
            if remaining > 0:
                self._pinned[job] = (blocks, remaining)
                continue
            del self._pinned[job]
            if self._unpin is not None:
                self._unpin(blocks)

    def loads_failed(self, failed_requests: set[str]) -> None:
        """These requests' loads failed: vLLM recomputes them, and they are not offered again."""
        self._no_load |= failed_requests

    @property
    def pending_saves(self) -> bool:
        """Whether blocks are pinned for saves still running (vLLM keeps stepping meanwhile)."""
        return bool(self._pinned)

    # -- vLLM: request_finished_all_groups ---------------------------------------------------------------
    def finished(self, req_id: str) -> bool:
        """Forget the request; never delays the free of its blocks (its saves pinned theirs)."""
        self._requests.pop(req_id, None)
        self._matches.pop(req_id, None)
        self._hit_split.pop(req_id, None)
        self._no_load.discard(req_id)
        self._unidentified.discard(req_id)
        self._pending_loads = [load for load in self._pending_loads if load.req_id != req_id]
        return False


def _computed_before_step(scheduler_output: Any) -> dict[str, int]:
    """Each scheduled request's computed tokens before this step."""
    computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return computed


def _blocks_of(part: GroupPart, block_size: int) -> list[int]:
    if part.state_blocks:
        return [block for _, block in part.state_blocks if block != NULL_BLOCK]
    blocks = part.block_ids[part.start // block_size : -(-part.end // block_size)]
    return [block for block in blocks if block != NULL_BLOCK]
