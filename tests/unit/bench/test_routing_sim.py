"""bench/routing_sim.py: the model serves every request, frees every block, and no policy beats the floor."""

import argparse
import statistics

import pytest

from bench.routing_sim import Cluster, Req, make_reqs, parse_variant, unloaded_ttft_ms
from services.model.timing import load_profile


def args(workers=4, requests=100):
    return argparse.Namespace(
        workers=workers,
        requests=requests,
        output_factor=16,
        num_blocks=65536,
        block_size=16,
        mbt=8192,
        report_interval_s=1.0,
        seed=0,
    )


def test_every_request_finishes_and_the_pool_empties():
    a = args()
    prof = load_profile("dynamo-mocker").scaled_to(a.num_blocks, a.block_size)
    base = make_reqs(a, 0.6)
    results = {}
    for spec in ("rr", "kv@lv", "kv@hb:dw=1", "kv@lv:lag=0.05+ttl=10"):
        reqs = [Req(r.rid, r.arrival, r.hashes, r.prompt, r.out) for r in base]
        cluster = Cluster(a, parse_variant(spec), reqs, prof, 0)
        cluster.run()
        assert all(r.produced == r.out and r.first_token >= r.arrival for r in reqs)
        for w in cluster.workers:  # nothing running, nothing reserved: only free cached blocks remain
            assert not w.running and not w.waiting and not w.refs
            assert w.used_extra == 0 and w.uncomputed == 0
        assert len(cluster.view) == 0  # the own load view ended every request
        results[spec] = reqs
    # The floor: each prompt alone on an idle worker with no cache at all bounds every TTFT from below
    # (its own prefill can only be shortened by hits, which the ideal-cache floor accounts for).
    for reqs in results.values():
        for r in reqs:
            alone = unloaded_ttft_ms(prof, r.prompt - r.cached, a.mbt)
            assert (r.first_token - r.arrival) * 1000 >= alone - 1e-6
    # The trace's first 100 requests share little (every policy finds the same few hits), but
    # placing by cost already queues less than rotating.
    hit = {k: sum(r.cached for r in v) / sum(r.prompt for r in v) for k, v in results.items()}
    assert hit["kv@lv"] >= hit["rr"] > 0
    ttft = {k: statistics.mean(r.first_token - r.arrival for r in v) for k, v in results.items()}
    assert ttft["kv@lv"] < 0.95 * ttft["rr"]


def test_variant_options_parse():
    v = parse_variant("kv@lv:dw=1+lag=0.5+ttl=10+oracle=1")
    assert (v.policy, v.own_view, v.decode_weight, v.lag, v.ttl, v.oracle) == (
        "kv_aware",
        True,
        1.0,
        0.5,
        10.0,
        True,
    )
    assert parse_variant("rr").policy == "round_robin"
    with pytest.raises(ValueError):
        parse_variant("kv@lv:bogus=1")


def test_the_hash_memo_model_counts_the_chunks_a_walk_hashes():
    """memo_walk: a walk `depth` blocks deep hashes ceil((depth + 1) / 16) chunks (the block
    that ends the match is read too), each keyed by its last block's chained hash; a chunk
    seen before is a hit, the LRU bound evicts the oldest."""
    a = args()
    a.memo_chunks = [2, 0]
    prof = load_profile("dynamo-mocker").scaled_to(a.num_blocks, a.block_size)
    cluster = Cluster(a, parse_variant("kv@lv"), [], prof, 0)
    first = list(range(1000, 1040))  # 40 blocks: chunks end at blocks 15, 31 and 39 (a partial one)
    cluster.memo_walk(first, 0)  # nothing cached: block 0 alone is read, chunk 0 hashed (a miss)
    cluster.memo_walk(first, 39)  # all 40 blocks: chunk 0 hits, chunks 1 and 2 are new
    assert cluster.memo_counts[0] == [0, 2, 1, 3, 0]  # warm, cold decisions; hit, missed chunks
    assert list(cluster.memos[0]) == [1015, 1031, 1039]
    assert list(cluster.memos[2]) == [1031, 1039]  # the bound of 2 dropped the oldest, chunk 0
    cluster.memo_walk(first, 20)  # chunks 0 and 1; under the bound of 2 chunk 0 was gone, and
    # taking it back evicted chunk 1 before the walk reached it: two misses there
    assert cluster.memo_counts[0] == [1, 2, 3, 3, 0]
    assert cluster.memo_counts[2] == [0, 3, 1, 5, 0]
    assert list(cluster.memos[2]) == [1015, 1031]
    longer = [*first[:32], 2000, 2001]  # the same first 32 blocks, another end: its last chunk is new
    cluster.memo_walk(longer, 33)
    assert cluster.memo_counts[0][2:] == [5, 4, 0]
    cluster.memo_walk([*first[:16], 3000], 17, decision=False)  # after a decision: counted apart
    assert cluster.memo_counts[0] == [1, 3, 5, 4, 1] and 3000 in cluster.memos[0]


