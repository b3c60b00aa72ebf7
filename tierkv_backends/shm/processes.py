"""The processes attached to a ``shm`` pool: a slot each (claimed with its kernel liveness lock),
a heartbeat, the lease that takes back a stopped process's holds, what a resumed process does
when it finds that happened, and the check that the pool file did not shrink under them.

Kept apart from the pool's state machine (``tierkv_backends.shm.pool``) because who is
attached, alive and running is one question (asked of the kernel, ``liveness``), and what
the pool does with a dead or stopped process's entries is another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from typing import Any

import numpy as np

from tierkv.errors import ConfigError, TierUnavailableError
from tierkv_backends.shm import liveness
from tierkv_backends.shm.file import now_ns
from tierkv_backends.shm.index import PoolIndex
from tierkv_backends.shm.layout import Word

logger = logging.getLogger("tierkv_backends.shm_pool")


def _process_start(pid: int) -> int:
    """A process's start time in clock ticks since boot (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return 0


def _process_state(pid: int) -> str:
    """A process's run state as ps shows it ("stopped" for T), "" when unknown here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            code = handle.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""
    return {"T": "stopped", "t": "stopped by a debugger", "D": "waiting on I/O", "Z": "a zombie"}.get(code, "")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class PoolBrokenError(TierUnavailableError):
    """The pool file shrank under this process (someone truncated it): its mapping cannot be
    touched (a SIGBUS), so the process stops using the pool."""


class PoolProcesses(PoolIndex):
    """This process's slot in a pool, and what it knows of the others' (see the module docstring)."""

    def _init_processes(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.broken: str | None = None
        self.rejoins = 0  # times this process found its holds taken back (it had been stopped)
        self._pidns = _pid_namespace()
        self.slot = -1
        self.token = 0
        self._free_positions: list[int] = []
        self._pending: list[Any] = []  # Held: releases that could not take the lock, done at the next one
        self._pending_aborts: list[int] = []  # reserved entries to give back at the next one
        self._stop = threading.Event()

    def _start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._beat, name="tierkv-shm-heartbeat", daemon=True)
        self._heartbeat.start()

    def _holder(self) -> str:
        """Who holds the lock, for messages: a process slot's pid (and whether it is stopped, when
        its pid means something here)."""
        try:
            slot = int(self.words[Word.HOLDER]) - 1
            if not 0 <= slot < self.geometry.max_processes:
                return "a process attaching or leaving" if slot >= 0 else "another process"
            pid = int(self.procs["pid"][slot])
        except (AttributeError, ValueError):
            return "another process"
        where = "" if int(self.procs["pidns"][slot]) == self._pidns else " in another pid namespace"
        state = _process_state(pid) if not where else ""
        return f"pid {pid}{where}" + (f" ({state})" if state else "")

    # -- a shrunk file -------------------------------------------------------------------------
    def check_intact(self) -> None:
        """Raise ``PoolBrokenError`` when the pool file is shorter than the mapping (checked
        by one ``fstat``: before each batch, at each heartbeat); the first time, one error line.
        A truncation between this check and a copy still kills the process (SIGBUS): no
        check can close that window, only not truncating a live pool."""
        if self.broken is None:
            size = self.shrunk()
            if size is None:
                return
            self.broken = (f"the pool file at {self.path!r} shrank to {size} bytes under this process (it must be "
                           f"{self.layout.file_bytes}): something truncated it")
            logger.error("%s: %s; this process stops using the pool (touching its mapping would kill it with "
                         "SIGBUS) and serves from its other tiers. Remove the file and restart the processes that "
                         "share it for a new pool", self.where, self.broken)
        raise PoolBrokenError(f"{self.where}: {self.broken}")

    # -- processes -----------------------------------------------------------------------------
    def _claim_slot(self) -> None:
        pids = self.procs["pid"]
        slot = next((int(s) for s in np.flatnonzero(pids == 0) if liveness.claim(self._fd, int(s))), -1)
        if slot < 0:
            raise ConfigError(f"{self.where}: the pool at {self.path!r} has all its {self.geometry.max_processes} "
                              "process slots taken by live processes (max_processes)")
        self.token = secrets.randbits(62) + 1
        self.holds[slot][:] = -1
        self.procs["start"][slot] = _process_start(os.getpid())
        self.procs["pidns"][slot] = self._pidns
        self.procs["heartbeat"][slot] = now_ns()
        self.procs["token"][slot] = self.token
        self.procs["holds"][slot] = 0
        self.procs["pid"][slot] = os.getpid()
        self.slot = slot
        self._free_positions = list(range(self.geometry.holds_per_process - 1, -1, -1))
        self._pending.clear()

    def _rejoin_if_revoked(self) -> None:
        """Under the lock: when another process took this one's holds back (its heartbeat had
        stopped for ``lease_s``: it was stopped or frozen), forget them without touching any
        count (the taker gave them back), and go on under a new token in the same slot (a slot
        is never given to another process while its own lives: ``liveness``). Holds taken
        before are stale: their reads are misses."""
        slot = self.slot
        if int(self.procs["token"][slot]) == self.token and int(self.procs["pid"][slot]) == os.getpid():
            return
        if int(self.procs["pid"][slot]) != os.getpid():  # never expected: the slot is not ours any more
            logger.warning("%s: this process's slot in the pool at %s was given away; taking a new one",
                           self.where, self.path)
            with contextlib.suppress(OSError):
                liveness.give_up(self._fd, slot)
            self._claim_slot()
            return
        self.token = secrets.randbits(62) + 1
        self.holds[slot][:] = -1
        self.procs["holds"][slot] = 0
        self.procs["heartbeat"][slot] = now_ns()
        self.procs["token"][slot] = self.token
        self._free_positions = list(range(self.geometry.holds_per_process - 1, -1, -1))
        self._pending.clear()
        self.rejoins += 1
        logger.warning("%s: this process's holds in the pool at %s were taken back while it did not run for "
                       "lease_s=%gs (stopped or frozen); the reads it had in flight are misses", self.where,
                       self.path, self.lease_s)

    def _beat(self) -> None:
        while not self._stop.wait(max(0.05, self.lease_s / 4)):
            try:
                if self.broken is not None or self.shrunk() is not None:
                    with contextlib.suppress(PoolBrokenError):
                        self.check_intact()
                    return
                if self.slot >= 0:
                    self.procs["heartbeat"][self.slot] = now_ns()
            except (AttributeError, ValueError, OSError):  # closing: the mapping is gone
                return

    def alive(self, slot: int) -> bool:
        """Whether the process in ``slot`` still runs: it holds the slot's liveness lock
        (``tierkv_backends.shm.liveness``), in whatever pid namespace it is."""
        if int(self.procs["pid"][slot]) == 0:
            return False
        if slot == self.slot:
            return True
        return liveness.held_elsewhere(self._fd, slot)

    def _lease_expired(self, slot: int) -> bool:
        return now_ns() - int(self.procs["heartbeat"][slot]) >= self.lease_s * 1e9
