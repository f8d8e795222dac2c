"""Prometheus metrics of the KV-transfer service (`pdmesh_kv_*`), on its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS


class KvServiceMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.agents = Gauge("pdmesh_kv_agents", "NIXL agents registered and alive", registry=registry)
        self.registrations = Counter(
            "pdmesh_kv_agent_registrations", "agent (re-)registrations", registry=registry
        )
        self.expirations = Counter(
            "pdmesh_kv_agent_expirations",
            "agents dropped because their liveness lease passed",
            registry=registry,
        )
        self.transfers = Counter(
            "pdmesh_kv_transfers",
            "KV transfers reported by workers",
            ["transport", "outcome"],
            registry=registry,
        )
        self.bytes = Counter(
            "pdmesh_kv_transfer_bytes",
            "KV bytes moved by successful transfers",
            ["transport"],
            registry=registry,
        )
        self.failures = Counter(
            "pdmesh_kv_transfer_failures",
            "failed KV transfers by kind",
            ["transport", "error"],
            registry=registry,
        )
        self.latency = Histogram(
            "pdmesh_kv_transfer_latency_seconds",
            "duration of successful KV transfers",
            ["transport"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
