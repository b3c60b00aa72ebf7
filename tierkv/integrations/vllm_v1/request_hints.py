"""Hints a vLLM request carries for tierkv: retain its prompt for a while, drop it when it ends,
prefetch a prompt to come (``tierkv.engine.hints`` executes them).

Two ways in, both per request:

- ``kv_transfer_params`` (``SamplingParams(extra_args={"kv_transfer_params": {...}})``, or the
  OpenAI server's ``kv_transfer_params`` field): ``{"tierkv": {"retain_s": 600}}`` keeps the
  request's prompt through evictions for 600 s once its save lands; ``{"tierkv": {"drop": true}}``
  drops the prompt's chunks instead of saving them (the session's last turn);
  ``{"tierkv": {"drop_tenant": true}}`` drops every chunk of the request's identity (its
  tenant's ``cache_salt``, its adapter) from every tier that can find chunks by scope
  (``StorageBackend.drop_scope``);
  ``{"tierkv": {"prefetch_token_ids": [...]}}`` moves that prompt's cached prefix up from the
  lower tiers now (a tool call's pause before the next turn);
- vLLM's typed hints (``request.kv_hints``, a ``KvHintsEnvelope`` an orchestrator attaches
  through the engine API): actions ``retain`` / ``pin`` (payload ``ttl_s``, ``seconds`` or
  ``duration_s``), ``fetch`` / ``prefetch`` (payload ``token_ids``; none: this request's
  prompt), ``drop`` / ``evict`` / ``release``. Other action types are left to other components.

A malformed hint is logged once per request and ignored: a client's mistake never fails the
request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

RETAIN_ACTIONS = ("retain", "pin", "keep")
FETCH_ACTIONS = ("fetch", "prefetch")
DROP_ACTIONS = ("drop", "evict", "release", "discard")
_SECONDS_KEYS = ("ttl_s", "seconds", "duration_s", "retain_s")


@dataclass(frozen=True)
class RequestHints:
    """What a request asks of tierkv beyond load and save."""

    retain_s: float = 0.0
    drop: bool = False
    prefetch: tuple[int, ...] | None = None  # token ids of a prompt to come; () : this request's own
    drop_tenant: bool = False  # every chunk of the request's identity, not only its prompt's

    def __bool__(self) -> bool:
        return bool(self.retain_s or self.drop or self.prefetch is not None or self.drop_tenant)


NO_HINTS = RequestHints()


def request_hints(request: Any) -> RequestHints:
    """The hints of a vLLM ``Request`` (``NO_HINTS`` when it carries none or only bad ones)."""
    retain_s, drop, prefetch, drop_tenant = 0.0, False, None, False
    try:
        params = getattr(request, "kv_transfer_params", None)
        ours = params.get("tierkv") if isinstance(params, Mapping) else None
        if ours is not None:
            if not isinstance(ours, Mapping):
                raise ValueError(f"kv_transfer_params['tierkv']: expected a mapping, got {type(ours).__name__}")
            if "retain_s" in ours:
                retain_s = _seconds(ours["retain_s"], "retain_s")
            drop = _flag(ours.get("drop", False), "drop")
            drop_tenant = _flag(ours.get("drop_tenant", False), "drop_tenant")
            if "prefetch_token_ids" in ours:
                prefetch = _token_ids(ours["prefetch_token_ids"], "prefetch_token_ids")
        envelope = getattr(request, "kv_hints", None)
        for action in getattr(envelope, "actions", None) or ():
            kind = str(getattr(action, "action_type", "")).lower()
            payload = getattr(action, "payload", None) or {}
            if kind in RETAIN_ACTIONS:
                given = [payload[key] for key in _SECONDS_KEYS if key in payload]
                if not given:
                    raise ValueError(f"a {kind!r} hint needs one of {list(_SECONDS_KEYS)} in its payload")
                retain_s = max(retain_s, _seconds(given[0], f"{kind}.{_SECONDS_KEYS[0]}"))
            elif kind in FETCH_ACTIONS:
                prefetch = _token_ids(payload["token_ids"], f"{kind}.token_ids") if "token_ids" in payload else ()
            elif kind in DROP_ACTIONS:
                drop = True
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning("tierkv: request %s: its KV hints are ignored: %s", getattr(request, "request_id", "?"), exc)
        return NO_HINTS
    return RequestHints(retain_s, drop or drop_tenant, prefetch, drop_tenant)


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a number of seconds >= 0, got {value!r}")
    return float(value)


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return value


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or \
            not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"{name}: expected a list of token ids (integers >= 0)")
    return tuple(int(t) for t in value)
