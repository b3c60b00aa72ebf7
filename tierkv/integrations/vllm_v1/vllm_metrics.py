"""tierkv's counters in vLLM's own metrics: the interval stats a worker hands vLLM
(``get_kv_connector_stats``), how vLLM's logger adds them up (``TierKVStats``), and the
Prometheus series ``vllm serve`` shows on ``/metrics`` (``TierKVPromMetrics``).

Series (each with vLLM's engine labels):

- ``vllm:tierkv_tokens_loaded_total``: prompt tokens whose KV tierkv put in vLLM's cache;
- ``vllm:tierkv_tokens_saved_total``: prompt tokens of the requests tierkv stored;
- ``vllm:tierkv_load_failures_total`` / ``vllm:tierkv_save_failures_total``;
- ``vllm:tierkv_tokens_load_failed_total``: tokens vLLM recomputed after a failed load;
- ``vllm:tierkv_load_seconds``: how long each synchronous load held the forward pass;
- ``vllm:tierkv_recompute_tokens_per_s`` (a gauge): vLLM's prefill speed at 1,024 tokens as
  tierkv learned it from vLLM's own steps (what its cost-aware lookups weigh loads against).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# worker stats key -> Prometheus counter name (without the vllm:tierkv_ prefix and _total suffix)
COUNTERS = {"tokens_loaded": "tokens_loaded", "prompt_tokens_saved": "tokens_saved",
            "load_failures": "load_failures", "save_failures": "save_failures",
            "tokens_load_failed": "tokens_load_failed"}
GAUGES = {"recompute_tokens_per_s": "recompute_tokens_per_s"}  # worker stats key -> gauge name (latest value)
LOAD_SECONDS = "load_seconds"
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TierKVStats(KVConnectorStats):
    """One interval of a worker's transfers: ``data`` is ``{counter: count, ...,
    "load_seconds": [seconds, ...]}`` (plain data: vLLM sends it from the worker to its logger)."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key == LOAD_SECONDS:
                self.data[key] = list(self.data.get(key, [])) + list(value)
            elif key in GAUGES:  # the same model on every worker: the latest (largest) estimate
                self.data[key] = max(self.data.get(key, 0), value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        loads = list(self.data.get(LOAD_SECONDS, []))
        summary: dict[str, int | float] = {key: self.data.get(key, 0) for key in (*COUNTERS, *GAUGES)}
        summary["loads"] = len(loads)
        summary["load_ms_avg"] = round(1000 * sum(loads) / len(loads), 2) if loads else 0.0
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in (*COUNTERS, *GAUGES, LOAD_SECONDS))


def interval_stats(now: Mapping[str, int], before: Mapping[str, int], load_seconds: list[float]) -> TierKVStats | None:
    """The stats of the interval between two snapshots of a worker's counters, or None when
    nothing happened in it."""
    data: dict[str, Any] = {key: now.get(key, 0) - before.get(key, 0) for key in COUNTERS
                            if now.get(key, 0) != before.get(key, 0)}
    data.update({key: now[key] for key in GAUGES if now.get(key) and now.get(key) != before.get(key)})
    if load_seconds:
        data[LOAD_SECONDS] = list(load_seconds)
    return TierKVStats(data=data) if data else None


class TierKVPromMetrics(KVConnectorPromMetrics):
    """Registers tierkv's series with vLLM's Prometheus registry and records each interval."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(name=f"vllm:tierkv_{name}", documentation=f"tierkv: {name.replace('_', ' ')}",
                                   labelnames=labelnames)
            for key, name in COUNTERS.items()}
        self._load_seconds = self._histogram_cls(
            name="vllm:tierkv_load_seconds", documentation="tierkv: seconds each synchronous load held the batch",
            labelnames=labelnames, buckets=LOAD_BUCKETS)
        self._gauges = {
            key: self._gauge_cls(name=f"vllm:tierkv_{name}", documentation=f"tierkv: {name.replace('_', ' ')} "
                                 "(vLLM's prefill at 1,024 tokens, learned from its steps)",
                                 labelnames=labelnames, multiprocess_mode="mostrecent")
            for key, name in GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for key, counter in self._counters.items():
            count = transfer_stats_data.get(key, 0)
            if count:
                counter.labels(*labels).inc(count)
        for seconds in transfer_stats_data.get(LOAD_SECONDS, []):
            self._load_seconds.labels(*labels).observe(seconds)
        for key, gauge in self._gauges.items():
            if transfer_stats_data.get(key):
                gauge.labels(*labels).set(transfer_stats_data[key])


class StatsInterval:
    """What a worker has reported to vLLM so far, to hand it only what is new."""

    def __init__(self) -> None:
        self._reported: Counter[str] = Counter()

    def take(self, stats: Counter[str], load_seconds: list[float]) -> TierKVStats | None:
        found = interval_stats(stats, self._reported, load_seconds)
        self._reported = Counter(stats)
        load_seconds.clear()
        return found
