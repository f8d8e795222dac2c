"""Per-worker circuit breakers: stop sending requests to a worker that keeps failing.

Owns one `CircuitBreaker` per worker id in a `BreakerRegistry`. The servicer
asks `allow_request` before dispatching to a worker and reports the attempt's
outcome with `record_success` / `record_failure` (a worker-side failure:
UNAVAILABLE, reset stream, KV transfer failure) or `record_ignored` (an outcome
that says nothing about the worker: client cancel, the request's own deadline,
invalid argument). The registry's eligibility view reads `is_available`, which
never changes state. Breakers of removed workers are dropped with `remove`.

    CLOSED --(N consecutive failures, or failure rate >= r over the window
              with at least min_requests)--> OPEN
    OPEN --(cooldown elapsed)--> HALF_OPEN        (lazily, when next asked)
    HALF_OPEN: up to `half_open_probes` requests at a time go through;
        a probe success -> CLOSED; a probe failure -> OPEN with a longer cooldown
    cooldown = min(cooldown_s * backoff_multiplier ** k, max_cooldown_s), where
        k counts re-opens since the breaker last stayed closed for backoff_reset_s.

Defaults, and why: 5 consecutive failures (a dead worker trips within a
handful of requests, one bad request does not); 50% failures over 10 s with at
least 20 requests (a sick-but-alive worker, with enough samples to tell);
cooldown 1 s doubling to 30 s (a restarted worker is back within about its
start time; a dead one costs one probe per 30 s); one probe at a time (a
probe of an LLM worker is a whole request, so do not spend more than one).
A probe that never reports (lost by a caller bug) frees its slot after
`probe_timeout_s`, so a breaker cannot stay HALF_OPEN with no slot forever.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.config import require, setting
from services.router.sliding_window import SlidingWindow

_SUCCESS, _FAILURE = 0, 1


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    enabled: bool = setting(True, "circuit breakers (false: a failing worker is never taken out)")
    consecutive_failures: int = setting(5, "consecutive failures that open a worker's breaker")
    failure_rate: float = setting(0.5, "failure fraction over the window that opens the breaker")
    min_requests: int = setting(20, "outcomes in the window before the failure rate counts")
    window_s: float = setting(10.0, "sliding window of the failure rate")
    window_buckets: int = setting(10, "buckets of the sliding window")
    cooldown_s: float = setting(1.0, "first OPEN period before a probe")
    backoff_multiplier: float = setting(2.0, "cooldown growth per re-open")
    max_cooldown_s: float = setting(30.0, "cooldown cap")
    backoff_reset_s: float = setting(60.0, "closed this long: the next open starts from cooldown_s again")
    half_open_probes: int = setting(1, "requests let through at once while HALF_OPEN")
    probe_timeout_s: float = setting(120.0, "a probe that never reports frees its slot after this")

    def __post_init__(self) -> None:
        require(self.consecutive_failures >= 1, "consecutive_failures must be >= 1")
        require(0 < self.failure_rate <= 1, "failure_rate must be in (0, 1]")
        require(self.min_requests >= 1, "min_requests must be >= 1")
        require(self.window_s > 0 and self.window_buckets >= 1, "need window_s > 0 and window_buckets >= 1")
        require(0 < self.cooldown_s <= self.max_cooldown_s, "need 0 < cooldown_s <= max_cooldown_s")
        require(self.backoff_multiplier >= 1, "backoff_multiplier must be >= 1")
        require(self.backoff_reset_s >= 0, "backoff_reset_s must be >= 0")
        require(self.half_open_probes >= 1, "half_open_probes must be >= 1")
        require(self.probe_timeout_s > 0, "probe_timeout_s must be > 0")


Transition = Callable[[BreakerState, BreakerState], None]


class CircuitBreaker:
    def __init__(
        self,
        config: BreakerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Transition | None = None,
    ):
        self.config = config or BreakerConfig()
        self._clock = clock
        self._on_transition = on_transition
        self._state = BreakerState.CLOSED
        self._window = SlidingWindow(self.config.window_s, self.config.window_buckets, fields=2)
        self._consecutive = 0
        self._reopens = 0  # k in the cooldown formula
        self._closed_since: float | None = None
        self._open_until = 0.0
        self._probes = 0
        self._last_probe_at = 0.0
        self.opens = 0  # lifetime count, for metrics

    @property
    def state(self) -> BreakerState:
        self._advance(self._clock())
        return self._state

    @property
    def open_until(self) -> float | None:
        """When an OPEN breaker will let a probe through (None unless OPEN)."""
        return self._open_until if self.state is BreakerState.OPEN else None

    def is_available(self) -> bool:
        """Would `allow_request` say yes now? (Changes nothing but the lazy OPEN -> HALF_OPEN.)"""
        now = self._clock()
        self._advance(now)
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            return False
        return self._probes < self.config.half_open_probes or self._probe_timed_out(now)

    def allow_request(self) -> bool:
        """May a request go to this worker now? In HALF_OPEN a yes takes a probe
        slot, which the request's `record_*` gives back."""
        now = self._clock()
        self._advance(now)
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            return False
        if self._probe_timed_out(now):
            self._probes = 0
        if self._probes >= self.config.half_open_probes:
            return False
        self._probes += 1
        self._last_probe_at = now
        return True

    def record_success(self) -> None:
        now = self._clock()
        self._advance(now)
        if self._state is BreakerState.CLOSED:
            self._consecutive = 0
            self._window.add(now, _SUCCESS)
        elif self._state is BreakerState.HALF_OPEN and self._probes > 0:
            self._close(now)
        # OPEN: a late result of a request sent before the breaker opened; ignore.

    def record_failure(self) -> None:
        if not self.config.enabled:  # the "naive" router of bench/faults.py: never opens
            return
        now = self._clock()
        self._advance(now)
        if self._state is BreakerState.CLOSED:
            self._consecutive += 1
            self._window.add(now, _FAILURE)
            ok, failed = self._window.totals(now)
            total = ok + failed
            over_rate = total >= self.config.min_requests and failed >= self.config.failure_rate * total
            if self._consecutive >= self.config.consecutive_failures or over_rate:
                self._open(now, from_closed=True)
        elif self._state is BreakerState.HALF_OPEN and self._probes > 0:
            self._open(now, from_closed=False)

    def record_ignored(self) -> None:
        """The request ended without a verdict on the worker; free its probe slot."""
        self._advance(self._clock())
        if self._state is BreakerState.HALF_OPEN and self._probes > 0:
            self._probes -= 1

    # ---- transitions --------------------------------------------------------

    def _advance(self, now: float) -> None:
        if self._state is BreakerState.OPEN and now >= self._open_until:
            self._probes = 0
            self._set(BreakerState.HALF_OPEN)

    def _probe_timed_out(self, now: float) -> bool:
        return self._probes > 0 and now - self._last_probe_at >= self.config.probe_timeout_s

    def _open(self, now: float, from_closed: bool) -> None:
        cfg = self.config
        if from_closed:
            stable = self._closed_since is not None and now - self._closed_since >= cfg.backoff_reset_s
            if stable:
                self._reopens = 0
        cooldown = min(cfg.cooldown_s * cfg.backoff_multiplier**self._reopens, cfg.max_cooldown_s)
        self._reopens += 1
        self._open_until = now + cooldown
        self._probes = 0
        self.opens += 1
        self._set(BreakerState.OPEN)

    def _close(self, now: float) -> None:
        self._consecutive = 0
        self._window.reset()
        self._probes = 0
        self._closed_since = now
        self._set(BreakerState.CLOSED)

    def _set(self, state: BreakerState) -> None:
        old, self._state = self._state, state
        if self._on_transition is not None and old is not state:
            self._on_transition(old, state)


