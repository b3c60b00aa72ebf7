"""The router's calls that are running, so that ``close()`` closes no tier under one of them.

A call into the router (a store, a read, a lookup) passes ``CallGate.call`` before it
touches a tier: it is refused with ``tierkv.errors.BackendClosedError`` once the gate is
shut, and counted while it runs otherwise. ``CallGate.shut`` refuses new calls and waits
for the counted ones to end, so a call that began before ``close()`` runs to its end against
open tiers and a live fill worker (it completes; the caller's next call is refused), instead
of meeting a tier closed under it and failing with whatever that tier's error turns into. Only
a call still running after the grace (a tier that hangs) can see a closed tier; the router
turns what that costs a store into ``BackendClosedError`` too.

Everything here runs on the router's event loop (no lock: a call enters and leaves there);
``shut`` may be read from any thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from tierkv.errors import BackendClosedError


class CallGate:
    """Admits router calls until ``shut``, and knows how many are running."""

    def __init__(self) -> None:
        self._running = 0
        self._shut = False
        self._idle: asyncio.Event | None = None  # made by shut(), on the router's loop

    @property
    def shut_down(self) -> bool:
        """Whether new calls are refused (close has begun)."""
        return self._shut

    @property
    def running(self) -> int:
        """How many admitted calls have not ended yet."""
        return self._running

    def check(self) -> None:
        """Raise BackendClosedError once the gate is shut (from any thread)."""
        if self._shut:
            raise BackendClosedError("engine is closed")

    @contextmanager
    def call(self) -> Iterator[None]:
        """One router call: refused once shut, counted until it ends (however it ends)."""
        self.check()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0 and self._idle is not None:
                self._idle.set()

    async def shut(self, grace_s: float) -> int:
        """Refuse new calls, then wait up to ``grace_s`` seconds for the running ones to end;
        how many are still running then (0: none can meet a closed tier). No call enters once
        shut, so the count only goes down."""
        self._shut = True
        if not self._running:
            return 0
        self._idle = asyncio.Event()
        idle = asyncio.ensure_future(self._idle.wait())
        try:
            await asyncio.wait({idle}, timeout=grace_s)
        finally:
            idle.cancel()
        return self._running
