"""Prometheus metrics: one registry per service instance and its HTTP port.

A service creates its metric objects against its own `CollectorRegistry` (no
global registry, so several services can live in one test process) and serves
it with `start_metrics_server`. Names follow `pdmesh_<service>_<what>_<unit>`:
seconds and bytes in the name (`_seconds`, `_bytes`), counters end in `_total`
(prometheus_client adds it), gauges never do. tests/unit/observability checks
every service's registry against these rules.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    make_wsgi_app,
    start_http_server,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# (ready, reason) for the HTTP readiness probe; answered on the server's own thread.
Readiness = Callable[[], tuple[bool, str]]

# Latency buckets in seconds, from sub-millisecond router hops to long prefills.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LoopHistogram(Collector):
    """A Prometheus histogram that the event loop updates with plain list and float
    arithmetic (the router's and the decode worker's per-token latencies). The router
    observes an inter-token gap per relayed message, and
    prometheus_client's Histogram.observe (a linear bucket scan, two locked value
    increments, an observability check) was ~6% of the router's busy CPU per message
    at 64 streams (bench/results/profile_front_tuned.txt). Only the loop writes; a
    scrape from the metrics thread reads a copy (a count and the sum may be one
    observation apart, as with prometheus_client's own separately locked values).
    Exposed as the same histogram family (buckets, _count, _sum)."""

    def __init__(self, name: str, doc: str, buckets: Iterable[float]):
        bounds = [float(b) for b in buckets]
        if bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self.name, self.doc = name, doc
        self.bounds = tuple(bounds)
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value` (le semantics: value <= bound)."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def snapshot(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        """(upper bounds with +Inf last, cumulative counts, sum)."""
        total, cumulative = 0, []
        for c in list(self.counts):
            total += c
            cumulative.append(total)
        return self.bounds, tuple(cumulative), self.sum

    def collect(self) -> Iterable[Any]:
        bounds, counts, total = self.snapshot()
        buckets = [(floatToGoString(b), c) for b, c in zip(bounds, counts, strict=True)]
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


# Event-loop lag: finer at the low end, where a healthy loop's lateness lies.
LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class LoopLag:
    """How late the event loop runs a timer: a callback due every `interval_s` records
    by how much it ran late, in `pdmesh_<service>_event_loop_lag_seconds`. A loop busy with other
    callbacks (a burst of requests being parsed and routed, a batch of KV events, a long
    collection) delays every request's next step by that much, whatever the CPU use
    averages; this is the number that says so (issue 16: the router's TTFT under load).
    Sampled, so it misses lateness shorter than a tick apart: the millisecond task wakeups
    the side by side's per-request timeline found (BENCHMARKS.md) barely show in it."""

    def __init__(self, registry: CollectorRegistry, service: str, interval_s: float = 0.05):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.histogram = LoopHistogram(
            f"pdmesh_{service}_event_loop_lag_seconds",
            f"how late the event loop ran a timer due every {interval_s:g} s",
            LOOP_LAG_BUCKETS,
        )
        registry.register(self.histogram)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        """From the event loop it watches."""
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self.histogram.observe(max(0.0, now - self._due))
        self._due = now + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)


class MetricsServer:
    """The HTTP server exposing one registry on /metrics; with `readiness`, also the
    Kubernetes-style probes `/livez` (200 while the process answers) and `/readyz`
    (200, or 503 with the reason as the body)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, readiness: Readiness | None = None):
        if readiness is None:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        else:
            self._server, self._thread = _serve(_with_probes(make_wsgi_app(registry), readiness), host, port)
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: no access log
        pass


def _serve(app: Callable, host: str, port: int) -> tuple[ThreadingWSGIServer, threading.Thread]:
    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread


def _with_probes(metrics_app: Callable, readiness: Readiness) -> Callable:
    """/livez and /readyz in front of the metrics app. They never touch the event loop
    or the engine: `readiness` reads state the service keeps current."""

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in ("/livez", "/readyz"):
            return metrics_app(environ, start_response)
        ok, reason = (True, "live") if path == "/livez" else readiness()
        body = f"{reason or ('ready' if ok else 'not ready')}\n".encode()
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(
            status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        )
        return [body]

    return app


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


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int, readiness: Readiness | None = None
) -> MetricsServer | None:
    """Serve `registry` (with the process metrics) on host:port (0 = any free port), and
    the probes when `readiness` is given; None when port < 0 (disabled)."""
    if port < 0:
        return None
    return MetricsServer(add_process_metrics(registry), host, port, readiness)
