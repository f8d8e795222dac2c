"""LeaseBudget, the prefill worker's bound on held KV (issue 13, item 3): plain core, fake clock."""

import pytest

from kvtransfer.leases import LeaseManager
from services.common.errors import ResourceExhausted
from services.prefill.config import PrefillConfig
from services.prefill.lease_budget import LeaseBudget

CONFIG = PrefillConfig(
    lease_ttl_s=5.0, max_lease_ms=10_000, max_requester_held_share=0.5, max_held_share=0.75
)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def budget():
    clock = Clock()
    leases = LeaseManager(clock=clock, default_ttl_s=5.0)
    return clock, leases, LeaseBudget(CONFIG, leases, pool_blocks=100, clock=clock)


def test_lease_length_is_the_default_or_clamped(budget):
    _, _, b = budget
    assert b.lease_ttl_s(0) == 5.0
    assert b.lease_ttl_s(2_000) == 2.0
    assert b.lease_ttl_s(2**32 - 1) == 10.0


def test_prefills_under_way_count_before_they_are_leased(budget):
    _, _, b = budget
    a1 = b.admit("dec-a", 30)
    with pytest.raises(ResourceExhausted):  # 30 + 30 > 50: dec-a's share, though nothing is leased yet
        b.admit("dec-a", 30)
    a1.done()
    a1.done()  # idempotent
    assert b.pending_blocks == 0
    b.admit("dec-a", 30).done()


def test_the_pool_limit_sheds_with_the_time_to_the_next_lease_end(budget):
    _, leases, b = budget
    leases.issue("h1", range(40), "dec-a", "agent-a", ttl_s=3.0, on_free=lambda: None)
    leases.issue("h2", range(40, 70), "dec-b", "agent-b", ttl_s=8.0, on_free=lambda: None)
    with pytest.raises(ResourceExhausted) as e:  # 70 held + 10 > 75
        b.admit("dec-c", 10)
    assert "75%" in str(e.value) and e.value.retry_after_s == pytest.approx(3.0)
    assert b.shed == 1
    b.admit("dec-c", 5).done()  # 75 exactly: still in
    leases.release("h1")
    b.admit("dec-c", 10).done()


def test_a_requester_share_counts_only_its_own_leases(budget):
    _, leases, b = budget
    leases.issue("h1", range(45), "dec-a", "agent-a", on_free=lambda: None)
    with pytest.raises(ResourceExhausted) as e:
        b.admit("dec-a", 10)
    assert "dec-a" in str(e.value) and e.value.retry_after_s > 0
    b.admit("dec-b", 10).done()
