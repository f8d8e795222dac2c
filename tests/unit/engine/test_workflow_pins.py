"""Workflow KV pins in the BlockManager (issue 21 item 2), on a fake clock."""

from __future__ import annotations

from services.engine.api import EngineRequest
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, SequenceStatus
from tests.unit.engine.test_block_manager import BS, computed, seq


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pinned_manager(num_blocks=8, ttl=10.0):
    clock = Clock()
    return BlockManager(num_blocks, BS, True, 100, pin_ttl_s=ttl, clock=clock), clock


def test_a_pin_keeps_the_blocks_out_of_the_free_queue_until_its_ttl():
    bm, clock = pinned_manager()
    s = computed(bm, seq(range(10), "step0"))  # 2 full cached blocks + 1 partial
    assert bm.pin("wf", s) == 2
    bm.free(s)
    assert bm.num_free_blocks == 8 - 2 and bm.pinned("wf") == 2
    # Another sequence filling the pool cannot take them while others are free.
    other = seq(range(100, 124), "other")
    assert bm.allocate_slots(other, 24)
    assert bm.cached_prefix_tokens(list(range(10))) == 8
    bm.free(other)
    clock.t += 9.9
    assert bm.expire_pins() == 0
    clock.t += 0.2
    assert bm.expire_pins() == 1
    st = bm.pin_stats()
    assert (st.pinned_blocks, st.pins_expired, st.pins_evicted) == (0, 1, 0)
    assert bm.num_free_blocks == 8


def test_pressure_releases_pins_lowest_value_first_and_counts_them():
    bm, _ = pinned_manager(num_blocks=8)
    small = computed(bm, seq(range(4), "a"))  # 1 block
    big = computed(bm, seq(range(50, 62), "b"))  # 3 blocks
    bm.pin("small", small)
    bm.pin("big", big)
    bm.free(small)
    bm.free(big)
    assert bm.num_free_blocks == 4
    s = seq(range(200, 220), "new")  # needs 5 blocks: releasing the small pin is enough
    assert bm.allocate_slots(s, 20)
    assert bm.pinned("small") == 0 and bm.pinned("big") == 3
    assert bm.pin_stats().pins_evicted == 1
    bm.free(s)
    t = seq(range(300, 332), "all")  # needs all 8: the big pin goes too
    assert bm.allocate_slots(t, 32)
    assert bm.pin_stats().pins_evicted == 2 and bm.pin_stats().pinned_blocks == 0
    bm.free(t)
    assert bm.num_free_blocks == 8


def test_a_failed_allocation_leaves_refcounts_unchanged():
    bm, _ = pinned_manager(num_blocks=4)
    a = computed(bm, seq(range(8), "a"))
    bm.pin("wf", a)
    bm.free(a)
    b = seq([*range(8), *range(100, 120)], "b")  # 2 hits + 5 new > 4
    hits = bm.match_prefix(b, b.num_tokens)
    assert not bm.allocate_slots(b, b.num_tokens, hits)
    assert b.block_table == [] and all(blk.ref_count == 0 for blk in bm.blocks)
    assert bm.num_free_blocks == 4


def test_next_step_hits_the_pinned_context_and_repins_then_the_end_releases():
    bm, _ = pinned_manager()
    step0 = computed(bm, seq(range(8), "s0"))
    bm.pin("wf", step0)
    bm.free(step0)
    step1 = seq([*range(8), *range(40, 48)], "s1")
    hits = bm.match_prefix(step1, step1.num_tokens)
    assert len(hits) == 2
    assert bm.allocate_slots(step1, step1.num_tokens, hits)
    step1.num_computed_tokens = step1.num_tokens
    bm.cache_full_blocks(step1)
    assert bm.pin("wf", step1) == 4  # replaces the old pin; shared blocks never hit 0
    bm.free(step1)
    assert bm.pinned("wf") == 4 and bm.num_free_blocks == 4
    assert bm.unpin("wf") and not bm.unpin("wf")
    assert bm.pin_stats().pins_released == 1 and bm.num_free_blocks == 8


def test_no_pins_without_a_ttl_or_workflow():
    bm = BlockManager(8, BS, True, 100)
    s = computed(bm, seq(range(8)))
    assert bm.pin("wf", s) == 0
    bm2, _ = pinned_manager()
    s2 = computed(bm2, seq(range(8)))
    assert bm2.pin("", s2) == 0


def wf_seq(tokens, rid, final=False) -> Sequence:
    return Sequence(EngineRequest(rid, list(tokens), workflow_id="wf", workflow_final=final), BS, None)


def test_scheduler_pins_a_finished_step_not_an_aborted_one_and_the_final_step_unpins():
    bm, _ = pinned_manager()
    sched = Scheduler(bm, 4, 64)
    s0 = wf_seq(range(8), "s0")
    computed(bm, s0)
    sched.finish(s0, SequenceStatus.ABORTED)
    assert bm.pinned("wf") == 0
    s1 = wf_seq(range(8), "s1")
    computed(bm, s1)
    sched.finish(s1, SequenceStatus.FINISHED)
    assert bm.pinned("wf") == 2
    s2 = wf_seq([*range(8), 1, 2, 3, 4], "s2", final=True)
    computed(bm, s2)
    sched.finish(s2, SequenceStatus.FINISHED)
    assert bm.pinned("wf") == 0 and bm.num_free_blocks == 8


def test_the_next_step_reaching_the_scheduler_restarts_the_pin_ttl_so_a_queued_step_keeps_it():
    # Before the fix the TTL ran from the end of the previous step only, so a step that
    # waited in a queue longer than TTL - think time found its context gone.
    bm, clock = pinned_manager(ttl=10.0)
    sched = Scheduler(bm, 4, 64)
    s0 = wf_seq(range(8), "s0")
    computed(bm, s0)
    sched.finish(s0, SequenceStatus.FINISHED)
    assert bm.pinned("wf") == 2
    clock.t += 6.0  # think time
    s1 = wf_seq([*range(8), *range(40, 48)], "s1")
    sched.add(s1)  # queued behind others
    clock.t += 8.0  # 14 s after the pin: past its first TTL, within the restarted one
    assert bm.expire_pins() == 0 and bm.pinned("wf") == 2
    assert bm.cached_prefix_tokens(list(range(8))) == 8
    clock.t += 2.1
    assert bm.expire_pins() == 1 and bm.num_free_blocks == 8
    assert not bm.touch_pin("wf") and not bm.touch_pin("")
