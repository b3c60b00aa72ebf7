"""SGLang pages through a tierkv engine: stored straight out of, and read straight into,
SGLang's host pool (one copy per byte), located from the tiers' in-memory indexes.

A page batch is handed to the engine as a ``ViewSource`` / ``ViewSink`` over chunk
views of the pool (``.layout``), the same ``ChunkSource`` / ``ChunkSink`` machinery the
connectors use (``tierkv.connectors.engine_io``): a memory tier copies a page into its slab
or out of it once, a disk tier reads or writes the page's contiguous runs in place. Page ``j``
of a batch stands at "tokens" ``[j * page, (j + 1) * page)`` of the batch.

The engine's public API reads prompts by their tokens; SGLang asks for pages by hash, so
``PageIO`` uses the engine's key-level calls: ``locate_keys_nowait`` / ``locate_keys``
(where each page is), ``plan_located`` (how many of them are worth loading),
``retrieve_keys_into`` and ``store_from`` (the pages themselves).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.chunks.keys import CacheKey
from tierkv.chunks.memory import copy_into
from tierkv.chunks.transfer import chunk_ranges
from tierkv.engine.blocking import Engine
from tierkv.policy import residency as policy


class ViewSource:
    """A store's pages, each a chunk view of the caller's memory (``ranges[j]`` is page ``j``)."""

    def __init__(self, views: Sequence[torch.Tensor], page_size: int) -> None:
        if not views:
            raise ValueError("a page source needs at least one page")
        self.views = list(views)
        self.page_size = page_size
        self.dtype = views[0].dtype
        self.device = torch.device("cpu")
        self.num_tokens = len(views) * page_size
        self._shape = tuple(views[0].shape)

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        if num_tokens != self.page_size:
            raise ValueError(f"an SGLang page holds {self.page_size} tokens, asked for {num_tokens}")
        return self._shape

    def view(self, start: int, end: int) -> torch.Tensor:
        return self.views[start // self.page_size]

    def write_into(self, dest: torch.Tensor, start: int, end: int) -> None:
        copy_into(dest, self.view(start, end))


class ViewSink:
    """A read's pages, each written straight into a chunk view of the caller's memory."""

    def __init__(self, views: Sequence[torch.Tensor], page_size: int) -> None:
        if not views:
            raise ValueError("a page sink needs at least one page")
        self.views = list(views)
        self.page_size = page_size
        self.dtype = views[0].dtype
        self._shape = tuple(views[0].shape)

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return self._shape  # every range the engine is given here is one page

    def destination(self, start: int, end: int) -> torch.Tensor:
        return self.views[start // self.page_size]

    def read_from(self, chunk: torch.Tensor, start: int, end: int) -> None:
        copy_into(self.views[start // self.page_size], chunk)


class PageIO:
    """Key-level page reads, writes and lookups through one engine (any thread)."""

    def __init__(self, engine: Engine, page_size: int) -> None:
        self.engine = engine
        self.core = engine.core
        self.page_size = page_size

    def ranges(self, count: int) -> list[tuple[int, int]]:
        return chunk_ranges(0, count * self.page_size, self.page_size)

    # -- where pages are ---------------------------------------------------------------------------
    def where(self, keys: Sequence[CacheKey]) -> list[str | None]:
        """The tier holding each page (``"fill-queue"``: acknowledged, not yet written; None:
        nowhere), from in-memory indexes on the calling thread; a tier without an index (S3)
        is asked on the engine's loop."""
        if not keys:
            return []
        tiers = self.core.locate_keys_nowait(keys)
        if tiers is None:
            tiers = self.engine.run(self.core.locate_keys(keys))
        return tiers

    def held_prefix(self, tiers: Sequence[str | None]) -> int:
        return policy.first_missing([tier is not None for tier in tiers])

    def worth_loading(self, tiers: Sequence[str | None], first_page: int) -> int:
        """How many of the held leading pages are faster to load than to recompute, under the
        engine's plan (all of them when the engine is not cost-aware); ``first_page``: pages
        of the prompt before these (SGLang has them already: context, not load)."""
        if not tiers or not self.engine.cost_aware:
            return len(tiers)
        num_tokens = (first_page + len(tiers)) * self.page_size
        plan = self.core.plan_located(tiers, num_tokens, first_page)
        return max(0, min(len(tiers), -(-plan.planned_tokens // self.page_size) - first_page))

    # -- moving pages ------------------------------------------------------------------------------
    def write(self, keys: Sequence[CacheKey], source: ViewSource) -> int:
        """Store the pages of ``source`` under ``keys``; pages written."""
        return self.engine.run(self.core.store_from(list(keys), source, self.ranges(len(keys))))

    def read(self, keys: Sequence[CacheKey], sink: ViewSink, deadline_s: float | None) -> int:
        """Read the leading pages held by some tier into ``sink``; how many leading pages arrived
        (a damaged page is a miss and ends the prefix; pages past it are not to be used)."""
        return self.engine.run(self.core.retrieve_keys_into(list(keys), self.ranges(len(keys)), sink, deadline_s))
