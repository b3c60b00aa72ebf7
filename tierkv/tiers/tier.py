"""One tier as the router sees it: a backend with its counters, health, speed estimate,
promote flag, memory-pressure and full-disk state.

One module of about 460 lines, by choice: one class, and every call into a backend passes here,
so the accounting of each call (counters, breaker, speed, full-disk pause) sits beside the call
it counts; the memory-pressure watcher is ``tierkv.tiers.tier_pressure``.

A ``Tier`` owns every call into its backend: a put (with timeout, counters, health and
the full-disk pause), a read into given memory or a plain get (timeouts and deadlines,
errors as misses, speed samples), and the answer to "may new chunks go here now?". The
router decides *which* tier; the handle says how one tier is asked and what it cost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch

from tierkv.backend.coded import CodedBackend
from tierkv.backend.contract import (
    ChunkHold,
    DemoteSink,
    InPlaceTier,
    NamesVictims,
    ReclaimsHeldMemory,
    StorageBackend,
    SupportsDemotion,
)
from tierkv.chunks import ownership
from tierkv.chunks.keys import CacheKey
from tierkv.chunks.kvlayout import nbytes_of
from tierkv.config.loader import HealthConfig, PressureConfig
from tierkv.errors import CapacityError, ChunkFormatError, TierFullError
from tierkv.metrics import TierMetrics
from tierkv.policy.admission import Admission, FrequencySketch
from tierkv.policy.health import CooldownBreaker
from tierkv.policy.planner import TierSpeed
from tierkv.policy.pressure import MemoryProbe
from tierkv.tiers.tier_pressure import Spawn, TierPressure, watch

logger = logging.getLogger("tierkv.engine")

T = TypeVar("T")
B = TypeVar("B", bound=StorageBackend)
"""A backend, or a wrapper of one (``Tier.wrap``)."""

Writer = Callable[[dict[CacheKey, torch.Tensor]], Awaitable[None]]
"""Fills an in-place tier's reserved chunks (key -> view of its memory)."""
Layouts = list[tuple[tuple[int, ...], torch.dtype]]

ADMIT_ALL = Admission()
_IN_PLACE: dict[type, bool] = {}  # isinstance of a runtime Protocol is slow: once per class


