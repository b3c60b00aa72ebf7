"""The connector's settings: vLLM's own config plus ``kv_connector_extra_config``.

What keys chunks (model and its revision, world size, worker id, KV dtype and geometry, and
per request its LoRA adapter, cache salt and media) comes from vLLM, so a cache is never
shared between models, revisions, tenants or tensor-parallel shapes by mistake; what the tiers are comes from
the tierkv config named in the extra config (a YAML path, or the config inline), or from
``TIERKV_CONFIG``.

``kv_connector_extra_config`` keys:

- ``config``: path of a tierkv YAML file, or the config as a mapping (required unless
  ``TIERKV_CONFIG`` names a file);
- ``load_async``: ``"auto"`` (default: asynchronous when part of a prefix comes from a tier
  below memory), ``"always"`` / ``true``, ``"never"`` / ``false``;
- ``load_timeout_s``: how long a load (synchronous, asynchronous or a hybrid model's) may
  take before it is abandoned and its blocks are recomputed (default 30; ``null`` for no
  limit);
- ``load_failure_policy``: ``"recompute"`` (default: a failed load is recomputed, as a cache
  miss should be) or ``"fail"`` (vLLM's own default: the request fails);
- ``stats_file``: a path where each worker keeps a JSON summary of its loads and saves;
- ``layout``: ``"auto"`` (default: from the attention backend and the cache's shape) or one of
  ``cpu``, ``content``, ``kv_first``, ``blocks_first`` (forces tierkv's view of the cache);
- ``layout_check``: ``true`` (default): at registration, write a pattern through vLLM's own
  cache-write op and read it back through tierkv's views; on any disagreement tierkv logs
  one error and stays off (no loads, no saves), so a vLLM that changed its layout runs as
  if no connector were set instead of computing from misplaced K/V. ``false`` skips it;
- ``transfer_cpus``: where tierkv's threads run in the worker: ``"auto"`` (default: the
  worker's own CPUs when ``VLLM_CPU_OMP_THREADS_BIND`` binds it to a list of cores, as when
  several replicas share a machine; else the CPUs vLLM reserves), ``"spare"`` (the CPUs the
  worker is not pinned to) or ``"own"`` (see ``tierkv.integrations.vllm_v1.placement.transfer_cpus``);
- ``identity_hook``: ``"package.module:function"`` called as ``function(request, identity)``
  for every request: returns the ``tierkv.chunks.identity.RequestIdentity`` to key it with
  (add ``extra`` parts, drop the salt to share across tenants knowingly) or None to leave
  the request uncached;
- ``continuation_tails``: ``true`` (default): a lookup probes the chunk after its cached
  prefix every 16 tokens and a save also stores its prompt cut at such a step, so a chat's
  next turn loads what its previous turn ended with
  (``tierkv.integrations.vllm_v1.continuation``); ``false``: only whole chunks and exact
  prompt ends are found.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierkv.config.loader import EngineConfig, config_for_integration
from tierkv.engine.blocking import EngineMetadata
from tierkv.errors import ConfigError
from tierkv.integrations.vllm_v1.cpu_pages import PAGE_ORDERS

_KNOWN = ("config", "load_async", "load_timeout_s", "load_failure_policy", "stats_file", "layout", "layout_check",
          "identity_hook", "transfer_cpus", "continuation_tails")
_TRANSFER_CPUS = ("auto", "spare", "own")
# auto, vLLM's CPU page orders (cpu: vec and its kin, cpu_amx, cpu_bfmmla), then the GPU backends' layouts
_LAYOUTS = ("auto", *PAGE_ORDERS, "content", "kv_first", "blocks_first")
_ROLES = {"kv_both": (True, True), "kv_producer": (False, True), "kv_consumer": (True, False)}


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector needs, checked once at start-up."""

    config: EngineConfig
    model_name: str
    world_size: int
    load: bool
    save: bool
    load_async: str
    load_timeout_s: float | None
    load_failure_policy: str
    stats_file: str | None
    layout: str = "auto"
    layout_check: bool = True
    identity_hook: str | None = None
    transfer_cpus: str = "auto"
    continuation_tails: bool = True

    def metadata(self, worker_id: int, kv_shape: tuple[int, int, int, Any] | None = None,
                 model_revision: str | None = None, kv_cache_dtype: str | None = None,
                 identity: tuple[tuple[str, str], ...] = ()) -> EngineMetadata:
        """The engine's metadata; ``kv_shape`` ``(layers, kv_heads, head_size, dtype)`` lets a fresh
        process size chunks (plan by cost, bound the first retrieve) before it has read one; it,
        the revision, the KV cache dtype and ``identity`` are in every key."""
        return EngineMetadata(self.model_name, self.world_size, worker_id, "vllm", kv_shape=kv_shape,
                              model_revision=model_revision, kv_cache_dtype=kv_cache_dtype, identity=identity)


