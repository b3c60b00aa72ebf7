"""Continuation tails: a chat's next turn finds the KV of where its previous turn ended.

A prompt's last chunk is usually partial, and it is stored under a key over exactly its
tokens: a repeat of the prompt matches it, the next turn does not (it extends the prompt, so
its own chunk there covers more tokens). With 256-token chunks a turn that adds a few hundred
tokens then recomputes up to a chunk of its predecessor's prompt on every replica but the one
that computed it, although that KV sits in the tiers.

So a lookup whose cached prefix ends at a chunk boundary probes the chunk after it at every
multiple of a step (``tail_lengths``, longest first), and a save whose prompt does not end on a
step also stores its prompt cut at the last one (``saved_tail_end``: one more partial chunk,
keyed over its own tokens). The previous turn's exact end, when it lies on a step, or else its
cut, is among the probes: the next turn recomputes at most ``step - 1`` tokens of it. The probes
are keys of one chunk each, named without hashing the prefix again
(``tierkv.AsyncEngine.tail_keys``), located from the tiers' in-memory indexes where they have
them. Both ends use the same step (``tail_step``), so what a save stores a later lookup looks
for; a tail found is loaded only where the cost model says its whole prefix pays (the same rule
as every other chunk).

The step is 16 tokens (``TAIL_STEP``, a GPU block), or vLLM's block where that is smaller, and
not vLLM's block itself: vLLM's CPU blocks are 128 tokens, so a cut at a block left up to 127
tokens of the previous turn to recompute, and a previous prompt's own exact end (kept in the
tiers anyway) was never probed unless it fell on a block. A load may end inside a block (vLLM
counts the tokens, not the blocks, it was given), so nothing ties the tails to vLLM's blocks;
a finer step costs one probe per step of the chunk (15 with 256-token chunks).
"""

from __future__ import annotations

TAIL_STEP = 16
"""The granularity of continuation tails, in tokens, where vLLM's block is not smaller."""


def tail_step(block_size: int) -> int:
    """The step of the cuts a save stores and a lookup probes, for vLLM's ``block_size``:
    ``TAIL_STEP`` or the block where that is smaller; 0 (tails off) when the block is unknown."""
    return min(block_size, TAIL_STEP) if block_size > 0 else 0


def saved_tail_end(num_tokens: int, chunk_size: int, step: int) -> int | None:
    """Where a save of a ``num_tokens`` prompt cuts its extra tail: the prompt floored to a
    multiple of ``step`` (``tail_step``), when that ends inside the last chunk and short of the
    prompt's end (whose own partial chunk is stored anyway); None otherwise (``step`` <= 0: off)."""
    if step <= 0 or num_tokens <= 0:
        return None
    end = num_tokens // step * step
    if end <= num_tokens // chunk_size * chunk_size or end == num_tokens:
        return None
    return end


def tail_lengths(num_tokens: int, held_tokens: int, chunk_size: int, step: int) -> list[int]:
    """The lengths (tokens into the chunk that starts at ``held_tokens``) at which a lookup of a
    ``num_tokens`` prompt probes for a stored tail, longest first: every cut at a multiple of
    ``step`` inside that chunk and short of the prompt's end (the prompt's own end is the
    regular key, probed already). Empty when ``step`` <= 0 or ``held_tokens`` is not a chunk
    boundary."""
    if step <= 0 or held_tokens % chunk_size:
        return []
    top = min(held_tokens + chunk_size - 1, num_tokens - 1)
    return [end - held_tokens for end in range(top // step * step, held_tokens, -step)]
