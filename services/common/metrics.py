"""Prometheus metrics: one registry per service instance and its HTTP port.

A service creates its metric objects against its own `CollectorRegistry` (no
global registry, so several services can live in one test process) and serves
it with `start_metrics_server`. Names follow `pdmesh_<service>_<what>_<unit>`:
seconds and bytes in the name (`_seconds`, `_bytes`), counters end in `_total`
(prometheus_client adds it), gauges never do. tests/unit/observability checks
every service's registry against these rules.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from services.engine.api import EngineStats

# Latency buckets in seconds, from sub-millisecond router hops to long prefills.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class MetricsServer:
    """The HTTP server exposing one registry on /metrics."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_WITH_PROCESS_METRICS: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()


def add_process_metrics(registry: CollectorRegistry) -> CollectorRegistry:
    """prometheus_client's default collectors (process_* CPU/memory/fds, python_gc_*,
    python_info) on a service's own registry, once per registry (several servers of one
    process may serve the same registry; a second registration would be a duplicate)."""
    if registry not in _WITH_PROCESS_METRICS:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        _WITH_PROCESS_METRICS.add(registry)
    return registry


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer | None:
    """Serve `registry` (with the process metrics) on host:port (0 = any free port); None
    when port < 0 (disabled)."""
    if port < 0:
        return None
    return MetricsServer(add_process_metrics(registry), host, port)


class EngineCollector:
    """Engine gauges read at scrape time (`pdmesh_kv_blocks_*`, `pdmesh_engine_*`),
    so the engine itself carries no metric objects."""

    def __init__(self, stats: Callable[[], EngineStats], role: str):
        self._stats = stats
        self._role = role

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = (
            # "_capacity", not "_total": Prometheus reserves "_total" for counters.
            ("pdmesh_kv_blocks_capacity", "KV blocks in the pool", s.total_blocks),
            ("pdmesh_kv_blocks_free", "free KV blocks (including evictable cached ones)", s.free_blocks),
            ("pdmesh_kv_blocks_used", "KV blocks in use", s.total_blocks - s.free_blocks),
            ("pdmesh_kv_blocks_cached", "KV blocks in the prefix cache", s.cached_blocks),
            ("pdmesh_kv_blocks_held", "KV blocks held for other workers", s.held_blocks),
            ("pdmesh_engine_running", "requests in the running batch", s.running),
            ("pdmesh_engine_waiting", "requests waiting to be scheduled (queue depth)", s.waiting),
            ("pdmesh_engine_tokens_waiting", "prompt tokens not yet computed", s.tokens_waiting),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["role"])
            g.add_metric([self._role], value)
            yield g
        counters = (
            ("pdmesh_engine_prompt_tokens_computed", "prompt tokens computed", s.prompt_tokens_computed),
            (
                "pdmesh_engine_decode_tokens_computed",
                "tokens produced by decode steps",
                s.decode_tokens_computed,
            ),
            (
                "pdmesh_engine_prompt_tokens_cached",
                "prompt tokens served from the prefix cache",
                s.prompt_tokens_cached,
            ),
            (
                "pdmesh_engine_prompt_tokens_transferred",
                "prompt tokens whose KV came from another worker",
                s.prompt_tokens_transferred,
            ),
            ("pdmesh_engine_preemptions", "requests preempted (recomputed later)", s.preemptions),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["role"])
            c.add_metric([self._role], value)
            yield c