def _load_async(value: Any) -> str:
    if value is True:
        return "always"
    if value is False:
        return "never"
    if value in ("auto", "always", "never"):
        return str(value)
    raise ConfigError(f"kv_connector_extra_config.load_async: expected 'auto', 'always', 'never' or a bool, got {value!r}")


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config.load_timeout_s: expected a positive number or null, got {value!r}")
    return float(value)


def settings_from(extra: Mapping[str, Any] | None, kv_role: str | None, model_name: str,
                  world_size: int) -> ConnectorSettings:
    """Validate the extra config (errors name the key and what was expected)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KNOWN))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; tierkv reads {list(_KNOWN)}")
    role = kv_role or "kv_both"
    if role not in _ROLES:
        raise ConfigError(f"kv_role: tierkv runs as one of {sorted(_ROLES)}, got {role!r}")
    source = extra.get("config") or os.environ.get("TIERKV_CONFIG")
    if not source:
        raise ConfigError(
            "kv_connector_extra_config.config: name a tierkv YAML file (or give the config inline, or set "
            "TIERKV_CONFIG), e.g. {\"config\": {\"chunk_size\": 256, \"tiers\": [{\"name\": \"host\", "
            "\"backend\": \"cpu\", \"capacity\": \"8GiB\"}]}}"
        )
    # its ``model`` defaults to vLLM's (keys use vLLM's name regardless)
    config = config_for_integration(source, model_name, "kv_connector_extra_config.config")
    if config.kv_format != "vllm":
        raise ConfigError(f"kv_format: the vLLM connector stores the vllm layout, got {config.kv_format!r}")
    policy = extra.get("load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ConfigError(f"kv_connector_extra_config.load_failure_policy: expected 'recompute' or 'fail', got {policy!r}")
    stats_file = extra.get("stats_file")
    if stats_file is not None and not isinstance(stats_file, str):
        raise ConfigError(f"kv_connector_extra_config.stats_file: expected a path, got {stats_file!r}")
    layout = extra.get("layout", "auto")
    if layout not in _LAYOUTS:
        raise ConfigError(f"kv_connector_extra_config.layout: expected one of {list(_LAYOUTS)}, got {layout!r}")
    check = extra.get("layout_check", True)
    if not isinstance(check, bool):
        raise ConfigError(f"kv_connector_extra_config.layout_check: expected true or false, got {check!r}")
    hook = extra.get("identity_hook")
    if hook is not None and (not isinstance(hook, str) or ":" not in hook):
        raise ConfigError(f"kv_connector_extra_config.identity_hook: expected 'package.module:function', got {hook!r}")
    placement = extra.get("transfer_cpus", "auto")
    if placement not in _TRANSFER_CPUS:
        raise ConfigError(f"kv_connector_extra_config.transfer_cpus: expected one of {list(_TRANSFER_CPUS)}, "
                          f"got {placement!r}")
    continuation = extra.get("continuation_tails", True)
    if not isinstance(continuation, bool):
        raise ConfigError(f"kv_connector_extra_config.continuation_tails: expected true or false, got {continuation!r}")
    load, save = _ROLES[role]
    return ConnectorSettings(config, model_name, world_size, load, save, _load_async(extra.get("load_async", "auto")),
                             _timeout(extra.get("load_timeout_s", 30.0)), str(policy), stats_file, str(layout), check,
                             hook, str(placement), continuation)
