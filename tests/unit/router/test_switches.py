"""Issue 18's switches for a "naive" router (bench/faults.py), and the journey's waste by cause."""

from __future__ import annotations

import pytest

from services.router.circuit_breaker import BreakerConfig, BreakerState, CircuitBreaker
from services.router.config import parse_settings
from services.router.cost import RequestOutcome
from services.router.migration import AttemptKind, JourneyError, RequestJourney
from services.router.retry_budget import RetryBudget, RetryBudgetConfig


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_disabled_breaker_never_opens():
    b = CircuitBreaker(BreakerConfig(enabled=False, consecutive_failures=1), Clock())
    for _ in range(50):
        b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allow_request()


def test_a_disabled_retry_budget_grants_every_retry():
    budget = RetryBudget(RetryBudgetConfig(enabled=False, min_retries_per_second=0, retry_ratio=0), Clock())
    for _ in range(100):
        assert budget.can_retry()
        budget.record_retry()
    assert not RetryBudget(RetryBudgetConfig(min_retries_per_second=0, retry_ratio=0), Clock()).can_retry()


def test_the_naive_router_flags_parse():
    s = parse_settings(
        [
            "--breaker-enabled",
            "false",
            "--retry-budget-enabled",
            "false",
            "--max-migrations",
            "0",
            "--outlier-enabled",
            "false",
            "--hedge-enabled",
            "false",
            "--reroute-unstarted",
            "false",
            "--first-token-timeout-multiple",
            "0",
            "--retry-attach-enabled",
            "false",
        ],
        env={},
    )
    assert not s.breaker.enabled and not s.retry_budget.enabled and s.journey.max_migrations == 0
    assert not s.outlier.enabled and not s.hedge.enabled and not s.retry_attach.enabled
    assert not s.router.reroute_unstarted and s.router.first_token_timeout_multiple == 0
    d = parse_settings([], env={})
    assert d.breaker.enabled and d.retry_budget.enabled and d.outlier.enabled and not d.hedge.enabled
    assert d.router.reroute_unstarted and d.retry_attach.enabled


def test_waste_by_cause_adds_up_to_the_wasted_tokens():
    j = RequestJourney("r", [1] * 10, 8)
    j.start_attempt("a")
    j.fail_attempt()  # retry: a's 10 prefill tokens thrown away
    j.start_attempt("b")
    j.hedge_won("c")  # b's 10 thrown away, c runs on
    assert j.current is not None and j.current.kind is AttemptKind.HEDGE and j.retries == 1
    j.record_tokens([5, 6])
    j.fail_attempt()  # migrated after 2 tokens: c's 12 thrown away
    j.start_attempt("d")
    j.record_tokens([7] * 6)
    cost = j.succeed()
    by = j.waste_by_cause()
    assert by == {"retried": 10, "hedged": 10, "migrated": 12}
    assert sum(by.values()) == cost.wasted_tokens


def test_waste_of_a_failed_request_is_all_failed():
    j = RequestJourney("r", [1] * 4, 8)
    with pytest.raises(JourneyError):
        j.waste_by_cause()
    j.start_attempt("a")
    cost = j.give_up()
    assert cost.outcome is RequestOutcome.FAILED and j.waste_by_cause() == {"failed": 4}
