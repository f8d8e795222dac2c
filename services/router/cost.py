"""Cost per successful request: the router's aggregate token accounting.

Owns lifetime counters only (no per-request history, so memory is fixed): a
finished request's `RequestCost` (built by its `RequestJourney`) is folded in
by `CostLedger.record`, admission rejections by `record_shed`. Read by the
servicer's Stats RPC and the metrics exporter.

Definitions (the proto's RouterServiceStatsResponse):
- computed tokens: every token position computed for a request across all its
  attempts (prefill + decode + recomputation after retry or migration);
- tokens per successful request: computed tokens of successful requests, all
  their attempts included, divided by successful requests;
- wasted tokens: all computed tokens of failed and cancelled requests, plus,
  for successful requests, the tokens of attempts that did not finish it
  (their KV was thrown away and recomputed elsewhere).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestOutcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # by the client or its deadline


@dataclass(frozen=True)
class RequestCost:
    """What one finished request cost."""

    outcome: RequestOutcome
    computed_tokens: int
    wasted_tokens: int  # part of computed_tokens
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0
    migrations: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.wasted_tokens <= self.computed_tokens):
            raise ValueError(f"need 0 <= wasted ({self.wasted_tokens}) <= computed ({self.computed_tokens})")


@dataclass(frozen=True)
class CostStats:
    requests_succeeded: int
    requests_failed: int
    requests_cancelled: int
    requests_shed: int
    computed_tokens: int
    successful_computed_tokens: int
    wasted_tokens: int
    retries: int
    migrations: int
    prompt_tokens: int = 0  # of finished requests (the planner's ISL)
    completion_tokens: int = 0  # delivered, of finished requests (the planner's OSL)

    @property
    def requests_finished(self) -> int:
        return self.requests_succeeded + self.requests_failed + self.requests_cancelled

    @property
    def tokens_per_successful_request(self) -> float:
        """Computed tokens of successful requests (all attempts) per success; 0 before any."""
        return self.successful_computed_tokens / self.requests_succeeded if self.requests_succeeded else 0.0

    @property
    def all_tokens_per_successful_request(self) -> float:
        """Every computed token, failures included, per success: the full cost of one success."""
        return self.computed_tokens / self.requests_succeeded if self.requests_succeeded else 0.0


class CostLedger:
    def __init__(self) -> None:
        self._by_outcome = dict.fromkeys(RequestOutcome, 0)
        self._shed = 0
        self._computed = 0
        self._successful_computed = 0
        self._wasted = 0
        self._retries = 0
        self._migrations = 0
        self._prompt = 0
        self._completion = 0

    def record(self, cost: RequestCost) -> None:
        """Fold in one finished request (call exactly once per request)."""
        self._by_outcome[cost.outcome] += 1
        self._computed += cost.computed_tokens
        self._wasted += cost.wasted_tokens
        if cost.outcome is RequestOutcome.SUCCEEDED:
            self._successful_computed += cost.computed_tokens
        self._retries += cost.retries
        self._migrations += cost.migrations
        self._prompt += cost.prompt_tokens
        self._completion += cost.completion_tokens

    def record_shed(self) -> None:
        """A request refused at admission (it computed nothing)."""
        self._shed += 1

    def stats(self) -> CostStats:
        return CostStats(
            requests_succeeded=self._by_outcome[RequestOutcome.SUCCEEDED],
            requests_failed=self._by_outcome[RequestOutcome.FAILED],
            requests_cancelled=self._by_outcome[RequestOutcome.CANCELLED],
            requests_shed=self._shed,
            computed_tokens=self._computed,
            successful_computed_tokens=self._successful_computed,
            wasted_tokens=self._wasted,
            retries=self._retries,
            migrations=self._migrations,
            prompt_tokens=self._prompt,
            completion_tokens=self._completion,
        )
