"""Prometheus metrics of the gateway (`pdmesh_gateway_*`), on its own registry,
served on the gateway's own HTTP port at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdmesh_gateway_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "pdmesh_gateway_request_seconds",
            "HTTP request duration (whole stream for streaming requests)",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pdmesh_gateway_ttft_seconds",
            "time from a generation request's head being parsed to its first token leaving the gateway",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "pdmesh_gateway_queue_seconds",
            "time from a generation request's head being parsed to its handler starting: the wait for the "
            "event loop, which the TTFT and duration histograms include",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("pdmesh_gateway_inflight", "generation requests in progress", registry=r)
        self.tokens = Counter(
            "pdmesh_gateway_tokens",
            "tokens of finished requests, by kind (prompt, completion)",
            ["kind"],
            registry=r,
        )
        self.disconnects = Counter(
            "pdmesh_gateway_client_disconnects",
            "requests whose HTTP client went away before the answer (upstream call cancelled)",
            registry=r,
        )
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)

    def finished(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def count_tokens(self, prompt: int, completion: int) -> None:
        self.tokens.labels("prompt").inc(prompt)
        self.tokens.labels("completion").inc(completion)
