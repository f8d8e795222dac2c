"""Workflow-aware control-plane rules (issue 21 item 1), on a fake clock."""

import pytest

from services.common.config import ConfigError
from services.router.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRejected,
    DeadlineUnreachable,
    Ticket,
    Waiter,
    WaiterState,
)
from services.router.migration import (
    Cause,
    JourneyConfig,
    Recovery,
    RecoveryInputs,
    RequestJourney,
    decide_recovery,
)
from services.router.retry_budget import RetryBudget, RetryBudgetConfig
from services.router.workflow_sched import (
    AttainedService,
    WorkflowInfo,
    WorkflowSchedConfig,
    service_level,
    shed_rank,
    sunk_cost_extra,
)
from tests.unit.router.fakes import FakeClock

CFG = WorkflowSchedConfig(window_s=60, level_base_tokens=1000, level_growth=4, max_level=3, level_delay_s=5)


def wf(wid: str = "", step: int = 0, spent: int = 0) -> WorkflowInfo:
    return WorkflowInfo(wid, step, spent)


# ---- pure rules ----------------------------------------------------------------


def test_service_level_grows_with_attained_tokens_and_is_capped():
    assert [service_level(t, CFG) for t in (0, 999, 1000, 3999, 4000, 16000, 10**9)] == [0, 0, 1, 1, 2, 3, 3]


def test_sunk_cost_extra_is_zero_for_fresh_work_and_bounded():
    cfg = WorkflowSchedConfig(sunk_unit_tokens=4000, max_sunk_extra=2)
    assert [sunk_cost_extra(t, cfg) for t in (0, 3999, 4000, 8000, 50_000, 10**9)] == [0, 0, 1, 2, 2, 2]


def test_shed_rank_prefers_low_priority_then_few_sunk_tokens_then_newest():
    assert shed_rank(-1, 10**6, 0.0) < shed_rank(0, 0, 0.0)
    assert shed_rank(0, 10, 0.0) < shed_rank(0, 5000, 0.0)
    assert shed_rank(0, 10, 5.0) < shed_rank(0, 10, 1.0)


def test_config_rejects_nonsense():
    with pytest.raises(ConfigError):
        WorkflowSchedConfig(level_growth=1.0)


def test_attained_service_counts_the_window_only_and_forgets():
    a = AttainedService(CFG)
    a.record("w", 1500, now=0.0)
    assert a.attained("w", 10.0) == 1500 and a.level("w", 10.0) == 1
    a.record("w", 3000, now=35.0)  # next half-window
    assert a.attained("w", 40.0) == 4500 and a.level("w", 40.0) == 2
    assert a.attained("w", 65.0) == 3000  # the first half-window rolled out
    assert a.attained("w", 200.0) == 0
    a.record("w", 10, 200.0)
    a.forget("w")
    assert a.attained("w", 200.0) == 0 and len(a) == 0
    a.record("", 100, 0.0)  # requests without a workflow are not tracked
    assert len(a) == 0


def test_attained_service_tracks_a_bounded_number_of_workflows():
    a = AttainedService(WorkflowSchedConfig(max_workflows=2))
    for i in range(5):
        a.record(f"w{i}", 10, 0.0)
    assert len(a) == 2 and a.attained("w4", 0.0) == 10 and a.attained("w0", 0.0) == 0


# ---- admission: queue order ------------------------------------------------------


def controller(**cfg):
    clock = FakeClock()
    cfg.setdefault("workflow", CFG)
    return AdmissionController(AdmissionConfig(**cfg), clock), clock


def drain_order(ctl: AdmissionController, holder: Ticket) -> list[int]:
    order = []
    ticket = holder
    while True:
        granted = ctl.release(ticket)
        if not granted:
            return order
        order.append(granted[0].id)
        ticket = granted[0].ticket


def test_edf_within_a_priority_class_and_priority_still_first():
    ctl, clock = controller(max_inflight=1)
    holder = ctl.try_admit("t")
    late = ctl.try_admit("t", deadline=clock() + 50)
    soon = ctl.try_admit("t", deadline=clock() + 20)
    nodl = ctl.try_admit("t")  # due at arrival + 30 s (default horizon)
    high = ctl.try_admit("t", priority=1, deadline=clock() + 100)
    assert drain_order(ctl, holder) == [high.id, soon.id, nodl.id, late.id]


def test_edf_off_keeps_arrival_order():
    ctl, clock = controller(max_inflight=1, edf=False)
    holder = ctl.try_admit("t")
    late = ctl.try_admit("t", deadline=clock() + 50)
    soon = ctl.try_admit("t", deadline=clock() + 20)
    assert drain_order(ctl, holder) == [late.id, soon.id]


def test_a_workflow_with_much_attained_service_waits_behind_fresh_ones_but_boundedly():
    ctl, clock = controller(max_inflight=1)
    t = ctl.try_admit("t", workflow=wf("agent"))
    clock.advance(1)
    holder = ctl.try_admit("t")  # queued, granted below
    ctl.release(t, served_tokens=20_000)  # the agent got a lot: level 3 = 15 s later due
    assert ctl.attained.level("agent", clock()) == 3
    agent = ctl.try_admit("t", workflow=wf("agent", step=7, spent=20_000))
    clock.advance(10)
    chat = ctl.try_admit("t", workflow=wf("chat"))  # arrived 10 s later, still ahead
    clock.advance(10)
    chat2 = ctl.try_admit("t", workflow=wf("chat2"))  # 20 s later: past the 15 s deferral
    assert drain_order(ctl, holder.ticket) == [chat.id, agent.id, chat2.id]


