"""Per-tenant open-request cap in admission control (running + queued)."""

from __future__ import annotations

import pytest

from services.router.admission import AdmissionConfig, AdmissionController, AdmissionRejected, Ticket, Waiter
from services.router.tenant_quota import TenantLimits


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_tenant_at_its_cap_is_shed_and_others_are_not():
    ctl = AdmissionController(AdmissionConfig(tenant_max_inflight=2), Clock())
    tickets = [ctl.try_admit("a") for _ in range(2)]
    with pytest.raises(AdmissionRejected) as e:
        ctl.try_admit("a")
    assert e.value.reason == "tenant_inflight" and "2 requests open" in str(e.value)
    assert e.value.retry_after_s is not None
    assert isinstance(ctl.try_admit("b"), Ticket)
    assert isinstance(tickets[0], Ticket)
    ctl.release(tickets[0])
    ctl.release(tickets[0])  # idempotent: counted once
    assert ctl.open_requests("a") == 1
    assert isinstance(ctl.try_admit("a"), Ticket)
    assert ctl.stats().rejected["tenant_inflight"] == 1


def test_queued_requests_count_and_leaving_the_queue_frees_the_place():
    ctl = AdmissionController(AdmissionConfig(max_inflight=1, tenant_max_inflight=2), Clock())
    running = ctl.try_admit("a")
    queued = ctl.try_admit("a")
    assert isinstance(running, Ticket) and isinstance(queued, Waiter)
    with pytest.raises(AdmissionRejected, match="tenant 'a'"):
        ctl.try_admit("a")
    assert ctl.cancel(queued)
    assert ctl.open_requests("a") == 1
    again = ctl.try_admit("a")
    assert isinstance(again, Waiter)
    (granted,) = ctl.release(running)  # the waiter now runs: still open
    assert granted is again and ctl.open_requests("a") == 1


def test_expired_waiters_give_their_place_back():
    clock = Clock()
    ctl = AdmissionController(
        AdmissionConfig(max_inflight=1, queue_timeout_s=1, tenant_max_inflight=2), clock
    )
    ctl.try_admit("a")
    ctl.try_admit("a")
    clock.t = 5
    assert len(ctl.expire()) == 1
    assert ctl.open_requests("a") == 1


def test_a_quota_from_limits_for_wins_and_a_changed_quota_applies():
    quotas = {"gold": TenantLimits(max_inflight=1)}
    ctl = AdmissionController(AdmissionConfig(tenant_max_inflight=5), Clock(), limits_for=quotas.get)
    ctl.try_admit("gold")
    with pytest.raises(AdmissionRejected, match="1 requests open"):
        ctl.try_admit("gold")
    quotas["gold"] = TenantLimits(max_inflight=3)  # e.g. the keys file changed
    assert isinstance(ctl.try_admit("gold"), Ticket)
    quotas["gold"] = TenantLimits(requests_per_s=1, request_burst=1)
    ctl.try_admit("gold")  # fresh buckets with the new rate: one request, then shed
    with pytest.raises(AdmissionRejected, match="over its quota"):
        ctl.try_admit("gold")


def test_tenant_limits_refuse_a_zero_cap():
    with pytest.raises(ValueError, match="max_inflight"):
        TenantLimits(max_inflight=0)
