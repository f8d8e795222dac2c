"""PrefixIndex optimistic (provisional) entries: inserted at routing, confirmed by
KV events, expired when unconfirmed, gone on a resync."""

import random

import pytest

from pdmesh.v1 import common_pb2, worker_pb2
from services.model.hashing import block_hashes
from services.router.convert import KvResync, apply_kv_message
from services.router.prefix_index import EventSequencer, PrefixIndex, PrefixIndexConfig

BS = 4


def chain(n_blocks, start=0):
    return block_hashes(list(range(start, start + n_blocks * BS)), BS)


A = chain(8)
B = chain(8, start=1000)


def test_a_routed_prompt_matches_at_once_and_is_provisional():
    idx = PrefixIndex()
    assert idx.apply_provisional("w1", A, expires_at=5.0) == 8
    assert idx.match(A) == {"w1": 8}
    assert idx.provisional("w1") == 8
    assert idx.blocks("w1") == 8


def test_only_the_missing_blocks_become_provisional():
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A[:3])
    assert idx.apply_provisional("w1", A, 5.0) == 5
    assert idx.provisional("w1") == 5
    idx.expire(10.0)
    assert idx.match(A) == {"w1": 3}  # the confirmed ones stay


def test_unconfirmed_blocks_expire():
    idx = PrefixIndex()
    idx.apply_provisional("w1", A, 5.0)
    assert idx.expire(4.9) == 0
    assert idx.match(A) == {"w1": 8}
    assert idx.expire(5.0) == 8
    assert idx.match(A) == {}
    assert idx.provisional("w1") == 0 and idx.blocks("w1") == 0
    assert len(idx) == 0  # nodes freed


def test_a_kv_event_confirms_them_and_they_no_longer_expire():
    idx = PrefixIndex()
    idx.apply_provisional("w1", A, 5.0)
    idx.apply_stored("w1", None, A[:6])
    assert idx.provisional("w1") == 2
    idx.expire(10.0)
    assert idx.match(A) == {"w1": 6}


def test_a_removal_event_removes_a_provisional_block():
    idx = PrefixIndex()
    idx.apply_provisional("w1", A, 5.0)
    idx.apply_removed("w1", [A[4]])
    assert idx.match(A) == {"w1": 4}
    assert idx.provisional("w1") == 7
    idx.expire(10.0)
    assert idx.match(A) == {} and len(idx) == 0


def test_routing_again_refreshes_the_expiry():
    idx = PrefixIndex()
    idx.apply_provisional("w1", A, 5.0)
    assert idx.apply_provisional("w1", A, 9.0) == 0
    idx.expire(6.0)
    assert idx.match(A) == {"w1": 8}
    idx.expire(9.0)
    assert idx.match(A) == {}


def test_other_workers_are_untouched():
    idx = PrefixIndex()
    idx.apply_stored("w2", None, A)
    idx.apply_provisional("w1", A[:4], 5.0)
    idx.expire(6.0)
    assert idx.match(A) == {"w2": 8}


def test_the_block_limit_caps_provisional_entries_without_raising():
    idx = PrefixIndex(PrefixIndexConfig(max_blocks_per_worker=5))
    assert idx.apply_provisional("w1", A, 5.0) == 5
    assert idx.match(A) == {"w1": 5}


def _snapshot(worker, seq, chains):
    snap = worker_pb2.KvCacheSnapshot(seq=seq)
    for parent, hashes in chains:
        c = snap.chains.add()
        c.block_hashes.extend(hashes)
        if parent is not None:
            c.parent_hash = parent
    return worker_pb2.SubscribeKvEventsResponse(worker_id=worker, snapshot=snap)


def _stored(worker, seq, parent, hashes):
    ev = common_pb2.KvEvent(seq=seq, stored=common_pb2.KvBlocksStored(block_hashes=hashes))
    if parent is not None:
        ev.stored.parent_hash = parent
    batch = worker_pb2.SubscribeKvEventsResponse(worker_id=worker)
    batch.events.events.append(ev)
    return batch


