"""The retry budget: retries may add at most a fixed fraction to recent traffic.

Owns a sliding window of first attempts and granted retries. A retry is
granted while

    retries in window < min_retries_per_second * window_s + retry_ratio * requests in window

so when every worker fails, the router sends at most (1 + retry_ratio) times
the client traffic plus a small constant, instead of (1 + max retries) times:
retries cannot amplify an outage. The servicer calls `record_request` once per
client request (first attempt only; retries do not earn budget); the
recovery decision (migration.py) reads `can_retry`, and the flow then records
the retry it starts (`record_retry`) or the one refused (`record_denied`).
Sunk cost: a retry of a request with `sunk_tokens` behind it (tokens its
workflow already spent) may also draw on a reserve of `sunk_reserve` retries
per window, in proportion min(1, sunk_tokens / sunk_full_tokens): losing a
step with 50k tokens behind it wastes them all, so it may spend more than a
fresh chat turn, still bounded by allowance + reserve.

Migrations after the first token are bounded per request by the journey's
migration limit, not by this budget.

Defaults, and why (cf. Finagle's RetryBudget: 20%, 10 s TTL, 10 retries/s
minimum; Envoy's retry_budget: 20%, min_retry_concurrency 3):
- retry_ratio 0.1: an LLM request costs seconds of accelerator time, so the
  router allows half the fraction of those RPC proxies;
- window 10 s in 10 buckets of 1 s: long enough to hold many requests at
  LLM request rates, short enough to track an outage;
- min_retries_per_second 0.3 (3 per window): a quiet router (a request every
  few seconds, where 10% of the window is less than one retry) can still retry
  an isolated failure, while Finagle's 10/s would be more retries than a small
  mesh has requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.config import require, setting
from services.router.sliding_window import SlidingWindow

_REQUESTS, _RETRIES = 0, 1


@dataclass(frozen=True)
class RetryBudgetConfig:
    enabled: bool = setting(True, "the retry budget (false: every retry is granted)")
    retry_ratio: float = setting(0.1, "retries allowed as a fraction of requests in the window")
    min_retries_per_second: float = setting(0.3, "retries allowed regardless of traffic, per second")
    window_s: float = setting(10.0, "sliding window of the retry budget")
    buckets: int = setting(10, "buckets of the sliding window")
    sunk_reserve: float = setting(3.0, "extra retries per window for requests with sunk workflow cost")
    sunk_full_tokens: int = setting(50_000, "sunk tokens that earn the whole reserve")

    def __post_init__(self) -> None:
        require(0 <= self.retry_ratio <= 1, "retry_ratio must be in [0, 1]")
        require(self.min_retries_per_second >= 0, "min_retries_per_second must be >= 0")
        require(self.window_s > 0, "window_s must be > 0")
        require(self.buckets >= 1, "buckets must be >= 1")
        require(self.sunk_reserve >= 0, "sunk_reserve must be >= 0")
        require(self.sunk_full_tokens >= 1, "sunk_full_tokens must be >= 1")


class RetryBudget:
    def __init__(self, config: RetryBudgetConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or RetryBudgetConfig()
        self._clock = clock
        self._window = SlidingWindow(self.config.window_s, self.config.buckets, fields=2)
        self.requests = 0  # lifetime counters, for metrics
        self.retries_granted = 0
        self.retries_denied = 0

    def record_request(self) -> None:
        """A client request's first attempt (earns budget)."""
        self._window.add(self._clock(), _REQUESTS)
        self.requests += 1

    def available(self, sunk_tokens: int = 0) -> float:
        """Retries that would be granted now to a request with `sunk_tokens`
        behind it (may be fractional)."""
        requests, retries = self._window.totals(self._clock())
        cfg = self.config
        allowance = cfg.min_retries_per_second * cfg.window_s + cfg.retry_ratio * requests
        allowance += cfg.sunk_reserve * min(max(sunk_tokens, 0) / cfg.sunk_full_tokens, 1.0)
        return max(allowance - retries, 0.0)

    def can_retry(self, sunk_tokens: int = 0) -> bool:
        """Would a retry be granted now? (Changes nothing.)"""
        if not self.config.enabled:  # the "naive" router of bench/faults.py
            return True
        return self.available(sunk_tokens) >= 1.0 - 1e-9  # tolerate float error in ratio * requests

    def record_retry(self) -> None:
        """A retry was started (after `can_retry` said yes): it spends budget."""
        self._window.add(self._clock(), _RETRIES)
        self.retries_granted += 1

    def record_denied(self) -> None:
        """A retry was refused because the budget was spent (for metrics)."""
        self.retries_denied += 1

    def try_acquire_retry(self, sunk_tokens: int = 0) -> bool:
        """Take one retry from the budget; False (and counted) when it is spent."""
        if self.can_retry(sunk_tokens):
            self.record_retry()
            return True
        self.record_denied()
        return False
