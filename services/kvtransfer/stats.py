"""Mesh-wide KV transfer statistics, from the records workers report.

Totals (transfers, failures by kind, bytes) per transport, and latency
percentiles over the most recent `window` successful transfers (a sliding
window, so the figures describe the mesh now rather than since start). Plain
and synchronous; the servicer feeds it and mirrors it into Prometheus.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass

_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class StatsSnapshot:
    transfers: int
    failures: int
    bytes: int
    latency_ms_p50: float
    latency_ms_p99: float
    failures_by_kind: dict[str, int]
    transfers_by_transport: dict[str, int]


class TransferStatistics:
    def __init__(self, window: int = 4096):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.transfers = 0
        self.failures = 0
        self.bytes = 0
        self.failures_by_kind: Counter[str] = Counter()
        self.transfers_by_transport: Counter[str] = Counter()
        self._latencies_ms: deque[float] = deque(maxlen=window)

    def record(self, transport: str, nbytes: int, duration_ms: float, ok: bool, error: str = "") -> None:
        """Count one finished transfer (`ok`) or failed one (`error` = its kind)."""
        self.transfers += 1
        self.transfers_by_transport[transport] += 1
        if ok:
            # Saturates at the contract's uint64 rather than overflow it: a worker may
            # report nonsense, and one bad record must not break Stats for good.
            self.bytes = min(self.bytes + nbytes, _U64_MAX)
            self._latencies_ms.append(duration_ms)
        else:
            self.failures += 1
            self.failures_by_kind[error or "unknown"] += 1

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile (q in [0, 100]) of recent successful latencies; 0 when none."""
        if not self._latencies_ms:
            return 0.0
        ordered = sorted(self._latencies_ms)
        rank = max(1, math.ceil(q / 100.0 * len(ordered)))
        return ordered[min(rank, len(ordered)) - 1]

    def snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(
            transfers=self.transfers,
            failures=self.failures,
            bytes=self.bytes,
            latency_ms_p50=self.percentile(50),
            latency_ms_p99=self.percentile(99),
            failures_by_kind=dict(self.failures_by_kind),
            transfers_by_transport=dict(self.transfers_by_transport),
        )
