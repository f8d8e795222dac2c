"""WorkflowLedger: cost per successful workflow, completion rate, waste by cause (issue 21 item 4)."""

import pytest

from services.router.cost import RequestCost, RequestOutcome, WasteCause, WorkflowLedger

OK, FAIL = RequestOutcome.SUCCEEDED, RequestOutcome.FAILED


def c(outcome, computed, wasted=0):
    return RequestCost(outcome=outcome, computed_tokens=computed, wasted_tokens=wasted)


def test_a_completed_workflow_costs_all_its_steps_attempts_included():
    led = WorkflowLedger()
    led.record_step("t", "w", c(OK, 100), final=False, now=0)
    led.record_step("t", "w", c(OK, 300, wasted=50), final=False, now=1)  # one retry inside
    assert led.stats().open == 1 and led.stats().completed == 0
    led.record_step("t", "w", c(OK, 200), final=True, now=2)
    s = led.stats("t")
    assert (s.completed, s.failed, s.open) == (1, 0, 0)
    assert s.cost_per_successful_workflow == 600 and s.completion_rate == 1.0
    assert s.wasted[WasteCause.RECOMPUTE] == 50 and s.wasted_tokens == 50


def test_a_failed_step_wastes_the_earlier_steps_too():
    led = WorkflowLedger()
    led.record_step("t", "w", c(OK, 100), final=False, now=0)
    led.record_step("t", "w", c(OK, 200, wasted=20), final=False, now=0)
    led.record_step("t", "w", c(FAIL, 70, wasted=70), final=False, now=0)
    s = led.stats()
    assert (s.completed, s.failed) == (0, 1) and s.completion_rate == 0.0
    assert s.wasted[WasteCause.FAILED_STEP] == 70
    assert s.wasted[WasteCause.EARLIER_STEPS] == 280  # 100 + 200 - the 20 already counted as recompute
    assert s.wasted[WasteCause.RECOMPUTE] == 20
    assert s.wasted_tokens == s.computed_tokens == 370
    assert s.cost_per_successful_workflow == 0


def test_shed_and_abandoned_workflows_and_per_tenant_split():
    led = WorkflowLedger(abandon_after_s=10)
    led.record_step("a", "w1", c(OK, 100), final=False, now=0)
    led.record_shed("a", "w1", now=1)
    led.record_step("b", "w2", c(OK, 40), final=False, now=0)
    led.record_step("b", "w3", c(OK, 10), final=True, now=0)
    assert led.expire(now=5) == 0
    assert led.expire(now=10) == 1
    a, b = led.stats("a"), led.stats("b")
    assert (a.failed, a.wasted[WasteCause.SHED]) == (1, 100)
    assert (b.completed, b.failed, b.wasted[WasteCause.ABANDONED]) == (1, 1, 40)
    assert b.completion_rate == pytest.approx(0.5) and b.wasted_per_successful_workflow == 40
    assert led.tenants() == ["a", "b"] and led.stats().failed == 2
    assert led.stats("nobody").completed == 0


def test_open_accounts_are_bounded():
    led = WorkflowLedger(max_open=2)
    for i in range(4):
        led.record_step("t", f"w{i}", c(OK, 10), final=False, now=i)
    s = led.stats()
    assert s.open == 2 and s.failed == 2 and s.wasted[WasteCause.ABANDONED] == 20
