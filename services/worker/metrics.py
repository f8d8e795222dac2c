"""Engine metrics of a worker, read from the engine at scrape time.

Moved out of services/common/metrics.py: common sits below the engine and must
not know `EngineStats`; the registry and naming rules stay there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.engine.api import EngineStats


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
            ("pdmesh_kv_blocks_pinned", "KV blocks pinned for workflows' next steps", s.pinned_blocks),
        )
        # Per tier (issue 22): the pool is "device"; the host tier is 0 when off.
        for name, doc, device, host in (
            ("pdmesh_kv_tier_blocks", "cached KV blocks held, per tier", s.cached_blocks, s.host_blocks),
            (
                "pdmesh_kv_tier_bytes",
                "bytes of KV held, per tier (the pool: its whole size)",
                s.kv_pool_bytes,
                s.host_bytes,
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=["role", "tier"])
            g.add_metric([self._role, "device"], device)
            g.add_metric([self._role, "host"], host)
            yield g
        c = CounterMetricFamily(
            "pdmesh_kv_tier_hit_tokens",
            "prompt tokens not recomputed, per tier they came from",
            labels=["role", "tier"],
        )
        c.add_metric([self._role, "device"], s.prompt_tokens_cached - s.prompt_tokens_restored)
        c.add_metric([self._role, "host"], s.prompt_tokens_restored)
        yield c
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
            (
                "pdmesh_engine_admitted_ahead",
                "requests admitted ahead of one waiting past queue_late_after_s (on time first)",
                s.admitted_ahead,
            ),
            (
                "pdmesh_engine_admitted_overdue",
                "requests admitted past queue_late_max_s, in their first-come place again",
                s.admitted_overdue,
            ),
            (
                "pdmesh_engine_moved_ahead",
                "streams moved off another worker queued ahead of waiting requests",
                s.moved_ahead,
            ),
            ("pdmesh_kv_pins_evicted", "workflow KV pins released under memory pressure", s.pins_evicted),
            ("pdmesh_kv_pins_expired", "workflow KV pins released on their TTL", s.pins_expired),
            ("pdmesh_kv_host_restores", "prefix hits restored from the host tier", s.host_restores),
            ("pdmesh_kv_host_restore_seconds", "time spent restoring from the host tier", s.host_restore_s),
            (
                "pdmesh_kv_host_restores_declined",
                "host-tier hits recomputed instead (restore predicted slower)",
                s.host_restores_declined,
            ),
            (
                "pdmesh_kv_host_rejected",
                "evicted blocks the host tier's frequency filter refused",
                s.host_rejected,
            ),
            ("pdmesh_kv_host_evicted", "blocks the host tier evicted (LRU)", s.host_evicted),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["role"])
            c.add_metric([self._role], value)
            yield c
        # Bytes by scheme (issue 22): what quantization saves, and what it costs in accuracy.
        for name, doc, scheme, value in (
            (
                "pdmesh_engine_weight_bytes",
                "bytes of the quantized linears as stored (0 = fp)",
                s.weight_scheme,
                s.weight_bytes,
            ),
            (
                "pdmesh_engine_weight_quant_error",
                "worst relative round-trip error of a quantized linear's weight",
                s.weight_scheme,
                s.weight_quant_error,
            ),
            ("pdmesh_kv_pool_bytes", "bytes of the KV pool", s.kv_scheme, s.kv_pool_bytes),
        ):
            g = GaugeMetricFamily(name, doc, labels=["role", "scheme"])
            g.add_metric([self._role, str(scheme)], value)
            yield g
