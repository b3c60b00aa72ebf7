"""The worker side of the vLLM v1 connector: loads into and saves out of vLLM's paged cache.

One module of about 610 lines, by choice: WorkerTransfers' loads, saves, completion reports,
reset and the timing of vLLM's steps (what its saves and the lookups' plans weigh) share its
locks, in-flight maps and engine; the hybrid path already stands apart (hybrid/worker.py).

Loads read each chunk from the tier that holds it straight into the request's blocks (a
memory tier's slab is scattered with no intermediate); saves gather the finished prompt's
tokens straight into the first tier's memory. Saves run on the tierkv engine's loop while
vLLM computes the next step: the blocks they read stay allocated until the scheduler hears,
through ``WorkerTransfers.finished``, that the save is done.

Nothing here fails a request. A load that errors, times out or finds a chunk gone reports
the blocks it could not fill (vLLM recomputes them); a guard stops a load that timed out
from writing into blocks vLLM has since been told to recompute. A failed save is a future
miss, counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, cast

import numpy as np
import torch

from tierkv.backend.contract import InPlaceTier
from tierkv.chunks.identity import RequestIdentity
from tierkv.chunks.ownership import WriteGrant
from tierkv.connectors import ConnectorSink, store_with_connector
from tierkv.engine.blocking import Engine
from tierkv.errors import RetentionRefusedError
from tierkv.integrations.vllm_v1.caller_runs import CallerRuns
from tierkv.integrations.vllm_v1.continuation import saved_tail_end, tail_lengths, tail_step
from tierkv.integrations.vllm_v1.cpu_pages import MappedPageConnector
from tierkv.integrations.vllm_v1.hybrid.worker import HybridTransfers, memory_sources
from tierkv.integrations.vllm_v1.kv_events import KVEventLog, TierKVEvents
from tierkv.integrations.vllm_v1.layout_check import CacheWriter, verify_layout
from tierkv.integrations.vllm_v1.layouts import PagedLayerConnector, connector_for, slot_mapping
from tierkv.integrations.vllm_v1.pool_events import (
    JournaledTier,
    PoolEventLog,
    hash_fingerprint,
    journaled,
    namespace_tag,
)
from tierkv.integrations.vllm_v1.scheduler import DropSpec, LoadSpec, LookupResult, PrefetchSpec, SaveSpec
from tierkv.policy.planner import PrefixPlan

logger = logging.getLogger(__name__)

RESET_WAIT_S = 120.0
"""How long a cache reset waits for the saves and fills started before it (see
``WorkerTransfers.reset_memory_tiers``); the scheduler waits that long and a little more."""


class _GuardedSink(ConnectorSink):
    """A sink that writes into vLLM's blocks only under a ``tierkv.chunks.ownership.WriteGrant``:
    once the load is abandoned (``abandon``: a timeout, vLLM finished the request) no
    chunk is written any more, and ``abandon`` returns only after a chunk being written has
    landed, so the blocks can go back to vLLM."""

    def __init__(self, connector: PagedLayerConnector | MappedPageConnector, kwargs: dict[str, Any], offset: int,
                 runner: CallerRuns | None = None) -> None:
        super().__init__(connector, kwargs, offset)
        self.grant = WriteGrant()
        self.runner = runner  # a synchronous load: the copies run on the thread waiting for it

    def read_from(self, chunk: torch.Tensor, start: int, end: int) -> None:
        self._write(functools.partial(ConnectorSink.read_from, self, chunk, start, end))

    def read_many(self, work: list[tuple[torch.Tensor, int, int]]) -> None:
        runner = self.runner
        if runner is None:
            self.grant.write(functools.partial(ConnectorSink.read_many, self, work))
            return
        # a synchronous load: vLLM's thread (its compute cores) and this one (the spare core) share the batch
        self.grant.write(functools.partial(runner.run_split, work, functools.partial(ConnectorSink.read_many, self)))

    def _write(self, copy: Any) -> None:
        runner = self.runner
        self.grant.write(copy if runner is None else functools.partial(runner.run, copy))

    def abandon(self) -> None:
        self.grant.revoke()

    @property
    def abandoned(self) -> bool:
        return self.grant.revoked


class WorkerTransfers:
    """Loads and saves for one worker (one tensor-parallel rank), through one tierkv engine."""

    def __init__(self, engine: Engine, load_timeout_s: float | None = 30.0, continuation_tails: bool = True) -> None:
        self.engine = engine
        self.load_timeout_s = load_timeout_s
        self.connector: PagedLayerConnector | MappedPageConnector | None = None
        self.block_size = 0
        self.stats: Counter[str] = Counter()
        self.events: KVEventLog | None = None  # vLLM KV events, when vLLM publishes them
        self.load_seconds: list[float] = []  # each synchronous load, until vLLM's next stats interval takes them
        self._lock = threading.Lock()
        self._saves: dict[str, list[concurrent.futures.Future[int]]] = defaultdict(list)
        self._owed: set[str] = set()  # finished requests whose save completion is still to be reported
        # per request: the load, its future, its sink, and when it is abandoned (monotonic; inf: never)
        self._async_loads: dict[str, tuple[LoadSpec, concurrent.futures.Future[torch.Tensor], _GuardedSink,
                                           float]] = {}
        self._load_errors: set[int] = set()
        self.disabled: str | None = None  # why tierkv is off for this worker (the layout check failed)
        self.saves_elsewhere: str | None = None  # why another worker saves for this one (an MLA model's TP ranks)
        self.hybrid: HybridTransfers | None = None  # a hybrid model's groups (hybrid/setup.py, bind_hybrid), else None
        self.on_saved: Callable[[], None] | None = None  # told after each save lands (the stats file)
        self._step: tuple[float, tuple[tuple[int, int], ...]] | None = None  # the forward pass being timed
        self._failures_said: set[tuple[str, str]] = set()  # kinds of save failure logged once already
        self._cuts_saved: dict[str, int] = {}  # per save in flight: where the cut it stored ends (KV events)
        # where a load is short enough to wait for in the forward pass: memory tiers, the fill queue
        self._in_memory = memory_sources(engine)
        # a save also stores its prompt cut at a step, a lookup probes the steps (.continuation)
        self.continuation_tails = continuation_tails

    # -- set-up ----------------------------------------------------------------------------------
    def register(self, layers: Sequence[torch.Tensor], layout: str, num_kv_heads: int, head_size: int,
                 kernel_block_size: int, block_size: int) -> None:
        """Bind the paged cache (one tensor per attention layer, in model order, cut in blocks of
        ``kernel_block_size``; the scheduler's block ids count blocks of ``block_size``)."""
        if block_size % kernel_block_size:
            raise ValueError(f"vLLM block size {block_size} is not a multiple of the cache's {kernel_block_size}")
        self.connector = connector_for(layers, layout, num_kv_heads, head_size, kernel_block_size)
        self.block_size = block_size
        self.stats["vllm_block_size"] = block_size
        self.stats["continuation_step"] = self.tail_step

    @property
    def tail_step(self) -> int:
        """Where continuation tails are cut and probed (``.continuation.tail_step`` of vLLM's block)."""
        return tail_step(self.block_size)

    def disable(self, reason: str) -> None:
        """Stay off from now on: no loads (each is reported failed, so vLLM recomputes), no
        saves (each is reported done at once, so vLLM frees the request's blocks)."""
        self.disabled = reason
        self.stats["disabled"] = 1

    def note_unidentified(self, count: int) -> None:
        """``count`` requests were left alone: tierkv cannot tell what their KV depends on."""
        self.stats["requests_unidentified"] += count
        for _ in range(count):
            self.engine.note_unidentified()

    def check_layout(self, layers: Sequence[torch.Tensor], cache_writer: CacheWriter, model_dtype: torch.dtype,
                     **options: Any) -> None:
        """Check that the registered views read what vLLM's own cache write (``cache_writer``)
        puts in ``layers``; raises ``.layout_check.LayoutMismatchError`` when not (see
        ``.layout_check.verify_layout``, which takes ``options``)."""
        verify_layout(layers, self._connector(), cache_writer, model_dtype, **options)

    # -- what the scheduler asks -----------------------------------------------------------------
    def lookup(self, tokens: np.ndarray, identity: RequestIdentity) -> LookupResult:
        """The scheduler's lookup (answered by worker 0): the prompt tokens worth loading (the
        engine's cost-aware plan) and how many of them sit in memory (memory tiers or the
        fill queue: a load short enough to wait for in the forward pass). ``-1`` when tierkv
        turned itself off, so the scheduler stops planning loads and saves."""
        if self.disabled is not None:
            return LookupResult(-1, 0)
        if self.hybrid is not None:
            return self.hybrid.lookup(tokens, identity)
        engine = self.engine
        chunk = engine.core.chunk_size
        plan = engine.plan(tokens, identity)
        held = engine.locate_prefix(tokens, identity)
        planned = plan.planned_tokens
        self._count_declined(plan)
        tiers = held[: -(-planned // chunk)]
        if self.continuation_tails and planned == len(held) * chunk:  # all of it pays, up to a chunk boundary
            tail = self._continuation(tokens, identity, tiers, planned)
            if tail is not None:
                planned += tail[0]
                tiers = [*tiers, tail[1]]
        in_memory = next((i for i, name in enumerate(tiers) if name not in self._in_memory), len(tiers))
        return LookupResult(planned, min(in_memory * chunk, planned))

    def _count_declined(self, plan: PrefixPlan) -> None:
        """Count a plan that leaves cached tokens to recompute (``lookup_tokens_declined``), and
        say the first such plan's costs once: the cost model standing aside is visible, not silent."""
        declined = plan.cached_tokens - plan.planned_tokens
        if declined <= 0:
            return
        self.stats["lookups_declined"] += 1
        self.stats["lookup_tokens_declined"] += declined
        if self.stats["lookups_declined"] == 1:
            logger.info("tierkv: %d of %d cached tokens are recomputed, not loaded (%s): expected fetch %.3g ms "
                        "against %.3g ms of prefill saved", declined, plan.cached_tokens, plan.reason, plan.fetch_ms,
                        plan.recompute_saved_ms)

    def _continuation(self, tokens: np.ndarray, identity: RequestIdentity, tiers: list[str],
                      held_tokens: int) -> tuple[int, str] | None:
        """The longest tail an earlier, shorter prompt left in the chunk after ``held_tokens``
        (``.continuation``) and the tier holding it, when loading the prefix with it still pays."""
        engine = self.engine
        core = engine.core
        lengths = tail_lengths(len(tokens), held_tokens, core.chunk_size, self.tail_step)
        if not lengths:
            return None
        keys = engine.tail_keys(tokens, held_tokens // core.chunk_size, lengths, identity)
        names = core.locate_keys_nowait(keys)
        if names is None:
            names = engine.run(core.locate_keys(keys))
        found = next(((length, name) for length, name in zip(lengths, names, strict=True) if name is not None), None)
        if found is None:
            return None
        extended = core.plan_located([*tiers, found[1]], held_tokens + found[0])
        if extended.planned_tokens != held_tokens + found[0]:
            return None
        self.stats["continuation_lookups"] += 1
        return found

    def _connector(self) -> PagedLayerConnector | MappedPageConnector:
        if self.connector is None:
            raise RuntimeError("the KV caches were not registered (register_kv_caches) before a load or save")
        return self.connector

    # -- loads -----------------------------------------------------------------------------------
    def _start_load(self, spec: LoadSpec, runner: CallerRuns | None = None
                    ) -> tuple[concurrent.futures.Future[torch.Tensor], _GuardedSink]:
        if self.disabled is not None:
            raise RuntimeError(f"tierkv is off for this vLLM: {self.disabled}")
        connector = self._connector()
        chunk = self.engine.core.chunk_size
        # whole chunks only (a stored partial last chunk is keyed by its exact tokens)
        limit = min(len(spec.token_ids), -(-spec.end // chunk) * chunk)
        tokens = spec.token_ids[:limit]
        slots = slot_mapping(spec.block_ids, self.block_size, limit, first=spec.start, last=spec.end)
        mask = torch.zeros(limit, dtype=torch.bool)
        mask[spec.start:] = True
        sink = _GuardedSink(connector, {"kvcaches": connector.views, "slot_mapping": slots}, spec.start, runner)
        # plan=False: vLLM's scheduler already chose how much to load (from a cost-aware lookup)
        return self.engine.submit(self.engine.core.retrieve_to(tokens, sink, mask, plan=False,
                                                               identity=spec.identity)), sink

    def load(self, spec: LoadSpec) -> bool:
        """Load now (before the forward pass that reads it); False when some blocks were not filled."""
        started = time.perf_counter()
        try:
            future, sink = self._start_load(spec, CallerRuns())  # vLLM's compute threads wait: they copy
        except Exception as exc:
            return self._load_failed(spec, spec.start, exc)
        try:
            return self._settle(spec, future, sink, self.load_timeout_s)
        finally:
            elapsed = time.perf_counter() - started
            self.stats["sync_load_ms"] += round(elapsed * 1000)
            self.load_seconds.append(elapsed)

    def start_async_load(self, spec: LoadSpec) -> None:
        """Start a load that vLLM waits for between steps (reported by ``finished``)."""
        try:
            future, sink = self._start_load(spec)
        except Exception as exc:
            self._load_failed(spec, spec.start, exc)
            failed: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            failed.set_exception(exc)
            future, sink = failed, _GuardedSink(self._connector(), {"slot_mapping": []}, 0)
            sink.abandon()
        deadline = time.monotonic() + self.load_timeout_s if self.load_timeout_s is not None else math.inf
        with self._lock:
            self._async_loads[spec.req_id] = (spec, future, sink, deadline)

    def _settle(self, spec: LoadSpec, future: concurrent.futures.Future[torch.Tensor], sink: _GuardedSink,
                timeout: float | None) -> bool:
        if sink.runner is not None:  # run the copies handed over until the load is done or the time is up
            sink.runner.serve(future, timeout)
            self.stats["sync_load_copy_ms"] += round(sink.runner.busy_s * 1000)  # of sync_load_ms: copying
            timeout = 0
        try:
            ret_mask = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            sink.abandon()  # no byte lands in these blocks once vLLM is told to recompute them
            future.cancel()
            return self._load_failed(spec, spec.start, exc)
        except Exception as exc:
            sink.abandon()
            return self._load_failed(spec, spec.start, exc)
        covered = ret_mask[spec.start : spec.end]
        if bool(covered.all()):
            self.stats["tokens_loaded"] += spec.end - spec.start
            self.stats["requests_loaded"] += 1
            return True
        first_missing = spec.start + int(torch.nonzero(~covered)[0])
        self.stats["tokens_loaded"] += first_missing - spec.start
        return self._load_failed(spec, first_missing, None)

    def _load_failed(self, spec: LoadSpec, first_missing: int, exc: BaseException | None) -> bool:
        """Blocks from the one holding ``first_missing`` to the end of the load were not filled."""
        first_block = first_missing // self.block_size
        last_block = (spec.end - 1) // self.block_size
        with self._lock:
            self._load_errors.update(spec.block_ids[first_block : last_block + 1])
        self.stats["tokens_load_failed"] += spec.end - first_missing
        self.stats["load_failures"] += 1
        if exc is not None:
            logger.warning("tierkv: load of request %s failed (vLLM recomputes it): %s: %s",
                           spec.req_id, type(exc).__name__, exc)
        else:
            logger.info("tierkv: request %s: %d of %d tokens were no longer cached (vLLM recomputes them)",
                        spec.req_id, spec.end - first_missing, spec.end - spec.start)
        return False

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- vLLM's speed -----------------------------------------------------------------------------
    def step_started(self, parts: tuple[tuple[int, int], ...]) -> None:
        """vLLM's forward pass of a step that computes ``parts`` (``(new, context)`` per request)
        is about to start (vLLM bound the step's metadata)."""
        self._step = (time.perf_counter(), parts) if parts else None

    def restart_step_clock(self) -> None:
        """The step's synchronous loads are in: its forward pass starts now (not counted as compute)."""
        if self._step is not None:
            self._step = (time.perf_counter(), self._step[1])

    def step_ended(self) -> None:
        """The forward pass started by ``step_started`` is over: its time refines the engine's
        recompute speed, which the lookups' cost-aware plans and ``worth_storing`` use. vLLM's
        own steps are the measurement: nothing to configure, and it follows the machine's load."""
        step, self._step = self._step, None
        if step is None:
            return
        started, parts = step
        self.engine.core.observe_step(parts, time.perf_counter() - started)
        self.stats["steps_timed"] += 1
        speed = self.engine.core.recompute_tokens_per_s(1024)
        if speed is not None and math.isfinite(speed):
            self.stats["recompute_tokens_per_s"] = int(speed)

    # -- saves -----------------------------------------------------------------------------------
    def save(self, spec: SaveSpec) -> None:
        """Start storing the prompt's KV; it runs while vLLM computes the next step. A prompt the
        cost model says could never load faster than vLLM recomputes it is not stored
        (``saves_skipped_never_pay``): a save would only cost the replica's cores and the tiers'
        room."""
        with self._lock:
            futures = self._saves[spec.req_id]  # known even if the submit fails: its finish is still owed
        never_pays = self.disabled is None and not self.engine.core.worth_storing(len(spec.token_ids))
        if never_pays:
            self.stats["saves_skipped_never_pay"] += 1
        if self.disabled is not None or self.saves_elsewhere is not None or never_pays:
            skipped: concurrent.futures.Future[int] = concurrent.futures.Future()
            skipped.set_result(0)
            with self._lock:
                futures.append(skipped)
            if self.saves_elsewhere is not None:
                self.stats["saves_left_to_rank0"] += 1
                # rank 0's announcement is published once every rank made it; a node pool's journal
                # already has every engine announce every chunk
                if self.events is not None and not isinstance(self.events, PoolEventLog) and spec.block_hashes:
                    self._announce(spec)
            return
        connector = self._connector()
        slots = slot_mapping(spec.block_ids, self.block_size, len(spec.token_ids))
        try:
            future = self.engine.submit(self._store(spec, store_with_connector(
                self.engine.core, connector, spec.token_ids, identity=spec.identity, kvcaches=connector.views,
                slot_mapping=slots), connector))
        except Exception as exc:
            self.stats["save_failures"] += 1
            logger.warning("tierkv: save of request %s not started: %s: %s", spec.req_id, type(exc).__name__, exc)
            return
        future.add_done_callback(functools.partial(self._save_done, spec, len(spec.token_ids)))
        with self._lock:
            futures.append(future)

    async def _store(self, spec: SaveSpec, storing: Awaitable[int],
                     connector: PagedLayerConnector | MappedPageConnector) -> int:
        """The save, then its continuation tail (``.continuation``) and its retention hint
        (``retain_s``: the tail leased with the chunks) once they are in; the chunks of the
        save itself."""
        chunks = await storing
        end = self._tail_end(len(spec.token_ids))
        if end is not None:
            await self._store_tail(spec, end, connector)
        if spec.retain_s:
            try:
                self.stats["hint_retained_tokens"] += await self.engine.core.retain(spec.token_ids, spec.retain_s,
                                                                                    spec.identity, cut_at=end)
            except RetentionRefusedError as exc:
                self.stats["hint_retain_refused"] += 1
                logger.warning("tierkv: request %s: retention refused: %s", spec.req_id, exc)
        return chunks

    def _tail_end(self, num_tokens: int) -> int | None:
        """Where a save of a ``num_tokens`` prompt cuts its continuation tail (None: it stores none)."""
        if not self.continuation_tails or self.hybrid is not None:
            return None
        return saved_tail_end(num_tokens, self.engine.core.chunk_size, self.tail_step)

    async def _drop_prompt(self, tokens: np.ndarray, identity: RequestIdentity) -> int:
        """Drop a prompt's chunks and the continuation tail its save stored; the prompt's tokens dropped."""
        core = self.engine.core
        dropped = await core.drop(tokens, identity)
        end = self._tail_end(len(tokens))
        if end is not None:
            await core.batched_delete([core.cut_key(tokens, end, identity)])
        return dropped

    async def _store_tail(self, spec: SaveSpec, end: int, connector: PagedLayerConnector | MappedPageConnector
                          ) -> None:
        """Store the prompt's first ``end`` tokens' last (partial) chunk: where the next turn of
        the conversation will look for it. A failure costs only that future hit."""
        chunk = self.engine.core.chunk_size
        mask = torch.zeros(end, dtype=torch.bool)
        mask[end // chunk * chunk:] = True
        try:
            written = await store_with_connector(
                self.engine.core, connector, spec.token_ids[:end], mask, identity=spec.identity,
                kvcaches=connector.views, slot_mapping=slot_mapping(spec.block_ids, self.block_size, end))
        except Exception as exc:
            self.stats["continuation_save_failures"] += 1
            logger.debug("tierkv: request %s: continuation tail not saved: %r", spec.req_id, exc)
            return
        self.stats["continuation_tails_saved"] += written
        if written and self.events is not None:
            with self._lock:
                self._cuts_saved[spec.req_id] = end

    def _identities(self, identity: RequestIdentity) -> list[RequestIdentity]:
        """The identities a request's chunks are keyed under: its own, or for a hybrid model one
        per KV cache group (each group's chunks have keys of their own)."""
        return self.hybrid.identities(identity) if self.hybrid is not None else [identity]

    def drop(self, spec: DropSpec) -> None:
        """A hint: drop the prompt's chunks from every tier, or every chunk of its identity (in
        the background; a hybrid model's, every group's)."""
        core, identities = self.engine.core, self._identities(spec.identity)
        if spec.whole_identity:
            self._hint(spec.req_id, "dropped_scope", _over(identities, core.drop_identity, sum), "chunks")
        else:
            self._hint(spec.req_id, "dropped",
                       _over(identities, lambda identity: self._drop_prompt(spec.token_ids, identity), _longest))

    def prefetch(self, spec: PrefetchSpec) -> None:
        """A hint: move a prompt's cached prefix up from the lower tiers (in the background; its
        outcome counted once the moves landed; a hybrid model's, every group's)."""
        core = self.engine.core
        self._hint(spec.req_id, "prefetched",
                   _over(self._identities(spec.identity),
                         lambda identity: core.prefetch(spec.token_ids, identity, wait=True), _longest))

    def _hint(self, req_id: str, what: str, work: Coroutine[Any, Any, int], unit: str = "tokens") -> None:
        if self.disabled is not None:
            work.close()
            return

        def done(future: concurrent.futures.Future[int]) -> None:
            if future.cancelled() or future.exception() is not None:
                self.stats["hint_failures"] += 1
                logger.warning("tierkv: request %s: %s hint failed: %r", req_id, what,
                               None if future.cancelled() else future.exception())
            else:
                self.stats[f"hint_{what}_{unit}"] += future.result()
            if self.on_saved is not None:  # the stats file shows the outcome at once
                self.on_saved()
        self.engine.submit(work).add_done_callback(done)

    def _save_done(self, spec: SaveSpec, num_tokens: int, future: concurrent.futures.Future[int]) -> None:
        with self._lock:
            cut = self._cuts_saved.pop(spec.req_id, None)
        if future.cancelled() or future.exception() is not None:
            self.stats["save_failures"] += 1
            error = None if future.cancelled() else future.exception()
            kind = (type(error).__name__, str(error).split(":", 1)[0])  # e.g. a tier's CapacityError
            said = kind in self._failures_said
            self._failures_said.add(kind)
            logger.log(logging.DEBUG if said else logging.WARNING,
                       "tierkv: save of request %s failed (a future miss): %r%s", spec.req_id, error,
                       "" if said else " (later failures of this kind are counted in save_failures, logged at debug)")
        else:
            chunks = future.result()
            self.stats["chunks_saved"] += chunks
            self.stats["requests_saved"] += 1
            self.stats["prompt_tokens_saved"] += num_tokens if chunks else 0
            if self.events is not None and spec.block_hashes:
                self._announce(spec, cut)
        if self.on_saved is not None:
            self.on_saved()

    def reset_memory_tiers(self) -> int:
        """Clear this worker's memory tiers (this instance's alone); the chunks cleared.

        It waits for what it resets first: the saves started before it (one landing after the
        clear would fill the tier again, and vLLM would load from a cache it was told is
        empty) and the engine's background work (fills and promotions), so the tiers below
        hold everything saved before the reset and nothing lands in a cleared tier after it.
        Raises TimeoutError (a failed reset, the tiers untouched) when that work is still
        running after ``RESET_WAIT_S``."""
        deadline = time.monotonic() + RESET_WAIT_S
        with self._lock:
            pending = [future for futures in self._saves.values() for future in futures]
        if self.hybrid is not None:
            pending += self.hybrid.pending_saves()
        _, running = concurrent.futures.wait(pending, timeout=RESET_WAIT_S)
        if running:
            raise TimeoutError(f"{len(running)} save(s) still running after {RESET_WAIT_S:.0f} s: the memory tiers "
                               "were not cleared")
        return int(self.engine.run(self._clear_memory_tiers(max(0.0, deadline - time.monotonic()))))

    async def _clear_memory_tiers(self, within_s: float) -> int:
        """On the engine's loop: let its background work land (within ``within_s``), then
        delete every chunk of its memory tiers; how many."""
        try:
            await asyncio.wait_for(self.engine.core.flush(), within_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the engine's fills were still running after {RESET_WAIT_S:.0f} s: the memory tiers "
                               "were not cleared") from None
        cleared = 0
        for tier in self.engine.tiers:
            resident = getattr(tier, "resident_keys", None)  # the memory tiers
            if isinstance(tier, InPlaceTier) and callable(resident):
                for key in resident():
                    cleared += bool(await tier.delete(key))
        return cleared

    # -- vLLM KV events --------------------------------------------------------------------------
    def record_events(self, block_size: int, hash_algorithm: str = "sha256") -> None:
        """Record vLLM KV events (vLLM's ``enable_kv_cache_events``): stores into the first tier
        and what that tier drops (a memory tier says when; other first tiers report stores only).
        A node pool as the first tier: every engine on it announces every engine's chunks, and
        every removal (``pool_events``)."""
        first = self.engine.tiers[0]
        if journaled(first):
            meta = self.engine.core.metadata
            namespace = namespace_tag(meta.fmt, meta.model_name, meta.world_size, meta.worker_id,
                                      meta.identity_parts())
            self.events = PoolEventLog(cast(JournaledTier, first), block_size, namespace,
                                       hash_fingerprint(hash_algorithm))
            return
        self.events = KVEventLog(first.name, block_size)
        if hasattr(first, "removal_listener"):
            first.removal_listener = self.events.removed

    def _announce(self, spec: SaveSpec, cut: int | None = None) -> None:
        """Announce a landed save's chunks; with ``cut`` (where the continuation tail its save
        stored ends), that partial chunk too, as a second holder of the full blocks it covers:
        while either it or the prompt's own last chunk is held, its blocks are not removed."""
        assert self.events is not None
        core = self.engine.core
        try:
            keys = self.engine.keys_for(spec.token_ids, spec.identity)
            cut_keys = [] if cut is None else [core.cut_key(spec.token_ids, cut, spec.identity)]
        except Exception as exc:  # an event stream is best effort; the save itself landed
            logger.warning("tierkv: no KV event for request %s: %s", spec.req_id, exc)
            return
        self.events.stored(keys, core.chunk_size, spec.token_ids, spec.block_hashes, spec.lora_name)
        if cut is not None:
            index = cut // core.chunk_size
            self.events.stored([*keys[:index], *cut_keys], core.chunk_size, spec.token_ids[:cut], spec.block_hashes,
                               spec.lora_name, chunks=[index])

    def take_events(self) -> TierKVEvents | None:
        return self.events.take() if self.events is not None else None

    def wait_for_saves(self, req_ids: Sequence[str]) -> None:
        """Block until the saves of ``req_ids`` are done (their blocks are about to be reused)."""
        with self._lock:
            pending = [future for req_id in req_ids for future in self._saves.get(req_id, [])]
        concurrent.futures.wait(pending)

    # -- completion reports ----------------------------------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(requests vLLM has finished whose saves are done, async loads now over, those of
        them that could not fill every block). Call before ``take_load_errors``: a failed
        async load's blocks are reported in the same step as the load's end.

        An async load of a request vLLM has finished (aborted while it waited for its KV) is
        abandoned: its remaining chunks are not written, and it is reported over only once no
        chunk is being written, since vLLM frees the request's blocks when it hears that. One
        still running ``load_timeout_s`` after it started (a hung tier) is abandoned the same
        way and reported failed: vLLM recomputes its blocks."""
        now = time.monotonic()
        with self._lock:
            self._owed |= {req_id for req_id in finished_req_ids if req_id in self._saves}
            sending = {req_id for req_id in self._owed if all(f.done() for f in self._saves[req_id])}
            for req_id in sending:
                self._owed.discard(req_id)
                del self._saves[req_id]
            aborted = [(req_id, entry) for req_id, entry in self._async_loads.items()
                       if req_id in finished_req_ids and not entry[1].done()]
            for req_id, _ in aborted:
                del self._async_loads[req_id]
            late = [(req_id, entry) for req_id, entry in self._async_loads.items()
                    if not entry[1].done() and now >= entry[3]]
            for req_id, _ in late:
                del self._async_loads[req_id]
            done_loads = [(req_id, entry) for req_id, entry in self._async_loads.items() if entry[1].done()]
            for req_id, _ in done_loads:
                del self._async_loads[req_id]
        for _, (_, future, sink, _) in aborted:
            sink.abandon()
            future.cancel()
            self.stats["loads_abandoned"] += 1
        for _, (spec, future, sink, _) in late:
            sink.abandon()  # returns once no chunk is being written: the blocks can go back to vLLM
            future.cancel()
            self.stats["load_timeouts"] += 1
            self._load_failed(spec, spec.start, TimeoutError(f"still running after {self.load_timeout_s:.1f} s"))
        failed = {req_id for req_id, (spec, future, sink, _) in done_loads if not self._settle(spec, future, sink, 0)}
        failed |= {req_id for req_id, _ in late}
        recving = {req_id for req_id, _ in done_loads + aborted + late}
        if self.hybrid is not None:
            over, hybrid_failed = self.hybrid.finished(finished_req_ids)
            recving |= over
            failed |= hybrid_failed
        return sending, recving, failed

    def close(self) -> None:
        """Let saves in flight land."""
        with self._lock:
            pending = [future for futures in self._saves.values() for future in futures]
        if self.hybrid is not None:
            pending += self.hybrid.pending_saves()
        concurrent.futures.wait(pending, timeout=self.load_timeout_s)


async def _over(identities: Sequence[RequestIdentity], work: Callable[[RequestIdentity], Awaitable[int]],
                combine: Callable[[list[int]], int]) -> int:
    """``work`` for each identity, one after another on the engine's loop; their counts combined."""
    return combine([await work(identity) for identity in identities])


def _longest(counts: list[int]) -> int:
    """A hybrid model's groups each cover the prompt: the prompt's tokens, not a sum over groups."""
    return max(counts, default=0)
