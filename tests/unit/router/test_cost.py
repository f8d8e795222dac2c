import pytest

from services.router.cost import CostLedger, RequestCost, RequestOutcome
from services.router.migration import RequestJourney

OK, FAILED, CANCELLED = RequestOutcome.SUCCEEDED, RequestOutcome.FAILED, RequestOutcome.CANCELLED


def test_tokens_per_successful_request_and_wasted_tokens():
    ledger = CostLedger()
    ledger.record(RequestCost(OK, computed_tokens=100, wasted_tokens=0))
    ledger.record(RequestCost(OK, computed_tokens=250, wasted_tokens=120, migrations=1))
    ledger.record(RequestCost(FAILED, computed_tokens=50, wasted_tokens=50, retries=2))
    ledger.record(RequestCost(CANCELLED, computed_tokens=30, wasted_tokens=30))
    ledger.record_shed()
    s = ledger.stats()
    assert (s.requests_succeeded, s.requests_failed, s.requests_cancelled, s.requests_shed) == (2, 1, 1, 1)
    assert s.requests_finished == 4
    assert s.tokens_per_successful_request == pytest.approx((100 + 250) / 2)
    assert s.all_tokens_per_successful_request == pytest.approx(430 / 2)
    assert (s.computed_tokens, s.wasted_tokens) == (430, 200)
    assert (s.retries, s.migrations) == (2, 1)


def test_no_success_yet_means_zero_not_a_division_error():
    ledger = CostLedger()
    ledger.record(RequestCost(FAILED, 10, 10))
    assert ledger.stats().tokens_per_successful_request == 0.0


def test_wasted_cannot_exceed_computed():
    with pytest.raises(ValueError):
        RequestCost(OK, computed_tokens=5, wasted_tokens=6)


def test_journeys_feed_the_ledger():
    ledger = CostLedger()
    clean = RequestJourney("a", range(10), 4)
    clean.start_attempt("w1")
    clean.record_tokens([1, 2, 3, 4])
    ledger.record(clean.succeed())  # 14 computed
    moved = RequestJourney("b", range(10), 4)
    moved.start_attempt("w1")
    moved.record_tokens([1, 2])
    moved.fail_attempt()  # 12, wasted
    moved.start_attempt("w2")
    moved.record_tokens([3, 4])
    ledger.record(moved.succeed())  # 12 + 2 = 14
    s = ledger.stats()
    assert s.tokens_per_successful_request == pytest.approx((14 + 26) / 2)
    assert s.wasted_tokens == 12
    assert s.migrations == 1
