"""Prometheus view of a holder's leases (`pdmesh_kv_lease*`).

`LeaseCollector` reads `LeaseManager.counters` at scrape time, so the lease
manager stays free of metric objects. A holder registers it once on its own
registry: `registry.register(LeaseCollector(leases))`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtransfer.leases import LeaseManager


class LeaseCollector(Collector):
    def __init__(self, leases: LeaseManager):
        self.leases = leases

    def collect(self) -> Iterator[Metric]:
        c = self.leases.counters
        for name, value, doc in (
            ("issued", c.issued, "KV leases issued"),
            ("pulled", c.pulled, "KV leases whose blocks the receiver pulled"),
            ("released", c.released, "KV leases released by the receiver"),
            ("expired", c.expired, "KV leases that expired before release"),
            ("agent_dead", c.agent_dead, "KV leases ended because the requester agent died"),
        ):
            yield CounterMetricFamily(f"pdmesh_kv_leases_{name}", doc, value=value)
        yield GaugeMetricFamily("pdmesh_kv_leases_held", "KV leases currently held", value=c.held)
        yield GaugeMetricFamily(
            "pdmesh_kv_lease_held_blocks",
            "KV blocks held under leases (not yet returned)",
            value=c.held_blocks,
        )
