import random

import pytest

from services.model.hashing import block_hashes
from services.router.prefix_index import (
    EventSequencer,
    IndexOverflow,
    PrefixIndex,
    PrefixIndexConfig,
    SeqVerdict,
)

BS = 4


def chain(n_blocks: int, start: int = 0) -> list[int]:
    """Chained hashes of a prompt of `n_blocks` full blocks (tokens start, start+1, ...)."""
    return block_hashes(list(range(start, start + n_blocks * BS)), BS)


A = chain(8)  # a prompt
B = chain(8, start=1000)  # an unrelated prompt


def test_stored_chain_matches_its_leading_prefix():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A[:5])
    assert idx.match(A) == {"w1": 5}
    assert idx.match(A[:3]) == {"w1": 3}
    assert idx.match(B) == {}
    assert idx.match([]) == {}
    assert idx.blocks("w1") == 5


def test_continuation_with_parent_hash_extends_the_chain():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A[:2])
    idx.apply_stored("w1", A[1], A[2:6])
    assert idx.match(A) == {"w1": 6}


def test_each_worker_gets_its_own_match_length():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A[:2])
    idx.apply_stored("w2", None, A[:7])
    idx.apply_stored("w3", None, A)
    idx.apply_stored("w4", None, B[:3])
    assert idx.match(A) == {"w1": 2, "w2": 7, "w3": 8}
    assert idx.match(B) == {"w4": 3}


def test_a_prompt_that_diverges_matches_only_the_shared_blocks():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A)
    other = block_hashes(list(range(3 * BS)) + [999] * (5 * BS), BS)  # same first 3 blocks
    assert other[:3] == A[:3] and other[3] != A[3]
    assert idx.match(other) == {"w1": 3}


def test_removed_block_in_the_middle_cuts_the_match_there():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A)
    idx.apply_stored("w2", None, A)
    idx.apply_removed("w1", [A[3]])
    assert idx.match(A) == {"w1": 3, "w2": 8}
    assert idx.blocks("w1") == 7  # blocks after the hole stay recorded
    # Storing the block again reconnects the rest of the chain.
    idx.apply_stored("w1", A[2], [A[3]])
    assert idx.match(A) == {"w1": 8, "w2": 8}


def test_removing_the_first_block_kills_the_whole_match():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A[:4])
    idx.apply_removed("w1", [A[0]])
    assert idx.match(A) == {}


def test_removal_frees_nodes_no_worker_holds():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A[:4])
    idx.apply_stored("w2", None, A[:2])
    assert len(idx) == 4
    idx.apply_removed("w1", A[:4])
    assert len(idx) == 2  # w2 still holds two
    assert idx.blocks("w1") == 0
    idx.apply_removed("w2", A[:2])
    assert len(idx) == 0
    assert idx._entries == {}  # no dangling per-block entries


def test_a_cleared_workers_slot_is_reused_without_its_blocks():
    # Workers are bits in each block's mask: a slot freed by clear() goes to the next new worker,
    # which must not inherit a single block of the old one.
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A)
    idx.apply_stored("w2", None, A[:3])
    idx.clear("w1")
    idx.apply_stored("w3", None, B[:2])
    assert idx.match(A) == {"w2": 3}
    assert idx.match(B) == {"w3": 2}
    assert idx.workers() == ["w2", "w3"]
    idx.apply_stored("w3", None, A[:5])
    assert idx.match(A) == {"w2": 3, "w3": 5}
    for w in ("w2", "w3"):
        idx.clear(w)
    assert len(idx) == 0 and idx._entries == {}


def test_removing_an_unknown_block_or_worker_is_a_no_op():
    idx = PrefixIndex()
    idx.apply_removed("ghost", A)
    idx.apply_stored("w1", None, A[:2])
    idx.apply_removed("w1", B)
    assert idx.match(A) == {"w1": 2}


