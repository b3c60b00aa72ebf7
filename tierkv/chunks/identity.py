"""What a chunk's KV depends on besides its token ids, bound into its key.

Token ids alone do not determine attention K/V in a serving engine: a LoRA adapter on the
K/V projections, a tenant's cache salt, the images behind a run of placeholder tokens, the
model's weights (a re-trained checkpoint under the same name) and the KV cache's dtype all
change it. tierkv promises "a chunk is exact or a miss", so every key covers them:

- the **engine identity** (``EngineMetadata`` fields: model revision, KV cache dtype,
  KV geometry) and the **request identity** (``RequestIdentity``: adapter, salt, extra
  parts from a user's hook) seed the prefix-chained hash of every chunk, and a short digest
  of both, the **scope**, is a field of the key (tiers count occupancy per scope without
  reading keys' hashes, and no salt is ever written anywhere);
- **media** (``MediaSpan``: a content hash and the placeholder tokens it occupies) are
  folded into the chain at the first chunk they overlap, so chunks before the first image
  keep the plain text key (text prefixes are still shared) and every chunk from it on is
  that image's alone.

The key format version is part of every seed: a cache written by an older tierkv (whose
keys had no identity) is a miss, never a wrong hit.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

KEY_FORMAT = b"tierkv-key-v2"
"""Seeds every chunk hash: keys of an older format can never equal a current one."""

_SCOPE_HEX = 16  # 64 bits: names a scope in key strings; the chain itself uses the full digest


@dataclass(frozen=True, order=True)
class MediaSpan:
    """One multimodal input of a prompt, at a run of placeholder tokens.

    Given in ``RequestIdentity.media``: the input is folded into the key of the first chunk
    it overlaps, so chunks before it keep their plain text keys and every chunk from it on
    is that input's alone.

    Attributes:
        content_hash: A stable digest of the image, audio or video (e.g. vLLM's
            ``mm_hash``).
        offset: The index of its first placeholder token in the prompt.
        length: How many placeholder tokens it occupies (at least one).

    Raises:
        ValueError: if ``content_hash`` is not a non-empty string, ``offset`` or ``length``
            is not a non-negative int, or ``length`` is 0.
    """

    content_hash: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.content_hash, str) or not self.content_hash:
            raise ValueError(f"MediaSpan.content_hash: expected a non-empty string, got {self.content_hash!r}")
        for name in ("offset", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"MediaSpan.{name}: expected a non-negative int, got {value!r}")
        if self.length == 0:
            raise ValueError("MediaSpan.length: a media input occupies at least one placeholder token, got 0")

    @property
    def end(self) -> int:
        """The index just past its last placeholder token: ``offset + length``."""
        return self.offset + self.length


@dataclass(frozen=True)
class RequestIdentity:
    """What, besides the tokens and the engine, determines one request's KV.

    Every prompt call of [Engine][tierkv.Engine] takes one (``identity=``); a chunk is only
    ever found again by a request of the same identity. The default (all empty) is a plain
    text request of the engine's base model.

    Attributes:
        adapter: A stable identity of the LoRA adapter
            (``tierkv.chunks.revisions.adapter_identity`` gives one from the adapter's files;
            never a per-process integer id); None: the base model.
        salt: The tenant's cache salt (vLLM's ``cache_salt``): requests under different
            salts never share a chunk. The salt itself is hashed, never stored or logged
            (it is left out of the repr).
        media: The multimodal inputs of the prompt, kept sorted by offset.
        extra: Anything else a user's rule binds (strings, hashed in order).

    Raises:
        ValueError: if ``adapter`` or ``salt`` is neither a string nor None, or ``media``
            holds something other than ``MediaSpan`` items, or ``extra`` something other
            than strings.
    """

    adapter: str | None = None
    salt: str | None = field(default=None, repr=False)  # never in a log line or a traceback
    media: tuple[MediaSpan, ...] = ()
    extra: tuple[str, ...] = field(default=())
    _scope_parts: tuple[tuple[str, str], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("adapter", "salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"RequestIdentity.{name}: expected a string or None, got {type(value).__name__}")
        media = tuple(self.media)
        if not all(isinstance(span, MediaSpan) for span in media):
            raise ValueError("RequestIdentity.media: expected MediaSpan items")
        object.__setattr__(self, "media", tuple(sorted(media, key=lambda span: (span.offset, span.content_hash))))
        extra = tuple(self.extra)
        if not all(isinstance(part, str) for part in extra):
            raise ValueError("RequestIdentity.extra: expected strings")
        object.__setattr__(self, "extra", extra)
        parts = []
        if self.adapter:
            parts.append(("adapter", self.adapter))
        if self.salt:
            parts.append(("salt", self.salt))
        parts.extend(("extra", part) for part in extra)
        object.__setattr__(self, "_scope_parts", tuple(parts))  # asked on every lookup: made once

    @property
    def scope_parts(self) -> tuple[tuple[str, str], ...]:
        """The parts that seed every chunk of the request (media are per chunk)."""
        return self._scope_parts

    def describe(self) -> dict[str, object]:
        """What this identity binds, safe to show (the salt is never shown).

        Returns:
            ``{"adapter": ...}`` when there is an adapter, ``{"salted": True}`` when there is
                a salt, ``{"extra_parts": n}`` when there are extra parts (together); empty for a
                plain request.
        """
        out: dict[str, object] = {}
        if self.adapter:
            out["adapter"] = self.adapter
        if self.salt:
            out["salted"] = True
        if self.extra:
            out["extra_parts"] = len(self.extra)
        return out

    def to_wire(self) -> dict[str, object]:
        """A JSON-safe form (the vLLM scheduler sends it to the worker that answers lookups).

        It holds the salt: send it only between a deployment's own processes.

        Returns:
            A dict of ``adapter``, ``salt``, ``extra`` and ``media`` (``[hash, offset,
                length]`` triples), for ``from_wire``.
        """
        return {"adapter": self.adapter, "salt": self.salt, "extra": list(self.extra),
                "media": [[span.content_hash, span.offset, span.length] for span in self.media]}

    @classmethod
    def from_wire(cls, data: object) -> RequestIdentity:
        """The identity ``to_wire`` wrote.

        Args:
            data: What ``to_wire`` returned, after a trip through JSON.

        Returns:
            An identity equal to the one written.

        Raises:
            ValueError: if ``data`` is not a mapping, its media are not ``[hash, offset,
                length]`` triples, or a part is invalid (as for the constructor).
        """
        if not isinstance(data, dict):
            raise ValueError(f"request identity: expected a mapping, got {type(data).__name__}")
        try:
            media = tuple(MediaSpan(str(h), int(o), int(n)) for h, o, n in data.get("media") or ())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"request identity: media must be [hash, offset, length] triples: {exc}") from exc
        return cls(data.get("adapter"), data.get("salt"), media, tuple(data.get("extra") or ()))  # type: ignore[arg-type]


PLAIN = RequestIdentity()


def _encode(parts: Iterable[tuple[str, str]]) -> bytes:
    """An unambiguous byte encoding of (name, value) pairs (length-prefixed)."""
    out = bytearray()
    for name, value in parts:
        for text in (name, value):
            data = text.encode("utf-8")
            out += len(data).to_bytes(4, "little") + data
    return bytes(out)


@dataclass(frozen=True)
class Scope:
    """The seed of every chunk hash of one (engine identity, request identity) and its
    short name in key strings."""

    seed: bytes
    name: str


def make_scope(engine_parts: Sequence[tuple[str, str]], identity: RequestIdentity) -> Scope:
    """The scope of ``identity`` under an engine identified by ``engine_parts``."""
    digest = hashlib.sha256(KEY_FORMAT + b"\0" + _encode(engine_parts) + b"\0" + _encode(identity.scope_parts))
    seed = digest.digest()
    return Scope(seed, seed.hex()[:_SCOPE_HEX])


@functools.lru_cache(maxsize=1024)
def media_mixins(media: tuple[MediaSpan, ...], chunk_size: int) -> dict[int, bytes]:
    """For each chunk index some media input overlaps, the bytes of every media input
    overlapping it (in offset order); chunks without media are absent. Remembered for the
    last requests (a scheduler's lookup and the worker's load hash the same prompt); the
    dict returned is shared: read it, never change it."""
    overlapping: dict[int, list[MediaSpan]] = {}
    for span in media:
        for index in range(span.offset // chunk_size, (span.end - 1) // chunk_size + 1):
            overlapping.setdefault(index, []).append(span)
    return {index: _encode((span.content_hash, f"{span.offset}:{span.length}") for span in spans)
            for index, spans in overlapping.items()}


def fold_media(previous: bytes, mixin: bytes) -> bytes:
    """The chain value a chunk with media hashes its tokens after (a chunk without media
    uses ``previous`` as it is, so text before the first image keeps its plain key)."""
    return hashlib.sha256(b"tierkv-media\0" + previous + mixin).digest()
