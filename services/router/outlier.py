"""Latency outlier detection: a worker far slower than its peers loses traffic, then is ejected.

Switches of the router's defences against slow, hung and flapping workers
(issue 18), for a "naive" router that has none of them (bench/faults.py):

    --breaker-enabled false            circuit breakers never open (services/router/circuit_breaker.py)
    --retry-budget-enabled false       every retry is granted (services/router/retry_budget.py)
    --max-migrations 0                 no mid-stream migration (services/router/migration.py)
    --outlier-enabled false            this module: no deprioritising, no ejection
    --hedge-enabled true|false         hedging before the first token, off by default (hedge.py)
    --reroute-unstarted false          a worker going unhealthy keeps its unstarted requests
    --first-token-timeout-multiple 0   the first-token timeout is the fixed --first-token-timeout-s
                                       instead of a multiple of the worker's predicted TTFT
    --retry-attach-enabled false       a retry with the idempotency key of a running request
                                       is a new request (retries.py)

(all also as PDMESH_* environment variables, e.g. PDMESH_OUTLIER_ENABLED=false). With
outlier detection off the detector still keeps its samples: the TTFT prediction (the
first-token timeout, hedging) works on, nobody is deprioritised or ejected.

`OutlierDetector` owns, per worker, a sliding window of latency samples the
request flow reports once per attempt (time to first message per unit of prefill
work, and the attempt's mean inter-token gap when it ends), with an injected clock. At most every
`eval_interval_s` it compares each worker's `quantile` of each metric with the
median of the same quantile over the *other* workers of its role that have
`min_samples` samples; the worst of the two ratios is the worker's score
(a ratio counts only when the worker is also `min_excess_s` slower in absolute
terms, so microsecond noise on an idle mesh is no outlier).

    score >= deprioritise_ratio: the worker's routing cost is multiplied by
        min(score, max_factor) (`rerank`, one call after the policy ranks);
    ITL score >= eject_ratio: EJECTED for min(base_ejection_s * multiplier ** k,
        max_ejection_s), k = ejections since it last stayed healthy for
        backoff_reset_s; never more than max(1, floor(share * workers)) of a
        role out at once, counting those out for another reason (`is_out`: not
        serving, breaker open), and never the last one; and only while the
        role's other serving workers have room for its load: at most
        `eject_room_waiting` requests waiting at each on average (their load
        reports, `waiting`). Without room it stays in, deprioritised: moving
        a slow worker's share into queues that are already there turns a
        fifth of a worker's capacity into none, and the others' queues take
        the misses (the faults study's overload);
    ejection over: PROBING, like the breaker's half-open: `probe_requests`
        requests at a time go through; each probe's samples are judged on their
        own against the peers: `probe_successes` good ones -> HEALTHY (its old
        samples dropped), one bad one -> EJECTED again, for longer. An ejected
        worker is probed at once when its peers queue past `recall_waiting`
        each (or more of its role went out after it); a bad probe then, with no
        room, readmits it HEALTHY at the probe's ratio as its cost factor
        (samples afresh; out again on that verdict once the peers have room).

Only the ITL (decode speed, and the gap a stream is in now) ejects. A worker's TTFT
includes the wait in its queue, which is the router's own doing: a worker that was sent
more work, or the work of a worker that just failed, answers later without being any
slower. Ejecting it for that moves its queue to its peers, whose TTFT then rises in turn:
in the faults study (bench/faults.py) the TTFT ejections of healthy workers under a burst
of failovers took half the mesh out. So TTFT only deprioritises (its cost grows, new work
goes elsewhere, the queue drains); a degraded accelerator is slow at every step and shows
in the ITL; a hung worker is also seen by its health (forward progress, probes).

Pure, synchronous and clock-injected; the router calls `is_available` (the
registry's eligibility, with the breaker's), `allow_request` / `release` around
an attempt, `record_ttft` / `record_itl`, and `predicted_ttft` (the first-token
timeout and the hedger read it).
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from services.common.config import require, setting


class OutlierState(enum.Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"
    PROBING = "probing"


@dataclass(frozen=True)
class OutlierConfig:
    enabled: bool = setting(True, "latency outlier detection: deprioritise, then eject, a slow worker")
    window_s: float = setting(30.0, "sliding window of the latency samples per worker")
    max_samples: int = setting(256, "samples kept per worker and metric (the newest)")
    min_samples: int = setting(8, "samples a worker needs in the window to be judged or to be a peer")
    quantile: float = setting(0.9, "quantile of TTFT and ITL compared with the peers")
    deprioritise_ratio: float = setting(1.5, "worker quantile / peers' median above which its cost grows")
    eject_ratio: float = setting(3.0, "worker quantile / peers' median above which it is ejected")
    min_excess_s: float = setting(0.01, "a worker must also be this much slower (seconds) to count")
    max_factor: float = setting(10.0, "largest multiplier of a deprioritised worker's routing cost")
    max_ejected_share: float = setting(0.5, "share of a role's workers ejected at once (at least 1)")
    base_ejection_s: float = setting(5.0, "first ejection period")
    ejection_multiplier: float = setting(2.0, "ejection period growth per re-ejection")
    max_ejection_s: float = setting(120.0, "longest ejection period")
    backoff_reset_s: float = setting(120.0, "healthy this long: the next ejection starts from base again")
    probe_requests: int = setting(1, "requests let through at once while PROBING")
    probe_successes: int = setting(3, "good probe samples that bring an ejected worker back")
    probe_timeout_s: float = setting(60.0, "a probe that never reports frees its slot after this")
    eval_interval_s: float = setting(0.5, "quantiles are recomputed at most this often")
    live_enabled: bool = setting(True, "judge workers also by the requests in flight there (`track`)")
    live_min_attempts: int = setting(2, "attempts in flight a worker needs to be judged by them")
    live_eject_after_s: float = setting(
        2.0, "the live view ejects only after this long above eject_ratio (before: it deprioritises)"
    )
    live_min_age_s: float = setting(
        0.5, "an attempt is judged live once this old (from its first message for ITL): scheduling noise"
    )
    eject_room_waiting: float = setting(
        1.0,
        "eject only while the role's other serving workers hold at most this many waiting requests "
        "each on average (room for the ejected one's load); < 0: eject regardless",
    )
    recall_waiting: float = setting(
        2.0,
        "above this many waiting requests per serving peer an ejected worker is probed at once, "
        "and a slow probe stays in, deprioritised, instead of going out again",
    )

    def __post_init__(self) -> None:
        require(self.window_s > 0 and self.max_samples >= 1, "need window_s > 0 and max_samples >= 1")
        require(1 <= self.min_samples <= self.max_samples, "need 1 <= min_samples <= max_samples")
        require(0 < self.quantile <= 1, "quantile must be in (0, 1]")
        require(
            1 <= self.deprioritise_ratio <= self.eject_ratio, "need 1 <= deprioritise_ratio <= eject_ratio"
        )
        require(self.min_excess_s >= 0 and self.max_factor >= 1, "need min_excess_s >= 0, max_factor >= 1")
        require(0 <= self.max_ejected_share <= 1, "max_ejected_share must be in [0, 1]")
        require(0 < self.base_ejection_s <= self.max_ejection_s, "need 0 < base_ejection_s <= max_ejection_s")
        require(self.ejection_multiplier >= 1 and self.backoff_reset_s >= 0, "bad ejection backoff")
        require(self.probe_requests >= 1 and self.probe_successes >= 1, "probe counts must be >= 1")
        require(self.probe_timeout_s > 0 and self.eval_interval_s >= 0, "bad probe or eval interval")
        require(self.live_min_attempts >= 1, "live_min_attempts must be >= 1")
        require(self.live_min_age_s >= 0, "live_min_age_s must be >= 0")
        require(self.live_eject_after_s >= 0, "live_eject_after_s must be >= 0")
        require(
            self.eject_room_waiting < 0 or self.recall_waiting >= self.eject_room_waiting,
            "need recall_waiting >= eject_room_waiting",
        )


TTFT, ITL = 0, 1
_METRICS = (TTFT, ITL)

C = TypeVar("C")


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank; `values` non-empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Worker:
    def __init__(self, role: str, max_samples: int):
        self.role = role
        self.samples: tuple[deque[tuple[float, float]], ...] = tuple(
            deque(maxlen=max_samples) for _ in _METRICS
        )
        self.state = OutlierState.HEALTHY
        self.factor = 1.0
        self.score = 1.0
        self.until = 0.0  # EJECTED: when probing starts
        self.others_out = 0  # EJECTED: workers of its role out for other reasons when it was ejected
        self.ejections = 0  # k in the backoff formula
        self.healthy_since = 0.0
        self.probes = 0  # PROBING: requests let through and not yet reported
        self.probe_at = 0.0
        self.good = 0  # PROBING: good probe samples so far
        self.quantiles: list[float | None] = [None, None]
        self.median_ttft: float | None = None
        self.live: list = []  # attempts in flight here (`track`), pruned as they end
        self.live_values: list[float | None] = [None, None]  # their medians at the last evaluation
        self.live_bad_since: float | None = None  # live score >= eject_ratio since (HEALTHY)
        self.readmitted = False  # back in after a slow probe, for want of room (`_readmit`)


class OutlierDetector:
    """Per-worker latency windows and outlier states (see the module docstring)."""

    def __init__(
        self,
        config: OutlierConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[str, OutlierState, OutlierState], None] | None = None,
        is_out: Callable[[str], bool] | None = None,
        waiting: Callable[[str], int | None] | None = None,
    ):
        self.config = config or OutlierConfig()
        self._clock = clock
        self._on_transition = on_transition
        self._is_out = is_out  # out of routing for another reason (not serving, breaker open)
        self._waiting = waiting  # requests waiting at a worker, its last load report (None: unknown)
        self._workers: dict[str, _Worker] = {}
        self._last_eval = -math.inf
        self._role_median: dict[str, float] = {}  # TTFT median over a role's samples
        self.inflated = False  # some worker's factor is above 1 (`rerank` has work to do)
        self.ejections = 0  # lifetime count, for metrics

    # ---- samples ------------------------------------------------------------

    def record_ttft(
        self, worker_id: str, seconds: float, prefill_blocks: int = 0, role: str = "decode"
    ) -> None:
        """Time from an attempt's start to its first message on `worker_id` (or to its failure
        before one: a lower bound, which still says the worker is slow). Kept per unit of
        work, seconds / (1 + blocks it had to prefill), so that a worker that gets the long
        or uncached prompts (kv-aware routing sends the cached ones elsewhere) is not taken
        for a slow one."""
        self._record(worker_id, role, TTFT, seconds / (1 + max(prefill_blocks, 0)))

    def record_itl(self, worker_id: str, seconds: float, role: str = "decode") -> None:
        """Mean gap between an attempt's messages after its first, once per attempt."""
        self._record(worker_id, role, ITL, seconds)

    def _record(self, worker_id: str, role: str, metric: int, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        w = self._worker(worker_id, role)
        now = self._clock()
        if w.state is OutlierState.PROBING and w.probes > 0:
            self._judge_probe(worker_id, w, metric, value, now)
            return
        w.samples[metric].append((now, value))
        self._maybe_evaluate(now)

    def track(self, attempt, role: str = "decode") -> None:
        """An attempt just sent to `attempt.worker_id` (a services/router/attempt.py
        DecodeAttempt: worker_id, started, first_at, last_at, later_tokens, prefill_blocks,
        ended). Until it ends it is judged live at each evaluation: the time it has waited
        for its first message, per unit of work, and its gap per token so far (the gap it
        is in now included), so a worker that turned slow or stopped is seen within an
        evaluation interval or two, not only once its requests finish."""
        if not self.config.live_enabled:
            return
        w = self._worker(attempt.worker_id, role)
        w.live.append(attempt)
        if len(w.live) > 4 * self.config.max_samples:  # no evaluation for a while: prune here
            w.live = [a for a in w.live if not a.ended]

    def remove(self, worker_id: str) -> None:
        """The worker left the registry."""
        self._workers.pop(worker_id, None)
        self.inflated = any(w.factor > 1 for w in self._workers.values())

    # ---- what routing reads ---------------------------------------------------

    def state(self, worker_id: str) -> OutlierState:
        w = self._workers.get(worker_id)
        if w is None:
            return OutlierState.HEALTHY
        self._advance(worker_id, w, self._clock())
        return w.state

    def factor(self, worker_id: str) -> float:
        """The multiplier of this worker's routing cost (1 = none)."""
        w = self._workers.get(worker_id)
        return 1.0 if w is None else w.factor

    def is_available(self, worker_id: str) -> bool:
        """May the worker take a request now? (Changes nothing but EJECTED -> PROBING.)"""
        w = self._workers.get(worker_id)
        if w is None or w.state is OutlierState.HEALTHY:  # (the common case: no clock read)
            return True
        now = self._clock()
        self._advance(worker_id, w, now)
        if w.state is OutlierState.EJECTED:
            return False
        if w.state is OutlierState.PROBING:
            return w.probes < self.config.probe_requests or now - w.probe_at >= self.config.probe_timeout_s
        return True

    def allow_request(self, worker_id: str) -> bool:
        """As `is_available`; while PROBING a yes takes a probe slot (`release` gives it back)."""
        if not self.is_available(worker_id):
            return False
        w = self._workers.get(worker_id)
        if w is not None and w.state is OutlierState.PROBING:
            now = self._clock()
            if now - w.probe_at >= self.config.probe_timeout_s:
                w.probes = 0
            w.probes += 1
            w.probe_at = now
        return True

    def release(self, worker_id: str) -> None:
        """A request let through by `allow_request` ended without a sample (cancelled)."""
        w = self._workers.get(worker_id)
        if w is not None and w.state is OutlierState.PROBING and w.probes > 0:
            w.probes -= 1

    def rerank(
        self,
        ranked: list[C],
        worker_of: Callable[[C], str],
        cost_of: Callable[[C], float],
        explained: Callable[[str], float] | None = None,
    ) -> list[C]:
        """`ranked` (a policy's choices, best first) re-sorted by (cost + 1) * factor: a
        deprioritised worker's cost grows in proportion (+1 so that a zero cost grows too).
        The order among undeprioritised workers is kept. `explained`: the share of a
        worker's slowness its cost already carries (its measured speed factor, routing on
        predicted time): the factor here is what is left of it, max(1, factor / explained)."""
        if not self.inflated:
            return ranked
        factor = self.factor
        if explained is None:
            return sorted(ranked, key=lambda ch: (cost_of(ch) + 1.0) * factor(worker_of(ch)))

        def left(worker_id: str) -> float:
            return max(1.0, factor(worker_id) / max(explained(worker_id), 1.0))

        return sorted(ranked, key=lambda ch: (cost_of(ch) + 1.0) * left(worker_of(ch)))

    def predicted_ttft(self, worker_id: str, prefill_blocks: int = 0) -> float | None:
        """The time to first message a request with `prefill_blocks` to prefill should take on
        this worker: the median per unit of work over the window (over its role's workers when
        it has too few samples) times (1 + prefill_blocks); None with no samples to go on.
        (The medians are computed with the quantiles, at most every eval_interval_s.)"""
        self._maybe_evaluate(self._clock())
        w = self._workers.get(worker_id)
        if w is not None and w.median_ttft is not None:
            per_unit: float | None = w.median_ttft
        else:
            per_unit = self._role_median.get(w.role if w is not None else "decode")
        return None if per_unit is None else per_unit * (1 + max(prefill_blocks, 0))

    # ---- evaluation -----------------------------------------------------------

    def _worker(self, worker_id: str, role: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(role, self.config.max_samples)
            w.healthy_since = self._clock()
        return w

    def _window(self, w: _Worker, metric: int, now: float) -> list[float]:
        dq = w.samples[metric]
        horizon = now - self.config.window_s
        while dq and dq[0][0] < horizon:
            dq.popleft()
        return [v for _, v in dq]

    def tick(self) -> None:
        """Evaluate if an interval has passed (the router's housekeeping calls it, so that
        requests in flight on a worker that stopped are judged with no traffic arriving)."""
        self._maybe_evaluate(self._clock())

    def evaluate(self) -> None:
        """Recompute every worker's quantiles, scores and states now."""
        self._last_eval = -math.inf
        self._maybe_evaluate(self._clock())

    def _maybe_evaluate(self, now: float) -> None:
        cfg = self.config
        if now - self._last_eval < cfg.eval_interval_s:
            return
        self._last_eval = now
        pooled: dict[str, list[float]] = {}
        for w in self._workers.values():
            for m in _METRICS:
                vals = self._window(w, m, now)
                enough = len(vals) >= cfg.min_samples
                w.quantiles[m] = quantile(vals, cfg.quantile) if enough else None
                if m == TTFT:
                    w.median_ttft = quantile(vals, 0.5) if enough else None
                    pooled.setdefault(w.role, []).extend(vals)
        self._role_median = {
            role: quantile(vals, 0.5) for role, vals in pooled.items() if len(vals) >= cfg.min_samples
        }
        if cfg.live_enabled:
            for w in self._workers.values():
                self._live(w, now)
        if not cfg.enabled:  # off: the samples serve the TTFT prediction only
            return
        for wid, w in self._workers.items():
            self._advance(wid, w, now)
            if w.state is OutlierState.PROBING and cfg.live_enabled:
                # A probe that is already far slower than the peers in flight: out again, now
                # (a probe has the worker to itself: no queue in its TTFT).
                if (ratio := max(self._live_score(wid, w))) >= cfg.eject_ratio:
                    if self._has_room(w.role, wid):
                        self._eject(wid, w, now)
                    else:
                        self._readmit(wid, w, ratio)
                continue
            if w.state is not OutlierState.HEALTHY:
                continue
            window, live = self._score(wid, w), self._live_score(wid, w)
            score = max(max(window), max(live))
            verdict = False  # a readmitted worker's slow probe is still all there is to go on
            if w.readmitted:
                if w.quantiles[TTFT] is not None or w.quantiles[ITL] is not None:
                    w.readmitted = False
                elif w.live_values[TTFT] is None and w.live_values[ITL] is None:
                    score, verdict = w.score, w.score >= cfg.eject_ratio
            w.score = score
            w.factor = min(w.score, cfg.max_factor) if w.score >= cfg.deprioritise_ratio else 1.0
            # Only the ITL ejects (the module docstring: TTFT carries the queue). The live view
            # steers new requests away at once (the factor) but ejects only when it has said so
            # for live_eject_after_s: on a CPU-starved machine a healthy worker's streams can
            # all be late for a moment, and ejecting it then takes capacity away when it is
            # needed most (the faults study's fault-free run cascaded that way).
            window, live = window[ITL], live[ITL]
            if live >= cfg.eject_ratio:
                if w.live_bad_since is None:
                    w.live_bad_since = now
            else:
                w.live_bad_since = None
            sustained = w.live_bad_since is not None and now - w.live_bad_since >= cfg.live_eject_after_s
            if (
                (window >= cfg.eject_ratio or sustained or verdict)
                and self._may_eject(w.role)
                and self._has_room(w.role, wid)
            ):
                w.live_bad_since = None
                self._eject(wid, w, now)
        self._probe_early_where_short(now)
        self.inflated = any(w.factor > 1 for w in self._workers.values())

    def _peer_median(self, worker_id: str, role: str, metric: int) -> float | None:
        peers = [
            q
            for wid, o in self._workers.items()
            if wid != worker_id and o.role == role and o.state is OutlierState.HEALTHY
            if (q := o.quantiles[metric]) is not None
        ]
        return quantile(peers, 0.5) if peers else None

    def _ratio(self, worker_id: str, role: str, metric: int, value: float) -> float:
        peer = self._peer_median(worker_id, role, metric)
        if peer is None or value - peer < self.config.min_excess_s:
            return 1.0
        return value / peer if peer > 0 else math.inf

    def _score(self, worker_id: str, w: _Worker) -> list[float]:
        """[TTFT, ITL] ratio of the worker's window quantile to its peers' (1: none)."""
        score = [1.0, 1.0]
        for m in _METRICS:
            q = w.quantiles[m]
            if q is not None:
                score[m] = self._ratio(worker_id, w.role, m, q)
        return score

    def _live(self, w: _Worker, now: float) -> None:
        """The medians of the worker's attempts in flight (None: fewer than needed)."""
        w.live = live = [a for a in w.live if not a.ended]
        ttft: list[float] = []
        itl: list[float] = []
        age = self.config.live_min_age_s  # a gap or two of a young stream is the OS's noise
        for a in live:
            if a.first_at is None:
                if now - a.started >= age:
                    ttft.append((now - a.started) / (1 + max(a.prefill_blocks, 0)))
            elif now - a.first_at < age:
                continue
            elif (later := a.later_tokens) >= 1:
                itl.append(max((a.last_at - a.first_at) / later, now - a.last_at))
            else:
                itl.append(now - a.first_at)
        need = 1 if w.state is OutlierState.PROBING or w.readmitted else self.config.live_min_attempts
        w.live_values = [
            quantile(ttft, 0.5) if len(ttft) >= need else None,
            quantile(itl, 0.5) if len(itl) >= need else None,
        ]

    def _live_score(self, worker_id: str, w: _Worker) -> list[float]:
        """[TTFT, ITL]: the worker's live medians against its healthy peers', each peer taken
        at the larger of its live median and its window quantile (so a lag in one view does
        not make a peer look fast), ratios counted as in `_ratio`."""
        score = [1.0, 1.0]
        for m in _METRICS:
            value = w.live_values[m]
            if value is None:
                continue
            refs = [
                max(v for v in (o.live_values[m], o.quantiles[m]) if v is not None)
                for wid, o in self._workers.items()
                if wid != worker_id and o.role == w.role and o.state is OutlierState.HEALTHY
                if o.live_values[m] is not None or o.quantiles[m] is not None
            ]
            if not refs:
                continue
            peer = quantile(refs, 0.5)
            if value - peer >= self.config.min_excess_s:
                score[m] = value / peer if peer > 0 else math.inf
        return score

    def _out_of(self, role: str) -> tuple[int, int]:
        """(workers of `role` out now, how many may be): out = ejected or probing, or out for
        another reason (`is_out`: not serving, breaker open); may = max(1, floor(share x
        workers)), never all of them."""
        is_out = self._is_out
        members = [(wid, w) for wid, w in self._workers.items() if w.role == role]
        out = sum(
            w.state is not OutlierState.HEALTHY or (is_out is not None and is_out(wid)) for wid, w in members
        )
        allowed = min(max(1, math.floor(self.config.max_ejected_share * len(members))), len(members) - 1)
        return out, (allowed if self.config.max_ejected_share > 0 else 0)

    def _may_eject(self, role: str) -> bool:
        out, allowed = self._out_of(role)
        return out < allowed

    def _others_out(self, role: str) -> int:
        """Workers of `role` out for a reason other than this detector (not serving, breaker open)."""
        is_out = self._is_out
        if is_out is None:
            return 0
        return sum(w.role == role and is_out(wid) for wid, w in self._workers.items())

    def _peers_waiting(self, role: str, worker_id: str) -> float | None:
        """Mean requests waiting at the other workers of `role` that take traffic now (not
        ejected or probing, not out for another reason), from their load reports; None when
        there is no such worker or no report."""
        waiting, is_out = self._waiting, self._is_out
        if waiting is None:
            return None
        counts = [
            n
            for wid, o in self._workers.items()
            if wid != worker_id and o.role == role and o.state is OutlierState.HEALTHY
            if not (is_out is not None and is_out(wid)) and (n := waiting(wid)) is not None
        ]
        return sum(counts) / len(counts) if counts else None

    def _has_room(self, role: str, worker_id: str) -> bool:
        """May `worker_id`'s load move onto its peers? Only while their queues are short: an
        ejection moves a slow worker's share onto the others, and when they are already
        queueing that share waits in their queues instead (the faults study's overload: 8.9
        req/s on what 3 of 4 workers could carry, a 5x slow worker ejected, and the healthy
        ones' queues took the misses). A slow worker is a fifth of a worker; none is none."""
        room = self.config.eject_room_waiting
        if room < 0:
            return True
        mean = self._peers_waiting(role, worker_id)
        return mean is None or mean <= room

    def _short(self, role: str, worker_id: str) -> bool:
        """Are `worker_id`'s peers queueing past `recall_waiting` each?"""
        if self.config.eject_room_waiting < 0:
            return False
        mean = self._peers_waiting(role, worker_id)
        return mean is not None and mean > self.config.recall_waiting

    def _probe_early_where_short(self, now: float) -> None:
        """Ejected workers are probed now instead of at the end of their backoff where the
        role is short of workers: more are out than the share allows (one ejected as slow,
        then two more stopped answering), or more are out for other reasons than when the
        worker was ejected. An ejection moves a slow worker's load onto the capacity the
        others have left at that moment; when another worker fails, that capacity is gone
        (the faults study: a worker ejected for 20 s by a probe sent in the last second of
        its slowdown, then another stopped, left 2 of 4 workers carrying the load and
        missed the SLOs for 15 s). A slow worker, or one recovered meanwhile, is better
        than none. Probing lets one request through at a time, judged on its own; a bad
        probe ejects again, against the outages of then."""
        for role in {w.role for w in self._workers.values() if w.state is OutlierState.EJECTED}:
            out, allowed = self._out_of(role)
            others = self._others_out(role)
            for wid, w in self._workers.items():
                if w.role != role or w.state is not OutlierState.EJECTED:
                    continue
                if out > allowed or others > w.others_out or self._short(role, wid):
                    w.until = min(w.until, now)
                    self._advance(wid, w, now)

    # ---- transitions ----------------------------------------------------------

    def _eject(self, worker_id: str, w: _Worker, now: float) -> None:
        cfg = self.config
        if now - w.healthy_since >= cfg.backoff_reset_s:
            w.ejections = 0
        period = min(cfg.base_ejection_s * cfg.ejection_multiplier**w.ejections, cfg.max_ejection_s)
        w.ejections += 1
        w.until = now + period
        w.others_out = self._others_out(w.role)
        w.factor = 1.0  # it gets no traffic while ejected; probes are judged on their own
        w.readmitted = False
        w.probes = w.good = 0
        self.ejections += 1
        self._set(worker_id, w, OutlierState.EJECTED)

    def _advance(self, worker_id: str, w: _Worker, now: float) -> None:
        if w.state is OutlierState.EJECTED and now >= w.until:
            w.probes = w.good = 0
            self._set(worker_id, w, OutlierState.PROBING)

    def _judge_probe(self, worker_id: str, w: _Worker, metric: int, value: float, now: float) -> None:
        """One sample of a probe request: good (within eject_ratio of the peers) or not. A bad
        one ejects again, or, while the peers have no room, readmits the worker deprioritised."""
        ratio = self._ratio(worker_id, w.role, metric, value)
        if ratio >= self.config.eject_ratio:
            if self._has_room(w.role, worker_id):
                self._eject(worker_id, w, now)
            else:
                self._readmit(worker_id, w, ratio)
            return
        if metric == TTFT:  # one verdict per probe request: its first sample
            w.probes -= 1
            w.good += 1
        if w.good >= self.config.probe_successes:
            for dq in w.samples:  # its slow past would eject it again at once
                dq.clear()
            w.quantiles = [None, None]
            w.median_ttft = None
            w.score, w.factor, w.healthy_since = 1.0, 1.0, now
            self._set(worker_id, w, OutlierState.HEALTHY)

    def _readmit(self, worker_id: str, w: _Worker, ratio: float) -> None:
        """Back to HEALTHY after a slow probe because its peers are queueing: it takes traffic
        again with its cost multiplied by the probe's ratio (capped), so new work goes to it
        only when the others' queues make it the cheaper place. Its samples start afresh
        (they are of the slowness the ejection already answered); until new ones or its
        requests in flight (judged from one, as a probe's) say otherwise, the probe's verdict
        stands, and it goes out again once the peers have room. Its backoff is not reset: it
        has not been healthy."""
        cfg = self.config
        for dq in w.samples:
            dq.clear()
        w.quantiles = [None, None]
        w.median_ttft = None
        w.live_values = [None, None]
        w.live_bad_since = None
        w.readmitted = True
        w.probes = w.good = 0
        w.score = ratio
        w.factor = min(ratio, cfg.max_factor)
        self._set(worker_id, w, OutlierState.HEALTHY)
        self.inflated = True

    def _set(self, worker_id: str, w: _Worker, state: OutlierState) -> None:
        old, w.state = w.state, state
        if old is not state and self._on_transition is not None:
            self._on_transition(worker_id, old, state)
