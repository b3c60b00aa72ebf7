"""``gpu`` tier: a device-memory pool of the configured capacity on one device.

Copies between host and device run on a dedicated CUDA stream that first waits for the
caller's current stream (so a chunk is never read before the compute that produced it
has finished); completion is awaited by polling an event, never by blocking the event
loop. Host sources that are not pinned are staged through pinned buffers, so the copy is
a real asynchronous DMA. With ``device: cpu`` the same tier logic runs without CUDA, which
is how the policy is tested on machines without a GPU.

``get`` returns a tensor on the tier's device: a serving engine wants its KV there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

import torch

from tierkv.backend.options import Option
from tierkv.chunks import copies, ownership
from tierkv.chunks.memory import copy_into, cuda_available, empty_host
from tierkv.errors import ConfigError
from tierkv_backends.memory.tier import EVICTION_OPTION, PREALLOCATE_OPTION, RETAIN_SHARE_OPTION, MemoryTier

logger = logging.getLogger(__name__)


def parse_device(value: object) -> str:
    """``cuda``, ``cuda:N`` or ``cpu`` (the latter for testing the tier logic without a GPU)."""
    text = str(value)
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"expected a device such as 'cuda:0' or 'cpu', got {value!r}") from exc
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"expected a CUDA device ('cuda:0') or 'cpu', got {value!r}")
    return text


async def wait_for_event(event: torch.cuda.Event) -> None:
    """Yield to the event loop until a CUDA event has completed."""
    delay = 0.0
    while not event.query():
        await asyncio.sleep(delay)
        delay = min(max(delay * 2, 5e-5), 1e-3)


class GPUBackend(MemoryTier):
    """Device-memory tier; see the module docstring."""

    #: SupportsPressure: its capacity is accelerator memory (NVML on a CUDA device; on a cpu
    #: device no probe, static capacity, and the stats say why)
    device_memory: ClassVar[bool] = True

    options: ClassVar[dict[str, Option]] = {
        "device": Option(parse_device, "cuda:0", doc="device of the pool: cuda:N, or cpu for tests"),
        "eviction": EVICTION_OPTION,
        "preallocate": PREALLOCATE_OPTION,
        "retain_share": RETAIN_SHARE_OPTION,
    }

    def __init__(self, name: str, capacity: int | None = None, device: str = "cuda:0", eviction: str = "lru",
                 preallocate: bool = True, retain_share: float = 0.5) -> None:
        target = torch.device(device)
        if target.type == "cuda":
            if not cuda_available():
                raise ConfigError(f"tier {name!r}: device {device!r} requested but CUDA is not available "
                                  "(use device: cpu to run the gpu tier's logic without a GPU)")
            if target.index is None:
                target = torch.device("cuda", torch.cuda.current_device())
        super().__init__(name, capacity, target, pinned=False, eviction=eviction, preallocate=preallocate,
                         retain_share=retain_share)
        self._stream = torch.cuda.Stream(device=target) if target.type == "cuda" else None

    def empty_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._stream is None:
            return empty_host(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    async def copy_chunks(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None or not pairs:
            await super().copy_chunks(pairs)
            return
        staged: list[torch.Tensor] = []  # pinned host copies must outlive the DMA
        with torch.cuda.device(self.device):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for dst, src in pairs:
                    if src.device.type == "cpu" and not src.is_pinned():
                        pinned = empty_host(tuple(src.shape), src.dtype)
                        copy_into(pinned, src)
                        staged.append(pinned)
                        src = pinned
                    copies.count(dst.numel() * dst.element_size())
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        # the DMA writes into slabs or a caller's memory and reads the pinned copies: a
        # cancellation is delivered only once it completed (tierkv.chunks.ownership)
        await ownership.finish(wait_for_event(event))
        del staged

    async def shrink_to_limit(self) -> int:
        """Demote and free chunks down to the limit, then hand the freed device memory back to
        the driver: torch's caching allocator would otherwise keep it, NVML would still count it
        as used, and the serving engine whose pressure started the shrink would not get it."""
        freed = await super().shrink_to_limit()
        if freed and self._stream is not None:
            self._stream.synchronize()  # no copy of ours still reads the freed slabs
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()
        return freed

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "cuda_stream": self._stream is not None}
