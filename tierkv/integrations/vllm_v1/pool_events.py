"""KV events for a node pool (the ``shm`` tier as the first tier), credited to every engine on
the node that can load from it, not only to the one that stored.

An engine that stores a chunk in the pool writes a *description* of it into the pool's journal
(``tierkv_backends.shm.journal``): the chunk's tokens and vLLM's block hashes of them, its
parent block's hash, the adapter's name, and two 64-bit tags, the engine's *namespace*
(model, world size, rank, the identity tierkv keys bind: two engines of one namespace make the
same keys, so either loads the other's chunks) and the *hash fingerprint* (vLLM's ``NONE_HASH``
under its hash algorithm: engines of one fingerprint compute the same block hashes). Every
attached engine reads the journal (``PoolEventLog.take``, once per vLLM step: one read of the
ring's head when nothing happened) and announces, in its own event stream:

- ``BlockStored`` for each described chunk of its namespace and fingerprint that the pool still
  holds, whoever stored it; an engine that starts after others stored reads the journal from its
  oldest record, so it announces what the pool holds (as far back as the ring reaches);
- ``BlockRemoved`` when the pool drops a chunk, whichever process evicted or deleted it (the
  journal's ``DROPPED`` records), for the blocks no other pool chunk it announced still holds.

Events carry ``medium`` = the tier's name and ``locality`` = ``LOCAL`` (the pool is on this
node). A reader the ring lapped (it fell more than the journal's size behind) re-checks what it
announced against the pool and announces removals for what is gone; stores it missed stay
unannounced (``lost_bytes`` counts them).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tierkv.chunks.keys import CacheKey
from tierkv.integrations.vllm_v1.kv_events import GroupTag, KVEventLog, TierKVEvents

DESCRIPTION = struct.Struct("<8s8sIIIII")  # namespace, fingerprint, block size, hashes, hash bytes, parent?, lora bytes
LOCALITY = "LOCAL"


class JournaledTier(Protocol):
    """What a first tier offers for pool events (the ``shm`` tier)."""

    name: str

    def describe(self, descriptions: Sequence[tuple[CacheKey, bytes]]) -> int: ...
    def journal_cursor(self, everything: bool = True) -> int: ...
    def read_journal(self, cursor: int, limit: int = 4096) -> Any: ...
    def holds_digests(self, digests: Sequence[tuple[int, int]]) -> list[bool]: ...


def journaled(tier: object) -> bool:
    """Whether ``tier`` keeps a journal other engines read (a node pool)."""
    return all(callable(getattr(tier, name, None)) for name in ("describe", "read_journal", "holds_digests"))


def namespace_tag(fmt: str, model_name: str, world_size: int, worker_id: int,
                  identity_parts: Sequence[tuple[str, str]]) -> bytes:
    """8 bytes naming the keys an engine makes (engines with equal tags load each other's chunks)."""
    text = json.dumps([fmt, model_name, world_size, worker_id, [list(p) for p in identity_parts]])
    return hashlib.sha256(b"tierkv-namespace\0" + text.encode()).digest()[:8]


def hash_fingerprint(algorithm: str) -> bytes:
    """8 bytes naming how this vLLM hashes blocks: its ``NONE_HASH`` (the chain's seed) under
    ``algorithm`` (``prefix_caching_hash_algo``). Where this process has not set it, it is
    derived as vLLM derives it; a non-cryptographic hash without ``PYTHONHASHSEED`` is seeded at
    random per process, and so is its fingerprint (no other engine shares its hashes)."""
    from vllm.v1.core import kv_cache_utils

    seed = getattr(kv_cache_utils, "NONE_HASH", None)
    if seed is None:
        from vllm.utils.hashing import get_hash_fn_by_name

        hash_fn = get_hash_fn_by_name(algorithm)
        seed = hash_fn(kv_cache_utils.resolve_none_hash_seed(hash_fn))
    return hashlib.sha256(b"tierkv-vllm-hashes\0" + bytes(seed)).digest()[:8]


def encode(namespace: bytes, fingerprint: bytes, block_size: int, hashes: Sequence[bytes], parent: bytes | None,
           tokens: Sequence[int], lora_name: str | None) -> bytes | None:
    """A chunk's description (None when vLLM's hashes are not bytes of one length)."""
    if not hashes or not all(isinstance(h, bytes) for h in hashes) or len({len(h) for h in hashes}) != 1:
        return None
    width = len(hashes[0])
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != width):
        return None
    lora = (lora_name or "").encode()
    return (DESCRIPTION.pack(namespace, fingerprint, block_size, len(hashes), width, parent is not None, len(lora))
            + (parent or b"") + b"".join(hashes) + struct.pack(f"<{len(tokens)}i", *tokens) + lora)


Description = tuple[bytes, bytes, int, list[bytes], bytes | None, list[int], str | None]


def decode(payload: bytes) -> Description | None:
    """(namespace, fingerprint, block size, hashes, parent, tokens, lora name) of a description,
    or None when it is not one whose lengths add up (nothing is trusted from the journal)."""
    if len(payload) < DESCRIPTION.size:
        return None
    namespace, fingerprint, block_size, count, width, has_parent, lora_len = DESCRIPTION.unpack_from(payload)
    tokens = count * block_size
    if not 0 < width <= 64 or has_parent not in (0, 1) or not 0 < block_size <= 1 << 20:
        return None
    if len(payload) != DESCRIPTION.size + (has_parent + count) * width + 4 * tokens + lora_len:
        return None
    offset = DESCRIPTION.size
    parent = payload[offset : offset + width] if has_parent else None
    offset += has_parent * width
    hashes = [payload[offset + i * width : offset + (i + 1) * width] for i in range(count)]
    offset += count * width
    token_ids = list(struct.unpack_from(f"<{tokens}i", payload, offset))
    offset += 4 * tokens
    try:
        lora = payload[offset:].decode() or None
    except UnicodeDecodeError:
        return None
    return namespace, fingerprint, block_size, hashes, parent, token_ids, lora


