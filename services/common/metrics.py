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

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

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
