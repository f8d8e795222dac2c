"""BlockManager and KvEventLog without a model."""

from __future__ import annotations

from services.engine.api import EngineRequest, KvEventKind
from services.engine.block_manager import BlockManager
from services.engine.kv_events import KvEventLog
from services.engine.sequence import Sequence
from services.model.hashing import block_hashes

BS = 4


def seq(tokens, rid="s") -> Sequence:
    return Sequence(EngineRequest(rid, list(tokens)), BS, None)


def computed(bm: BlockManager, s: Sequence, n: int | None = None) -> Sequence:
    """Allocate and mark `n` (default all) tokens computed, offering full blocks to the cache."""
    n = s.num_tokens if n is None else n
    assert bm.allocate_slots(s, n, bm.match_prefix(s, n) if not s.block_table else ())
    s.num_computed_tokens = n
    bm.cache_full_blocks(s)
    return s


def test_hashes_are_the_shared_chained_hashes():
    bm = BlockManager(8, BS, True, 100)
    s = computed(bm, seq(range(10)))
    assert bm.cached_prefix_tokens(list(range(10))) == 8
    event = bm.events.since(0)[0]
    assert event.kind is KvEventKind.STORED and event.parent_hash is None
    assert list(event.block_hashes) == block_hashes(list(range(10)), BS)
    bm.free(s)


def test_a_sequence_extends_its_hashes_in_pieces_to_the_shared_chain():
    s = seq(range(6))
    assert s.block_hashes(1) == block_hashes(list(range(4)), BS)
    for t in range(6, 21):  # decode appends; the chain continues from the last hashed block
        s.append_token(t)
    assert s.block_hashes(3) == block_hashes(list(range(12)), BS)
    assert s.block_hashes(5) == block_hashes(list(range(21)), BS)
    assert s.block_hashes(2) == block_hashes(list(range(8)), BS)  # a shorter read: a prefix


def test_refcounts_share_blocks_and_free_keeps_them_cached():
    bm = BlockManager(8, BS, True, 100)
    a = computed(bm, seq(range(12), "a"))
    b = seq([*range(8), 99, 98], "b")
    hits = bm.match_prefix(b, b.num_tokens)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, 10, hits)
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 8 - 4
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3


def test_lru_evicts_unused_blocks_first_and_chains_from_the_end():
    bm = BlockManager(6, BS, True, 100)
    old = computed(bm, seq(range(12), "old"))  # 3 cached blocks
    old_blocks = list(old.block_table)
    bm.free(old)
    # Needs 4 blocks: 3 never-used ones go first, then the end of the old chain.
    s = seq(range(100, 116), "new")
    assert bm.allocate_slots(s, 16)
    assert set(old_blocks[2:]) <= set(s.block_table) and not set(old_blocks[:2]) & set(s.block_table)
    removed = [e for e in bm.events.since(0) if e.kind is KvEventKind.REMOVED]
    assert removed[0].block_hashes == (block_hashes(list(range(12)), BS)[2],)
    assert bm.cached_prefix_tokens(list(range(12))) == 8
    bm.free(s)


def test_allocation_is_all_or_nothing():
    bm = BlockManager(4, BS, True, 100)
    a = seq(range(12), "a")
    assert bm.allocate_slots(a, 12)
    b = seq(range(8), "b")
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.free(a)


def test_idle_cache_hits_count_against_free_blocks():
    bm = BlockManager(3, BS, True, 100)
    bm.free(computed(bm, seq(range(8), "a")))  # 2 idle cached blocks, 1 never used
    b = seq([*range(8), 5, 6, 7, 8, 9], "b")
    hits = bm.match_prefix(b, b.num_tokens)
    assert len(hits) == 2
    # 2 hits + 2 new blocks > 3 blocks: refused without touching anything.
    assert not bm.allocate_slots(b, 13, hits)
    assert bm.num_free_blocks == 3 and all(bm.blocks[h].ref_count == 0 for h in hits)


def test_duplicate_blocks_are_not_registered_twice():
    bm = BlockManager(8, BS, True, 100)
    a = seq(range(8), "a")
    b = seq(range(8), "b")
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 8)
    for s in (a, b):
        s.num_computed_tokens = 8
        bm.cache_full_blocks(s)
    assert bm.num_cached_blocks == 2
    assert len(bm.events.since(0)) == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(8, BS, False, 100)
    s = computed(bm, seq(range(12)))
    assert bm.num_cached_blocks == 0 and bm.events.since(0) == [] and bm.cached_prefix_tokens(range(12)) == 0
    bm.free(s)


def test_event_log_overflow_shows_a_gap():
    log = KvEventLog(capacity=3)
    for i in range(5):
        log.removed([i])
    events = log.since(0)
    assert [e.seq for e in events] == [3, 4, 5]
    assert log.since(3)[0].seq == 4 and log.since(5) == [] and log.last_seq == 5
    log.stored(None, [])  # empty batches are not events
    assert log.last_seq == 5
