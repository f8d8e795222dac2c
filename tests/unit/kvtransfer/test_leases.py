"""LeaseManager and LeaseKeeper with a fake clock: every lease frees its blocks exactly once."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.errors import FailureKind, KvTransferFailed, NotOwner, StaleHandle
from kvtransfer.leases import LeaseEnd, LeaseKeeper, LeaseManager
from kvtransfer.testing import BlockPool


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def env():
    clock = Clock()
    pool = BlockPool(32)
    leases = LeaseManager(clock=clock, default_ttl_s=30.0, wall_clock=lambda: 5000.0)
    return clock, pool, leases


def issue(leases, pool, handle_id, n=2, issued_to="dec-1", agent="dec-agent", ttl=None):
    ids = pool.alloc(n)
    return leases.issue(handle_id, ids, issued_to, agent, ttl, on_free=lambda: pool.free(ids))


def test_release_frees_once_and_counts(env):
    _, pool, leases = env
    lease = issue(leases, pool, "h1", n=3)
    assert lease.expires_unix_ms == 5_030_000
    assert pool.num_free == 29 and leases.held == 1 and leases.held_blocks == 3
    assert leases.mark_pulled("h1") and not leases.mark_pulled("h1")
    assert leases.release("h1") is True
    assert leases.release("h1") is False  # idempotent, no double free
    assert pool.num_free == 32
    c = leases.counters
    assert (c.issued, c.pulled, c.released, c.expired, c.held, c.held_blocks) == (1, 1, 1, 0, 0, 0)


def test_expiry_uses_the_clock_and_default_or_given_ttl(env):
    clock, pool, leases = env
    issue(leases, pool, "short", ttl=1.0)
    issue(leases, pool, "long")
    clock.t += 0.999
    assert leases.expire() == []
    clock.t += 0.001
    assert [x.handle_id for x in leases.expire()] == ["short"]
    assert leases.next_expiry() == pytest.approx(1030.0)
    clock.t += 29
    assert [x.handle_id for x in leases.expire()] == ["long"]
    assert pool.num_free == 32 and leases.counters.expired == 2


def test_stale_handle_says_why(env):
    clock, pool, leases = env
    issue(leases, pool, "rel")
    issue(leases, pool, "exp", ttl=1)
    leases.release("rel")
    clock.t += 2
    leases.expire()
    with pytest.raises(StaleHandle, match="was released"):
        leases.get("rel")
    with pytest.raises(StaleHandle, match="was expired"):
        leases.get("exp")
    with pytest.raises(StaleHandle, match="unknown") as e:
        leases.get("never")
    assert e.value.kind == FailureKind.STALE_HANDLE


def test_only_the_issued_worker_may_read(env):
    _, pool, leases = env
    issue(leases, pool, "h", issued_to="dec-1")
    with pytest.raises(NotOwner) as e:
        leases.get("h", "dec-2")
    assert e.value.kind == FailureKind.NOT_OWNER
    assert leases.get("h", "dec-1").handle_id == "h"
    assert leases.get("h").handle_id == "h"  # no requester given: holder-side lookup
    leases.release("h")


def test_agent_death_frees_only_that_agents_leases(env):
    _, pool, leases = env
    issue(leases, pool, "a1", agent="A")
    issue(leases, pool, "a2", agent="A")
    issue(leases, pool, "b1", agent="B")
    assert leases.requester_agents() == {"A", "B"}
    assert leases.agent_dead("A") == 2
    assert leases.agent_dead("") == 0
    assert leases.held == 1 and leases.counters.agent_dead == 2
    with pytest.raises(StaleHandle, match="agent_dead"):
        leases.get("a1")
    assert leases.close() == 1
    assert pool.num_free == 32


def test_a_reader_pins_blocks_until_it_stops(env):
    clock, pool, leases = env
    issue(leases, pool, "h", n=4, ttl=1)
    lease = leases.begin_read("h", "dec-1")
    clock.t += 5
    leases.expire()
    assert lease.ended == LeaseEnd.EXPIRED
    # Gone for new readers at once, but the blocks stay out until the reader stops.
    with pytest.raises(StaleHandle):
        leases.get("h")
    assert pool.num_free == 28 and leases.held == 0 and leases.held_blocks == 4
    leases.end_read(lease)
    assert pool.num_free == 32 and leases.held_blocks == 0


def test_bad_issue_arguments_are_refused(env):
    _, pool, leases = env
    issue(leases, pool, "h")
    with pytest.raises(ValueError, match="already held"):
        leases.issue("h", [20], "w", on_free=lambda: None)
    with pytest.raises(ValueError, match="at least one block"):
        leases.issue("empty", [], "w", on_free=lambda: None)
    with pytest.raises(ValueError, match="non-empty"):
        leases.issue("", [21], "w", on_free=lambda: None)
    with pytest.raises(ValueError):
        LeaseManager(default_ttl_s=0)
    leases.close()


def test_a_failing_on_free_does_not_wedge_other_leases(env):
    clock, pool, leases = env

    def boom():
        raise RuntimeError("engine bug")

    leases.issue("bad", [30], "w", ttl_s=1, on_free=boom)
    issue(leases, pool, "good", ttl=1)
    clock.t += 2
    assert len(leases.expire()) == 2
    assert pool.num_free == 32 and leases.held == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("irepgdx"), st.integers(0, 5)), max_size=40))
def test_every_lease_frees_exactly_once_whatever_happens(ops):
    clock = Clock()
    pool = BlockPool(64)
    leases = LeaseManager(clock=clock, default_ttl_s=10)
    freed: dict[str, int] = {}
    reads = []
    for op, k in ops:
        h = f"h{k}"
        if op == "i" and pool.num_free >= 2:
            try:
                leases.get(h)
                continue  # still held
            except KvTransferFailed:
                pass
            ids = pool.alloc(2)
            key = f"{h}#{len(freed)}"
            freed[key] = 0

            def free(ids=ids, key=key):
                freed[key] += 1
                pool.free(ids)

            leases.issue(h, ids, "w", f"agent{k % 2}", ttl_s=k + 1, on_free=free)
        elif op == "r":
            leases.release(h)
        elif op == "e":
            clock.t += k
            leases.expire()
        elif op == "p":
            leases.mark_pulled(h)
        elif op == "g":
            try:
                reads.append(leases.begin_read(h, "w"))
            except KvTransferFailed:
                pass
        elif op == "d":
            leases.agent_dead(f"agent{k % 2}")
        elif op == "x" and reads:
            leases.end_read(reads.pop(0))
    for lease in reads:
        leases.end_read(lease)
    leases.close()
    assert all(n == 1 for n in freed.values()), freed
    assert pool.num_free == 64 and leases.held_blocks == 0
    c = leases.counters
    assert c.issued == len(freed) and c.held == 0
    assert c.released + c.expired + c.agent_dead <= c.issued  # the rest were closed


class FakeLiveness:
    def __init__(self, dead):
        self.dead = dead
        self.asked = []

    async def is_alive(self, name):
        self.asked.append(name)
        if name == "unsure":
            return None
        return name not in self.dead


async def test_keeper_ends_leases_of_dead_requesters_only(env):
    _, pool, leases = env
    issue(leases, pool, "a", agent="alive")
    issue(leases, pool, "d", agent="dead")
    issue(leases, pool, "u", agent="unsure")
    keeper = LeaseKeeper(leases, FakeLiveness({"dead"}))
    assert await keeper.check_liveness() == 1
    assert leases.held == 2 and leases.counters.agent_dead == 1
    leases.close()
    assert pool.num_free == 32


def test_a_handle_id_can_be_reissued_while_its_ended_lease_is_still_read(env):
    _, pool, leases = env
    first = issue(leases, pool, "req-1", n=2)
    reader = leases.begin_read("req-1", "dec-1")
    leases.release("req-1")  # e.g. the decode worker gave up and retries the same request
    second = issue(leases, pool, "req-1", n=3)
    assert leases.get("req-1") is second and leases.held_blocks == 5
    leases.end_read(reader)
    assert first.freed and not second.freed and pool.num_free == 29
    leases.release("req-1")
    assert pool.num_free == 32


def test_issue_listeners_hear_every_new_lease(env):
    _, pool, leases = env
    heard = []
    leases.add_issue_listener(lambda lease: heard.append(lease.handle_id))
    issue(leases, pool, "a")
    issue(leases, pool, "b")
    assert heard == ["a", "b"]
    leases.close()
