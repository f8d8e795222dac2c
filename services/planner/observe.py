"""From two reads of cumulative counters to one interval's `Observation`.

The router's and the workers' Stats are counters since start (requests,
prompt/output tokens, latency histograms, cached prompt tokens); a `Snapshot`
holds one read of them, and `observation_between(prev, cur, ...)` subtracts
two reads. Plain Python: the gRPC reads are services/planner/stats_reader.py's.

A counter that went down (the router restarted) makes that interval's deltas
from zero, not negative: the read after a restart is its own baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.planner.planner import Observation


@dataclass(frozen=True)
class Histogram:
    """Cumulative: counts[i] samples <= bounds[i]; bounds end with +Inf."""

    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()

    def minus(self, older: Histogram) -> Histogram:
        if older.bounds != self.bounds or any(n < o for n, o in zip(self.counts, older.counts, strict=True)):
            return self  # different buckets or a restart: this read is the interval
        return Histogram(self.bounds, tuple(n - o for n, o in zip(self.counts, older.counts, strict=True)))

    @property
    def total(self) -> int:
        return self.counts[-1] if self.counts else 0

    def quantile(self, q: float) -> float | None:
        """The q-quantile, linear within its bucket (Prometheus' histogram_quantile); None when empty.

        A quantile in the +Inf bucket is the largest finite bound (what can be said)."""
        n = self.total
        if n == 0:
            return None
        rank = q * n
        lower_bound, lower_count = 0.0, 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if bound == float("inf"):
                    return lower_bound
                inside = count - lower_count
                return lower_bound + (bound - lower_bound) * (
                    (rank - lower_count) / inside if inside else 1.0
                )
            lower_bound, lower_count = bound, count
        return lower_bound


@dataclass(frozen=True)
class Snapshot:
    """One read of the counters (router + workers) and the pools' sizes."""

    at_s: float
    arrivals: int = 0  # the router's requests_total
    finished: int = 0  # succeeded + failed + cancelled
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    # per worker that answered: (prompt tokens served from its cache, prompt tokens it computed)
    prompt_counters: dict[str, tuple[int, int]] = field(default_factory=dict)
    ready: dict[str, int] = field(default_factory=dict)  # healthy workers per role (ListWorkers)
    queued: int = 0  # requests waiting for admission at the router
    kv_use: float = 0.0  # mean used share of the decode workers' KV pools


def _delta(new: int, old: int) -> int:
    return new - old if new >= old else new  # restart: the new count is the interval's


def observation_between(prev: Snapshot, cur: Snapshot, pools: dict[str, int], q: float) -> Observation:
    """The interval (prev, cur]: arrivals, mean ISL/OSL and hit rate, measured quantiles.

    `pools` is the size each role has now (the actuator's); `q` the SLO quantile."""
    finished = _delta(cur.finished, prev.finished)
    prompt = _delta(cur.prompt_tokens, prev.prompt_tokens)
    completion = _delta(cur.completion_tokens, prev.completion_tokens)
    cached = computed = 0
    for worker, (c, p) in cur.prompt_counters.items():  # workers seen both times (the pools change)
        if worker in prev.prompt_counters:
            c0, p0 = prev.prompt_counters[worker]
            cached, computed = cached + _delta(c, c0), computed + _delta(p, p0)
    return Observation(
        requests=_delta(cur.arrivals, prev.arrivals),
        mean_isl=prompt / finished if finished else 0.0,
        mean_osl=completion / finished if finished else 0.0,
        hit_rate=cached / (cached + computed) if cached + computed else 0.0,
        prefill_workers=pools.get("prefill", 0),
        decode_workers=pools.get("decode", 0),
        ttft_q_s=cur.ttft.minus(prev.ttft).quantile(q),
        itl_q_s=cur.itl.minus(prev.itl).quantile(q),
        ready_prefill_workers=cur.ready.get("prefill", 0),
        ready_decode_workers=cur.ready.get("decode", 0),
    )
