"""Counters and latency histograms, and their Prometheus exposition.

Plain Python objects, cheap enough for the hot path; ``stats()`` returns them as plain
data. ``PrometheusCollector`` (needs prometheus-client, the ``metrics`` extra) exposes an
engine's stats on scrape, without global state::

    from prometheus_client import REGISTRY, start_http_server
    from tierkv.metrics import PrometheusCollector
    REGISTRY.register(PrometheusCollector(engine))   # merge into your registry
    start_http_server(9400)                          # or serve it yourself
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

# Seconds; spans a memcpy of a small chunk to a slow remote GET.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Cumulative-bucket histogram with count and sum (Prometheus semantics)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (None when empty)."""
        if not self.count:
            return None
        rank = q * self.count
        seen = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            seen += count
            if seen >= rank:
                return bound
        return float("inf")

    def snapshot(self) -> dict[str, Any]:
        return {"count": self.count, "sum_s": round(self.sum, 6), "p50_s": self.quantile(0.5),
                "p99_s": self.quantile(0.99),
                "buckets": dict(zip((*map(str, self.buckets), "+Inf"), self._cumulative()))}

    def _cumulative(self) -> list[int]:
        total, out = 0, []
        for count in self.counts:
            total += count
            out.append(total)
        return out


TIER_COUNTERS = ("hits", "misses", "bytes_in", "bytes_out", "puts", "errors", "promotions", "demotions", "flushed",
                 "dirty_lost", "dropped_fills", "admitted", "rejected", "skipped_unhealthy", "skipped_pressure", "deadline_misses")


class TierMetrics:
    """Everything counted about one tier by the engine."""

    def __init__(self) -> None:
        self.counters = dict.fromkeys(TIER_COUNTERS, 0)
        self.get_latency = Histogram()
        self.put_latency = Histogram()

    def add(self, name: str, amount: int = 1) -> None:
        self.counters[name] += amount

    def snapshot(self) -> dict[str, Any]:
        return {**self.counters, "get_latency": self.get_latency.snapshot(), "put_latency": self.put_latency.snapshot()}


class PrometheusCollector:
    """A prometheus-client collector reading ``engine.stats()`` on every scrape."""

    def __init__(self, engine: Any, prefix: str = "tierkv") -> None:
        self._stats: Callable[[], dict[str, Any]] = engine.stats
        self.prefix = prefix

    def describe(self) -> list[Any]:
        return []  # unchecked collector: metrics depend on the configured tiers

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        stats = self._stats()
        p = self.prefix
        labels = ["model", "tier"]
        family: Any
        model = str(stats.get("model", ""))
        for name in TIER_COUNTERS:
            family = CounterMetricFamily(f"{p}_tier_{name}", f"tierkv per-tier {name.replace('_', ' ')}", labels=labels)
            for tier, tier_stats in stats["tiers"].items():
                family.add_metric([model, tier], float(tier_stats.get(name, 0)))
            yield family
        for gauge, help_text in (("used_bytes", "bytes held by the tier"), ("capacity_bytes", "effective capacity"),
                                 ("chunks", "chunks held by the tier")):
            family = GaugeMetricFamily(f"{p}_tier_{gauge}", help_text, labels=labels)
            for tier, tier_stats in stats["tiers"].items():
                value = tier_stats.get(gauge)
                if value is not None:
                    family.add_metric([model, tier], float(value))
            yield family
        for op in ("get", "put"):
            family = HistogramMetricFamily(f"{p}_tier_{op}_latency_seconds", f"tier {op} batch latency", labels=labels)
            for tier, tier_stats in stats["tiers"].items():
                snap = tier_stats[f"{op}_latency"]
                family.add_metric([model, tier], list(snap["buckets"].items()), snap["sum_s"])
            yield family
        for name in ("hit_tokens", "miss_tokens"):
            family = CounterMetricFamily(f"{p}_{name}", f"tokens {name.split('_')[0]} by retrieve", labels=["model"])
            family.add_metric([model], float(stats[name]))
            yield family
        for gauge, key, help_text in (
                ("pressure_used_fraction", "last_used_fraction", "device/host memory in use at the last reading"),
                ("pressure_admitting", "admitting", "1 while the tier admits new chunks, 0 under pressure"),
                ("pressure_freed_bytes", "freed_bytes", "bytes the tier gave back under memory pressure")):
            family = GaugeMetricFamily(f"{p}_tier_{gauge}", help_text, labels=labels)
            for tier, tier_stats in stats["tiers"].items():
                value = tier_stats.get("pressure", {}).get(key)
                if value is not None:
                    family.add_metric([model, tier], float(value))
            yield family
        for gauge, key, help_text in (
                ("get_fixed_seconds", "fixed_ms", "estimated fixed cost of one get batch (cost model)"),
                ("get_bandwidth_bytes_per_second", "bandwidth_MBps", "estimated get bandwidth (cost model)")):
            family = GaugeMetricFamily(f"{p}_tier_{gauge}", help_text, labels=labels)
            for tier, tier_stats in stats["tiers"].items():
                speed = tier_stats.get("speed")
                if speed is not None:
                    scale = 1e-3 if key == "fixed_ms" else 1e6
                    family.add_metric([model, tier], float(speed[key]) * scale)
            yield family
        recompute = stats.get("recompute", {})
        if recompute.get("known"):
            family = GaugeMetricFamily(f"{p}_recompute_tokens_per_second",
                                       "estimated prefill throughput of the serving model (cost model)",
                                       labels=["model", "prompt_tokens"])
            for tokens, key in (("1024", "tokens_per_s_at_1k"), ("16384", "tokens_per_s_at_16k")):
                family.add_metric([model, tokens], float(recompute[key]))
            yield family
        queue = GaugeMetricFamily(f"{p}_fill_queue_bytes", "bytes waiting in the background fill queue", labels=["model"])
        queue.add_metric([model], float(stats["fill_queue"]["bytes"]))
        yield queue
