import pytest

from services.common.config import ConfigError
from services.router.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRejected,
    DeadlineUnreachable,
    InvalidAdmission,
    TenantLimits,
    Ticket,
    Waiter,
    WaiterState,
)
from tests.unit.router.fakes import FakeClock


def controller(clock=None, **cfg) -> tuple[AdmissionController, FakeClock]:
    clock = clock or FakeClock()
    return AdmissionController(AdmissionConfig(**cfg), clock), clock


def fill(ctl: AdmissionController, n: int) -> list[Ticket]:
    tickets = [ctl.try_admit("fill") for _ in range(n)]
    assert all(isinstance(t, Ticket) for t in tickets)
    return tickets


# ---- tenant token buckets ------------------------------------------------------


def test_request_rate_limit_rejects_with_the_refill_time_and_refills():
    ctl, clock = controller(default_limits=TenantLimits(requests_per_s=2, request_burst=2))
    assert isinstance(ctl.try_admit("t"), Ticket)
    assert isinstance(ctl.try_admit("t"), Ticket)
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t")
    assert e.value.reason == "rate_limited"
    assert e.value.retry_after_s == pytest.approx(0.5)
    clock.advance(0.5)
    assert isinstance(ctl.try_admit("t"), Ticket)


def test_token_rate_limit_charges_prompt_plus_max_tokens():
    ctl, clock = controller(default_limits=TenantLimits(tokens_per_s=100, token_burst=1000))
    ctl.try_admit("t", cost_tokens=800)
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t", cost_tokens=300)
    assert e.value.retry_after_s == pytest.approx(1.0)  # 100 more tokens at 100/s
    clock.advance(1.0)
    assert isinstance(ctl.try_admit("t", cost_tokens=300), Ticket)


def test_a_request_larger_than_the_burst_runs_once_the_bucket_is_full_and_pays_it_back():
    ctl, clock = controller(default_limits=TenantLimits(tokens_per_s=100, token_burst=1000))
    assert isinstance(ctl.try_admit("t", cost_tokens=2500), Ticket)
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t", cost_tokens=100)
    assert e.value.retry_after_s == pytest.approx(16.0)  # from -1500 up to 100 at 100/s
    clock.advance(16.0)
    assert isinstance(ctl.try_admit("t", cost_tokens=100), Ticket)


def test_tenants_have_separate_buckets_and_overrides():
    ctl, _ = controller(
        default_limits=TenantLimits(requests_per_s=1, request_burst=1),
        tenant_limits={"gold": TenantLimits(requests_per_s=100, request_burst=5)},
    )
    ctl.try_admit("a")
    with pytest.raises(AdmissionRejected):
        ctl.try_admit("a")
    assert isinstance(ctl.try_admit("b"), Ticket)
    assert all(isinstance(ctl.try_admit("gold"), Ticket) for _ in range(5))


def test_tenant_buckets_are_bounded():
    ctl, clock = controller(max_tenants=3, default_limits=TenantLimits(requests_per_s=1, request_burst=1))
    for i in range(10):
        ctl.try_admit(f"t{i}")
    assert len(ctl._tenants) <= 3
    clock.advance(5)  # every bucket is full again: idle tenants are dropped as others arrive
    ctl.try_admit("new")
    assert "t9" not in ctl._tenants


# ---- concurrency and the priority queue ---------------------------------------------------


def test_over_max_inflight_a_request_queues_and_release_hands_it_the_slot():
    ctl, _ = controller(max_inflight=2)
    t1, _ = fill(ctl, 2)
    waiter = ctl.try_admit("t")
    assert isinstance(waiter, Waiter) and waiter.state is WaiterState.WAITING
    assert (ctl.inflight, ctl.queued) == (2, 1)
    assert ctl.release(t1) == [waiter]
    assert waiter.state is WaiterState.GRANTED and isinstance(waiter.ticket, Ticket)
    assert (ctl.inflight, ctl.queued) == (2, 0)


def test_release_is_idempotent():
    ctl, _ = controller(max_inflight=1)
    (t1,) = fill(ctl, 1)
    ctl.try_admit("t")
    ctl.try_admit("t")
    assert len(ctl.release(t1)) == 1
    assert ctl.release(t1) == []
    assert (ctl.inflight, ctl.queued) == (1, 1)


def test_waiters_are_served_by_priority_then_arrival():
    ctl, _ = controller(max_inflight=1)
    (ticket,) = fill(ctl, 1)
    a = ctl.try_admit("t", priority=0)
    b = ctl.try_admit("t", priority=5)
    c = ctl.try_admit("t", priority=0)
    d = ctl.try_admit("t", priority=5)
    e = ctl.try_admit("t", priority=-3)
    order = []
    for _ in range(5):
        (w,) = ctl.release(ticket)
        order.append(w)
        ticket = w.ticket
    assert order == [b, d, a, c, e]


def test_each_priority_has_its_own_queue_limit():
    ctl, _ = controller(max_inflight=1, queue_limit_per_priority=2)
    fill(ctl, 1)
    ctl.try_admit("t", priority=0)
    ctl.try_admit("t", priority=0)
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t", priority=0)
    assert e.value.reason == "queue_full"
    assert isinstance(ctl.try_admit("t", priority=1), Waiter)
    assert ctl.queued == 3


