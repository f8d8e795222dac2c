import math
import random

import pytest

from services.common.config import ConfigError
from services.router.policy import (
    POLICY_NAMES,
    Candidate,
    KvAwarePolicy,
    PolicyConfig,
    WorkerLoad,
    make_policy,
)


def cand(worker_id: str, decode_blocks: int = 0, tokens_waiting: int = 0, healthy=True, inflight=0):
    load = WorkerLoad(active_decode_blocks=decode_blocks, tokens_waiting=tokens_waiting)
    return Candidate(worker_id, load, healthy, inflight)


def ids(choices):
    return [c.worker_id for c in choices]


def kv(seed=0, **cfg):
    return make_policy("kv_aware", PolicyConfig(block_size=16, **cfg), random.Random(seed))


def test_factory_knows_every_policy_and_refuses_others():
    assert {make_policy(n).name for n in POLICY_NAMES} == set(POLICY_NAMES)
    with pytest.raises(ValueError, match="kv_aware"):
        make_policy("random")


def test_config_is_validated():
    with pytest.raises(ConfigError):
        PolicyConfig(temperature=-1)
    with pytest.raises(ConfigError):
        PolicyConfig(block_size=0)


def test_kv_aware_prefers_the_worker_with_the_most_cached_prefix():
    ranked = kv().rank([cand("a"), cand("b"), cand("c")], prompt_blocks=10, overlaps={"b": 8, "c": 3})
    assert ids(ranked) == ["b", "c", "a"]
    assert [c.cost for c in ranked] == [2, 7, 10]
    assert ranked[0].overlap_blocks == 8


def test_kv_aware_load_outweighs_a_small_overlap():
    # b has 2 more cached blocks but 5 more active decode blocks.
    ranked = kv().rank([cand("a", decode_blocks=1), cand("b", decode_blocks=6)], 10, {"a": 4, "b": 6})
    assert ids(ranked) == ["a", "b"]
    assert [c.cost for c in ranked] == [7, 10]


def test_kv_aware_counts_queued_prefill_tokens_as_blocks_and_weights_them():
    p = kv(prefill_weight=2.0)
    # a: 33 queued tokens = 3 blocks; (4 - 0 + 3) * 2 = 14. b: (4 - 0 + 0) * 2 + 5 = 13.
    ranked = p.rank([cand("a", tokens_waiting=33), cand("b", decode_blocks=5)], 4, {})
    assert [(c.worker_id, c.cost) for c in ranked] == [("b", 13), ("a", 14)]


def test_kv_aware_clamps_an_overlap_beyond_the_prompt():
    (only,) = kv().rank([cand("a")], prompt_blocks=3, overlaps={"a": 9})
    assert (only.cost, only.overlap_blocks) == (0, 3)


def test_kv_aware_ties_are_broken_randomly_but_reproducibly():
    cands = [cand(f"w{i}") for i in range(4)]
    firsts = [ids(kv(seed).rank(cands, 4, {}))[0] for seed in range(40)]
    assert len(set(firsts)) == 4  # every tied worker wins sometimes
    assert firsts == [ids(kv(seed).rank(cands, 4, {}))[0] for seed in range(40)]


def test_unhealthy_candidates_are_skipped_by_every_policy():
    cands = [cand("sick", healthy=False), cand("ok")]
    for name in POLICY_NAMES:
        ranked = make_policy(name, rng=random.Random(0)).rank(cands, 4, {"sick": 4})
        assert ids(ranked) == ["ok"], name
    assert make_policy("kv_aware").rank([], 4, {}) == []


def test_temperature_sampling_follows_the_softmax_of_normalized_costs():
    p = KvAwarePolicy(PolicyConfig(temperature=1.0), random.Random(1234))
    cands = [cand("cheap"), cand("dear", decode_blocks=10)]  # costs 0 and 10 -> normalized 0 and 1
    n = 20_000
    wins = sum(ids(p.rank(cands, 0, {}))[0] == "cheap" for _ in range(n))
    expected = 1 / (1 + math.exp(-1))  # 0.731
    assert abs(wins / n - expected) < 0.015


def test_temperature_ranking_is_a_permutation_and_low_temperature_is_nearly_greedy():
    p = KvAwarePolicy(PolicyConfig(temperature=0.05), random.Random(5))
    cands = [cand("a", decode_blocks=0), cand("b", decode_blocks=5), cand("c", decode_blocks=10)]
    results = [ids(p.rank(cands, 0, {})) for _ in range(200)]
    assert all(sorted(r) == ["a", "b", "c"] for r in results)
    assert sum(r[0] == "a" for r in results) >= 195


