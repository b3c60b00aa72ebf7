"""Counters, latency histograms and their Prometheus exposition from a live engine."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import torch

from tierkv import Engine
from tierkv.metrics import Histogram, PrometheusCollector

prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics extra (prometheus-client) is not installed")


def test_histogram_quantiles_and_buckets() -> None:
    hist = Histogram(buckets=(0.001, 0.01, 0.1))
    for value in [0.0005] * 50 + [0.005] * 40 + [0.05] * 9 + [5.0]:
        hist.observe(value)
    snap = hist.snapshot()
    assert snap["count"] == 100
    assert hist.quantile(0.5) == 0.001  # the bucket bound holding the median
    assert hist.quantile(0.9) == 0.01
    assert hist.quantile(0.99) == 0.1
    assert hist.quantile(1.0) == float("inf")  # beyond the last bucket
    assert Histogram().quantile(0.5) is None
    assert snap["sum_s"] == pytest.approx(0.0005 * 50 + 0.005 * 40 + 0.05 * 9 + 5.0)


def engine_config(tmp_path: Path) -> dict:
    return {"model": "metrics-model", "chunk_size": 16, "kv_format": "vllm",
            "tiers": [{"name": "host", "backend": "cpu", "capacity": "8MiB"},
                      {"name": "disk", "backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "64MiB"}]}


def sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name} {labels} in the exposition")


def test_collector_exposes_engine_stats_in_a_registry(tmp_path: Path) -> None:
    with Engine(engine_config(tmp_path)) as eng:
        tokens = torch.arange(48)
        eng.store(tokens, torch.randn(3, 2, 48, 2, 8))
        eng.retrieve(tokens)
        eng.retrieve(torch.arange(48) + 5000)  # a miss
        eng.flush()
        registry = prometheus_client.CollectorRegistry()
        registry.register(PrometheusCollector(eng))
        text = prometheus_client.generate_latest(registry).decode()
        stats = eng.stats()
    labels = {"model": "metrics-model", "tier": "host"}
    assert sample(text, "tierkv_tier_hits_total", **labels) == stats["tiers"]["host"]["hits"] == 3
    assert sample(text, "tierkv_tier_bytes_in_total", tier="disk") == stats["tiers"]["disk"]["bytes_in"] > 0
    assert sample(text, "tierkv_hit_tokens_total") == 48 and sample(text, "tierkv_miss_tokens_total") == 48
    assert sample(text, "tierkv_tier_get_latency_seconds_count", **labels) == stats["tiers"]["host"]["get_latency"]["count"]
    assert sample(text, "tierkv_tier_used_bytes", **labels) == stats["tiers"]["host"]["used_bytes"]
    assert sample(text, "tierkv_tier_pressure_admitting", **labels) == 1.0
    assert sample(text, "tierkv_fill_queue_bytes") == 0
    speed = stats["tiers"]["host"]["speed"]
    assert speed["samples"] >= 1  # the hit above was timed
    assert sample(text, "tierkv_tier_get_fixed_seconds", **labels) == pytest.approx(speed["fixed_ms"] / 1e3)
    assert sample(text, "tierkv_tier_get_bandwidth_bytes_per_second", tier="disk") == pytest.approx(
        stats["tiers"]["disk"]["speed"]["bandwidth_MBps"] * 1e6)
    assert sample(text, "tierkv_tier_deadline_misses_total", **labels) == 0


def test_recompute_speed_is_exposed_once_known(tmp_path: Path) -> None:
    with Engine({**engine_config(tmp_path), "recompute": {"tokens_per_s": 2000}}) as eng:
        registry = prometheus_client.CollectorRegistry()
        registry.register(PrometheusCollector(eng))
        text = prometheus_client.generate_latest(registry).decode()
    assert sample(text, "tierkv_recompute_tokens_per_second", prompt_tokens="1024") == pytest.approx(2000)


def test_collector_can_be_served_over_http(tmp_path: Path) -> None:
    with Engine(engine_config(tmp_path)) as eng:
        registry = prometheus_client.CollectorRegistry()
        registry.register(PrometheusCollector(eng, prefix="kvcache"))
        server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
        try:
            eng.store(torch.arange(16), torch.randn(3, 2, 16, 2, 8))
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
                text = response.read().decode()
        finally:
            server.shutdown()
            thread.join(timeout=10)
    assert sample(text, "kvcache_tier_puts_total", tier="host") == 1