def test_a_heterogeneous_fleet_slows_its_slow_workers_and_the_profiles_find_them():
    """--speeds: worker i's pass times x entry i mod len; prof=1 learns the factors online."""
    from bench.routing_sim import parse_speeds

    assert parse_speeds("1, 3/1.6") == [(1.0, 1.0), (3.0, 1.6)]
    with pytest.raises(ValueError):
        parse_speeds("1,0")
    a = args(requests=300)
    a.speeds = parse_speeds("1,3")
    prof = load_profile("dynamo-mocker").scaled_to(a.num_blocks, a.block_size)
    base = make_reqs(a, 0.6)
    reqs = [Req(r.rid, r.arrival, r.hashes, r.prompt, r.out) for r in base]
    cluster = Cluster(a, parse_variant("kv@lv:prof=1"), reqs, prof, 0)
    assert [w.prefill_x for w in cluster.workers] == [1.0, 3.0, 1.0, 3.0]
    cluster.run()
    assert all(r.produced == r.out for r in reqs)
    speeds = cluster.profiles.speeds()
    fast = max(speeds[w][0] for w in ("0", "2"))
    assert min(speeds[w][0] for w in ("1", "3")) > fast  # the slow ones cost more per prefill block
    labelled = Cluster(a, parse_variant("kv@lv:label=1"), [], prof, 0)
    assert labelled.labels == {"0": (0.5, 0.5), "1": (1.5, 1.5), "2": (0.5, 0.5), "3": (1.5, 1.5)}


def _loaded_holder(variant: str):
    """Two workers: worker 0 holds a 250-block prefix and reports a long prefill queue; a request
    sharing that prefix is routed."""
    a = args(workers=2)
    prof = load_profile("dynamo-mocker").scaled_to(a.num_blocks, a.block_size)
    cluster = Cluster(a, parse_variant(variant), [], prof, 0)
    prefix = list(range(5000, 5250))
    holder = cluster.workers[0]
    for h in prefix:
        holder.cache[h] = None
    from services.router.policy import WorkerLoad

    cluster.reports[0] = WorkerLoad(tokens_waiting=200_000)  # busy: the policy prefers worker 1
    r = Req(0, 0.0, [*prefix, 9000, 9001], 252 * 16 + 5, 4)
    cluster.route(r, 0.0)
    cluster.drain()
    return cluster, r, prefix


def test_a_pull_lands_the_holders_prefix_on_the_chosen_worker_before_it_queues():
    """pull=1: the router's PrefixPullPlanner decides; the target gets the holder's blocks (as
    cached, announced in its KV log) after the pull's time, then computes only the rest."""
    cluster, r, prefix = _loaded_holder("kv@lv:pull=1")
    assert r.worker == 1 and r.pulled == len(prefix)
    assert r.cached == len(prefix) * 16  # admitted with the pulled blocks as its cached prefix
    assert all(h in cluster.workers[1].cache for h in prefix)
    assert r.produced == r.out
    assert r.first_token >= cluster.puller.pull_s(len(prefix))  # the pull came first
    w = cluster.workers[1]
    assert not w.running and not w.waiting and not w.refs and w.used_extra == 0 and w.uncomputed == 0
    assert len(cluster.view) == 0
    # Without pulls the same request recomputes the prefix on worker 1.
    _, r0, _ = _loaded_holder("kv@lv")
    assert r0.worker == 1 and r0.pulled == 0 and r0.cached == 0
    assert r0.first_token > r.first_token  # recomputing 4,000 tokens is slower than pulling them
