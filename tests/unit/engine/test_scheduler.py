"""Scheduler decisions without a model: the test plays the model's part."""

from __future__ import annotations

from services.engine.api import EngineRequest
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=32, max_seqs=8, budget=16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, True, 100), max_seqs, budget)


def seq(n: int, rid: str, priority: int = 0, base: int = 0) -> Sequence:
    return Sequence(EngineRequest(rid, list(range(base, base + n)), priority=priority), BS, None)


def run(sched: Scheduler) -> dict[str, int]:
    """One step: mark scheduled tokens computed, 'sample' token 7 where a sequence caught up."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        sched.block_manager.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)
    return {s.request_id: n for s, n in out.scheduled}


def test_budget_chunks_long_prompts_and_running_goes_first():
    sched = make(budget=16)
    sched.add(seq(40, "long"))
    sched.add(seq(3, "short"))
    assert run(sched) == {"long": 16}
    assert run(sched) == {"long": 16}
    assert run(sched) == {"long": 8, "short": 3}
    assert run(sched) == {"long": 1, "short": 1}  # both decoding now


def test_max_num_seqs_bounds_the_batch():
    sched = make(max_seqs=2, budget=64)
    for i in range(3):
        sched.add(seq(4, f"s{i}", base=10 * i))
    assert set(run(sched)) == {"s0", "s1"}
    assert len(sched.waiting) == 1


def test_priority_orders_the_waiting_queue():
    sched = make(max_seqs=1, budget=64)
    sched.add(seq(4, "low", priority=-1))
    sched.add(seq(4, "normal"))
    sched.add(seq(4, "high", priority=5))
    sched.add(seq(4, "normal2"))
    assert [s.request_id for s in sched.waiting] == ["high", "normal", "normal2", "low"]


def test_cached_prefix_is_skipped_but_the_last_token_is_computed():
    sched = make(budget=64)
    first = seq(12, "first")
    sched.add(first)
    run(sched)
    sched.finish(first, SequenceStatus.FINISHED)
    again = seq(12, "again")
    sched.add(again)
    # 3 full blocks cached, but the last token must be computed: 2 blocks reused.
    assert run(sched) == {"again": 4}
    assert again.num_cached_tokens == 8 and sched.prompt_tokens_cached == 8
    sched.finish(again, SequenceStatus.FINISHED)


def test_preemption_frees_the_newest_and_requeues_it_first():
    sched = make(num_blocks=4, budget=64)
    a, b = seq(8, "a"), seq(8, "b", base=50)
    sched.add(a)
    sched.add(b)
    assert run(sched) == {"a": 8, "b": 8}  # 2 blocks each, all 4 used
    assert run(sched) == {"a": 1}  # `a` needs a third block: `b` goes
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b and b.block_table == []
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    # b's full block survived as a cache hit.
    assert sched.block_manager.match_prefix(b, b.num_tokens - 1)


def test_a_sequence_that_cannot_grow_preempts_itself():
    sched = make(num_blocks=2, budget=64)
    a = seq(8, "a")
    sched.add(a)
    run(sched)
    out = sched.schedule()
    assert out.scheduled == [] and out.preempted == [a]
    assert a.status is SequenceStatus.WAITING and sched.block_manager.num_free_blocks == 2


def test_hold_and_remote_paths():
    sched = make()
    s = seq(6, "p")
    sched.add(s)
    run(sched)
    sched.hold(s)
    assert s.status is SequenceStatus.HELD and not sched.running and sched.held["p"] is s
    r = seq(6, "r")
    assert sched.reserve_remote(r) and r.status is SequenceStatus.WAITING_FOR_REMOTE_KV
    # The held blocks' first full block is in the cache: the reservation reuses it.
    assert r.num_cached_tokens == 4 and r.block_table[0] == s.block_table[0]
    sched.commit_remote(r)
    assert r.status is SequenceStatus.DECODING and r.num_computed_tokens == 6 and sched.running == [r]
    for x in (s, r):
        sched.finish(x, SequenceStatus.FINISHED)
    assert sched.block_manager.num_free_blocks == 32 and not sched.held and not sched.has_work()


# ---- on time first (late_after_s) ------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def timed(late_after_s: float, max_seqs: int = 1, late_max_s: float = 0.0) -> tuple[Scheduler, Clock]:
    clock = Clock()
    sched = Scheduler(
        BlockManager(32, BS, True, 100),
        max_seqs,
        64,
        late_after_s=late_after_s,
        clock=clock,
        late_max_s=late_max_s,
    )
    return sched, clock


def admitted(sched: Scheduler) -> list[str]:
    return [s.request_id for s, _ in sched.schedule().scheduled if s.status is SequenceStatus.PREFILLING]


def test_a_late_head_yields_the_slot_to_an_on_time_request_then_follows():
    sched, clock = timed(1.0)
    sched.add(seq(4, "old"))
    clock.t = 1.5
    sched.add(seq(4, "new", base=10))
    clock.t = 1.6  # old has waited 1.6 s (late), new 0.1 s
    assert admitted(sched) == ["new"]
    assert sched.num_admitted_ahead == 1
    sched.finish(sched.running[0], SequenceStatus.FINISHED)
    assert admitted(sched) == ["old"]  # no on-time request left: the late one goes next
    sched.finish(sched.running[0], SequenceStatus.FINISHED)
    assert sched.block_manager.num_free_blocks == 32


def test_off_by_default_first_come_first_served():
    sched, clock = timed(0.0)
    sched.add(seq(4, "old"))
    clock.t = 100.0
    sched.add(seq(4, "new", base=10))
    assert admitted(sched) == ["old"]
    assert sched.num_admitted_ahead == 0


def test_late_requests_keep_their_order_among_themselves():
    sched, clock = timed(1.0, max_seqs=2)
    for i in range(3):
        sched.add(seq(4, f"late{i}", base=10 * i))
    clock.t = 5.0
    assert admitted(sched) == ["late0", "late1"]
    assert sched.num_admitted_ahead == 0


def test_the_head_on_time_keeps_its_place():
    sched, clock = timed(1.0)
    sched.add(seq(4, "first"))
    clock.t = 0.5
    sched.add(seq(4, "second", base=10))
    clock.t = 0.9
    assert admitted(sched) == ["first"]


def test_a_resumed_stream_is_never_late():
    sched, clock = timed(1.0)
    resumed = Sequence(EngineRequest("resumed", list(range(4)), resume_token_ids=[5, 6]), BS, None)
    sched.add(resumed)
    clock.t = 3.0
    sched.add(seq(4, "new", base=10))
    assert admitted(sched) == ["resumed"]  # its first token went out long ago: it is not waiting for one


def test_a_preempted_sequence_keeps_its_place_at_the_head():
    sched, clock = timed(1.0)
    sched.add(seq(4, "a"))
    assert admitted(sched) == ["a"]
    sched._preempt(sched.running[0])  # back to the head of the queue, as a recompute
    clock.t = 3.0
    sched.add(seq(4, "new", base=10))
    out = sched.schedule().scheduled
    assert [s.request_id for s, _ in out] == ["a"]


def test_an_on_time_request_of_lower_priority_does_not_pass_a_late_higher_one():
    sched, clock = timed(1.0)
    sched.add(seq(4, "high", priority=5))
    clock.t = 2.0
    sched.add(seq(4, "low", priority=0, base=10))
    assert admitted(sched) == ["high"]


def test_late_after_s_must_not_be_negative():
    import pytest

    with pytest.raises(ValueError, match="late_after_s"):
        Scheduler(BlockManager(8, BS, True, 100), 1, 16, late_after_s=-1.0)


def test_a_request_that_waited_elsewhere_brings_its_wait():
    """A re-routed request (EngineRequest.waited_s) is late here as soon as its wait in the mesh
    passes the setting, so it does not take a slot ahead of one that can still start in time."""
    sched, clock = timed(1.0)
    sched.add(Sequence(EngineRequest("rerouted", list(range(4)), waited_s=1.5), BS, None))
    clock.t = 0.1
    sched.add(seq(4, "new", base=10))
    assert admitted(sched) == ["new"]
    assert sched.num_admitted_ahead == 1


# ---- the bound on being passed over (late_max_s) --------------------------------------


def test_an_overdue_request_takes_its_first_come_place_again():
    sched, clock = timed(1.0, late_max_s=3.0)
    sched.add(seq(4, "old"))
    clock.t = 2.9
    sched.add(seq(4, "new", base=10))
    clock.t = 3.1  # old has waited 3.1 s: past late_max_s, overdue
    assert admitted(sched) == ["old"]
    assert (sched.num_admitted_ahead, sched.num_admitted_overdue) == (0, 1)
    sched.finish(sched.running[0], SequenceStatus.FINISHED)
    assert admitted(sched) == ["new"]
    sched.finish(sched.running[0], SequenceStatus.FINISHED)
    assert sched.block_manager.num_free_blocks == 32


def test_a_late_request_not_yet_overdue_is_still_passed_over():
    sched, clock = timed(1.0, late_max_s=3.0)
    sched.add(seq(4, "old"))
    clock.t = 2.0
    sched.add(seq(4, "new", base=10))
    clock.t = 2.5  # old late (2.5 s) but not overdue
    assert admitted(sched) == ["new"]
    assert (sched.num_admitted_ahead, sched.num_admitted_overdue) == (1, 0)


def test_an_overdue_request_behind_a_late_head_goes_before_on_time_ones():
    """Queue order: late head (not overdue), then one overdue (it brought its wait from elsewhere),
    then an on-time one: the overdue one is the first to take the slot."""
    sched, clock = timed(1.0, late_max_s=3.0)
    sched.add(seq(4, "late"))
    sched.add(Sequence(EngineRequest("overdue", list(range(10, 14)), waited_s=2.5), BS, None))
    clock.t = 1.5
    sched.add(seq(4, "on_time", base=20))
    assert admitted(sched) == ["overdue"]  # late 1.5 s, overdue 4.0 s, on_time 0 s
    assert sched.num_admitted_ahead == 1


def test_without_the_bound_a_late_request_waits_for_as_long_as_on_time_ones_come():
    sched, clock = timed(1.0)
    sched.add(seq(4, "old"))
    clock.t = 99.0
    sched.add(seq(4, "new", base=10))
    clock.t = 99.5
    assert admitted(sched) == ["new"]


def test_late_max_s_needs_a_late_after_s_below_it():
    import pytest

    for after, bound in ((0.0, 3.0), (3.0, 3.0), (4.0, 3.0)):
        with pytest.raises(ValueError, match="late_max_s"):
            Scheduler(BlockManager(8, BS, True, 100), 1, 16, late_after_s=after, late_max_s=bound)


# ---- moved streams go ahead (front) -------------------------------------------------------


def moved(n: int, rid: str, priority: int = 0, base: int = 0) -> Sequence:
    return Sequence(EngineRequest(rid, list(range(base, base + n)), priority=priority, front=True), BS, None)


def queue(sched: Scheduler) -> list[str]:
    return [s.request_id for s in sched.waiting]


def test_a_moved_stream_goes_ahead_of_its_priority_but_behind_higher_ones():
    sched = Scheduler(BlockManager(32, BS, True, 100), 1, 64)  # first come, first served
    for rid, prio in (("high", 1), ("a", 0), ("b", 0), ("low", -1)):
        sched.add(seq(4, rid, priority=prio, base=10 * len(sched.waiting)))
    sched.add(moved(4, "moved1", base=50))
    sched.add(moved(4, "moved2", base=60))  # moved ones keep their order among themselves
    assert queue(sched) == ["high", "moved1", "moved2", "a", "b", "low"]
    assert sched.num_moved_ahead == 2
    assert admitted(sched) == ["high"]


def test_a_moved_stream_stays_behind_a_preempted_one():
    sched = Scheduler(BlockManager(32, BS, True, 100), 1, 64)
    sched.add(seq(4, "a"))
    assert admitted(sched) == ["a"]
    sched._preempt(sched.running[0])  # back to the head, as a recompute
    sched.add(seq(4, "b", base=10))
    sched.add(moved(4, "moved", base=20))
    assert queue(sched) == ["a", "moved", "b"]
    assert sched.num_moved_ahead == 1
    sched.add(seq(4, "low", priority=-1, base=30))
    sched.add(moved(4, "moved_low", priority=-1, base=40))
    assert queue(sched) == ["a", "moved", "b", "moved_low", "low"] and sched.num_moved_ahead == 2
    alone = Scheduler(BlockManager(32, BS, True, 100), 1, 64)
    alone.add(moved(4, "first"))  # nobody to pass: not counted
    assert alone.num_moved_ahead == 0


def test_a_moved_request_is_admitted_before_on_time_ones_that_queued_first():
    """With on time first, a request moved off an unhealthy worker (waited_s 0, front) takes the
    next slot even though on-time requests queued before it."""
    sched, clock = timed(1.0)
    sched.add(seq(4, "x"))
    sched.add(seq(4, "y", base=10))
    clock.t = 0.5
    sched.add(moved(4, "moved", base=20))
    assert admitted(sched) == ["moved"]
    assert sched.num_admitted_ahead == 0  # it was at the head: nobody was passed over
