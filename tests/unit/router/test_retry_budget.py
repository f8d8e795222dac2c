import pytest

from services.common.config import ConfigError
from services.router.retry_budget import RetryBudget, RetryBudgetConfig
from tests.unit.router.fakes import FakeClock


def budget(**cfg) -> tuple[RetryBudget, FakeClock]:
    clock = FakeClock()
    return RetryBudget(RetryBudgetConfig(**cfg), clock), clock


def grant_all(b: RetryBudget) -> int:
    n = 0
    while b.try_acquire_retry():
        n += 1
    return n


def test_retries_are_capped_at_the_ratio_of_recent_requests():
    b, _ = budget(retry_ratio=0.1, min_retries_per_second=0)
    for _ in range(100):
        b.record_request()
    assert grant_all(b) == 10
    assert (b.retries_granted, b.retries_denied) == (10, 1)
    for _ in range(10):
        b.record_request()
    assert grant_all(b) == 1  # 110 requests earn 11


def test_the_minimum_allowance_covers_a_quiet_router():
    b, _ = budget(retry_ratio=0.1, min_retries_per_second=0.3, window_s=10)
    b.record_request()  # 10% of one request is not a retry ...
    assert grant_all(b) == 3  # ... but the floor of 0.3/s over 10 s is


def test_requests_and_retries_leave_the_window_as_it_slides():
    b, clock = budget(retry_ratio=0.1, min_retries_per_second=0, window_s=10, buckets=10)
    for _ in range(100):
        b.record_request()
    clock.advance(5)
    assert grant_all(b) == 10
    clock.advance(5)  # the requests slid out; the retries 5 s later did not
    for _ in range(100):
        b.record_request()
    assert grant_all(b) == 0
    clock.advance(5)  # now those retries slid out too
    assert grant_all(b) == 10


def test_defaults_and_validation():
    b, _ = budget()
    assert (b.config.retry_ratio, b.config.min_retries_per_second, b.config.window_s) == (0.1, 0.3, 10.0)
    with pytest.raises(ConfigError):
        RetryBudgetConfig(retry_ratio=1.5)
    with pytest.raises(ConfigError):
        RetryBudgetConfig(window_s=0)
