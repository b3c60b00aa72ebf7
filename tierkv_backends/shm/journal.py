"""The journal of a ``shm`` pool: a ring of records in the pool file saying what entered and
what left it, so every process attached to the pool learns of every other's chunks.

Three kinds of record, the first two naming a chunk by its 128-bit digest:

- ``DESCRIBED``: a process that stored a chunk says what it holds, as an opaque payload the
  pool never interprets (the vLLM integration writes the chunk's tokens and vLLM's block
  hashes, so every engine on the node can announce it as a KV event);
- ``DROPPED``: the chunk left the pool (evicted, deleted), written by whichever process made it
  leave. A chunk replaced by a newer copy of itself did not leave;
- ``NAMED``: the model a key scope's chunks belong to (its name), written by a process the
  first time it stores into a scope and again before the ring could have overwritten that
  record, so ``tierkv pool`` can say per model what the pool holds.

Writers append under the pool's lock (one writer at a time, by construction); readers read
without it, each at a cursor of its own (an absolute byte position). The ring's header words
(``Word.JOURNAL_*``) hold the bytes ever written (``HEAD``) and where the oldest whole record
starts (``TAIL``). A writer moves ``TAIL`` past the records it is about to overwrite *before*
writing, and ``HEAD`` past its record *after*, so:

- a writer that dies mid-record leaves ``HEAD`` where it was: the half record is never read,
  and the next writer writes over it;
- a reader that finds ``TAIL`` past its cursor after copying a record knows the copy may be torn
  and drops it (counted as lost, with everything else it missed); every record also carries a
  CRC-32 of its contents, so a torn copy is refused on its own as well.

Records never straddle the ring's end: a record that would is preceded by padding to the end.
Nothing read from the ring is trusted beyond its bounds: a length that does not fit ends the
read (``corrupt``) rather than indexing past the ring.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv_backends.shm.layout import Word

HEADER = struct.Struct("<IIIIQ")  # total bytes, kind, payload bytes, crc32, sequence number
DIGEST = struct.Struct("<QQ")


class Kind(enum.IntEnum):
    """What a record says (the module docstring); PAD fills the ring's end before a wrap."""

    PAD = 0
    DESCRIBED = 1
    DROPPED = 2
    NAMED = 3  # the digest field holds (scope id, 0)


@dataclass(frozen=True)
class Record:
    """One journal record: its sequence number, kind, chunk digest and (DESCRIBED) payload."""

    seq: int
    kind: Kind
    digest: tuple[int, int]
    payload: bytes = b""


@dataclass
class Reading:
    """What one ``read`` found: the records, the cursor to read on from, and how many bytes of
    records it could not read (overwritten before it got to them, or damaged)."""

    records: list[Record]
    cursor: int
    lost_bytes: int = 0