def test_queue_full_retry_after_is_the_queue_wait_at_its_own_priority():
    # 2 slots, requests held 4 s on average: a slot frees every 2 s. (Issue 18: the hint
    # counted only higher priorities, 2.0 and 4.0 here, while the queue took longer.)
    ctl, _ = controller(max_inflight=2, queue_limit_per_priority=1, initial_hold_s=4.0)
    fill(ctl, 2)
    ctl.try_admit("t", priority=0)
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t", priority=0)
    assert e.value.retry_after_s == pytest.approx(4.0)  # the waiter ahead, then its own slot
    ctl.try_admit("t", priority=3)
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t", priority=0)
    assert e.value.retry_after_s == pytest.approx(6.0)  # and the higher-priority one first
    assert e.value.retry_after_s == pytest.approx(ctl.estimated_wait_s(0))


def test_queue_full_retry_after_follows_the_measured_service_time_under_a_burst():
    # The overload of issue 18: 64 slots, 128 waiters per priority, requests that
    # take 2 s. Queued requests wait ~4 s; the hint said 50 ms (the floor).
    ctl, clock = controller(max_inflight=64, queue_limit_per_priority=128, initial_hold_s=0.1)
    tickets = fill(ctl, 64)
    clock.advance(2.0)
    for t in tickets:  # 64 holds measured at 2 s: the mean (an EWMA) is at 2 s
        ctl.release(t)
    fill(ctl, 64)
    assert ctl._mean_hold_s == pytest.approx(2.0, rel=0.01)
    for _ in range(128):
        assert isinstance(ctl.try_admit("t"), Waiter)
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t")
    assert e.value.reason == "queue_full"
    assert e.value.retry_after_s == pytest.approx(129 * 2.0 / 64, rel=0.01)  # ~4 s, not 0.05


class CountingQueue(list):
    """A heap that counts walks over it (the shed path must never make one)."""

    walks = 0

    def __iter__(self):
        CountingQueue.walks += 1
        return super().__iter__()


def test_the_shed_path_under_a_storm_never_scans_the_queue():
    ctl, _ = controller(max_inflight=4, queue_limit_per_priority=40)
    fill(ctl, 4)
    for _ in range(40):
        ctl.try_admit("t")
    ctl._queue = CountingQueue(ctl._queue)
    ctl._expiry = CountingQueue(ctl._expiry)
    CountingQueue.walks = 0
    for _ in range(10 * 44):  # a 10x storm against the whole capacity
        with pytest.raises(AdmissionRejected) as e:
            ctl.try_admit("t")
        assert e.value.reason == "queue_full"
    assert CountingQueue.walks == 0
    assert ctl.queued == 40 and ctl.stats().rejected == {"queue_full": 440}


def test_wait_estimate_learns_the_mean_hold_time():
    ctl, clock = controller(max_inflight=1, initial_hold_s=1.0)
    (t,) = fill(ctl, 1)
    before = ctl.estimated_wait_s(0)
    clock.advance(11.0)
    ctl.release(t)
    fill(ctl, 1)
    assert before == pytest.approx(1.0)
    assert ctl.estimated_wait_s(0) == pytest.approx(1.0 + 0.2 * (11.0 - 1.0))


# ---- deadlines and timeouts -----------------------------------------------------


def test_a_passed_deadline_is_rejected_immediately():
    ctl, clock = controller()
    with pytest.raises(DeadlineUnreachable):
        ctl.try_admit("t", deadline=clock() - 0.001)
    assert ctl.inflight == 0


def test_a_deadline_before_the_estimated_queue_wait_is_rejected_not_queued():
    ctl, clock = controller(max_inflight=1, initial_hold_s=5.0)
    fill(ctl, 1)
    with pytest.raises(DeadlineUnreachable) as e:
        ctl.try_admit("t", deadline=clock() + 4.0)  # first in line waits ~5 s
    assert isinstance(e.value, AdmissionRejected)  # the edge may catch both together
    assert ctl.queued == 0
    assert isinstance(ctl.try_admit("t", deadline=clock() + 6.0), Waiter)


def test_a_deadline_before_the_quota_refills_is_deadline_unreachable():
    ctl, clock = controller(default_limits=TenantLimits(requests_per_s=0.1, request_burst=1))
    ctl.try_admit("t")
    with pytest.raises(DeadlineUnreachable):
        ctl.try_admit("t", deadline=clock() + 5.0)  # next token in 10 s
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("t", deadline=clock() + 20.0)
    assert not isinstance(e.value, DeadlineUnreachable)
    assert e.value.reason == "rate_limited"


