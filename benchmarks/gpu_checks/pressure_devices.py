"""What the pressure scenario runs against: a memory probe and a squeezer, real or modelled.

On the device the probe is NVML (``tierkv.policy.pressure.NVMLProbe``) and the squeezer is a second
process allocating device memory on command (``DeviceSqueezer``, running
``SQUEEZER_CODE``): the serving engine growing into, then leaving, the GPU tierkv shares.
On the CPU, ``ModelledDevice`` is both, so the same scenario code is rehearsed in CI.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

from .context import PartFailed

if TYPE_CHECKING:
    from tierkv.policy.pressure import MemoryReading


class Probe(Protocol):
    """A reading of device memory in use (tierkv.policy.pressure's probe protocol)."""

    name: str

    def read(self) -> MemoryReading: ...


class Squeezer(Protocol):
    """Something that takes device memory away from tierkv, the way a serving engine does."""

    def allocate(self, nbytes: int) -> int:
        """Take ``nbytes`` more; returns the bytes held."""

    def release(self) -> None:
        """Give everything back."""

    def close(self) -> None:
        """Stop."""


SQUEEZER_CODE = r"""
import sys
import torch

device = sys.argv[1]
cuda = device.startswith("cuda")
torch.empty(1, device=device)
held = []
print("held 0", flush=True)
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "exit":
        break
    if words[0] == "alloc":
        held.append(torch.empty(int(words[1]), dtype=torch.uint8, device=device))
    elif words[0] == "free":
        held.clear()
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        torch.cuda.synchronize()
    print("held", sum(t.numel() for t in held), flush=True)
"""


class DeviceSqueezer:
    """A second process that allocates device memory on command (``torch.empty`` on cuda) and
    frees it: the serving engine growing into, then leaving, the GPU tierkv shares."""

    def __init__(self, device: str = "cuda:0") -> None:
        self._process = subprocess.Popen([sys.executable, "-c", SQUEEZER_CODE, device], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self._answer()  # its CUDA context exists before the baseline is read

    def _answer(self) -> int:
        assert self._process.stdout is not None
        line = self._process.stdout.readline().split()
        if len(line) != 2 or line[0] != "held":
            raise PartFailed(f"the allocating process stopped answering (exit {self._process.poll()})")
        return int(line[1])

    def _ask(self, command: str) -> int:
        assert self._process.stdin is not None
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        return self._answer()

    def allocate(self, nbytes: int) -> int:
        return self._ask(f"alloc {nbytes}")

    def release(self) -> None:
        self._ask("free")

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.write("exit\n")
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


class ModelledDevice:
    """A device for the CPU rehearsal: memory in use is a baseline, what the squeezer holds, and
    the gpu tier's allocated bytes; freed tier memory goes straight back (the ideal driver)."""

    name = "modelled"

    def __init__(self, total: int, base: int) -> None:
        self.total = total
        self.base = base
        self.held = 0
        self.tier: Any = None

    def read(self) -> MemoryReading:
        from tierkv.policy.pressure import MemoryReading

        tier_bytes = int(self.tier.stats()["allocated_bytes"]) if self.tier is not None else 0
        return MemoryReading(self.base + self.held + tier_bytes, self.total, time.monotonic())

    def allocate(self, nbytes: int) -> int:
        self.held += nbytes
        return self.held

    def release(self) -> None:
        self.held = 0

    def close(self) -> None:
        self.held = 0
