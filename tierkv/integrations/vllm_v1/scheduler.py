"""The scheduler side of the vLLM v1 connector: what to load and save, per request and step.

Pure bookkeeping (no I/O, no vLLM import): vLLM's scheduler asks how many prompt tokens
tierkv can supply, allocates blocks, then asks for the step's metadata; this module answers
from a ``lookup`` callable and the scheduler's own output objects, so it is tested with
plain stand-ins for them.

Rules:

- matched tokens = what tierkv holds of the prompt beyond what vLLM already computed,
  never the whole prompt (vLLM must compute at least the last token to sample the next);
- a request's load is planned once its blocks are allocated, with the request's full
  prompt (so a stored partial last chunk matches) and the token range to write;
- a request's prompt is saved in the step that completes its prefill, once; a request
  whose save was planned keeps its blocks after it finishes until the worker reports
  the save done (``request_finished`` returns True);
- every lookup, load and save carries the request's identity (LoRA adapter, cache salt,
  media: ``tierkv.chunks.identity.RequestIdentity``), recorded when vLLM first asks about the
  request; a request without one (prompt embeddings, an adapter tierkv cannot read) is
  neither loaded nor saved, and counted;
- a request's hints (``request_hints``) ride along: its save carries ``retain_s``; a request
  that asks to be dropped is not saved, and its prompt's chunks are dropped in the step that
  completes its prefill; a prefetch is planned once, in the next step after vLLM first asks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.chunks.keys import as_token_array
from tierkv.integrations.vllm_v1.request_hints import NO_HINTS, RequestHints


@dataclass(frozen=True)
class LoadSpec:
    """Read the KV of tokens ``[start, end)`` of ``token_ids`` into the request's blocks."""

    req_id: str
    token_ids: np.ndarray
    block_ids: tuple[int, ...]
    start: int
    end: int
    asynchronous: bool = False
    identity: RequestIdentity = PLAIN


@dataclass(frozen=True)
class SaveSpec:
    """Store the KV of ``token_ids`` (a finished prefill) from the request's blocks."""

    req_id: str
    token_ids: np.ndarray
    block_ids: tuple[int, ...]
    identity: RequestIdentity = PLAIN
    block_hashes: tuple[Any, ...] = ()  # vLLM's hashes of the prompt's full blocks (for KV events)
    lora_name: str | None = None
    retain_s: float = 0.0  # a hint: keep the prompt through evictions this long once saved


@dataclass(frozen=True)
class DropSpec:
    """A hint: remove the chunks of ``token_ids`` from every tier (a session's last turn), or
    (``whole_identity``) every chunk of the request's identity (its tenant, its adapter)."""

    req_id: str
    token_ids: np.ndarray
    identity: RequestIdentity = PLAIN
    whole_identity: bool = False


@dataclass(frozen=True)
class PrefetchSpec:
    """A hint: move the cached prefix of ``token_ids`` up from the lower tiers now."""

    req_id: str
    token_ids: np.ndarray
    identity: RequestIdentity = PLAIN


