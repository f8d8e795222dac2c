"""The KV-transfer service's cores: agent registry (fake clock) and transfer statistics."""

import pytest

from kvtransfer.agents import AgentRecord
from kvtransfer.layout import KvLayout
from services.kvtransfer.registry import AgentRegistry, UnknownAgent
from services.kvtransfer.stats import TransferStatistics

LAYOUT = KvLayout(2, 2, 16, "float32", 4)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def rec(name="p1", meta=b"md"):
    return AgentRecord(name=name, metadata=meta, layout=LAYOUT, num_blocks=8, length=8 * LAYOUT.block_bytes)


@pytest.fixture
def reg():
    clock = Clock()
    return clock, AgentRegistry(clock=clock, default_lease_s=10, max_lease_s=60)


def test_every_registration_gets_a_new_incarnation(reg):
    _, r = reg
    a, lease = r.register(rec(meta=b"old"))
    b, _ = r.register(rec(meta=b"new"))
    assert (a.incarnation, b.incarnation, lease) == (1, 2, 10)
    assert r.get("p1").metadata == b"new" and r.get("p1").incarnation == 2
    assert r.registrations == 2 and len(r) == 1


def test_heartbeat_renews_and_stale_incarnations_are_refused(reg):
    clock, r = reg
    r.register(rec())
    r.register(rec())  # incarnation 2 supersedes 1
    with pytest.raises(UnknownAgent, match="stale"):
        r.heartbeat("p1", 1)
    clock.t = 9
    assert r.heartbeat("p1", 2) == 10
    clock.t = 18  # 9 s after the renewal: still alive
    assert r.get("p1").incarnation == 2
    clock.t = 19
    with pytest.raises(UnknownAgent):
        r.get("p1")  # expired even though no sweep ran
    assert r.expirations == 1 and len(r) == 0


def test_expire_sweeps_and_incarnations_never_go_back(reg):
    clock, r = reg
    r.register(rec("a"), lease_s=1)
    r.register(rec("b"))
    clock.t = 5
    assert [x.name for x in r.expire()] == ["a"]
    assert r.names() == ["b"]
    again, _ = r.register(rec("a"))
    assert again.incarnation == 2


def test_lease_is_capped_and_must_be_positive(reg):
    _, r = reg
    assert r.register(rec(), lease_s=600)[1] == 60
    with pytest.raises(Exception, match="lease"):
        r.register(rec(), lease_s=-1)
    with pytest.raises(ValueError):
        AgentRegistry(default_lease_s=0)


def test_deregister_only_removes_the_current_incarnation(reg):
    _, r = reg
    r.register(rec())
    r.register(rec())
    assert r.deregister("p1", 1) is False  # a late goodbye of the previous process
    assert r.get("p1").incarnation == 2
    assert r.deregister("p1", 2) is True
    assert r.deregister("p1", 2) is False
    with pytest.raises(UnknownAgent):
        r.heartbeat("p1", 2)


def test_statistics_count_bytes_failures_and_recent_latency():
    s = TransferStatistics(window=100)
    for i in range(1, 101):
        s.record("nixl", 1000, float(i), ok=True)
    s.record("grpc", 0, 5.0, ok=False, error="timeout")
    s.record("grpc", 0, 5.0, ok=False)
    snap = s.snapshot()
    assert (snap.transfers, snap.failures, snap.bytes) == (102, 2, 100_000)
    assert snap.latency_ms_p50 == 50.0 and snap.latency_ms_p99 == 99.0
    assert snap.failures_by_kind == {"timeout": 1, "unknown": 1}
    assert snap.transfers_by_transport == {"nixl": 100, "grpc": 2}
    for _ in range(100):  # the window slides: old latencies no longer count
        s.record("nixl", 1, 1000.0, ok=True)
    assert s.percentile(50) == 1000.0
    assert TransferStatistics().percentile(99) == 0.0
    with pytest.raises(ValueError):
        TransferStatistics(window=0)
