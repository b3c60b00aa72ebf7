"""Chunk keys and prefix-chained hashing of token sequences.

A chunk's key must be the same in every process and on every machine that sees the
same tokens for the same model, otherwise a shared tier never hits (the "zero hits
across instances" failure of salted ``hash()``). So hashing is SHA-256 over a fixed
byte encoding of the token ids, chained from chunk to chunk: a chunk's hash covers
every token before it, which makes a key stand for a whole prefix.

The chain starts from a seed that binds everything else the KV depends on (the key
format version, the model revision, the KV dtype and geometry, the request's LoRA adapter,
tenant salt and media: ``tierkv.chunks.identity``), and the key names that seed's short digest,
its *scope*: ``fmt@model@world_size@worker_id@scope@hash``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

import numpy as np
import torch

from tierkv.chunks.identity import PLAIN, RequestIdentity, Scope, fold_media, make_scope, media_mixins

KV_FORMATS = ("vllm", "huggingface")

# Token ids are hashed as little-endian int32: every tokenizer vocabulary fits, and the
# narrower encoding halves the bytes hashed per lookup.
_TOKEN_DTYPE = np.dtype("<i4")
_TOKEN_MAX = 2**31 - 1
_TORCH_INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
_HASH_BYTES = 16  # 128 bits of the SHA-256 digest name the chunk
_KEY_FIELDS = (5, 6)  # without / with a scope


@dataclass(frozen=True, slots=True, eq=False)
class CacheKey:
    """Identity of one chunk of KV cache.

    The model, world size and worker id are part of the key so that caches of different
    models or tensor-parallel shards never mix, even in one shared bucket. ``scope`` names
    the identity the chunk's hash was seeded with (``tierkv.chunks.identity``: model revision,
    KV dtype and geometry, LoRA adapter, tenant salt); every key an engine makes has one,
    and keys made by hand (a backend's tests) may leave it empty. An engine makes keys with
    ``keys_for``; a backend stores under them, or under ``to_string``.

    Attributes:
        fmt: The KV layout, ``"vllm"`` or ``"huggingface"``.
        model_name: The model's name.
        world_size: How many workers share the model.
        worker_id: The rank of the worker whose KV this is.
        chunk_hash: The hex hash of the chunk's tokens and every token before them.
        scope: The short digest of the identity the hash was seeded with; ``""`` for a key
            made by hand.
    """

    fmt: str
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: str
    scope: str = ""
    # the string form and the hash, computed once (tiers ask for them on every lookup)
    _string: str | None = field(default=None, init=False, repr=False, compare=False, hash=False)
    _hash: int | None = field(default=None, init=False, repr=False, compare=False, hash=False)
    _bytes: bytes | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((self.chunk_hash, self.fmt, self.model_name, self.world_size,
                                                    self.worker_id, self.scope)))
        return self._hash  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if not isinstance(other, CacheKey):
            return NotImplemented
        return (self.chunk_hash == other.chunk_hash and self.fmt == other.fmt and self.model_name == other.model_name
                and self.world_size == other.world_size and self.worker_id == other.worker_id
                and self.scope == other.scope)

    def to_string(self) -> str:
        """Stable, escaped string form for byte stores.

        Every field is percent-escaped, so ``@`` or ``/`` in a model name cannot collide
        with the separators.

        Returns:
            ``fmt@model@world@worker@scope@hash``, or ``fmt@model@world@worker@hash`` for a
                key without a scope; ``from_string`` parses it back.
        """
        if self._string is None:
            tail = self.chunk_hash if _PLAIN.match(self.chunk_hash) else quote(str(self.chunk_hash), safe="-_.")
            object.__setattr__(self, "_string",
                               namespace_prefix(self.fmt, self.model_name, self.world_size, self.worker_id,
                                                self.scope) + tail)
        return self._string  # type: ignore[return-value]

    def to_bytes(self) -> bytes:
        """``to_string`` in UTF-8 (computed once: byte stores look it up on every probe).

        Returns:
            The UTF-8 bytes of ``to_string()``.
        """
        if self._bytes is None:
            object.__setattr__(self, "_bytes", self.to_string().encode())
        return self._bytes  # type: ignore[return-value]

    @classmethod
    def in_namespace(cls, fields: tuple[str, str, int, int, str], prefix: str, chunk_hash: str) -> CacheKey:
        """The key of a plain (hex) ``chunk_hash`` in a namespace whose string prefix is known.

        Its string form is set at once (a lookup makes a key per chunk, and every tier asks for
        that string).

        Args:
            fields: ``(fmt, model_name, world_size, worker_id, scope)`` of the namespace.
            prefix: Their escaped string form, ``namespace_prefix(*fields)``.
            chunk_hash: The chunk's hash, of characters that need no escaping.

        Returns:
            The key.
        """
        fmt, model, world, worker, scope = fields
        key = cls(fmt, model, world, worker, chunk_hash, scope)
        object.__setattr__(key, "_string", prefix + chunk_hash)
        return key

    @classmethod
    def from_string(cls, text: str) -> CacheKey:
        """Parse the form written by ``to_string``.

        Args:
            text: A key's string form.

        Returns:
            The key it names.

        Raises:
            ValueError: if ``text`` has neither 5 nor 6 ``@``-separated fields, or its world
                size or worker id is not an integer.
        """
        parts = text.split("@")
        if len(parts) not in _KEY_FIELDS:
            raise ValueError(
                f"not a tierkv key: expected 6 '@'-separated fields (fmt@model@world_size@worker_id@scope@hash) "
                f"or 5 without the scope, got {len(parts)} in {text!r}"
            )
        fields = [unquote(p) for p in parts]
        fmt, model, world, worker = fields[:4]
        scope = fields[4] if len(fields) == 6 else ""
        try:
            return cls(fmt, model, int(world), int(worker), fields[-1], scope)
        except ValueError as exc:
            raise ValueError(f"not a tierkv key: world_size and worker_id must be integers in {text!r}") from exc

    def __str__(self) -> str:
        return self.to_string()


_PLAIN = re.compile(r"[0-9A-Za-z_.-]*\Z")


def scope_of(key: str | bytes | CacheKey) -> str:
    """The scope a key (or its string form) names; ``""`` for a key without one (made by hand,
    or by a tierkv older than scopes: such keys are never made by an engine now)."""
    if isinstance(key, CacheKey):
        return key.scope
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    parts = text.split("@")
    return unquote(parts[4]) if len(parts) == 6 else ""


def in_scope(key: str | bytes | CacheKey, model_name: str, scope: str) -> bool:
    """Whether a key (or its string form) belongs to model ``model_name``'s ``scope``: what a
    tenant's or an adapter's drop removes. A string that is not a key is in no scope."""
    if isinstance(key, CacheKey):
        return key.scope == scope and key.model_name == model_name
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    parts = text.split("@")
    return len(parts) == 6 and unquote(parts[4]) == scope and unquote(parts[1]) == model_name


def count_by_scope(sized_keys: Iterable[tuple[str | bytes | CacheKey, int]]) -> dict[str, dict[str, int]]:
    """``{scope: {"chunks": n, "bytes": b}}`` of (key, size) pairs."""
    usage: dict[str, dict[str, int]] = {}
    for key, size in sized_keys:
        entry = usage.setdefault(scope_of(key), {"chunks": 0, "bytes": 0})
        entry["chunks"] += 1
        entry["bytes"] += int(size)
    return usage


@functools.lru_cache(maxsize=256)
def namespace_prefix(fmt: str, model_name: str, world_size: int, worker_id: int, scope: str = "") -> str:
    """The escaped ``fmt@model@world@worker@scope@`` part of every key of one namespace
    (``fmt@model@world@worker@`` without a scope)."""
    parts = (fmt, model_name, world_size, worker_id, scope) if scope else (fmt, model_name, world_size, worker_id)
    return "".join(quote(str(part), safe="-_.") + "@" for part in parts)


TokenIds = torch.Tensor | Sequence[int] | np.ndarray
"""What every token-taking call accepts: a 1-D tensor, a sequence of ints, or a numpy array."""


def as_token_array(tokens: TokenIds) -> np.ndarray:
    """Validate token ids and return them as a little-endian int32 array.

    Raises ValueError naming what was expected for anything that is not a 1-D sequence of
    non-negative integer ids.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor of token ids, got shape {tuple(tokens.shape)}")
        dtype = tokens.dtype
        if dtype not in _TORCH_INTS and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
        array = tokens.numpy() if tokens.is_cpu else tokens.cpu().numpy()  # ints carry no grad
    else:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got an array of shape {array.shape}")
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    if array.size and _out_of_range(array):
        raise ValueError(f"token ids must lie in [0, {_TOKEN_MAX}], got [{int(array.min())}, {int(array.max())}]")
    return np.ascontiguousarray(array, dtype=_TOKEN_DTYPE)


def _out_of_range(array: np.ndarray) -> bool:
    """Whether any id is negative or above the int32 range (one pass: negatives read as
    huge unsigned values)."""
    if array.dtype.itemsize in (4, 8) and array.dtype.kind == "i" and array.flags.c_contiguous:
        # the OR of all ids has a bit above the int32 range iff one id has (a lookup pays
        # for this on every call: the bare ufunc is the cheapest full pass numpy has)
        return int(np.bitwise_or.reduce(array.view(f"u{array.dtype.itemsize}"))) > _TOKEN_MAX
    return int(array.min()) < 0 or int(array.max()) > _TOKEN_MAX


class ChunkHasher:
    """Splits a token sequence into chunks and gives each its prefix-chained hash."""

    def __init__(self, chunk_size: int) -> None:
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def num_chunks(self, num_tokens: int) -> int:
        """Chunks needed for ``num_tokens`` tokens; the last one may be partial."""
        return -(-num_tokens // self.chunk_size)

    def prefix_hashes(self, tokens: torch.Tensor | Sequence[int] | np.ndarray, seed: bytes = b"",
                      identity: RequestIdentity = PLAIN) -> list[str]:
        """Hex hash of every chunk, each covering all tokens up to the end of its chunk, the
        chain's ``seed`` and the media of ``identity`` that overlap it or a chunk before it."""
        return list(self.iter_prefix_hashes(as_token_array(tokens), seed, identity))

    def iter_prefix_hashes(self, token_array: np.ndarray, seed: bytes = b"",
                           identity: RequestIdentity = PLAIN) -> Iterator[str]:
        """``prefix_hashes`` of a validated token array (``as_token_array``), one at a
        time: a lookup stops hashing at the first chunk no tier holds. Media past the tokens
        given overlap no chunk (a caller may hash a prompt's first chunks only)."""
        for digest in self._chain(token_array, seed, identity):
            yield digest[:_HASH_BYTES].hex()

    def tail_hashes(self, token_array: np.ndarray, start_chunk: int, lengths: Sequence[int], seed: bytes = b"",
                    identity: RequestIdentity = PLAIN) -> list[str]:
        """The hash of a partial chunk ``start_chunk`` of each length in ``lengths``: for each
        ``n`` the last of ``prefix_hashes(token_array[:start_chunk * chunk_size + n])``, with the
        chain before the chunk hashed once (a lookup probing where an earlier, shorter prompt
        ended: ``tierkv.integrations.vllm_v1.continuation``).

        Raises:
            ValueError: if a length is not in ``[1, chunk_size]`` or runs past the tokens.
        """
        start = start_chunk * self.chunk_size
        for length in lengths:
            if not 0 < length <= self.chunk_size or start + length > len(token_array):
                raise ValueError(f"tail lengths must lie in [1, {self.chunk_size}] and end within the "
                                 f"{len(token_array)} tokens from token {start}, got {length}")
        chain = list(self._chain(token_array[:start], seed, identity))
        previous = chain[-1] if chain else seed
        mixins = media_mixins(identity.media, self.chunk_size) if identity.media else None
        mixin = mixins.get(start_chunk) if mixins else None
        if mixin is not None:
            previous = fold_media(previous, mixin)
        data = memoryview(token_array.data).cast("B")
        width = _TOKEN_DTYPE.itemsize
        hashes = []
        for length in lengths:
            digest = hashlib.sha256(previous)
            digest.update(data[start * width : (start + length) * width])
            hashes.append(digest.digest()[:_HASH_BYTES].hex())
        return hashes

    def _chain(self, token_array: np.ndarray, seed: bytes, identity: RequestIdentity) -> Iterator[bytes]:
        """The full chain value after each chunk (a key names its first ``_HASH_BYTES``)."""
        data = memoryview(token_array.data).cast("B")
        step = self.chunk_size * _TOKEN_DTYPE.itemsize
        previous = seed
        sha256 = hashlib.sha256
        mixins = media_mixins(identity.media, self.chunk_size) if identity.media else None
        for index, start in enumerate(range(0, len(data), step)):
            if mixins:
                mixin = mixins.get(index)
                if mixin is not None:
                    previous = fold_media(previous, mixin)
            digest = sha256(previous)
            digest.update(data[start : start + step])
            previous = digest.digest()
            yield previous


class KeyMaker:
    """The keys of one worker's prompts: ``fmt``, model, world size, worker id and scope in
    every key, chunk hashes from a ``ChunkHasher`` seeded with the scope's identity.

    ``engine_parts`` is the engine's identity (``EngineMetadata.identity_parts
   ``); each request adds its own
    (``tierkv.chunks.identity.RequestIdentity``). Keys of recently seen chunks are reused (up
    to ``recent_max``, then the memory starts afresh): a scheduler looks a prompt up, then
    retrieves it, and each tier asks a key for its string form.
    """

    def __init__(self, fmt: str, model_name: str, world_size: int, worker_id: int, chunk_size: int,
                 recent_max: int = 1 << 15, engine_parts: tuple[tuple[str, str], ...] = ()) -> None:
        self._fields = (fmt, model_name, world_size, worker_id)
        self._engine_parts = tuple(engine_parts)
        self._hasher = ChunkHasher(chunk_size)
        self._scopes: dict[tuple[tuple[str, str], ...], tuple[Scope, str]] = {}
        self.scope_labels: dict[str, dict[str, object]] = {}
        self.recent: dict[str, CacheKey] = {}
        self.recent_max = recent_max

    def _scope(self, identity: RequestIdentity) -> tuple[Scope, str]:
        parts = identity.scope_parts
        known = self._scopes.get(parts)
        if known is None:
            if len(self._scopes) >= 4096:  # one per adapter x salt seen; bounded like `recent`
                self._scopes.clear()
                self.scope_labels.clear()
            scope = make_scope(self._engine_parts, identity)
            known = self._scopes[parts] = (scope, namespace_prefix(*self._fields, scope.name))
            self.scope_labels.setdefault(scope.name, identity.describe())
        return known

    def scope_name(self, identity: RequestIdentity = PLAIN) -> str:
        """The scope (16 hex digits) of every key of ``identity``'s requests."""
        return self._scope(identity)[0].name

    def iter_keys(self, token_array: np.ndarray, identity: RequestIdentity = PLAIN) -> Iterator[CacheKey]:
        """Keys of a validated token array (``as_token_array``) of a request of ``identity``,
        made as they are needed."""
        recent = self.recent
        scope, prefix = self._scope(identity)
        fields = (*self._fields, scope.name)
        for chunk_hash in self._hasher.iter_prefix_hashes(token_array, scope.seed, identity):
            key = recent.get(chunk_hash)
            if key is None:
                if len(recent) >= self.recent_max:
                    recent.clear()
                key = recent[chunk_hash] = CacheKey.in_namespace(fields, prefix, chunk_hash)
            yield key

    def tail_keys(self, token_array: np.ndarray, start_chunk: int, lengths: Sequence[int],
                  identity: RequestIdentity = PLAIN) -> list[CacheKey]:
        """The keys of partial chunk ``start_chunk`` of a validated token array cut at each of
        ``lengths`` tokens into it (``ChunkHasher.tail_hashes``); not remembered in ``recent``."""
        scope, prefix = self._scope(identity)
        fields = (*self._fields, scope.name)
        return [CacheKey.in_namespace(fields, prefix, chunk_hash)
                for chunk_hash in self._hasher.tail_hashes(token_array, start_chunk, lengths, scope.seed, identity)]

    def cut_key(self, token_array: np.ndarray, end: int, identity: RequestIdentity = PLAIN) -> CacheKey:
        """The key of the partial chunk ``token_array[:end]`` ends with, ``end`` inside a chunk:
        where a save stored its prompt cut (a continuation tail), which its lease, its drop and
        its KV event name alike (``ValueError`` for an ``end`` on a chunk boundary)."""
        chunk = self._hasher.chunk_size
        return self.tail_keys(token_array, end // chunk, [end % chunk], identity)[0]
