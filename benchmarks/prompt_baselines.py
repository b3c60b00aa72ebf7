"""The prompt benchmark's raw baselines: one file per chunk (writev / preadv) and bare py-lmdb.

They copy exactly the byte layout tierkv's fs and lmdb tiers use, so each row of ``prompt.py``
compares a tier with the fastest plain code that writes and reads the same bytes; the py-lmdb
configurations beside the lmdb tier's store show what each of LMDB's guarantees costs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lmdb
import torch
import xxhash
from prompt_workload import CHUNK, DTYPE


def _byte_runs(chunk: torch.Tensor) -> list[memoryview]:
    """The chunk's bytes straight out of the prompt's KV: one run per (layer, K/V) slice,
    each contiguous in a vllm-layout blob."""
    return [chunk[layer, kv].view(torch.uint8).numpy().reshape(-1).data
            for layer in range(chunk.shape[0]) for kv in range(2)]


class RawFiles:
    """The raw-files baseline: one file per chunk, writev out of the KV, preadv into ``out``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def store(self, prompt: int, kv: torch.Tensor, publish: bool = False) -> None:
        """``publish``: write each file under a temporary name and rename it into place, as
        the fs tier does so that no reader sees a half-written chunk (the bare baseline lacks that)."""
        for index, start in enumerate(range(0, kv.shape[2], CHUNK)):
            runs = _byte_runs(kv.narrow(2, start, min(CHUNK, kv.shape[2] - start)))
            final = self.root / f"{prompt}-{index}"
            path = final.with_name(f".{final.name}.tmp") if publish else final
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, runs)
            finally:
                os.close(fd)
            if publish:
                os.replace(path, final)

    def read(self, prompt: int, out: torch.Tensor) -> None:
        for index, start in enumerate(range(0, out.shape[2], CHUNK)):
            runs = _byte_runs(out.narrow(2, start, min(CHUNK, out.shape[2] - start)))
            fd = os.open(self.root / f"{prompt}-{index}", os.O_RDONLY)
            try:
                os.preadv(fd, runs, 0)
            finally:
                os.close(fd)

    def clear(self) -> None:
        for path in self.root.iterdir():
            path.unlink()


RAW_LMDB_PUTS: dict[str, dict[str, Any]] = {
    # name -> (py-lmdb open flags); "raw lmdb put" is the configuration that keeps LMDB's crash
    # guarantees as tierkv uses them (a crashed process leaves the last committed batches
    # intact; a full disk is an error): no writemap, no fsync per commit -- tierkv's default
    "raw lmdb put": {"sync": False, "metasync": False, "writemap": False},
    # + power loss loses at most the last commits, never the environment (ACI kept)
    "raw lmdb put (sync, nometasync)": {"sync": True, "metasync": False, "writemap": False},
    # + durable on power loss
    "raw lmdb put (sync)": {"sync": True, "metasync": True, "writemap": False},
    # values written straight into the shared map: one copy, but the map file is sparse (a
    # full disk is a SIGBUS, not an error) and a stray write in the process reaches the data
    "raw lmdb put (writemap)": {"sync": False, "metasync": False, "writemap": True},
    "raw lmdb put (writemap, map_async)": {"sync": True, "metasync": True, "writemap": True, "map_async": True},
}
"""Raw py-lmdb put configurations timed next to the lmdb tiers' store (one transaction per prompt,
i.e. per batch; ``raw lmdb put (txn per chunk)`` is the first one committing every chunk)."""
RAW_LMDB_BASELINE = {"lmdb": "raw lmdb put", "lmdb-trusted": "raw lmdb put (writemap)"}


class RawLMDB:
    """The raw py-lmdb baseline: one write transaction per prompt (or per chunk); reads copy into ``out``."""

    def __init__(self, root: Path, map_size: int, **flags: Any) -> None:
        self.env = lmdb.open(str(root), map_size=map_size, **flags)

    def store(self, prompt: int, kv: torch.Tensor, txn_per_chunk: bool = False) -> None:
        starts = list(range(0, kv.shape[2], CHUNK))
        batches = [[s] for s in starts] if txn_per_chunk else [starts]
        for batch in batches:
            with self.env.begin(write=True) as txn:
                for start in batch:
                    chunk = kv.narrow(2, start, min(CHUNK, kv.shape[2] - start)).contiguous()
                    txn.put(f"{prompt}-{start // CHUNK}".encode(), chunk.view(torch.uint8).numpy().data)

    def read(self, prompt: int, out: torch.Tensor, digests: list[int] | None = None) -> None:
        """Copy the prompt's chunks into ``out``; with ``digests`` (one XXH3 per chunk), each
        value is checked against its digest before it is copied."""
        with self.env.begin(buffers=True) as txn:
            for index, start in enumerate(range(0, out.shape[2], CHUNK)):
                target = out.narrow(2, start, min(CHUNK, out.shape[2] - start))
                value = txn.get(f"{prompt}-{index}".encode())
                if digests is not None and xxhash.xxh3_64_intdigest(value) != digests[index]:
                    raise RuntimeError(f"raw lmdb: chunk {index} of prompt {prompt} does not match its digest")
                flat = torch.frombuffer(value, dtype=DTYPE).view(target.shape)
                target.view(torch.int16).copy_(flat.view(torch.int16))

    def clear(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.drop(self.env.open_db(), delete=False)

    def close(self) -> None:
        self.env.close()


def chunk_digests(kv: torch.Tensor) -> list[int]:
    """The XXH3 of each chunk's bytes as stored (the ``raw lmdb + XXH3`` reader checks them)."""
    return [xxhash.xxh3_64_intdigest(kv.narrow(2, start, min(CHUNK, kv.shape[2] - start)).contiguous()
                                     .view(torch.uint8).numpy().data)
            for start in range(0, kv.shape[2], CHUNK)]