def test_clear_forgets_one_worker_only():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A)
    idx.apply_stored("w2", None, A[:3])
    idx.clear("w1")
    assert idx.match(A) == {"w2": 3}
    assert idx.blocks("w1") == 0
    assert idx.workers() == ["w2"]
    assert len(idx) == 3


def test_snapshot_replaces_the_workers_entries_and_accepts_any_chain_order():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, B)
    # Chains of A listed child-first: the parent arrives after its child.
    idx.apply_snapshot("w1", [(A[3], A[4:6]), (None, A[:2]), (A[1], A[2:4])])
    assert idx.match(A) == {"w1": 6}
    assert idx.match(B) == {}
    assert idx.blocks("w1") == 6


def test_empty_snapshot_keeps_the_worker_known_with_no_blocks():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A)
    idx.apply_snapshot("w1", [])
    assert idx.workers() == ["w1"]
    assert idx.blocks("w1") == 0
    assert idx.match(A) == {}


def test_a_worker_past_the_block_limit_is_dropped_and_told_to_resubscribe():
    idx = PrefixIndex(PrefixIndexConfig(max_blocks_per_worker=5))
    idx.apply_stored("w2", None, A[:2])
    with pytest.raises(IndexOverflow) as e:
        idx.apply_stored("w1", None, A)
    assert e.value.worker_id == "w1"
    assert idx.blocks("w1") == 0
    assert idx.match(A) == {"w2": 2}


def test_random_event_streams_match_a_naive_model():
    """Against a model that keeps each worker's block set and matches the first
    missing block: stores (with parents), mid-chain removals, clears."""
    rng = random.Random(7)
    prompts = [chain(12, start=s) for s in (0, 5000)]
    # A branch sharing the first 4 blocks of prompt 0.
    prompts.append(block_hashes(list(range(4 * BS)) + [77] * (8 * BS), BS))
    workers = ["w0", "w1", "w2", "w3"]
    idx = PrefixIndex()
    model: dict[str, set[int]] = {w: set() for w in workers}
    for _ in range(3000):
        w = rng.choice(workers)
        p = rng.choice(prompts)
        op = rng.random()
        if op < 0.55:
            i = rng.randrange(len(p))
            j = rng.randrange(i, min(i + 4, len(p))) + 1
            idx.apply_stored(w, p[i - 1] if i else None, p[i:j])
            model[w].update(p[i:j])
        elif op < 0.97:
            gone = rng.sample(p, rng.randint(1, 3))
            idx.apply_removed(w, gone)
            model[w].difference_update(gone)
        else:
            idx.clear(w)
            model[w].clear()
        q = rng.choice(prompts)
        expected = {}
        for ww, held in model.items():
            n = next((k for k, h in enumerate(q) if h not in held), len(q))
            if n:
                expected[ww] = n
        assert idx.match(q) == expected
        assert idx.blocks(w) == len(model[w])
    assert len(idx) == len(set().union(*model.values()))


def test_sequencer_applies_in_order_and_skips_duplicates():
    seq = EventSequencer()
    seq.start("w1", 10)
    assert seq.check("w1", 11) is SeqVerdict.APPLY
    assert seq.check("w1", 11) is SeqVerdict.DUPLICATE
    assert seq.check("w1", 9) is SeqVerdict.DUPLICATE
    assert seq.check("w1", 12) is SeqVerdict.APPLY
    assert seq.last_seq("w1") == 12


def test_sequencer_reports_a_gap_and_stays_in_gap_until_a_new_snapshot():
    seq = EventSequencer()
    seq.start("w1", 10)
    assert seq.check("w1", 12) is SeqVerdict.GAP
    assert seq.check("w1", 13) is SeqVerdict.GAP  # nothing applied on top of a hole
    seq.start("w1", 20)
    assert seq.check("w1", 21) is SeqVerdict.APPLY


def test_sequencer_needs_a_snapshot_first():
    seq = EventSequencer()
    assert seq.check("w1", 1) is SeqVerdict.GAP
    seq.start("w1", 0)
    seq.forget("w1")
    assert seq.check("w1", 1) is SeqVerdict.GAP