def test_attained_service_off_ignores_the_history():
    ctl, _ = controller(max_inflight=1, attained_service=False)
    t = ctl.try_admit("t", workflow=wf("agent"))
    ctl.release(t, served_tokens=20_000)
    holder = ctl.try_admit("t")
    agent = ctl.try_admit("t", workflow=wf("agent"))
    chat = ctl.try_admit("t", workflow=wf("chat"))
    assert drain_order(ctl, holder) == [agent.id, chat.id]


# ---- admission: shedding by sunk cost -------------------------------------------


def test_full_queue_sheds_the_waiter_with_the_fewest_sunk_tokens():
    ctl, _ = controller(max_inflight=1, queue_limit_per_priority=2)
    ctl.try_admit("t")
    cheap = ctl.try_admit("t", workflow=wf("a", 1, 100))
    dear = ctl.try_admit("t", workflow=wf("b", 5, 9000))
    late = ctl.try_admit("t", workflow=wf("c", 9, 50_000))
    assert isinstance(late, Waiter)
    [shed] = ctl.expire()
    assert shed is cheap and cheap.state is WaiterState.EXPIRED
    assert cheap.rejection.reason == "shed_for_sunk_cost"
    assert dear.state is WaiterState.WAITING and ctl.queued == 2
    assert ctl.stats().rejected == {"shed_for_sunk_cost": 1}
    assert ctl.open_requests("t") == 3  # the running one + two waiting


def test_fresh_work_is_shed_itself_when_the_queue_is_full():
    ctl, _ = controller(max_inflight=1, queue_limit_per_priority=1)
    ctl.try_admit("t")
    ctl.try_admit("t", workflow=wf("a", 1, 100))
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t", workflow=wf("fresh"))
    assert e.value.reason == "queue_full" and ctl.expire() == []


def test_shedding_stays_within_the_priority_class():
    ctl, _ = controller(max_inflight=1, queue_limit_per_priority=1)
    ctl.try_admit("t")
    low = ctl.try_admit("t", priority=-1, workflow=wf("a", 0, 0))
    ctl.try_admit("t", priority=1, workflow=wf("b", 1, 500))
    with pytest.raises(AdmissionRejected):  # priority 1 is full, its waiter has more sunk cost
        ctl.try_admit("t", priority=1, workflow=wf("c", 1, 200))
    assert low.state is WaiterState.WAITING


def test_sunk_cost_shedding_off_rejects_the_newcomer():
    ctl, _ = controller(max_inflight=1, queue_limit_per_priority=1, sunk_cost_shedding=False)
    ctl.try_admit("t")
    ctl.try_admit("t", workflow=wf("a", 1, 0))
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t", workflow=wf("c", 9, 50_000))
    assert e.value.reason == "queue_full"


def test_early_rejection_when_the_latency_budget_cannot_be_met():
    ctl, clock = controller(max_inflight=1, initial_hold_s=10.0)
    ctl.try_admit("t")
    with pytest.raises(DeadlineUnreachable):
        ctl.try_admit("t", deadline=clock() + 5, workflow=wf("a", 3, 9000))
    assert isinstance(ctl.try_admit("t", deadline=clock() + 15), Waiter)


# ---- retry budget and recovery scale with sunk cost ----------------------------


def test_retry_budget_reserve_grows_with_sunk_cost_and_is_bounded():
    clock = FakeClock()
    b = RetryBudget(
        RetryBudgetConfig(retry_ratio=0, min_retries_per_second=0, sunk_reserve=2, sunk_full_tokens=10_000),
        clock,
    )
    assert not b.can_retry() and not b.can_retry(sunk_tokens=4000)  # 0.8 of a retry
    assert b.try_acquire_retry(sunk_tokens=10**9)
    assert b.try_acquire_retry(sunk_tokens=10**9)
    assert not b.try_acquire_retry(sunk_tokens=10**9)  # reserve of 2 spent: bounded
    clock.advance(11)
    assert b.can_retry(sunk_tokens=5000)


def inputs(**kw):
    base = dict(
        retryable=True, delivered=0, max_tokens=10, retries=2, max_retries=2, migrations=0, max_migrations=1
    )
    base.update(kw)
    return RecoveryInputs(**base)


def test_decide_recovery_allows_more_retries_and_migrations_with_sunk_cost_bounded():
    assert decide_recovery(inputs()).cause is Cause.RETRY_LIMIT
    assert decide_recovery(inputs(sunk_tokens=8000)).action is Recovery.RETRY
    assert decide_recovery(inputs(retries=4, sunk_tokens=10**9)).cause is Cause.RETRY_LIMIT
    mid = dict(delivered=3, migrations=1)
    assert decide_recovery(inputs(**mid)).cause is Cause.MIGRATION_LIMIT
    assert decide_recovery(inputs(**mid, sunk_tokens=4000)).action is Recovery.MIGRATE
    assert (
        decide_recovery(inputs(delivered=3, migrations=3, sunk_tokens=10**9)).cause is Cause.MIGRATION_LIMIT
    )


def test_journey_with_sunk_cost_may_start_the_extra_retry():
    j = RequestJourney("r", [1, 2, 3], 5, JourneyConfig(max_retries=0), sunk_tokens=4000)
    j.start_attempt("w1")
    assert j.fail_attempt(another_worker=True).action is Recovery.RETRY
    j.start_attempt("w2")  # the sunk-cost retry
    assert j.fail_attempt(another_worker=True).cause is Cause.RETRY_LIMIT
    fresh = RequestJourney("r", [1, 2, 3], 5, JourneyConfig(max_retries=0))
    fresh.start_attempt("w1")
    assert fresh.fail_attempt(another_worker=True).cause is Cause.RETRY_LIMIT
