"""The router's view of host KV tiers: host events never touch the pool's index,
a host-tier hit is credited by the worker's measured restore vs prefill time,
and a resync clears both views."""

from __future__ import annotations

import random

from pdmesh.v1 import common_pb2, worker_pb2
from services.router.convert import apply_kv_message
from services.router.policy import Candidate, KvAwarePolicy, PolicyConfig, WorkerLoad
from services.router.prefix_index import EventSequencer
from services.router.tier_index import TieredPrefixIndex, host_weight

HOST = common_pb2.KV_TIER_HOST


def stored(seq, hashes, parent=None, tier=common_pb2.KV_TIER_DEVICE):
    s = common_pb2.KvBlocksStored(block_hashes=hashes, tier=tier)
    if parent is not None:
        s.parent_hash = parent
    return common_pb2.KvEvent(seq=seq, stored=s)


def removed(seq, hashes, tier=common_pb2.KV_TIER_DEVICE):
    return common_pb2.KvEvent(seq=seq, removed=common_pb2.KvBlocksRemoved(block_hashes=hashes, tier=tier))


def feed(index, seqr, worker, *events, snapshot=None):
    if snapshot is not None:
        apply_kv_message(index, seqr, worker, worker_pb2.SubscribeKvEventsResponse(snapshot=snapshot))
    if events:
        batch = worker_pb2.KvEventBatch(events=list(events))
        apply_kv_message(index, seqr, worker, worker_pb2.SubscribeKvEventsResponse(events=batch))


def reach(index, hashes, worker="w"):
    """Leading prompt blocks `worker` holds in either tier (credit at weight 1)."""
    overlaps = index.match(hashes)
    return index.tier_credits(hashes, overlaps, {worker: WorkerLoad()}).get(worker, overlaps.get(worker, 0))


def test_offload_moves_a_block_to_the_host_view_and_a_host_eviction_keeps_the_pools_copy():
    index, seqr = TieredPrefixIndex(), EventSequencer()
    feed(index, seqr, "w", snapshot=worker_pb2.KvCacheSnapshot(seq=0))
    feed(index, seqr, "w", stored(1, [1, 2, 3, 4]))
    # The pool evicts 3, 4 (tail first) into the host tier.
    feed(index, seqr, "w", removed(2, [4, 3]), stored(3, [3, 4], parent=2, tier=HOST))
    assert index.match([1, 2, 3, 4]) == {"w": 2}  # the pool's view: 2 blocks
    assert reach(index, [1, 2, 3, 4]) == 4
    # 3 is restored to the pool, then the host tier drops it: the pool still has it.
    feed(index, seqr, "w", stored(4, [3], parent=2), removed(5, [3], tier=HOST))
    assert index.match([1, 2, 3, 4]) == {"w": 3}
    assert reach(index, [1, 2, 3, 4]) == 4
    # 4 leaves the host tier too: nothing past the pool's 3.
    feed(index, seqr, "w", removed(6, [4], tier=HOST))
    assert reach(index, [1, 2, 3, 4]) == 3
    index.clear("w")
    assert index.match([1, 2]) == {} and not index.tiers.has_tiers()


def test_a_snapshot_with_host_chains_rebuilds_both_views():
    index, seqr = TieredPrefixIndex(), EventSequencer()
    chains = [
        common_pb2.KvBlocksStored(block_hashes=[1]),
        common_pb2.KvBlocksStored(block_hashes=[2], parent_hash=1),
        common_pb2.KvBlocksStored(block_hashes=[3], parent_hash=2, tier=HOST),
    ]
    feed(index, seqr, "w", snapshot=worker_pb2.KvCacheSnapshot(seq=7, chains=chains))
    assert index.match([1, 2, 3]) == {"w": 2}
    assert reach(index, [1, 2, 3]) == 3 and index.tiers.blocks("w") == 1


def test_workers_without_a_host_tier_cost_the_view_nothing():
    index, seqr = TieredPrefixIndex(), EventSequencer()
    feed(index, seqr, "w", snapshot=worker_pb2.KvCacheSnapshot(seq=0))
    feed(index, seqr, "w", stored(1, [1, 2]))
    assert not index.tiers.has_tiers()
    assert index.tier_credits([1, 2], {"w": 2}, {"w": WorkerLoad()}) == {}


def test_host_credit_comes_from_the_workers_measured_times():
    assert host_weight(WorkerLoad(host_restore_ms_per_block=1.0, prefill_ms_per_block=4.0)) == 0.75
    assert host_weight(WorkerLoad(host_restore_ms_per_block=5.0, prefill_ms_per_block=4.0)) == 0.0
    assert host_weight(WorkerLoad()) == 1.0  # nothing measured: restores are taken


def test_kv_aware_prefers_a_fast_host_tier_over_recomputing_but_not_a_slow_one():
    index, seqr = TieredPrefixIndex(), EventSequencer()
    for w in ("a", "b"):
        feed(index, seqr, w, snapshot=worker_pb2.KvCacheSnapshot(seq=0))
    # a: 2 blocks in its pool; b: 1 in its pool + 7 more in its host tier.
    feed(index, seqr, "a", stored(1, [1, 2]))
    feed(index, seqr, "b", stored(1, list(range(1, 9))), removed(2, list(range(8, 1, -1))))
    feed(index, seqr, "b", stored(3, list(range(2, 9)), parent=1, tier=HOST))
    hashes = list(range(1, 11))
    overlaps = index.match(hashes)
    assert overlaps == {"a": 2, "b": 1}
    policy = KvAwarePolicy(PolicyConfig(), random.Random(0))
    fast = {"a": WorkerLoad(), "b": WorkerLoad(host_restore_ms_per_block=0.5, prefill_ms_per_block=5.0)}
    slow = {"a": WorkerLoad(), "b": WorkerLoad(host_restore_ms_per_block=9.0, prefill_ms_per_block=5.0)}
    for loads, best in ((fast, "b"), (slow, "a")):
        cands = [Candidate(w, load) for w, load in loads.items()]
        credits = index.tier_credits(hashes, overlaps, loads)
        assert policy.rank(cands, len(hashes), overlaps, credits=credits)[0].worker_id == best
