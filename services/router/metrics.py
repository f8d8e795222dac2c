"""The router's Prometheus metrics, on its own CollectorRegistry.

Counters that the cores already keep (the CostLedger, the retry budget,
admission) are not counted twice: a collector reads them at scrape time
through `stats()` (plain integer reads, safe from the metrics thread). Events
only the edge sees (time to first token, shed reasons, breaker transitions,
invalid requests) are counted here. Worker gauges (counts by health, and per
worker: breaker state, queue depth, running, in flight) are refreshed by the
router's housekeeping task, on the event loop, because they walk the registry.

The one name without the `pdmesh_router_` prefix is the cost metric shared
across the mesh: `pdmesh_tokens_per_successful_request`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.metrics import LATENCY_BUCKETS, LoopHistogram


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self) -> Iterable[Any]:
        s = self._stats()
        yield GaugeMetricFamily(
            "pdmesh_tokens_per_successful_request",
            "Tokens computed for successful requests (all attempts) per successful request",
            value=s.tokens_per_successful_request,
        )
        counters = (
            ("wasted_tokens", "Tokens computed for failed, cancelled or retried work", s.wasted_tokens),
            ("computed_tokens", "Tokens computed for every finished request", s.computed_tokens),
            ("retries", "Retries of requests that failed before their first token", s.retries),
            ("retries_denied", "Retries refused because the retry budget was spent", s.retries_denied),
            ("migrations", "Streams moved to another worker mid-way", s.migrations),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"pdmesh_router_{name}", doc, value=value)
        requests = CounterMetricFamily(
            "pdmesh_router_requests", "Generate requests by outcome", labels=["outcome"]
        )
        for outcome, value in (
            ("succeeded", s.requests_succeeded),
            ("failed", s.requests_failed),
            ("cancelled", s.requests_cancelled),
            ("shed", s.requests_shed),
        ):
            requests.add_metric([outcome], value)
        yield requests
        yield GaugeMetricFamily(
            "pdmesh_router_inflight", "Requests holding an admission slot", value=s.inflight
        )
        yield GaugeMetricFamily(
            "pdmesh_router_queued", "Requests waiting for an admission slot", value=s.queued
        )


# Breaker states as gauge values: 0 = closed (traffic flows), 1 = half open (probing), 2 = open.
BREAKER_STATE_VALUES = {"closed": 0, "half_open": 1, "open": 2}


@dataclass(frozen=True)
class WorkerGauges:
    """One worker's row in the per-worker gauges (taken on the event loop)."""

    worker_id: str
    role: str
    breaker: str  # BreakerState value
    waiting: int  # requests waiting at the worker, as it last reported
    running: int  # requests in its running batch, as it last reported
    inflight: int  # router requests running there now
    prefill_speed: float = 1.0  # its routing cost's prefill factor (worker_profile.py)
    decode_speed: float = 1.0  # and decode factor


class _WorkerCollector(Collector):
    """Per-worker gauges from the last snapshot: a worker that left disappears
    with the next snapshot (no stale label sets, unlike a labelled Gauge)."""

    def __init__(self) -> None:
        self.rows: tuple[WorkerGauges, ...] = ()  # replaced whole, read by the scrape thread

    def collect(self) -> Iterable[Any]:
        rows = self.rows
        families: tuple[tuple[str, str, Callable[[WorkerGauges], float]], ...] = (
            (
                "breaker_state",
                "Circuit breaker state per worker: 0 closed, 1 half open, 2 open",
                lambda w: BREAKER_STATE_VALUES.get(w.breaker, 0),
            ),
            (
                "worker_waiting",
                "Requests waiting at the worker (its queue depth, as last reported)",
                lambda w: w.waiting,
            ),
            (
                "worker_running",
                "Requests in the worker's running batch, as last reported",
                lambda w: w.running,
            ),
            ("worker_inflight", "Router requests running on the worker now", lambda w: w.inflight),
            (
                "worker_prefill_speed_factor",
                "Measured prefill time per token over the median worker's (1: not measured)",
                lambda w: w.prefill_speed,
            ),
            (
                "worker_decode_speed_factor",
                "Measured time per streamed token over the median worker's (1: not measured)",
                lambda w: w.decode_speed,
            ),
        )
        for name, doc, value in families:
            g = GaugeMetricFamily(f"pdmesh_router_{name}", doc, labels=["worker", "role"])
            for w in rows:
                g.add_metric([w.worker_id, w.role], value(w))
            yield g