def _aligned(size: int) -> int:
    return -(-size // 8) * 8


class Journal:
    """The journal ring over a mapped pool: ``words`` is the pool's header, ``ring`` its bytes."""

    def __init__(self, words: np.ndarray, ring: np.ndarray) -> None:
        self.words = words
        self.ring = ring
        self.size = int(ring.shape[0])

    @property
    def max_payload(self) -> int:
        """The largest payload a record may carry (an eighth of the ring: a few records always fit)."""
        return self.size // 8 - HEADER.size - DIGEST.size

    # -- writing (under the pool's lock) -----------------------------------------------------------
    def dropped(self, digests: Sequence[tuple[int, int]]) -> None:
        for d0, d1 in digests:
            self._append(Kind.DROPPED, DIGEST.pack(d0, d1))

    def described(self, digest: tuple[int, int], payload: bytes) -> bool:
        """Append a description of a chunk; False (nothing written) when it is larger than
        ``max_payload``."""
        if len(payload) > self.max_payload:
            return False
        self._append(Kind.DESCRIBED, DIGEST.pack(*digest) + payload)
        return True

    def named(self, scope: int, name: str) -> None:
        self._append(Kind.NAMED, DIGEST.pack(scope, 0) + name.encode()[:256])

    def _append(self, kind: Kind, body: bytes) -> None:
        words, size = self.words, self.size
        total = _aligned(HEADER.size + len(body))
        head, tail = int(words[Word.JOURNAL_HEAD]), int(words[Word.JOURNAL_TAIL])
        position = head % size
        pad = size - position if size - position < total else 0
        while head + pad + total - tail > size:  # make room: the oldest records go first
            tail = self._next(tail, head)
        words[Word.JOURNAL_TAIL] = tail  # before anything is overwritten
        if pad:
            if pad >= HEADER.size:
                self.ring[position : position + HEADER.size] = np.frombuffer(HEADER.pack(pad, Kind.PAD, 0, 0, 0),
                                                                             dtype=np.uint8)
            position = 0
        seq = int(words[Word.JOURNAL_SEQ]) + 1
        crc = zlib.crc32(struct.pack("<IQ", kind, seq) + body)
        record = HEADER.pack(total, kind, len(body), crc, seq) + body
        self.ring[position : position + len(record)] = np.frombuffer(record, dtype=np.uint8)
        words[Word.JOURNAL_SEQ] = seq
        words[Word.JOURNAL_HEAD] = head + pad + total  # last: the record is now readable

    def _next(self, position: int, head: int) -> int:
        """Where the record after the one at ``position`` starts (``head`` when the ring is damaged)."""
        offset = position % self.size
        left = self.size - offset
        if left < HEADER.size:
            return position + left
        total = int.from_bytes(self.ring[offset : offset + 4].tobytes(), "little")
        if total < 8 or total % 8 or total > left:
            return head  # damaged: start over from the head (readers count what they lose)
        return position + total

    # -- reading (no lock) ---------------------------------------------------------------------------
    def oldest(self) -> int:
        """The cursor of the oldest record still in the ring (a reader that wants everything)."""
        return int(self.words[Word.JOURNAL_TAIL])

    def newest(self) -> int:
        """The cursor past the newest record (a reader that wants only what comes next)."""
        return int(self.words[Word.JOURNAL_HEAD])

    def read(self, cursor: int, limit: int = 4096) -> Reading:
        """Up to ``limit`` records from ``cursor`` on."""
        words, size = self.words, self.size
        head = int(words[Word.JOURNAL_HEAD])
        records: list[Record] = []
        lost = 0
        if cursor > head:  # a cursor of another pool (recreated): start from its beginning
            cursor = int(words[Word.JOURNAL_TAIL])
        while cursor < head and len(records) < limit:
            tail = int(words[Word.JOURNAL_TAIL])
            if cursor < tail:
                lost += tail - cursor
                cursor = tail
                continue
            offset = cursor % size
            left = size - offset
            if left < HEADER.size:
                cursor += left
                continue
            total, kind, length, crc, seq = HEADER.unpack(self.ring[offset : offset + HEADER.size].tobytes())
            sane = 8 <= total <= left and not total % 8 and (kind == Kind.PAD or HEADER.size + length <= total)
            body = self.ring[offset + HEADER.size : offset + HEADER.size + length].tobytes() if sane else b""
            if int(words[Word.JOURNAL_TAIL]) > cursor:  # overwritten while it was copied
                continue
            if not sane:
                lost += head - cursor
                cursor = head
                break
            cursor += total
            if kind == Kind.PAD:
                continue
            if kind not in (Kind.DESCRIBED, Kind.DROPPED, Kind.NAMED) or length < DIGEST.size \
                    or zlib.crc32(struct.pack("<IQ", kind, seq) + body) != crc:
                lost += total
                continue
            records.append(Record(seq, Kind(kind), DIGEST.unpack_from(body), body[DIGEST.size :]))
        return Reading(records, cursor, lost)