class BreakerRegistry:
    """One breaker per worker id, created on first use, dropped with the worker.

    `on_transition(worker_id, old, new)` lets the edge count and log transitions.
    """

    def __init__(
        self,
        config: BreakerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[str, BreakerState, BreakerState], None] | None = None,
    ):
        self.config = config or BreakerConfig()
        self._clock = clock
        self._on_transition = on_transition
        self._breakers: dict[str, CircuitBreaker] = {}

    def get(self, worker_id: str) -> CircuitBreaker:
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            hook = None
            if self._on_transition is not None:
                cb = self._on_transition

                def hook(old: BreakerState, new: BreakerState, _w: str = worker_id) -> None:
                    cb(_w, old, new)

            breaker = CircuitBreaker(self.config, self._clock, hook)
            self._breakers[worker_id] = breaker
        return breaker

    def is_available(self, worker_id: str) -> bool:
        breaker = self._breakers.get(worker_id)
        return breaker is None or breaker.is_available()

    def allow_request(self, worker_id: str) -> bool:
        return self.get(worker_id).allow_request()

    def record_success(self, worker_id: str) -> None:
        self.get(worker_id).record_success()

    def record_failure(self, worker_id: str) -> None:
        self.get(worker_id).record_failure()

    def record_ignored(self, worker_id: str) -> None:
        breaker = self._breakers.get(worker_id)
        if breaker is not None:
            breaker.record_ignored()

    def state(self, worker_id: str) -> BreakerState:
        breaker = self._breakers.get(worker_id)
        return BreakerState.CLOSED if breaker is None else breaker.state

    def remove(self, worker_id: str) -> None:
        self._breakers.pop(worker_id, None)

    def __len__(self) -> int:
        return len(self._breakers)
