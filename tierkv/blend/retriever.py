"""Segment retriever: fetches every segment's KV in the background, hands it out layer by layer.

``new_request`` returns at once. A worker thread reads all segments of the batch from the
engine (one batched get), then lays the chunks out per layer into token-first
``[num_tokens, num_kv_heads, head_size]`` K and V on the target device, releasing each
layer as soon as it is in place. ``result(layer_id)`` waits for that layer only, so the
caller computes layer ``i`` while layers ``i+1 …`` are being assembled (and, for the first
layer, while the tiers are read).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from tierkv.blend.interfaces import BlendRetriever, BlendRetrieverResult, BlendRetrieverTask
from tierkv.blend.segments import FetchedSegment, SegmentKeys, fetch_segments, segment_keys
from tierkv.chunks import kvlayout
from tierkv.chunks.identity import PLAIN, RequestIdentity
from tierkv.engine.blocking import Engine


def split_segments(prompt: torch.Tensor, starts: Sequence[int]) -> list[tuple[int, int]]:
    """``(begin, end)`` of each segment of ``prompt`` given where segments start.

    Offset 0 and the prompt's end are implied; offsets must be increasing and inside the prompt.
    """
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1:
        raise ValueError("each full prompt must be a 1-D tensor of token ids")
    length = prompt.numel()
    bounds = sorted({0, *[int(s) for s in starts]})
    if any(b < 0 or b > length for b in bounds):
        raise ValueError(f"segment start offsets must lie in [0, {length}], got {list(starts)}")
    bounds = [b for b in bounds if b < length] + [length]
    return list(zip(bounds[:-1], bounds[1:]))


class SegmentRetrievalTask(BlendRetrieverTask):
    """A background retrieval of one batch; ``result(layer_id)`` blocks for that layer only."""

    def __init__(self, engine: Engine, prompts: list[torch.Tensor], indices: list[list[int]],
                 device: torch.device | str | None, identity: RequestIdentity = PLAIN) -> None:
        if len(prompts) != len(indices):
            raise ValueError(f"new_request got {len(prompts)} prompts but {len(indices)} index lists")
        self._engine = engine
        self._device = torch.device(device) if device is not None else None
        self._spans: list[tuple[int, int]] = []  # (begin, end) in the concatenated batch
        self._keys: list[SegmentKeys] = []
        offset = 0
        for prompt, starts in zip(prompts, indices):
            for begin, end in split_segments(prompt, starts):
                self._spans.append((offset + begin, offset + end))
                self._keys.append(segment_keys(engine, prompt[begin:end], identity))
            offset += prompt.numel()
        self.num_tokens = offset
        with torch.inference_mode(False):  # filled in by the worker thread, which is not in inference mode
            self.valid_mask = torch.zeros(offset, dtype=torch.bool)
            self._original = torch.zeros(offset, dtype=torch.int64)
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._num_layers: int | None = None
        self._ready = threading.Condition()
        self._done_layers = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tierkv-blend-retrieve", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            fetched = fetch_segments(self._engine, self._keys)
            self._assemble(fetched)
        except BaseException as exc:  # handed to the caller by result()
            with self._ready:
                self._error = exc
                self._ready.notify_all()

    def _assemble(self, fetched: list[FetchedSegment]) -> None:
        fmt = self._engine.metadata.fmt
        dim = kvlayout.token_dim(fmt)
        pieces: list[tuple[int, torch.Tensor]] = []  # (row in the batch, chunk blob)
        chunk_size = self._engine.config.chunk_size
        for (begin, _end), seg in zip(self._spans, fetched):
            if seg.positions is None:
                continue
            for number, chunk in enumerate(seg.chunks):
                if chunk is None:
                    continue
                row = begin + number * chunk_size
                rows = chunk.shape[dim]
                self.valid_mask[row : row + rows] = True
                self._original[row : row + rows] = seg.positions[number * chunk_size : number * chunk_size + rows]
                pieces.append((row, chunk))
        first = pieces[0][1] if pieces else None
        with self._ready:
            self._num_layers = 0 if first is None else first.shape[0]
            self._ready.notify_all()
        if first is None:
            return
        device = self._device or first.device
        heads, head_size = (first.shape[3], first.shape[4]) if fmt == "vllm" else (first.shape[2], first.shape[4])
        for layer in range(first.shape[0]):
            k = torch.empty(self.num_tokens, heads, head_size, dtype=first.dtype, device=device)
            v = torch.empty_like(k)
            for row, chunk in pieces:
                part = chunk[layer] if fmt == "vllm" else chunk[layer].transpose(1, 2)
                k[row : row + part.shape[1]].copy_(part[0], non_blocking=True)
                v[row : row + part.shape[1]].copy_(part[1], non_blocking=True)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            with self._ready:
                self._layers.append((k, v))
                self._done_layers += 1
                self._ready.notify_all()

    def result(self, layer_id: int) -> BlendRetrieverResult:
        with self._ready:
            self._ready.wait_for(lambda: self._error is not None or (
                self._num_layers is not None and (layer_id >= self._num_layers or self._done_layers > layer_id)))
            if self._error is not None:
                raise RuntimeError("blend retrieval failed") from self._error
            num_layers = self._num_layers or 0
            if num_layers == 0:
                return BlendRetrieverResult(None, None, self.valid_mask, self._original)
            if not 0 <= layer_id < num_layers:
                raise ValueError(f"layer_id must lie in [0, {num_layers}), got {layer_id}")
            k, v = self._layers[layer_id]
        return BlendRetrieverResult(k, v, self.valid_mask, self._original.to(k.device))


class SegmentBlendRetriever(BlendRetriever):
    """Retrieves the segments stored by ``tierkv.blend.store_segments`` from an engine."""

    def __init__(self, engine: Engine, device: torch.device | str | None = None,
                 identity: RequestIdentity = PLAIN) -> None:
        self.engine = engine
        self.device = device
        self.identity = identity  # the adapter and salt whose segments this retriever reads

    def new_request(self, full_prompts: list[torch.Tensor], indices: list[list[int]]) -> SegmentRetrievalTask:
        return SegmentRetrievalTask(self.engine, list(full_prompts), [list(i) for i in indices], self.device,
                                    self.identity)