def test_round_robin_cycles_in_worker_id_order():
    p = make_policy("round_robin")
    cands = [cand("c"), cand("a"), cand("b")]
    firsts = [ids(p.rank(cands))[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert ids(p.rank(cands)) == ["a", "b", "c"]  # the rest of the ranking rotates too


def test_least_loaded_orders_by_load_then_router_inflight():
    p = make_policy("least_loaded", PolicyConfig(block_size=16), random.Random(0))
    cands = [
        cand("busy", decode_blocks=9),
        cand("queued", tokens_waiting=160),  # 10 blocks of queued prefill
        cand("idle-but-routed", inflight=3),
        cand("idle"),
    ]
    assert ids(p.rank(cands, 4, {"busy": 4})) == ["idle", "idle-but-routed", "busy", "queued"]


def test_kv_aware_busy_blocks_prices_the_pass_in_progress():
    # a holds 20 of the prompt's 100 blocks but is running a request; b is idle. In blocks
    # alone a wins (100 - 20 + 0.1 * 100 = 90 < 100); a new request there waits out a's
    # pass and shares the next one, which busy_blocks prices.
    cands = [
        Candidate("a", WorkerLoad(running=1, active_decode_blocks=100)),
        Candidate("b", WorkerLoad()),
    ]
    plain = make_policy("kv_aware", PolicyConfig(decode_weight=0.1), random.Random(0))
    assert plain.rank(cands, 100, {"a": 20})[0].worker_id == "a"
    busy = make_policy("kv_aware", PolicyConfig(decode_weight=0.1, busy_blocks=30), random.Random(0))
    ranked = busy.rank(cands, 100, {"a": 20})
    assert [c.worker_id for c in ranked] == ["b", "a"] and ranked[1].cost == 120


def test_kv_aware_ranks_on_predicted_time_with_measured_speeds():
    """speeds: (prefill factor, decode factor) against the fleet's median worker."""
    p = kv(decode_weight=0.1)
    idle = [cand("slow"), cand("fast")]
    # Idle and uncached: the block costs tie; the slower prefill costs more.
    ranked = p.rank(idle, 10, speeds={"slow": (2.0, 1.0), "fast": (0.5, 1.0)})
    assert ids(ranked) == ["fast", "slow"]
    # prefill 0.5 * 10 + decode 1 * 0.1 * (0 + 10) = 6; slow: 2 * 10 + 0.1 * 10 = 21
    assert [c.cost for c in ranked] == pytest.approx([6.0, 21.0])
    # A slower decoder: its own context's decode costs more (a worker without an entry is 1).
    ranked = p.rank(idle, 10, speeds={"slow": (1.0, 4.0)})
    assert ids(ranked) == ["fast", "slow"]
    assert [c.cost for c in ranked] == pytest.approx([11.0, 14.0])
    # A cache hit on the slow worker still wins when it saves more than the speed costs.
    ranked = p.rank(idle, 10, {"slow": 8}, speeds={"slow": (2.0, 1.0)})
    assert ids(ranked) == ["slow", "fast"]  # 2 * 2 + 1 = 5 < 10 + 1
    # A queue on the fast worker counts at its own speed: 32 tokens waiting = 2 blocks.
    loaded = [cand("slow"), cand("fast", tokens_waiting=32 * 16)]
    assert ids(p.rank(loaded, 10, speeds={"slow": (2.0, 1.0), "fast": (0.5, 1.0)})) == ["slow", "fast"]
    assert ids(p.rank(loaded, 10, speeds={"slow": (2.0, 1.0), "fast": (0.2, 1.0)})) == ["fast", "slow"]


def test_without_speeds_kv_aware_costs_are_dynamos():
    p = kv(decode_weight=0.1)
    ranked = p.rank([cand("a", decode_blocks=20), cand("b")], 10)
    assert [(c.worker_id, c.cost) for c in ranked] == [("b", pytest.approx(10.0)), ("a", pytest.approx(12.0))]
    assert p.rank([cand("a")], 10, speeds={})[0].cost == pytest.approx(10.0)  # empty: unmeasured


def test_least_loaded_weighs_each_load_by_the_workers_speed():
    p = make_policy("least_loaded", PolicyConfig(block_size=16, decode_weight=1.0), random.Random(0))
    cands = [cand("a", decode_blocks=10), cand("b", decode_blocks=15)]
    assert ids(p.rank(cands)) == ["a", "b"]
    assert ids(p.rank(cands, speeds={"a": (1.0, 2.0)})) == ["b", "a"]  # 20 > 15
