import pytest

from services.router.cost import RequestOutcome
from services.router.migration import (
    AttemptKind,
    AttemptOutcome,
    JourneyConfig,
    JourneyError,
    Recovery,
    RequestJourney,
)

PROMPT = tuple(range(100, 110))  # 10 tokens


def journey(max_tokens=8, **cfg) -> RequestJourney:
    return RequestJourney("r1", PROMPT, max_tokens, JourneyConfig(**cfg))


def test_the_first_attempt_sends_the_prompt_and_the_whole_budget():
    j = journey()
    plan = j.next_attempt()
    assert plan.kind is AttemptKind.FIRST and plan.index == 0
    assert plan.prompt_token_ids == PROMPT and plan.resume_token_ids == ()
    assert (plan.max_tokens, plan.max_tokens_remaining) == (8, 8)
    assert plan.exclude_workers == frozenset()


def test_a_failure_before_the_first_token_is_a_retry_of_the_same_request():
    j = journey()
    j.start_attempt("w1")
    decision = j.fail_attempt()
    assert decision.action is Recovery.RETRY
    plan = j.next_attempt()
    assert plan.kind is AttemptKind.RETRY
    assert plan.resume_token_ids == () and plan.max_tokens_remaining == 8
    assert plan.exclude_workers == {"w1"}
    j.start_attempt("w2")
    assert j.retries == 1 and j.migrations == 0


def test_a_failure_after_tokens_migrates_with_the_delivered_tokens_as_resume_tokens():
    j = journey(max_tokens=8)
    j.start_attempt("w1")
    j.record_tokens([1, 2])
    j.record_tokens([3])
    decision = j.fail_attempt()
    assert decision.action is Recovery.MIGRATE
    plan = j.next_attempt()
    assert plan.kind is AttemptKind.MIGRATION
    assert plan.prompt_token_ids == PROMPT
    assert plan.resume_token_ids == (1, 2, 3)
    assert plan.max_tokens == 8  # the proto's max_tokens counts resume tokens ...
    assert plan.max_tokens_remaining == 5  # ... 5 are left to generate
    attempt = j.start_attempt("w2")
    assert (attempt.resume_tokens, attempt.input_tokens) == (3, 13)
    j.record_tokens([4, 5, 6, 7, 8])
    cost = j.succeed()
    assert j.delivered_token_ids == (1, 2, 3, 4, 5, 6, 7, 8)  # one stream, no gap, no duplicate
    assert (cost.migrations, cost.retries, cost.completion_tokens) == (1, 0, 8)


def test_retries_are_limited_per_request():
    j = journey(max_retries=1)
    j.start_attempt("w1")
    assert j.fail_attempt().action is Recovery.RETRY
    j.start_attempt("w2")
    decision = j.fail_attempt()
    assert decision.action is Recovery.GIVE_UP and "retry limit" in decision.reason
    with pytest.raises(JourneyError):
        j.start_attempt("w3")
    assert j.give_up().outcome is RequestOutcome.FAILED


def test_migrations_are_limited_per_request():
    j = journey(max_tokens=10, max_migrations=2)
    for w in ("w1", "w2", "w3"):
        j.start_attempt(w)
        j.record_tokens([7])
        decision = j.fail_attempt()
    assert decision.action is Recovery.GIVE_UP and "migration limit" in decision.reason
    assert j.migrations == 2
    with pytest.raises(JourneyError):
        j.start_attempt("w4")


def test_a_non_retryable_error_gives_up_at_once():
    j = journey()
    j.start_attempt("w1")
    assert j.fail_attempt(retryable=False).action is Recovery.GIVE_UP


def test_a_failure_after_the_last_token_completes_the_request():
    j = journey(max_tokens=2)
    j.start_attempt("w1")
    j.record_tokens([1, 2])
    assert j.fail_attempt().action is Recovery.COMPLETE
    assert j.complete().outcome is RequestOutcome.SUCCEEDED


def test_a_worker_sending_more_than_max_tokens_is_an_error():
    j = journey(max_tokens=2)
    j.start_attempt("w1")
    with pytest.raises(JourneyError):
        j.record_tokens([1, 2, 3])


def test_the_journey_refuses_out_of_order_calls():
    j = journey()
    with pytest.raises(JourneyError):
        j.record_tokens([1])
    j.start_attempt("w1")
    with pytest.raises(JourneyError):
        j.start_attempt("w2")
    j.succeed()
    with pytest.raises(JourneyError):
        j.succeed()
    with pytest.raises(JourneyError):
        j.next_attempt()
    with pytest.raises(ValueError):
        RequestJourney("r", [], 4)


def test_computed_tokens_use_the_reported_count_or_an_estimate():
    j = journey(max_tokens=8)
    a1 = j.start_attempt("w1", cached_tokens=4)
    j.record_tokens([1, 2, 3])
    assert j.computed_tokens == (10 - 4) + 3  # running attempt, estimated
    j.fail_attempt()
    assert (a1.outcome, a1.computed_tokens) == (AttemptOutcome.FAILED, 9)
    j.start_attempt("w2")
    j.record_tokens([4, 5])
    j.succeed(computed_tokens=20)  # as its worker reported
    assert j.computed_tokens == 29


def test_cost_of_a_migrated_request_counts_the_discarded_attempt_as_wasted():
    j = journey(max_tokens=8)
    j.start_attempt("w1")  # prompt 10, no cache
    j.record_tokens([1, 2, 3])
    j.fail_attempt()  # estimate: 10 prefill + 3 decode = 13
    j.start_attempt("w2")  # recomputes prompt + 3 resume tokens
    j.record_tokens([4, 5, 6, 7, 8])
    cost = j.succeed()  # estimate: 13 + 5 = 18
    assert cost.outcome is RequestOutcome.SUCCEEDED
    assert (cost.computed_tokens, cost.wasted_tokens) == (31, 13)
    assert (cost.prompt_tokens, cost.completion_tokens) == (10, 8)


def test_cost_of_a_retried_request_counts_the_failed_prefill_as_wasted():
    j = journey(max_tokens=2)
    j.start_attempt("w1")
    j.fail_attempt()  # assumed to have prefilled: 10
    j.start_attempt("w2", cached_tokens=8)
    j.record_tokens([1, 2])
    cost = j.succeed()
    assert (cost.computed_tokens, cost.wasted_tokens, cost.retries) == (10 + 2 + 2, 10, 1)


def test_a_cancelled_request_wastes_everything_it_computed():
    j = journey()
    j.start_attempt("w1")
    j.record_tokens([1])
    cost = j.cancel(computed_tokens=11)
    assert cost.outcome is RequestOutcome.CANCELLED
    assert cost.computed_tokens == cost.wasted_tokens == 11
    # Cancelled while still queued: nothing computed.
    assert journey().cancel().computed_tokens == 0
