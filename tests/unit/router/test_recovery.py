"""decide_recovery: one pure function decides retry / migrate / complete / give up; each branch."""

from __future__ import annotations

import pytest

from services.router.migration import (
    Cause,
    JourneyConfig,
    Recovery,
    RecoveryInputs,
    RequestJourney,
    decide_recovery,
)

BASE = {
    "retryable": True,
    "delivered": 0,
    "max_tokens": 8,
    "retries": 0,
    "max_retries": 2,
    "migrations": 0,
    "max_migrations": 3,
}


def decide(**changes):
    return decide_recovery(RecoveryInputs(**{**BASE, **changes}))


@pytest.mark.parametrize(
    ("changes", "action", "cause", "reason"),
    [
        ({}, Recovery.RETRY, Cause.BEFORE_FIRST_TOKEN, "before the first token"),
        ({"retryable": False}, Recovery.GIVE_UP, Cause.NOT_RETRYABLE, "not retryable"),
        # Not retryable wins even when every token is out: the client's error stands.
        ({"retryable": False, "delivered": 8}, Recovery.GIVE_UP, Cause.NOT_RETRYABLE, "not retryable"),
        ({"retries": 2}, Recovery.GIVE_UP, Cause.RETRY_LIMIT, "retry limit 2"),
        ({"another_worker": False}, Recovery.GIVE_UP, Cause.NO_OTHER_WORKER, "no other decode worker"),
        ({"retry_budget": False}, Recovery.GIVE_UP, Cause.RETRY_BUDGET, "retry budget spent"),
        # With no worker to go to, the budget is not asked (nothing would be spent).
        (
            {"another_worker": False, "retry_budget": False},
            Recovery.GIVE_UP,
            Cause.NO_OTHER_WORKER,
            "no other",
        ),
        ({"delivered": 3}, Recovery.MIGRATE, Cause.MID_STREAM, "after 3 tokens"),
        # Migrations are bounded per request, not by the retry budget.
        ({"delivered": 3, "retry_budget": False}, Recovery.MIGRATE, Cause.MID_STREAM, "after 3 tokens"),
        ({"delivered": 3, "retries": 2}, Recovery.MIGRATE, Cause.MID_STREAM, "after 3 tokens"),
        ({"delivered": 3, "migrations": 3}, Recovery.GIVE_UP, Cause.MIGRATION_LIMIT, "migration limit 3"),
        ({"delivered": 3, "another_worker": False}, Recovery.GIVE_UP, Cause.NO_OTHER_WORKER, "no other"),
        ({"delivered": 8}, Recovery.COMPLETE, Cause.ALL_DELIVERED, "every token"),
        # Complete needs no worker and no migration left.
        (
            {"delivered": 8, "another_worker": False, "migrations": 3},
            Recovery.COMPLETE,
            Cause.ALL_DELIVERED,
            "",
        ),
    ],
)
def test_each_branch(changes, action, cause, reason):
    d = decide(**changes)
    assert (d.action, d.cause) == (action, cause)
    assert reason in d.reason


def test_the_journey_feeds_its_own_counts_and_the_callers_facts():
    j = RequestJourney("r", (1, 2, 3), 4, JourneyConfig(max_retries=1))
    j.start_attempt("w1")
    assert j.fail_attempt(retry_budget=False).cause is Cause.RETRY_BUDGET
    j = RequestJourney("r", (1, 2, 3), 4, JourneyConfig(max_retries=1))
    j.start_attempt("w1")
    j.record_tokens([5])
    assert j.fail_attempt(another_worker=False).cause is Cause.NO_OTHER_WORKER
