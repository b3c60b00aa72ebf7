"""The two circuit breakers of a tier: the engine's ``CooldownBreaker`` (any backend) and
``CircuitBreaker``, with a background probe, for backends that talk to a remote store.

A remote tier (an object store, a cache server) can be down or slow; serving must never
wait on it. ``CircuitBreaker`` counts consecutive failures; after ``failure_threshold``
of them the tier is *unhealthy*: ``CircuitBreaker.check`` raises
``tierkv.errors.TierUnavailableError`` at once (fail fast, no network round trip),
and a background task calls the backend's cheap ``probe`` every ``probe_interval_s``.
The first probe that succeeds makes the tier healthy again, with no traffic needed.

The engine has a breaker of its own (it skips a failing tier for a while); this one lives
inside the backend so that a backend used on its own behaves the same, and so the probe
can be a request that costs nothing (a HEAD on the bucket) instead of a real chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tierkv.errors import TierUnavailableError

logger = logging.getLogger("tierkv.health")

Probe = Callable[[], Awaitable[object]]


class CircuitBreaker:
    """Healthy/unhealthy state of one tier; fail fast while unhealthy; probe to recover."""

    def __init__(self, name: str, probe: Probe, failure_threshold: int = 3, probe_interval_s: float = 2.0) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.name = name
        self.failure_threshold = failure_threshold
        self.probe_interval_s = probe_interval_s
        self._probe = probe
        self.healthy = True
        self.consecutive_failures = 0
        self.counts = {"failures": 0, "rejected_unhealthy": 0, "probes": 0, "trips": 0, "recoveries": 0}
        self.last_error: str | None = None
        self.unhealthy_since: float | None = None
        self._prober: asyncio.Task[None] | None = None

    def check(self) -> None:
        """Raise TierUnavailableError at once if the tier is unhealthy (and make sure it is probed)."""
        if self.healthy:
            return
        self.counts["rejected_unhealthy"] += 1
        self._ensure_prober()
        down_for = time.monotonic() - (self.unhealthy_since or time.monotonic())
        raise TierUnavailableError(f"tier {self.name!r} is unhealthy (down for {down_for:.1f}s, probed every "
                                   f"{self.probe_interval_s:g}s); last error: {self.last_error}")

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if not self.healthy:
            self._recover()

    def record_failure(self, error: BaseException | str) -> None:
        """Count one failed operation; trip to unhealthy after ``failure_threshold`` in a row."""
        self.consecutive_failures += 1
        self.counts["failures"] += 1
        self.last_error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.healthy and self.consecutive_failures >= self.failure_threshold:
            self.healthy = False
            self.unhealthy_since = time.monotonic()
            self.counts["trips"] += 1
            logger.warning("tier %r marked unhealthy after %d consecutive failures (last: %s); probing every %gs",
                           self.name, self.consecutive_failures, self.last_error, self.probe_interval_s)
            self._ensure_prober()

    def _recover(self) -> None:
        down_for = time.monotonic() - (self.unhealthy_since or time.monotonic())
        self.healthy = True
        self.unhealthy_since = None
        self.consecutive_failures = 0
        self.counts["recoveries"] += 1
        logger.warning("tier %r is healthy again after %.1fs", self.name, down_for)

    def _ensure_prober(self) -> None:
        if self._prober is not None and not self._prober.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside a loop: the next check() inside one starts it
            return
        self._prober = loop.create_task(self._probe_until_healthy(), name=f"tierkv-probe-{self.name}")

    async def _probe_until_healthy(self) -> None:
        while not self.healthy:
            await asyncio.sleep(self.probe_interval_s)
            self.counts["probes"] += 1
            try:
                await self._probe()
            except Exception as exc:  # noqa: BLE001 - a failed probe just means "still down"
                self.last_error = f"probe: {type(exc).__name__}: {exc}"
                continue
            self._recover()

    async def close(self) -> None:
        """Stop probing (the backend is closing)."""
        prober, self._prober = self._prober, None
        if prober is None or prober.done():
            return
        if prober.get_loop() is asyncio.get_running_loop():
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
        elif not prober.get_loop().is_closed():
            prober.get_loop().call_soon_threadsafe(prober.cancel)

    def state(self) -> dict[str, Any]:
        """Plain-data view for ``stats()``."""
        return {"healthy": self.healthy, "consecutive_failures": self.consecutive_failures,
                "last_error": self.last_error, **self.counts}


class CooldownBreaker:
    """The engine's breaker for one tier (``Tier.breaker``): after ``threshold`` consecutive
    failures the tier is skipped for ``cooldown_s``, then one operation is let through as a
    probe. Any backend gets it; a remote backend may add a ``CircuitBreaker`` of its own."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.consecutive_failures = 0
        self.total_failures = 0
        self.retry_at: float | None = None
        self.last_error: str | None = None

    def available(self, now: float) -> bool:
        """Whether operations should be sent to the tier now."""
        return self.retry_at is None or now >= self.retry_at

    @property
    def healthy(self) -> bool:
        return self.retry_at is None

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.retry_at = None

    def record_failure(self, now: float, error: str) -> None:
        self.consecutive_failures += 1
        self.total_failures += 1
        self.last_error = error
        if self.consecutive_failures >= self.threshold:
            self.retry_at = now + self.cooldown_s

    def state(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "consecutive_failures": self.consecutive_failures,
                "failures": self.total_failures, "last_error": self.last_error}