def test_a_sequence_gap_resyncs_exactly_dropping_provisional_entries():
    idx, seqr = PrefixIndex(), EventSequencer()
    apply_kv_message(idx, seqr, "w1", _snapshot("w1", 1, [(None, B[:2])]))
    idx.apply_provisional("w1", A, 5.0)
    with pytest.raises(KvResync):
        apply_kv_message(idx, seqr, "w1", _stored("w1", 3, None, B[2:4]))  # seq 2 lost
    # What the worker pool does on KvResync: clear, then the new subscription's snapshot.
    idx.clear("w1")
    seqr.forget("w1")
    assert idx.provisional("w1") == 0
    apply_kv_message(idx, seqr, "w1", _snapshot("w1", 3, [(None, B[:4])]))
    assert idx.match(A) == {} and idx.match(B) == {"w1": 4}
    assert idx.blocks("w1") == 4
    idx.expire(10.0)  # stale expiry records of the cleared entries touch nothing
    assert idx.match(B) == {"w1": 4}


def test_random_streams_with_provisional_entries_match_a_naive_model():
    """Model: per worker, confirmed set + {hash: expiry} provisional; stores confirm,
    removals drop either, expiry drops unconfirmed ones, clears drop both."""
    rng = random.Random(11)
    prompts = [chain(10, start=s) for s in (0, 5000)]
    prompts.append(block_hashes(list(range(4 * BS)) + [77] * (6 * BS), BS))
    workers = ["w0", "w1", "w2"]
    idx = PrefixIndex()
    confirmed = {w: set() for w in workers}
    prov = {w: {} for w in workers}
    now = 0.0
    for _ in range(3000):
        now += rng.random()
        w = rng.choice(workers)
        p = rng.choice(prompts)
        op = rng.random()
        if op < 0.3:
            i = rng.randrange(len(p))
            j = rng.randrange(i, min(i + 4, len(p))) + 1
            idx.apply_stored(w, p[i - 1] if i else None, p[i:j])
            for h in p[i:j]:
                prov[w].pop(h, None)
                confirmed[w].add(h)
        elif op < 0.6:
            n = rng.randint(1, len(p))
            idx.apply_provisional(w, p[:n], now + 3.0)
            for h in p[:n]:
                if h in prov[w] or h not in confirmed[w]:
                    prov[w][h] = now + 3.0
        elif op < 0.95:
            gone = rng.sample(p, rng.randint(1, 3))
            idx.apply_removed(w, gone)
            for h in gone:
                confirmed[w].discard(h)
                prov[w].pop(h, None)
        else:
            idx.clear(w)
            confirmed[w].clear()
            prov[w].clear()
        idx.expire(now)
        for ww in workers:
            prov[ww] = {h: e for h, e in prov[ww].items() if e > now}
        q = rng.choice(prompts)
        expected = {}
        for ww in workers:
            held = confirmed[ww] | set(prov[ww])
            n = next((k for k, h in enumerate(q) if h not in held), len(q))
            if n:
                expected[ww] = n
        assert idx.match(q) == expected
        assert idx.provisional(w) == len(prov[w])
        assert idx.blocks(w) == len(confirmed[w] | set(prov[w]))


def test_a_lazy_chain_matches_like_a_list_and_hashes_only_what_the_walk_reads():
    from services.model.hashing import BlockHashChain

    tokens = list(range(64 * BS))  # 64 blocks; A is its first 8
    idx = PrefixIndex()
    idx.apply_stored("w1", None, A[:3])
    lazy = BlockHashChain(tokens, BS)
    assert idx.match(lazy) == idx.match(A) == {"w1": 3}
    assert lazy.computed <= 16 < len(lazy)  # the tail after the first miss was not hashed
    idx.apply_stored("w1", A[2], A[3:])
    assert idx.match(BlockHashChain(tokens[: 8 * BS], BS)) == {"w1": 8}
    assert idx.match(BlockHashChain(tokens[: BS - 1], BS)) == {}
