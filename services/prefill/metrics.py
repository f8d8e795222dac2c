"""Prometheus metrics and counters of a prefill worker (its own registry)."""

from __future__ import annotations

from collections import Counter as _Counter

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.metrics import LATENCY_BUCKETS


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._outcomes = Counter(
            "pdmesh_prefill_requests", "Prefill calls by outcome", ["outcome"], registry=registry
        )
        self._latency = Histogram(
            "pdmesh_prefill_duration_seconds",
            "Prefill call duration (queue + compute)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._computed = Counter(
            "pdmesh_prefill_computed_tokens", "prompt tokens computed", registry=registry
        )
        self._cached = Counter(
            "pdmesh_prefill_cached_tokens", "prompt tokens served from the prefix cache", registry=registry
        )
        self._counts: _Counter[str] = _Counter()

    def prefilled(self, seconds: float, computed: int, cached: int) -> None:
        self._latency.observe(seconds)
        self._computed.inc(computed)
        self._cached.inc(cached)
        self.finished("ok")

    def finished(self, outcome: str) -> None:
        self._outcomes.labels(outcome).inc()
        self._counts["total"] += 1
        self._counts[outcome] += 1

    def count(self, what: str) -> int:
        return self._counts[what]