@dataclass
class StepPlan:
    """What the workers do around one forward pass (``unidentified``: requests seen since the
    last step that tierkv leaves alone because it cannot identify their KV)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: tuple[str, ...] = ()
    unidentified: int = 0
    drops: list[DropSpec] = field(default_factory=list)
    prefetches: list[PrefetchSpec] = field(default_factory=list)


@dataclass
class _Request:
    tokens: np.ndarray
    block_ids: list[int] = field(default_factory=list)
    save_planned: bool = False
    identity: RequestIdentity | None = PLAIN
    block_hashes: Sequence[Any] = ()  # vLLM's own list (it grows in place as blocks fill)
    lora_name: str | None = None
    hints: RequestHints = NO_HINTS
    prefetch_planned: bool = False


@dataclass
class _Match:
    local: int
    external: int
    asynchronous: bool
    in_memory: int = 0  # of the external tokens, how many a memory tier holds
    keyed: int = 0  # the prompt length whose chunk keys the hit was found under (a continuation tail: shorter)


@dataclass(frozen=True)
class LookupResult:
    """A lookup's answer: cached prompt tokens, and how many of them sit in memory tiers.
    ``cached_tokens < 0``: tierkv is off for this vLLM (its layout check failed)."""

    cached_tokens: int
    in_memory_tokens: int


class SchedulerPlanner:
    """Answers vLLM's scheduler-side connector calls (see the module docstring).

    ``lookup(tokens, identity) -> LookupResult``; ``load``/``save``: whether this instance loads
    (``kv_consumer``/``kv_both``) and saves (``kv_producer``/``kv_both``); ``load_async``:
    ``"never"``, ``"always"``, or ``"auto"`` (asynchronous when part of the prefix has to
    come from a tier below memory: the request then waits for its KV without holding up
    the batch).
    """

    def __init__(self, lookup: Callable[[np.ndarray, RequestIdentity], LookupResult], *, load: bool = True,
                 save: bool = True,
                 load_async: str = "auto", block_size: int = 0) -> None:
        if load_async not in ("never", "always", "auto"):
            raise ValueError(f"load_async must be 'never', 'always' or 'auto', got {load_async!r}")
        self._lookup = lookup
        self.block_size = block_size  # vLLM's (the block hashes' granularity)
        self.load = load
        self.save = save
        self.load_async = load_async
        self._requests: dict[str, _Request] = {}
        self._matches: dict[str, _Match] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._pending_prefetches: list[PrefetchSpec] = []
        self._saving: set[str] = set()
        self._loading: dict[str, tuple[int, ...]] = {}  # blocks of each load not yet known to have landed
        self._no_load: set[str] = set()  # requests whose load failed: vLLM recomputes, tierkv does not retry
        self._hit_split: dict[str, tuple[int, int]] = {}  # a planned load: (tokens in memory tiers, below them)
        self.tokens_planned_to_load = 0
        self.tokens_planned_to_save = 0
        self.unidentified_requests = 0
        self._unidentified_unreported = 0
        self._unidentified: set[str] = set()  # requests counted as unidentified (once each)

    # -- vLLM: get_num_new_matched_tokens -------------------------------------------------
    def matched_tokens(self, req_id: str, prompt_token_ids: Sequence[int] | None, num_computed_tokens: int,
                       identity: RequestIdentity | None = PLAIN, block_hashes: Sequence[Any] = (),
                       lora_name: str | None = None, hints: RequestHints = NO_HINTS) -> tuple[int, bool]:
        """Tokens tierkv can load beyond ``num_computed_tokens``, and whether asynchronously.

        ``identity``: what else the request's KV depends on (None: tierkv cannot tell, and
        neither loads nor saves it). Side-effect free apart from caching the prompt's token
        array and identity (vLLM may ask again for a request it could not schedule yet).
        """
        if identity is None and req_id not in self._unidentified:
            self._unidentified.add(req_id)
            self.unidentified_requests += 1
            self._unidentified_unreported += 1
        if prompt_token_ids is None:
            return 0, False
        request = self._request(req_id, prompt_token_ids)
        request.identity = identity
        request.block_hashes, request.lora_name, request.hints = block_hashes, lora_name, hints
        if hints.prefetch is not None and identity is not None and not request.prefetch_planned:
            request.prefetch_planned = True
            tokens = as_token_array(np.asarray(hints.prefetch, dtype=np.int64)) if hints.prefetch else request.tokens
            self._pending_prefetches.append(PrefetchSpec(req_id, tokens, identity))
        if not self.load or identity is None or req_id in self._no_load or len(request.tokens) <= 1:
            return 0, False
        result = self._lookup(request.tokens, identity)
        if result.cached_tokens < 0:  # the workers turned tierkv off: behave as no connector from now on
            self.load = self.save = False
            return 0, False
        usable = min(result.cached_tokens, len(request.tokens) - 1)
        external = usable - num_computed_tokens
        if external <= 0:
            self._matches.pop(req_id, None)
            return 0, False
        asynchronous = self.load_async == "always" or (self.load_async == "auto" and result.in_memory_tokens < usable)
        in_memory = max(0, min(result.in_memory_tokens, usable) - num_computed_tokens)
        self._matches[req_id] = _Match(num_computed_tokens, external, asynchronous, in_memory, result.cached_tokens)
        return external, asynchronous

    # -- vLLM: update_state_after_alloc --------------------------------------------------------
    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Blocks are allocated: plan the load of the tokens vLLM now counts as computed."""
        if num_external_tokens <= 0:
            return
        match = self._matches.pop(req_id, None)
        request = self._requests.get(req_id)
        if match is None or request is None:
            return
        external = min(num_external_tokens, match.external)
        self._hit_split[req_id] = (min(match.in_memory, external), external - min(match.in_memory, external))
        request.block_ids = list(block_ids)
        # the chunks to read are keyed by the tokens the lookup matched: the whole prompt, or where an
        # earlier prompt ended inside a chunk (``continuation``)
        tokens = request.tokens[: match.keyed] if 0 < match.keyed < len(request.tokens) else request.tokens
        self._pending_loads[req_id] = LoadSpec(req_id, tokens, tuple(block_ids), match.local,
                                               match.local + external, match.asynchronous,
                                               request.identity or PLAIN)

    def hit_split(self, req_id: str, num_external_tokens: int) -> tuple[int, int]:
        """Of a request's ``num_external_tokens`` (its planned load), how many come from memory
        tiers and how many from the tiers below (asked once, after the load was planned)."""
        memory, below = self._hit_split.pop(req_id, (0, num_external_tokens))
        memory = min(memory, num_external_tokens)
        return memory, num_external_tokens - memory

    # -- vLLM: build_connector_meta ----------------------------------------------------------------
    def build(self, scheduler_output: Any) -> StepPlan:
        """The step's loads (every load planned since the last step) and saves (requests whose
        prefill this step completes)."""
        plan = StepPlan(loads=list(self._pending_loads.values()), unidentified=self._unidentified_unreported,
                        prefetches=self._pending_prefetches)
        self._pending_prefetches = []
        self._unidentified_unreported = 0
        self._pending_loads.clear()
        self._loading.update((load.req_id, load.block_ids) for load in plan.loads)
        self.tokens_planned_to_load += sum(load.end - load.start for load in plan.loads)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None or new.req_id not in self._requests:
                continue  # never asked about (matched_tokens): its identity is unknown, so it is not saved
            request = self._request(new.req_id, new.prompt_token_ids)
            request.block_ids = list(new.block_ids[0])
            self._plan_save(plan, new.req_id, request, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            known = self._requests.get(req_id)
            if known is None:
                continue
            request = known
            new_blocks = cached.new_block_ids[index]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    request.block_ids = list(new_blocks[0])
                else:
                    request.block_ids.extend(new_blocks[0])
            self._plan_save(plan, req_id, request, cached.num_computed_tokens[index] + scheduled.get(req_id, 0))
        plan.preempted = tuple(sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        return plan

    def _plan_save(self, plan: StepPlan, req_id: str, request: _Request, computed_after_step: int) -> None:
        if request.save_planned or request.identity is None or computed_after_step < len(request.tokens):
            return
        if request.hints.drop:  # the session's last turn: its prompt leaves the tiers, nothing is saved
            request.save_planned = True
            plan.drops.append(DropSpec(req_id, request.tokens, request.identity, request.hints.drop_tenant))
            return
        if not self.save:
            return
        request.save_planned = True
        self._saving.add(req_id)
        full_blocks = len(request.tokens) // self.block_size if self.block_size else 0
        plan.saves.append(SaveSpec(req_id, request.tokens, tuple(request.block_ids), request.identity,
                                   tuple(request.block_hashes[:full_blocks]), request.lora_name,
                                   request.hints.retain_s))
        self.tokens_planned_to_save += len(request.tokens)

    # -- vLLM: update_connector_output -------------------------------------------------------------
    def loads_failed(self, invalid_block_ids: set[int], failed_requests: set[str]) -> None:
        """The workers could not fill these blocks (or these requests' async loads): vLLM
        recomputes them, and those requests are not offered tierkv's KV again (a tier that
        answers lookups but fails reads would otherwise be retried forever)."""
        failed = set(failed_requests)
        if invalid_block_ids:
            failed |= {req_id for req_id, blocks in self._loading.items() if invalid_block_ids.intersection(blocks)}
        self._no_load |= failed
        for req_id in failed:
            self._loading.pop(req_id, None)

    # -- vLLM: request_finished ---------------------------------------------------------------------
    def finished(self, req_id: str) -> bool:
        """Forget the request; True when its blocks must outlive it until the worker reports
        its save done (``get_finished``)."""
        self._requests.pop(req_id, None)
        self._hit_split.pop(req_id, None)
        self._matches.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self._loading.pop(req_id, None)
        self._no_load.discard(req_id)
        self._unidentified.discard(req_id)
        if req_id in self._saving:
            self._saving.discard(req_id)
            return True
        return False

    def _request(self, req_id: str, prompt_token_ids: Sequence[int]) -> _Request:
        request = self._requests.get(req_id)
        if request is None or len(request.tokens) != len(prompt_token_ids):
            identity = PLAIN if request is None else request.identity
            request = self._requests[req_id] = _Request(as_token_array(np.asarray(prompt_token_ids, dtype=np.int64)),
                                                        identity=identity)
        return request


def step_parts(scheduler_output: Any) -> tuple[tuple[int, int], ...]:
    """Each scheduled request's ``(tokens computed this step, cached context before them)``:
    what the workers time the step's forward pass against (``RecomputeModel.observe_step``).
    The context counts what a load brought in: vLLM counts it as computed."""
    scheduled = scheduler_output.num_scheduled_tokens
    parts = [(int(scheduled.get(new.req_id, 0)), int(new.num_computed_tokens))
             for new in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    parts += [(int(scheduled.get(req_id, 0)), int(computed))
              for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens)]
    return tuple(part for part in parts if part[0] > 0)