class PoolEventLog(KVEventLog):
    """A worker's KV events when its first tier is a node pool (see the module docstring)."""

    locality = LOCALITY

    def __init__(self, tier: JournaledTier, block_size: int, namespace: bytes, fingerprint: bytes,
                 remembered_chunks: int = 1_000_000) -> None:
        super().__init__(tier.name, block_size, remembered_chunks)
        self.tier = tier
        self.namespace = namespace
        self.fingerprint = fingerprint
        self._cursor = tier.journal_cursor(everything=True)  # what the pool holds is announced first
        self.counts = {"described": 0, "announced_from_pool": 0, "lost_bytes": 0, "foreign": 0, "malformed": 0}

    def stored(self, chunk_keys: Sequence[CacheKey], chunk_size: int, token_ids: Any,
               block_hashes: Sequence[Any], lora_name: str | None, group: GroupTag | None = None,
               chunks: Iterable[int] | None = None) -> None:
        """Describe a request's chunks (only the indices ``chunks``, when given) in the pool's
        journal (every engine, this one included, announces them when it next reads it).
        One-group models only: a hybrid model's chunks (``group``) are not described."""
        if group is not None:
            return
        full = min(len(block_hashes), len(token_ids) // self.block_size)
        descriptions = []
        for index in range(len(chunk_keys)) if chunks is None else chunks:
            key = chunk_keys[index]
            first = index * chunk_size // self.block_size
            last = min(full, -(-((index + 1) * chunk_size) // self.block_size))
            if last <= first:
                continue
            payload = encode(self.namespace, self.fingerprint, self.block_size, list(block_hashes[first:last]),
                             block_hashes[first - 1] if first > 0 else None,
                             [int(t) for t in token_ids[first * self.block_size : last * self.block_size]], lora_name)
            if payload is not None:
                descriptions.append((key, payload))
        written = self.tier.describe(descriptions)
        with self._lock:
            self.counts["described"] += written

    def take(self) -> TierKVEvents | None:
        self._read_journal()
        return super().take()

    def _read_journal(self) -> None:
        reading = self.tier.read_journal(self._cursor)
        self._cursor = reading.cursor
        if reading.lost_bytes:
            with self._lock:
                self.counts["lost_bytes"] += reading.lost_bytes
            self._forget_what_left()
        if not reading.records:
            return
        mine: list[tuple[Any, Description | None]] = []
        for record in reading.records:
            if record.kind.name == "DROPPED":
                mine.append((record, None))
                continue
            if record.kind.name != "DESCRIBED":  # the pool's other notes (a scope's model name)
                continue
            described = decode(record.payload)
            if described is None:
                self.counts["malformed"] += 1
            elif described[0] != self.namespace or described[1] != self.fingerprint:
                self.counts["foreign"] += 1
            else:
                mine.append((record, described))
        held = iter(self.tier.holds_digests([record.digest for record, d in mine if d is not None]))
        for record, described in mine:
            if described is None:
                self.removed(record.digest)
            elif next(held):
                self._announce_chunk(record.digest, described)

    def _announce_chunk(self, chunk: tuple[int, int], described: Description) -> None:
        _, _, block_size, hashes, parent, token_ids, lora = described
        converted = [maybe_convert_block_hash(h) for h in hashes]
        with self._lock:
            if chunk in self._by_chunk:
                return
            self._by_chunk[chunk] = (None, tuple(converted))  # one group: a pool's events are a one-group model's
            fresh = []
            for index, block_hash in enumerate(converted):
                if self._announced.get((None, block_hash), 0) == 0:
                    fresh.append(index)
                self._announced[(None, block_hash)] = self._announced.get((None, block_hash), 0) + 1
            while len(self._by_chunk) > self._limit:
                self._forget(*self._by_chunk.popitem(last=False)[1])
            self.counts["announced_from_pool"] += 1
            start = 0
            while start < len(fresh):  # one BlockStored per run of fresh blocks
                end = start
                while end + 1 < len(fresh) and fresh[end + 1] == fresh[end] + 1:
                    end += 1
                first, last = fresh[start], fresh[end] + 1
                before = converted[first - 1] if first > 0 else (
                    maybe_convert_block_hash(parent) if parent is not None else None)
                self._events.append(BlockStored(
                    block_hashes=converted[first:last], parent_block_hash=before,
                    token_ids=token_ids[first * block_size : last * block_size], block_size=block_size,
                    lora_id=None, medium=self.medium, lora_name=lora, locality=self.locality))
                start = end + 1

    def _forget_what_left(self) -> None:
        """After records were lost: announce the removal of every announced chunk the pool no
        longer holds."""
        with self._lock:
            chunks: list[Any] = list(self._by_chunk)  # digests: this log holds no other chunk ids
        for chunk, held in zip(chunks, self.tier.holds_digests(chunks)):
            if not held:
                self.removed(chunk)
