"""Engine-level store / retrieve through a connector: a store's chunks gathered by the
connector straight into the first tier's memory (``ConnectorSource``), a retrieve's chunks
scattered by it straight out of the tier's memory (``ConnectorSink``), no prompt-sized blob.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from tierkv.chunks import copies, kvlayout
from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.chunks.keys import CacheKey, as_token_array

if TYPE_CHECKING:
    from tierkv.connectors.gpu import GPUConnector
    from tierkv.engine.blocking import AsyncEngine, Engine


def _check_format(engine: AsyncEngine, connector: GPUConnector) -> None:
    if connector.fmt != engine.metadata.fmt:
        raise ValueError(
            f"connector produces {connector.fmt!r} blobs but the engine stores {engine.metadata.fmt!r}; "
            "construct the connector with the engine's kv_format"
        )


class ConnectorSource:
    """A store's chunks gathered by ``connector.from_gpu`` straight into the tier's memory.

    The gather runs on the CUDA stream that was current where the source was made (the
    serving engine's), whichever thread the engine copies on. A batch's copies queue back to
    back on that stream and the host waits once, when the batch is over (or failed): no copy
    into the tier's memory is in flight once a call returns.
    """

    def __init__(self, connector: GPUConnector, kwargs: dict[str, Any], num_tokens: int) -> None:
        self.connector = connector
        self.kwargs = {**kwargs, "sync": False}  # waited for by _gather_all
        self.dtype = connector.dtype_of(**kwargs)
        self.device = torch.device("cpu")
        self.num_tokens = num_tokens
        self._stream = _current_stream(kwargs)

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return tuple(self.connector.get_shape(num_tokens))

    def view(self, start: int, end: int) -> None:
        return None

    def write_into(self, dest: torch.Tensor, start: int, end: int) -> None:
        self._gather_all([(dest, start, end)])

    def write_many(self, work: list[tuple[torch.Tensor, int, int]]) -> None:
        """Every chunk of ``work`` at once (see ``tierkv.chunks.transfer.write_all``)."""
        self._gather_all(work)

    def _gather_all(self, work: list[tuple[torch.Tensor, int, int]]) -> None:
        events: list[Any] = []
        try:
            with _on_stream(self._stream):
                for dest, start, end in work:
                    events.append(self.connector.from_gpu(dest, start, end, **self.kwargs))
                    copies.count(dest.nbytes)
        finally:  # a failure part way still waits for the copies already queued into the tier's memory
            _wait_all(events)


class ConnectorSink:
    """A retrieve's chunks scattered by ``connector.to_gpu`` straight out of the tier's memory
    (tokens before ``offset`` in a chunk, an unaligned mask, are left alone). A batch's copies
    queue back to back and the host waits once for the copies out of the chunks, so the
    chunks may be released when a call returns (the scatters stay queued on the serving
    engine's stream, ahead of its compute)."""

    def __init__(self, connector: GPUConnector, kwargs: dict[str, Any], offset: int) -> None:
        self.connector = connector
        self.kwargs = {**kwargs, "sync": False}  # waited for by _scatter_all
        self.dtype = connector.dtype_of(**kwargs)
        self.offset = offset
        self._stream = _current_stream(kwargs)

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return tuple(self.connector.get_shape(num_tokens))

    def destination(self, start: int, end: int) -> None:
        return None

    def read_from(self, chunk: torch.Tensor, start: int, end: int) -> None:
        self._scatter_all([(chunk, start, end)])

    def read_many(self, work: list[tuple[torch.Tensor, int, int]]) -> None:
        """Every chunk of ``work`` at once (see ``tierkv.chunks.transfer.read_all``)."""
        self._scatter_all(work)

    def _scatter_all(self, work: list[tuple[torch.Tensor, int, int]]) -> None:
        events: list[Any] = []
        narrowed = []  # alive until their copies are done
        try:
            with _on_stream(self._stream):
                for chunk, start, end in work:
                    skip = max(0, self.offset - start)
                    if skip:
                        chunk = chunk.narrow(kvlayout.token_dim(self.connector.fmt), skip,
                                             end - start - skip).contiguous()
                        narrowed.append(chunk)
                    events.append(self.connector.to_gpu(chunk, start + skip, end, **self.kwargs))
                    copies.count(chunk.nbytes)
        finally:  # a failure part way still waits for the copies already reading the chunks
            _wait_all(events)


def _wait_all(events: list[Any]) -> None:
    """Wait for every copy a connector left in flight (None: it finished before returning)."""
    for event in events:
        if event is not None:
            event.synchronize()


def _current_stream(kwargs: dict[str, Any]) -> torch.cuda.Stream | None:
    """The caller's current stream on the serving engine's cache device (None on the CPU)."""
    try:
        device = kwargs["kvcaches"][0][0].device  # a (K, V) pair's K, or a fused layer's K half
    except (KeyError, TypeError, IndexError, AttributeError):
        return None
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _on_stream(stream: torch.cuda.Stream | None) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


async def _store_range(engine: AsyncEngine, tokens: Any, mask: torch.Tensor | None,
                       identity: RequestIdentity = PLAIN) -> tuple[int, list[CacheKey], list[tuple[int, int]]]:
    """How many tokens the chunks to store cover (masked-out and already cached ones left out),
    and their keys and token ranges."""
    token_array = as_token_array(tokens)
    skip = kvlayout.store_mask_skip(mask, len(token_array), engine.chunk_size)
    keys, ranges = await engine.chunks_to_store(token_array, skip, identity=identity)
    return (len(token_array) - ranges[0][0] if ranges else 0), keys, ranges


async def store_with_connector(
    engine: AsyncEngine, connector: GPUConnector, tokens: Any, mask: torch.Tensor | None = None, *,
    identity: RequestIdentity = PLAIN, **kwargs: Any
) -> int:
    """Store the KV of ``tokens`` straight from the serving engine's cache; returns chunks written.

    ``kwargs`` go to ``connector.from_gpu`` (``kvcaches``, ``slot_mapping``). Each chunk is
    gathered once, straight into the memory of the first tier that takes it (a chunk-sized
    pooled buffer for tiers without memory of their own): no prompt-sized blob. Chunks
    already cached at the start of the prompt are neither gathered nor written again; a
    suffix ``mask`` (aligned to chunks) leaves its unmasked prefix out, as in ``AsyncEngine.store``.
    ``identity``: the request's adapter, salt and media (see ``AsyncEngine.store``).
    """
    _check_format(engine, connector)
    num_tokens, keys, ranges = await _store_range(engine, tokens, mask, identity)
    if not keys:
        return 0
    return await engine.store_from(keys, ConnectorSource(connector, kwargs, num_tokens), ranges)


async def retrieve_with_connector(
    engine: AsyncEngine, connector: GPUConnector, tokens: Any, mask: torch.Tensor | None = None,
    deadline_s: float | None = None, *, identity: RequestIdentity = PLAIN, **kwargs: Any
) -> torch.Tensor:
    """Retrieve the cached prefix of ``tokens`` straight into the serving engine's cache.

    ``kwargs`` go to ``connector.to_gpu``. Chunks in a memory tier are scattered straight out
    of its slabs. Returns the mask of the tokens written (as ``AsyncEngine.retrieve``'s
    ``ret_mask``); tokens outside it are left untouched.
    """
    _check_format(engine, connector)
    skip = kvlayout.suffix_mask_skip(mask, len(as_token_array(tokens)))
    return await engine.retrieve_to(tokens, ConnectorSink(connector, kwargs, skip), mask, deadline_s,
                                    identity=identity)


def store_paged(
    engine: Engine, connector: GPUConnector, tokens: Any, mask: torch.Tensor | None = None, *,
    identity: RequestIdentity = PLAIN, **kwargs: Any
) -> int:
    """Blocking ``store_with_connector`` for ``tierkv.Engine`` (the gathers run on the
    caller's CUDA stream)."""
    core = engine.core
    _check_format(core, connector)
    source = ConnectorSource(connector, kwargs, 0)

    async def store() -> int:
        source.num_tokens, keys, ranges = await _store_range(core, tokens, mask, identity)
        if not keys:
            return 0
        return await core.store_from(keys, source, ranges)
    return engine.run(store())


def retrieve_paged(
    engine: Engine, connector: GPUConnector, tokens: Any, mask: torch.Tensor | None = None,
    deadline_s: float | None = None, *, identity: RequestIdentity = PLAIN, **kwargs: Any
) -> torch.Tensor:
    """Blocking ``retrieve_with_connector`` for ``tierkv.Engine`` (the scatters run on
    the caller's CUDA stream)."""
    core = engine.core
    _check_format(core, connector)
    skip = kvlayout.suffix_mask_skip(mask, len(as_token_array(tokens)))
    return engine.run(core.retrieve_to(tokens, ConnectorSink(connector, kwargs, skip), mask, deadline_s,
                                       identity=identity))