class RouterMetrics:
    def __init__(self, stats: Callable[[], Any], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        r.register(_StatsCollector(stats))
        self._per_worker = _WorkerCollector()
        r.register(self._per_worker)
        self._ttft = LoopHistogram(
            "pdmesh_router_ttft_seconds",
            "Time from a request's arrival at the router to its first token leaving it",
            LATENCY_BUCKETS,
        )
        r.register(self._ttft)
        self._itl = LoopHistogram(
            "pdmesh_router_itl_seconds",
            "Inter-token latency at the router: time between a request's successive tokens leaving "
            "it (tokens sent together share the gap)",
            LATENCY_BUCKETS,
        )
        r.register(self._itl)
        self._shed = Counter("pdmesh_router_shed", "Requests shed, by reason", ["reason"], registry=r)
        self._invalid = Counter("pdmesh_router_invalid_requests", "Requests refused as invalid", registry=r)
        self._breaker = Counter(
            "pdmesh_router_breaker_transitions",
            "Circuit breaker transitions, by new state",
            ["state"],
            registry=r,
        )
        self._workers = Gauge(
            "pdmesh_router_workers", "Workers known to the router", ["role", "health"], registry=r
        )
        self._keys_reload_errors = Counter(
            "pdmesh_router_api_keys_reload_errors",
            "Reloads of the API-keys file that met bad lines or could not read it "
            "(only the valid lines' keys stay in force)",
            registry=r,
        )
        self._indexed = Gauge(
            "pdmesh_router_indexed_blocks", "Distinct blocks in the prefix index", registry=r
        )
        # Issue 18: slow, hung and flapping workers.
        self._wasted = Counter(
            "pdmesh_router_wasted_tokens_by_cause",
            "Tokens computed and thrown away, by cause: retried, migrated (the attempts a retry or a "
            "migration replaced), hedged (the losing copy of a hedged request, estimated as its "
            "prefill), failed, cancelled (every attempt of such a request)",
            ["cause"],
            registry=r,
        )
        self._hedges = Counter(
            "pdmesh_router_hedges",
            "Hedges before the first token: sent, won (the copy started first), lost, denied "
            "(retry budget spent), no_worker",
            ["outcome"],
            registry=r,
        )
        self._reroutes = Counter(
            "pdmesh_router_reroutes",
            "Requests moved before their first token because their worker went unhealthy, by cause",
            ["cause"],
            registry=r,
        )
        self._reroute_first = LoopHistogram(
            "pdmesh_router_reroute_first_token_seconds",
            "Time from moving a request off a worker that went unhealthy before its first token "
            "(the router noticing) to that first token leaving the router from another worker",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),  # issue 18's bound: 2 s
        )
        r.register(self._reroute_first)
        self._outlier = Counter(
            "pdmesh_router_outlier_transitions",
            "Latency outlier detector transitions, by new state (ejected, probing, healthy)",
            ["state"],
            registry=r,
        )
        self._retried = Counter(
            "pdmesh_router_retried_arrivals",
            "Arrivals recognised as retries of a request the router knows (idempotency key): "
            "attached (to the running request, no new prefill), replayed (finished: its result "
            "again), conflict (the key names a different request)",
            ["outcome"],
            registry=r,
        )
        self._pull_hints = Counter(
            "pdmesh_router_prefix_pull_hints",
            "Requests routed with a hint to pull a cached prefix from another worker (issue 17)",
            registry=r,
        )

    def prefix_pull_hinted(self) -> None:
        self._pull_hints.inc()

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def itl(self, gap_s: float, tokens: int) -> None:
        """`tokens` left together `gap_s` after the previous message: one sample per token."""
        self._itl.observe(gap_s / tokens, tokens)

    def latency_histograms(self) -> dict[str, tuple[tuple[float, ...], tuple[int, ...], float]]:
        """{"ttft", "itl"}: (upper bounds with +Inf last, cumulative counts, sum) since start (Stats)."""
        return {"ttft": self._ttft.snapshot(), "itl": self._itl.snapshot()}

    def wasted(self, cause: str, tokens: int) -> None:
        self._wasted.labels(cause).inc(tokens)

    def hedge(self, outcome: str) -> None:
        self._hedges.labels(outcome).inc()

    def reroute_first_token(self, seconds: float) -> None:
        self._reroute_first.observe(seconds)

    def reroute(self, cause: str, n: int = 1) -> None:
        self._reroutes.labels(cause).inc(n)

    def outlier_transition(self, state: str) -> None:
        self._outlier.labels(state).inc()

    def retried_arrival(self, outcome: str) -> None:
        self._retried.labels(outcome).inc()

    def shed(self, reason: str) -> None:
        self._shed.labels(reason).inc()

    def retry_denied(self) -> None:
        pass  # counted by the retry budget and exported through stats()

    def invalid(self) -> None:
        self._invalid.inc()

    def api_keys_reload_failed(self) -> None:
        self._keys_reload_errors.inc()

    def breaker_transition(self, state: str) -> None:
        self._breaker.labels(state).inc()

    def set_workers(
        self,
        counts: dict[tuple[str, str], int],
        indexed_blocks: int,
        per_worker: Iterable[WorkerGauges] = (),
    ) -> None:
        for (role, health), n in counts.items():
            self._workers.labels(role, health).set(n)
        self._indexed.set(indexed_blocks)
        self._per_worker.rows = tuple(per_worker)
