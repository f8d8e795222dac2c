"""Every service's Prometheus registry follows one naming scheme and exposes what
issue 9 asks for: TTFT/ITL histograms, queue depth, KV blocks used/free,
transfers, decisions, breaker state, sheds, migrations, tokens per successful
request.

The registries are assembled here the way each service's main assembles them
(the same metric classes and collectors); that the live processes expose the
dashboard's metrics is checked in tests/e2e/test_compose_launch.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtransfer.leases import LeaseManager
from kvtransfer.metrics import LeaseCollector
from services.decode.metrics import DecodeMetrics
from services.engine.api import EngineStats
from services.gateway.metrics import GatewayMetrics
from services.kvtransfer.metrics import KvServiceMetrics
from services.prefill.metrics import PrefillMetrics
from services.router.metrics import RouterMetrics, WorkerGauges
from services.router.router import RouterStats
from services.worker.metrics import EngineCollector


def engine_stats() -> EngineStats:
    return EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)} | {"total_blocks": 64})


def router_stats() -> RouterStats:
    return RouterStats(**{f.name: 0 for f in dataclasses.fields(RouterStats)})


def registries() -> dict[str, CollectorRegistry]:
    router = RouterMetrics(router_stats)
    router.set_workers({("decode", "serving"): 1}, 0, [WorkerGauges("d1", "decode", "open", 3, 2, 1)])
    decode = CollectorRegistry()
    DecodeMetrics(decode)
    decode.register(EngineCollector(engine_stats, "decode"))
    prefill = CollectorRegistry()
    PrefillMetrics(prefill)
    prefill.register(EngineCollector(engine_stats, "prefill"))
    prefill.register(LeaseCollector(LeaseManager()))
    kv = CollectorRegistry()
    KvServiceMetrics(kv)
    return {
        "router": router.registry,
        "decode": decode,
        "prefill": prefill,
        "kvtransfer": kv,
        "gateway": GatewayMetrics().registry,
    }


def families(registry: CollectorRegistry) -> dict[str, str]:
    """Exposed family name -> type, as a scraper reads them (counters with `_total`)."""
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if not name.endswith("_created"):  # prometheus_client's creation timestamps
                out[name] = kind
    return out


ALL = {svc: families(r) for svc, r in registries().items()}


@pytest.mark.parametrize("service", sorted(ALL))
def test_names_follow_the_scheme(service):
    for name, kind in ALL[service].items():
        assert name.startswith("pdmesh_"), name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), f"{name}: a {kind} must not end in _total"
        if kind == "histogram":
            assert name.endswith(("_seconds", "_bytes")), f"{name}: a histogram names its unit"
        for unit in ("_ms", "_millis", "_us", "_kb", "_mb"):
            assert f"{unit}_" not in name + "_", f"{name}: use base units (_seconds, _bytes)"


def test_what_the_issue_lists_is_exposed():
    want = {
        "router": {
            "pdmesh_router_ttft_seconds": "histogram",
            "pdmesh_router_itl_seconds": "histogram",
            "pdmesh_router_queued": "gauge",  # admission queue depth
            "pdmesh_router_worker_waiting": "gauge",  # each worker's queue depth
            "pdmesh_router_breaker_state": "gauge",
            "pdmesh_router_shed_total": "counter",
            "pdmesh_router_migrations_total": "counter",
            "pdmesh_tokens_per_successful_request": "gauge",
        },
        "decode": {
            "pdmesh_decode_ttft_seconds": "histogram",
            "pdmesh_decode_itl_seconds": "histogram",
            "pdmesh_engine_waiting": "gauge",
            "pdmesh_kv_blocks_used": "gauge",
            "pdmesh_kv_blocks_free": "gauge",
            "pdmesh_kv_pull_seconds": "histogram",
            "pdmesh_kv_pull_bytes_total": "counter",
            "pdmesh_disagg_decisions_total": "counter",
        },
        "prefill": {
            "pdmesh_engine_waiting": "gauge",
            "pdmesh_kv_blocks_used": "gauge",
            "pdmesh_kv_blocks_free": "gauge",
            "pdmesh_prefill_duration_seconds": "histogram",
        },
        "kvtransfer": {
            "pdmesh_kv_transfers_total": "counter",
            "pdmesh_kv_transfer_bytes_total": "counter",
            "pdmesh_kv_transfer_latency_seconds": "histogram",
        },
        "gateway": {"pdmesh_gateway_ttft_seconds": "histogram"},
    }
    for service, metrics in want.items():
        for name, kind in metrics.items():
            assert ALL[service].get(name) == kind, f"{service}: {name} ({kind})"


def test_itl_spreads_a_gap_over_the_tokens_sent_together():
    m = RouterMetrics(router_stats)
    m.itl(0.3, 3)
    m.itl(0.05, 1)
    assert m.registry.get_sample_value("pdmesh_router_itl_seconds_count") == 4
    assert m.registry.get_sample_value("pdmesh_router_itl_seconds_sum") == pytest.approx(0.35)
    assert m.registry.get_sample_value("pdmesh_router_itl_seconds_bucket", {"le": "0.1"}) == 4


def test_per_worker_gauges_follow_the_last_snapshot():
    m = RouterMetrics(router_stats)
    m.set_workers(
        {},
        0,
        [WorkerGauges("d1", "decode", "open", 3, 2, 1), WorkerGauges("d2", "decode", "half_open", 0, 0, 0)],
    )
    get = m.registry.get_sample_value
    assert get("pdmesh_router_breaker_state", {"worker": "d1", "role": "decode"}) == 2
    assert get("pdmesh_router_breaker_state", {"worker": "d2", "role": "decode"}) == 1
    assert get("pdmesh_router_worker_waiting", {"worker": "d1", "role": "decode"}) == 3
    assert get("pdmesh_router_worker_running", {"worker": "d1", "role": "decode"}) == 2
    assert get("pdmesh_router_worker_inflight", {"worker": "d1", "role": "decode"}) == 1
    m.set_workers({}, 0, [WorkerGauges("d2", "decode", "closed", 0, 0, 0)])
    assert get("pdmesh_router_breaker_state", {"worker": "d1", "role": "decode"}) is None  # d1 left
    assert get("pdmesh_router_breaker_state", {"worker": "d2", "role": "decode"}) == 0
