"""CacheBlend executor: keep the retrieved KV, recompute only the tokens whose KV deviates most.

One forward pass over a batch calls ``CacheBlendExecutor.blend`` once per layer, in
layer order:

* layers before ``check_layer`` compute every token (their fresh K/V are returned as the
  long K/V; the retrieved KV is not needed there);
* at ``check_layer`` every token is still computed; the retrieved K, re-rotated from the
  positions it was cached at to its positions in this input (``rope_rerotate``), is scored
  against the fresh K per token (``kv_deviation``); in each request the top
  ``recompute_ratio`` of the tokens with cached KV are selected, together with every token
  without cached KV and the request's last token (whose logits are wanted); the fresh K/V
  of the selected tokens are written into the retrieved K/V (``blend_scatter``), and only
  their Q goes on;
* later layers compute only the selected tokens: their fresh K/V are scattered into that
  layer's re-rotated retrieved K/V, which attention then reads in full.

``recompute_ratio=1`` recomputes everything (a full prefill); ``0`` keeps every cached token
(plain concatenation of the segments' KV after re-rotation). The retrieved K/V tensors are
updated in place and returned as the long K/V. A new pass starts when ``layer_id`` does not
increase (or after ``reset``).
"""

from __future__ import annotations

import math

import torch

from tierkv import ops
from tierkv.blend.interfaces import BlendExecutor, BlendOutput


class CacheBlendExecutor(BlendExecutor):
    """Token-selective recompute (CacheBlend) with RoPE re-rotation of the reused K."""

    def __init__(self, cos_sin_cache: torch.Tensor, recompute_ratio: float = 0.15, check_layer: int = 1,
                 is_neox: bool = True) -> None:
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must lie in [0, 1], got {recompute_ratio}")
        if check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {check_layer}")
        if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dim() != 2:
            raise ValueError("cos_sin_cache must be a [max_position, rot_dim] tensor ([cos | sin] halves)")
        self.cos_sin_cache = cos_sin_cache.to(torch.float32)
        self.recompute_ratio = recompute_ratio
        self.check_layer = check_layer
        self.is_neox = is_neox
        self._device_caches: dict[torch.device, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the selection of the previous forward pass."""
        self._last_layer = -1
        self._selected: torch.Tensor | None = None  # long indices still computed, None = all
        self._long_positions: torch.Tensor | None = None
        self.num_selected: int | None = None

    def _cache_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._device_caches:
            self._device_caches[device] = self.cos_sin_cache.to(device)
        return self._device_caches[device]

    def _rerotate(self, retrieved_k: torch.Tensor, valid: torch.Tensor, original: torch.Tensor) -> None:
        """Move the cached K of valid tokens from their original to their new positions, in place."""
        long_positions = self._long_positions if self._long_positions is not None else torch.arange(valid.numel())
        new = long_positions.to(retrieved_k.device, torch.int64)
        old = torch.where(valid.to(retrieved_k.device), original.to(retrieved_k.device, torch.int64), new)
        if torch.equal(old, new):
            return
        ops.rope_rerotate(retrieved_k, old, new, self._cache_on(retrieved_k.device), self.is_neox)

    def _select(self, deviation: torch.Tensor, valid: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """Long indices to recompute: per request, the top deviations among valid tokens + invalid + last."""
        chosen: list[torch.Tensor] = []
        bounds = query_start_loc.tolist()
        for begin, end in zip(bounds[:-1], bounds[1:]):
            if end <= begin:
                continue
            request_valid = valid[begin:end]
            keep = ~request_valid
            keep[-1] = True
            valid_rows = request_valid.nonzero().flatten()
            count = min(math.ceil(self.recompute_ratio * valid_rows.numel() - 1e-9), valid_rows.numel())
            if count > 0:
                top = torch.topk(deviation[begin:end][valid_rows], count).indices
                keep[valid_rows[top]] = True
            chosen.append(keep.nonzero().flatten() + begin)
        return torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.int64)

    def blend(
        self,
        layer_id: int,
        retrieved_k: torch.Tensor | None,
        retrieved_v: torch.Tensor | None,
        valid_mask: torch.Tensor,
        original_positions: torch.Tensor,
        fresh_q: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        token_dim: int = 0,
    ) -> BlendOutput:
        if token_dim not in (0, 1):
            raise ValueError(f"token_dim must be 0 ([tokens, heads, head_size]) or 1 ([heads, tokens, head_size]), "
                             f"got {token_dim}")
        if layer_id <= self._last_layer:
            self.reset()
        self._last_layer = layer_id
        if token_dim == 1:
            cached_k = None if retrieved_k is None else retrieved_k.transpose(0, 1)
            cached_v = None if retrieved_v is None else retrieved_v.transpose(0, 1)
            out = self.blend(layer_id, cached_k, cached_v, valid_mask, original_positions, fresh_q.transpose(0, 1),
                             fresh_k.transpose(0, 1), fresh_v.transpose(0, 1), positions, query_start_loc, 0)
            out.q, out.k, out.v = out.q.transpose(0, 1), out.k.transpose(0, 1), out.v.transpose(0, 1)
            return out
        num_fresh = fresh_q.shape[0]
        device = fresh_q.device
        if self._selected is None:
            self._long_positions = positions
        everything = BlendOutput(fresh_q, fresh_k, fresh_v, positions, torch.arange(num_fresh, device=device), None)
        if retrieved_k is None or retrieved_v is None or (self._selected is None and layer_id < self.check_layer):
            return everything
        num_tokens = retrieved_k.shape[0]
        valid = valid_mask.to(torch.bool)
        if valid.numel() != num_tokens or retrieved_v.shape != retrieved_k.shape:
            raise ValueError(f"retrieved K {tuple(retrieved_k.shape)}, V {tuple(retrieved_v.shape)} and valid_mask "
                             f"({valid.numel()}) must all cover the same tokens")
        expected = num_tokens if self._selected is None else self._selected.numel()
        if num_fresh != expected or fresh_k.shape[0] != expected or fresh_k.shape[1:] != retrieved_k.shape[1:]:
            raise ValueError(f"layer {layer_id}: fresh K holds {fresh_k.shape[0]} tokens of shape "
                             f"{tuple(fresh_k.shape[1:])}, expected {expected} of {tuple(retrieved_k.shape[1:])}")
        self._rerotate(retrieved_k, valid, original_positions)
        if self._selected is None:  # the check layer: choose who is recomputed from here on
            deviation = ops.kv_deviation(retrieved_k, fresh_k).cpu()
            selected = self._select(deviation, valid.cpu(), query_start_loc.cpu())
            self._selected = selected.to(device)
            self.num_selected = selected.numel()
            local = self._selected
            fresh_k, fresh_v = fresh_k[local], fresh_v[local]
            q, q_positions = fresh_q[local], positions[local]
            # ``selected`` is sorted, so each request's start in the short Q is a binary search.
            new_start_loc = torch.searchsorted(selected, query_start_loc.cpu().to(torch.int64)).to(
                query_start_loc.device, query_start_loc.dtype)
        else:
            local = torch.arange(num_fresh, device=device)
            q, q_positions, new_start_loc = fresh_q, positions, None
        ops.blend_scatter(retrieved_k, fresh_k.to(retrieved_k.dtype).contiguous(), self._selected)
        ops.blend_scatter(retrieved_v, fresh_v.to(retrieved_v.dtype).contiguous(), self._selected)
        return BlendOutput(q, retrieved_k, retrieved_v, q_positions, local, new_start_loc)