class Tier:
    """A backend at one level of the stack, with everything the router tracks about it."""

    def __init__(self, backend: StorageBackend, level: int, promote: bool, health: HealthConfig,
                 admission: Admission = ADMIT_ALL, sketch: FrequencySketch | None = None, codec: str = "none") -> None:
        self.backend = backend
        self.admission = admission
        self.sketch = sketch  # the engine's counts of sightings, shared by its tiers
        self.name = backend.name
        self.level = level
        self.promote = promote
        self.metrics = TierMetrics()
        self.speed = TierSpeed(type(backend).speed_seed)
        self.breaker = CooldownBreaker(health.failure_threshold, health.retry_after_s)
        self.timeout = health.timeout_s
        self.full_retry_s = health.retry_after_s
        self.full: tuple[float, str] | None = None  # (when it said full, what it said)
        self._last_failure = ""  # the last failure logged (its repeats are not)
        self.pressure: TierPressure | None = None
        self.coded: CodedBackend | None = None
        if codec != "none":  # the tier's reads feed its speed line with the bytes moved, not decoded
            self.backend = self.coded = CodedBackend(backend, codec, self.speed.transfer_seconds, self.speed.observe)
            self.speed.coding = self.coded

    def wrap(self, wrapper: Callable[[StorageBackend], B]) -> B:
        """Put ``wrapper(backend)`` in the backend's place: every later call of the engine into
        this tier goes through it (a fault injector, a throttle, a tracer). It must keep the
        tier's name; the wrapped backend is returned. On a coded tier it wraps the store under
        the codec: it sees the bytes that are stored and moved (frames), as the medium does."""
        inner = self.coded.inner if self.coded is not None else self.backend
        wrapped = wrapper(inner)
        if not isinstance(wrapped, StorageBackend):
            raise TypeError(f"tier {self.name!r}: a wrapper must return a StorageBackend, got {type(wrapped).__name__}")
        if wrapped.name != self.name:
            raise ValueError(f"tier {self.name!r}: the wrapped backend is named {wrapped.name!r}; "
                             "expected the tier's own name")
        if self.coded is not None:
            self.coded.inner = wrapped
        else:
            self.backend = wrapped
        return wrapped

    @property
    def in_place(self) -> bool:
        """Whether the backend keeps chunks in memory written and read in place (``InPlaceTier``)."""
        kind = type(self.backend)
        known = _IN_PLACE.get(kind)
        if known is None:
            known = _IN_PLACE[kind] = isinstance(self.backend, InPlaceTier)
        return known

    # -- admission --------------------------------------------------------------------------
    def available(self, now: float | None = None) -> bool:
        """Whether the health breaker lets calls through (counted when it does not)."""
        if self.breaker.available(time.monotonic() if now is None else now):
            return True
        self.metrics.add("skipped_unhealthy")
        return False

    def admits(self, skipped: dict[str, str] | None = None) -> bool:
        """Whether new chunks may be written here now (healthy, not under pressure, not full);
        when not, why goes into ``skipped`` (tier name -> reason)."""
        if self.pressure is not None and not self.pressure.admitting:
            self.metrics.add("skipped_pressure")
            if skipped is not None:
                skipped[self.name] = f"under memory pressure (capacity now {self.backend.capacity_bytes} bytes)"
            return False
        if self.full is not None:
            now = time.monotonic()
            since, error = self.full
            if now < since + self.full_retry_s:  # bounded: then one put is let through to see
                if skipped is not None:
                    skipped[self.name] = (f"full for {now - since:.1f}s (asked again in "
                                          f"{since + self.full_retry_s - now:.1f}s): {error}")
                return False
        if self.available():
            return True
        if skipped is not None:
            skipped[self.name] = self.unhealthy_reason()
        return False

    def admit(self, keys: Sequence[CacheKey], chunk_nbytes: Sequence[int], unrecorded: int = 0) -> list[bool]:
        """Which of ``keys`` (chunks of ``chunk_nbytes`` bytes) may be copied into this tier by
        its admission rule (``tierkv.policy.admission``); counted as admitted / rejected.
        ``unrecorded``: sightings of each not counted yet (a hit being served)."""
        if not self.admission.filters or self.sketch is None or not keys:
            flags = [True] * len(keys)
        else:
            counts = [count + unrecorded for count in self.sketch.estimate(keys)]
            victim_counts = None
            if self.admission.policy == "tinylfu" and isinstance(self.backend, NamesVictims):
                victims = self.backend.next_victims(chunk_nbytes)
                if victims:  # the i-th chunk in would displace the i-th victim (the last, past the end)
                    seen = self.sketch.estimate(victims)
                    victim_counts = [seen[min(i, len(seen) - 1)] for i in range(len(keys))]
            flags = self.admission.admits(counts, victim_counts)
        admitted = sum(flags)
        self.metrics.add("admitted", admitted)
        self.metrics.add("rejected", len(flags) - admitted)
        return flags

    def unhealthy_reason(self) -> str:
        health = self.breaker
        now = time.monotonic()
        retry_at = health.retry_at if health.retry_at is not None else now
        return (f"unhealthy for {max(0.0, now - (retry_at - health.cooldown_s)):.1f}s after "
                f"{health.consecutive_failures} failures in a row (retried in {max(0.0, retry_at - now):.1f}s; "
                f"last error: {health.last_error})")

    def succeeded(self) -> None:
        """A call went through: the breaker closes, and the next failure is logged again."""
        self.breaker.record_success()
        self._last_failure = ""

    def failed(self, operation: str, exc: BaseException) -> None:
        """Count a failed call and feed the health breaker. The same failure again (a tier that
        stays down, probed every ``retry_after_s``) is logged at debug level, not once per call."""
        self.metrics.add("errors")
        said = f"{operation}: {type(exc).__name__}: {exc}"
        self.breaker.record_failure(time.monotonic(), said)
        level = logging.DEBUG if said == self._last_failure else logging.WARNING
        self._last_failure = said
        logger.log(level, "tier %r: %s failed: %s: %s", self.name, operation, type(exc).__name__, exc)

    # -- timeouts ---------------------------------------------------------------------------
    async def timed(self, awaitable: Awaitable[T]) -> T:
        """``awaitable`` within the health timeout (when one is set)."""
        if self.timeout is None:
            return await awaitable
        return await asyncio.wait_for(awaitable, self.timeout)

    async def timed_owned(self, awaitable: Awaitable[T], timeout: float | None = None, *,
                          run_to_end: bool = False) -> T:
        """``awaitable``, which copies into or out of memory it was lent, with a timeout
        (``timeout``, else the health timeout): a cancellation of the caller is delivered
        only once it stopped (``tierkv.chunks.ownership.finish``; ``asyncio.wait_for`` alone stops
        waiting when it is cancelled again while it cancels). At the timeout it is cancelled
        and waited for, or with ``run_to_end`` (a backend whose worker threads outlive its
        cancelled coroutine) left to finish before the timeout is raised."""
        timeout = self.timeout if timeout is None else timeout
        if timeout is None:
            return await ownership.finish(awaitable)
        if run_to_end:
            awaitable = ownership.finish(awaitable)
        return await ownership.finish(asyncio.wait_for(awaitable, timeout))

    # -- lifecycle --------------------------------------------------------------------------
    def demote_to(self, sink: DemoteSink) -> bool:
        """Write-back: chunks the tier evicts go to ``sink`` (the router's demotion) instead of
        being dropped; False when the backend cannot demote (``SupportsDemotion``)."""
        if not isinstance(self.backend, SupportsDemotion):
            return False
        self.backend.demote_sink = sink
        return True

    def reclaim_with(self, reclaim: Callable[[int, bool], Awaitable[int]]) -> bool:
        """Write-through: when a store needs memory that fills hold, the tier calls ``reclaim``
        (the fill worker's); False when the backend's memory is not held by fills."""
        if not isinstance(self.backend, ReclaimsHeldMemory):
            return False
        self.backend.reclaim = reclaim
        return True

    def watch_pressure(self, probe: MemoryProbe | None, config: PressureConfig, spawn: Spawn) -> None:
        """Start following memory pressure, when the backend can (see ``tier_pressure.watch``)."""
        self.pressure = watch(self.backend, probe, config, spawn)

    async def stop_watching(self) -> None:
        """Stop the pressure monitor, if one runs."""
        if self.pressure is not None:
            await self.pressure.monitor.stop()

    async def close(self) -> None:
        """Close the backend; an error is logged, not raised (every other tier still closes)."""
        try:
            await self.backend.close()
        except Exception:
            logger.exception("closing tier %r", self.name)

    # -- questions without data -------------------------------------------------------------
    async def contains(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        """Whether the tier holds each key, within the health timeout; None when it failed
        (counted). An answer does not reset the failure streak: an index can answer while
        every read fails, and the breaker must still trip."""
        try:
            return list(await self.timed(self.backend.batched_contains(list(keys))))
        except Exception as exc:
            self.failed("contains", exc)
            return None

    def contains_nowait(self, keys: Sequence[CacheKey]) -> list[bool] | None:
        """``contains`` from the tier's in-memory index, from any thread; None when the
        tier has none (its answer needs I/O)."""
        return self.backend.batched_contains_nowait(list(keys))

    async def delete(self, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys``; how many were there. A failure (counted) ends the call: the keys
        before it are removed, the rest are not tried."""
        removed = 0
        for key in keys:
            try:
                removed += bool(await self.timed(self.backend.delete(key)))
            except Exception as exc:
                self.failed("delete", exc)
                break
        return removed

    @property
    def streams_into_destination(self) -> bool:
        """Whether a read writes into the caller's memory while it runs (see
        ``tierkv.backend.StorageBackend.streams_into_destination``)."""
        return bool(self.backend.streams_into_destination)

    @property
    def lossy(self) -> bool:
        """Whether the tier keeps its chunks with a lossy codec (what it serves is not exact)."""
        return self.coded is not None and self.coded.marker != ""

    @property
    def persistent(self) -> bool:
        """Whether the tier keeps its chunks across processes (a memory tier does not)."""
        return bool(self.backend.persistent)

    # -- writes -----------------------------------------------------------------------------
    async def chunks_to_copy(self, keys: Sequence[CacheKey]) -> tuple[list[torch.Tensor | None], list[Any]]:
        """The chunks of ``keys`` to copy elsewhere (None where absent) and the holds to
        release once the copy is over: an in-place tier lends its memory, pinned; any other
        is read within the health timeout. Not counted as hits: nobody asked for them."""
        if self.in_place:
            holds = self.hold(keys, pin=True)
            return [None if hold is None else hold.chunk for hold in holds], holds
        return list(await self.timed(self.backend.batched_get(list(keys)))), []

    def hold(self, keys: Sequence[CacheKey], pin: bool) -> list[ChunkHold | None]:
        """Holds on an in-place tier's chunks (see ``tierkv.backend.InPlaceTier``)."""
        return list(self.backend.hold(keys, pin=pin))  # type: ignore[attr-defined]

    async def put(self, keys: list[CacheKey], chunks: list[torch.Tensor] | None = None, *,
                  layouts: Layouts | None = None, write: Writer | None = None,
                  fill_holds: list[Any] | None = None, on_commit: Callable[[], None] | None = None) -> int:
        """Put ``chunks`` (or, in an in-place tier, let ``write`` fill chunks of ``layouts`` in
        its memory), with timeout, metrics and health; chunks stored.

        ``fill_holds`` (write-through, an in-place tier): receives holds on the chunks taken
        at the moment they are committed, so no other store evicts them before their fill
        is queued (a chunk evicted then would be in no tier at all). ``on_commit`` runs at
        the commit, before any other task can evict the chunks (write-back marks them dirty
        there); for a tier that is not in place, once the put returned."""
        tier = self.backend
        started = time.perf_counter()
        if self.in_place and write is None and chunks is not None:  # the tier's own copy, in place
            layouts, write = [(tuple(c.shape), c.dtype) for c in chunks], _copier(tier, keys, chunks)
        extra: dict[str, Any] = {}
        if self.in_place and (fill_holds is not None or on_commit is not None):
            def committed() -> None:
                if on_commit is not None:
                    on_commit()
                if fill_holds is not None:
                    fill_holds.extend(self.hold(keys, pin=False))
            extra["on_commit"] = committed
        try:
            if write is not None and layouts is not None:
                stored = await self.timed_owned(tier.put_with(keys, layouts, write, **extra))  # type: ignore[attr-defined]
                nbytes = sum(nbytes_of(shape, dtype) for shape, dtype in layouts)
            else:
                if chunks is None:
                    raise TypeError(f"tier {self.name!r}: a put needs chunks, or layouts and a writer")
                # the tier reads the chunks (a caller's tensor, held slabs) until the put stopped,
                # and a backend's worker thread may go on after its coroutine was cancelled: a
                # timeout or cancellation waits for the put's end before that memory goes back
                stored = await self.timed_owned(tier.batched_put(keys, chunks), run_to_end=True)
                nbytes = sum(c.nbytes for c in chunks)
                if on_commit is not None:
                    on_commit()
        except TierFullError as exc:  # the tier's store is full: not admitting for a while, reads go on
            self.metrics.add("errors")
            if self.full is None:
                logger.warning("tier %r: full, not admitting for %.1fs: %s", self.name, self.full_retry_s, exc)
            self.full = (time.monotonic(), str(exc))
            raise
        except CapacityError as exc:  # the tier is fine, the chunk just does not fit
            self.metrics.add("errors")
            logger.info("tier %r: %s", self.name, exc)
            raise
        except Exception as exc:
            self.failed("put", exc)
            raise
        self.metrics.put_latency.observe(time.perf_counter() - started)
        self.succeeded()
        if self.full is not None:
            self.full = None
            logger.info("tier %r: admitting again (a put succeeded)", self.name)
        self.metrics.add("puts", stored)
        self.metrics.add("bytes_in", nbytes)
        return stored

    # -- reads ------------------------------------------------------------------------------
    async def get_into(self, keys: list[CacheKey], outs: list[torch.Tensor], deadline: float | None = None,
                       abandonable: bool = False) -> list[bool]:
        """``batched_get_into`` with timeout, metrics and health; errors are misses. At
        ``deadline`` the chunks not in yet are misses (counted apart: a slow tier is not a
        failing one).

        ``abandonable``: ``outs`` are staging buffers nobody else uses (kept alive by the
        tier's worker while it writes), so a timeout or cancellation may leave the read
        behind. Otherwise (a caller's memory, slabs) the read is waited for to its end."""
        timeout, by_deadline = self.timeout, False
        if deadline is not None:
            remaining = max(0.0, deadline - time.monotonic())
            if timeout is None or remaining < timeout:
                timeout, by_deadline = remaining, True
        if by_deadline and timeout is not None and timeout <= 0:  # past the deadline already: nothing is asked
            self.metrics.add("deadline_misses", len(keys))
            return [False] * len(keys)
        started = time.perf_counter()
        try:
            request = self.backend.batched_get_into(keys, outs)
            if abandonable:
                got = await (request if timeout is None else asyncio.wait_for(request, timeout))
            else:
                got = await self.timed_owned(request, timeout, run_to_end=True)
        except TimeoutError as exc:
            if by_deadline:
                self.metrics.add("deadline_misses", len(keys))
            else:
                self.failed("get", exc)
            return [False] * len(keys)
        except Exception as exc:
            self.failed("get", exc)
            return [False] * len(keys)
        self.metrics.get_latency.observe(time.perf_counter() - started)
        self.succeeded()
        self.count_read(len(got), [out for out, hit in zip(outs, got) if hit], started)
        return list(got)

    async def get(self, keys: list[CacheKey]) -> list[torch.Tensor | None]:
        """``batched_get`` within the health timeout; errors are misses, an undecodable chunk
        is dropped (see ``_get_one_checked``)."""
        started = time.perf_counter()
        try:
            got = await self.timed(self.backend.batched_get(keys))
        except ChunkFormatError:
            got = [await self._get_one_checked(key) for key in keys]
        except Exception as exc:
            self.failed("get", exc)
            return [None] * len(keys)
        self.metrics.get_latency.observe(time.perf_counter() - started)
        self.succeeded()
        self.count_read(len(got), [c for c in got if c is not None], started)
        return got

    def count_read(self, asked: int, hits: Sequence[torch.Tensor], started: float) -> None:
        """Hits, misses and bytes of one read that began at ``started`` (perf_counter), and a
        sample of the tier's speed for the cost model."""
        nbytes = sum(chunk.nbytes for chunk in hits)
        self.metrics.add("hits", len(hits))
        self.metrics.add("misses", asked - len(hits))
        self.metrics.add("bytes_out", nbytes)
        if nbytes and self.coded is None:  # a coded tier times its transfers itself
            self.speed.observe(nbytes, time.perf_counter() - started)

    async def _get_one_checked(self, key: CacheKey) -> torch.Tensor | None:
        """A get that turns an undecodable value into a miss, a delete and a count, for a
        backend that raised instead of dropping it itself (counted by the backend's
        ``tierkv.backend.StorageBackend.count_corrupt``, like its own drops)."""
        try:
            return await self.backend.get(key)
        except ChunkFormatError as exc:
            self.backend.count_corrupt([(key.to_string(), exc)])
            await self.backend.delete(key)
            return None

    def stats(self) -> dict[str, Any]:
        """The backend's own stats, the router's counters, health, speed, full and pressure state."""
        entry = {**self.backend.stats(), **self.metrics.snapshot()}
        entry["health"] = self.breaker.state()
        entry["promote"] = self.promote
        entry["admission"] = self.admission.describe()
        entry["speed"] = self.speed.snapshot()
        full = self.full
        entry["full"] = None if full is None else {"for_s": round(time.monotonic() - full[0], 3), "error": full[1]}
        if self.pressure is not None:
            entry["pressure"] = self.pressure.describe()
        return entry


def _copier(tier: StorageBackend, keys: list[CacheKey], chunks: list[torch.Tensor]) -> Writer:
    """The writer of an in-place tier's put of ``chunks``: the tier's own copy into its slabs
    (later duplicates of a key win)."""
    latest = dict(zip(keys, chunks))

    async def write(views: dict[CacheKey, torch.Tensor]) -> None:
        await tier.copy_chunks([(view, latest[key].detach()) for key, view in views.items()])  # type: ignore[attr-defined]
    return write


def release_all(holds: Sequence[Any]) -> None:
    """Release every hold (None entries are skipped)."""
    for hold in holds:
        if hold is not None:
            hold.release()


def rejection(exc: BaseException) -> str:
    """Why a tier did not take a put, for ``tierkv.errors.TierUnavailableError``."""
    if isinstance(exc, TierFullError):
        return f"full: {exc}"
    if isinstance(exc, CapacityError):
        return f"rejected the size: {exc}"
    return f"failed: {type(exc).__name__}: {exc}"