def test_queue_timeout_expires_waiters_and_refunds_their_quota():
    ctl, clock = controller(
        max_inflight=1,
        queue_timeout_s=3.0,
        default_limits=TenantLimits(tokens_per_s=1, token_burst=100),
    )
    fill(ctl, 1)
    waiter = ctl.try_admit("t", cost_tokens=100)
    assert ctl.next_expiry() == pytest.approx(clock() + 3.0)
    clock.advance(2.9)
    assert ctl.expire() == []
    clock.advance(0.1)
    assert ctl.expire() == [waiter]
    assert waiter.state is WaiterState.EXPIRED
    assert waiter.rejection.reason == "queue_timeout" and waiter.rejection.retry_after_s > 0
    assert ctl.queued == 0 and ctl.next_expiry() is None
    # The quota it took was given back: another 100-token request is admitted at once.
    assert isinstance(ctl.try_admit("t", cost_tokens=100), Waiter)


def test_a_waiter_whose_deadline_passes_in_the_queue_expires_as_deadline_unreachable():
    ctl, clock = controller(max_inflight=1, queue_timeout_s=30.0, initial_hold_s=0.1)
    fill(ctl, 1)
    waiter = ctl.try_admit("t", deadline=clock() + 2.0)
    clock.advance(2.0)
    assert ctl.expire() == [waiter]
    assert isinstance(waiter.rejection, DeadlineUnreachable)


def test_release_does_not_grant_a_waiter_that_already_expired():
    ctl, clock = controller(max_inflight=1, queue_timeout_s=1.0)
    (t,) = fill(ctl, 1)
    waiter = ctl.try_admit("t")
    clock.advance(1.5)
    assert ctl.release(t) == []  # the slot stays free ...
    assert ctl.expire() == [waiter]  # ... and the waiter is reported expired
    assert ctl.inflight == 0


def test_a_cancelled_waiter_is_skipped():
    ctl, _ = controller(max_inflight=1)
    (t,) = fill(ctl, 1)
    gone = ctl.try_admit("t")
    stays = ctl.try_admit("t")
    assert ctl.cancel(gone) is True
    assert ctl.cancel(gone) is False
    assert ctl.release(t) == [stays]
    assert gone.state is WaiterState.CANCELLED


def test_dead_queue_entries_are_compacted():
    ctl, _ = controller(max_inflight=1, queue_limit_per_priority=10_000)
    fill(ctl, 1)
    for _ in range(1000):
        ctl.cancel(ctl.try_admit("t"))
    assert len(ctl._queue) < 200 and len(ctl._expiry) < 200


# ---- validation and stats ------------------------------------------------------


def test_priority_out_of_range_is_invalid():
    ctl, _ = controller()
    with pytest.raises(InvalidAdmission):
        ctl.try_admit("t", priority=11)
    with pytest.raises(ConfigError):
        AdmissionConfig(max_inflight=0)
    with pytest.raises(ConfigError):
        TenantLimits(requests_per_s=0)


def test_stats_count_admissions_and_rejections_by_reason():
    ctl, clock = controller(max_inflight=1, queue_limit_per_priority=1)
    fill(ctl, 1)
    ctl.try_admit("t")
    with pytest.raises(AdmissionRejected):
        ctl.try_admit("t")
    with pytest.raises(DeadlineUnreachable):
        ctl.try_admit("t", deadline=clock())
    s = ctl.stats()
    assert (s.inflight, s.queued, s.admitted, s.queued_total) == (1, 1, 1, 1)
    assert s.rejected == {"queue_full": 1, "deadline_unreachable": 1}


# ---- slots reserved for the higher priorities ------------------------------------------


def test_low_priority_work_cannot_take_the_reserved_slots_and_waits_for_a_free_one():
    ctl, _ = controller(max_inflight=4, reserved_inflight=2, reserve_priority=0)
    low = [ctl.try_admit("t", priority=-1) for _ in range(3)]
    assert [isinstance(x, Ticket) for x in low] == [True, True, False]  # 2 = 4 - 2 reserved
    assert ctl.estimated_wait_s(-1) > 0 and ctl.estimated_wait_s(0) == 0.0
    hi = [ctl.try_admit("t", priority=0) for _ in range(2)]
    assert all(isinstance(x, Ticket) for x in hi)  # the reserve is theirs
    assert ctl.try_admit("t", priority=1).state is WaiterState.WAITING  # max_inflight still holds
    waiting_low = low[2]
    (top,) = ctl.release(hi[0])  # the priority-1 waiter goes first
    assert top.priority == 1 and waiting_low.state is WaiterState.WAITING
    # 3, then 2 in flight: not under the low cap of 2 yet, the low waiter still waits
    assert ctl.release(hi[1]) == [] and ctl.release(low[0]) == []
    assert waiting_low.state is WaiterState.WAITING
    assert ctl.release(top.ticket) == [waiting_low] and waiting_low.state is WaiterState.GRANTED


def test_without_a_reserve_low_priority_work_takes_every_slot():
    ctl, _ = controller(max_inflight=3)
    assert all(isinstance(ctl.try_admit("t", priority=-1), Ticket) for _ in range(3))


def test_the_reserve_must_leave_a_slot():
    with pytest.raises(ConfigError):
        AdmissionConfig(max_inflight=4, reserved_inflight=4)
    with pytest.raises(ConfigError):
        AdmissionConfig(max_inflight=4, reserved_inflight=-1)
