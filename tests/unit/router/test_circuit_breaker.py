import pytest

from services.common.config import ConfigError
from services.router.circuit_breaker import (
    BreakerConfig,
    BreakerRegistry,
    BreakerState,
    CircuitBreaker,
)
from tests.unit.router.fakes import FakeClock

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def breaker(**cfg) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(BreakerConfig(**cfg), clock), clock


def fail(b: CircuitBreaker, n: int) -> None:
    for _ in range(n):
        b.record_failure()


def open_breaker(b: CircuitBreaker) -> None:
    fail(b, b.config.consecutive_failures)
    assert b.state is OPEN


def test_consecutive_failures_open_the_breaker_and_a_success_resets_the_count():
    b, _ = breaker(consecutive_failures=3)
    fail(b, 2)
    b.record_success()
    fail(b, 2)
    assert b.state is CLOSED and b.allow_request()
    b.record_failure()
    assert b.state is OPEN
    assert not b.allow_request() and not b.is_available()
    assert b.opens == 1


def test_failure_rate_over_the_window_opens_once_enough_requests_were_seen():
    b, _ = breaker(consecutive_failures=100, failure_rate=0.5, min_requests=20)
    for _ in range(9):
        b.record_success()
        b.record_failure()
    assert b.state is CLOSED  # 50% but only 18 outcomes
    b.record_success()
    b.record_failure()
    assert b.state is OPEN  # 10 of 20


def test_old_outcomes_slide_out_of_the_window():
    b, clock = breaker(consecutive_failures=100, min_requests=4, window_s=10, window_buckets=10)
    fail(b, 3)
    b.record_success()  # the success keeps the consecutive count low
    clock.advance(11)
    b.record_failure()
    assert b.state is CLOSED  # the 3 old failures are gone: 1 of 1 < min_requests
    fail(b, 3)
    assert b.state is OPEN


def test_open_goes_half_open_after_the_cooldown_and_lets_one_probe_through():
    b, clock = breaker(cooldown_s=2.0)
    open_breaker(b)
    assert b.open_until == pytest.approx(clock() + 2.0)
    clock.advance(1.9)
    assert b.state is OPEN and not b.allow_request()
    clock.advance(0.1)
    assert b.state is HALF_OPEN
    assert b.is_available()
    assert b.allow_request()
    assert not b.allow_request()  # one probe at a time
    assert not b.is_available()


def test_probe_success_closes():
    b, clock = breaker(cooldown_s=1.0)
    open_breaker(b)
    clock.advance(1.0)
    assert b.allow_request()
    b.record_success()
    assert b.state is CLOSED and b.allow_request()


def test_probe_failure_reopens_with_exponential_backoff_up_to_the_cap():
    b, clock = breaker(cooldown_s=1.0, backoff_multiplier=2.0, max_cooldown_s=5.0)
    open_breaker(b)
    cooldowns = []
    for _ in range(5):
        cooldowns.append(b.open_until - clock())
        clock.advance(cooldowns[-1])
        assert b.allow_request()
        b.record_failure()
        assert b.state is OPEN
    assert cooldowns == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_backoff_restarts_only_after_the_breaker_stayed_closed_long_enough():
    b, clock = breaker(cooldown_s=1.0, backoff_reset_s=60.0)
    open_breaker(b)
    clock.advance(1.0)
    b.allow_request()
    b.record_success()  # closed again, but flapping
    open_breaker(b)
    assert b.open_until - clock() == 2.0
    clock.advance(2.0)
    b.allow_request()
    b.record_success()
    clock.advance(60.0)  # stable for a minute
    open_breaker(b)
    assert b.open_until - clock() == 1.0


def test_an_ignored_outcome_frees_the_probe_slot():
    b, clock = breaker(cooldown_s=1.0)
    open_breaker(b)
    clock.advance(1.0)
    assert b.allow_request()
    b.record_ignored()  # e.g. the client cancelled the probe
    assert b.state is HALF_OPEN
    assert b.allow_request()


def test_a_probe_that_never_reports_frees_its_slot_after_the_probe_timeout():
    b, clock = breaker(cooldown_s=1.0, probe_timeout_s=30.0)
    open_breaker(b)
    clock.advance(1.0)
    assert b.allow_request()
    clock.advance(29.0)
    assert not b.allow_request()
    clock.advance(1.0)
    assert b.allow_request()


def test_late_results_of_requests_sent_before_opening_are_ignored():
    b, clock = breaker(cooldown_s=1.0)
    open_breaker(b)
    b.record_success()
    assert b.state is OPEN
    clock.advance(1.0)
    b.record_failure()  # HALF_OPEN but no probe in flight: not a verdict
    assert b.state is HALF_OPEN and b.opens == 1


def test_config_is_validated():
    with pytest.raises(ConfigError):
        BreakerConfig(failure_rate=0)
    with pytest.raises(ConfigError):
        BreakerConfig(cooldown_s=10, max_cooldown_s=5)


def test_registry_keeps_one_breaker_per_worker_and_reports_transitions():
    clock = FakeClock()
    seen = []
    reg = BreakerRegistry(
        BreakerConfig(consecutive_failures=2, cooldown_s=1.0), clock, lambda w, a, b: seen.append((w, a, b))
    )
    assert reg.is_available("w1") and reg.state("w1") is CLOSED and len(reg) == 0  # no breaker made
    reg.record_failure("w1")
    reg.record_failure("w1")
    reg.record_failure("w2")
    assert reg.state("w1") is OPEN and reg.state("w2") is CLOSED
    assert not reg.allow_request("w1") and reg.allow_request("w2")
    clock.advance(1.0)
    assert reg.is_available("w1")
    assert reg.is_available("w1")  # a peek takes no probe slot
    assert reg.allow_request("w1")
    reg.record_success("w1")
    assert seen == [("w1", CLOSED, OPEN), ("w1", OPEN, HALF_OPEN), ("w1", HALF_OPEN, CLOSED)]
    reg.remove("w1")
    assert len(reg) == 1
