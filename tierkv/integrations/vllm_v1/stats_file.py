"""A worker's transfer counters as a JSON file (``stats_file`` in the connector's settings).

vLLM's own metrics (``.vllm_metrics``) show intervals; the file shows the totals since
the worker started, for scripts and tests that read them from outside the serving process.
Worker 0 writes ``stats_file``, worker *n* ``stats_file.rank<n>``; each write replaces the
file whole (a reader never sees half of one), and only when a counter changed.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping


class StatsFile:
    """Writes one worker's counters to its file (nothing when no path was configured)."""

    def __init__(self, path: str | None, worker_id: int) -> None:
        self.path = None if not path else path if worker_id == 0 else f"{path}.rank{worker_id}"
        self._written: dict[str, int] | None = None
        self._lock = threading.Lock()  # vLLM's step thread and the engine's (a save that landed) both write

    def write(self, stats: Mapping[str, int]) -> None:
        """Replace the file with ``stats`` when they differ from what was last written."""
        if self.path is None:
            return
        with self._lock:
            current = dict(stats)
            if current == self._written:
                return
            temporary = f"{self.path}.tmp"
            with open(temporary, "w") as handle:
                json.dump(current, handle)
            os.replace(temporary, self.path)
            self._written = current
