"""The host KV tier: LRU with a frequency filter, offload on eviction, restore
into scattered pool blocks, events per tier, the restore-vs-recompute rule, and
outputs unchanged by a restore (torch tiny model, greedy and seeded)."""

from __future__ import annotations

import torch

from services.engine.api import EngineRequest, KvEventKind, KvTier
from services.engine.block_manager import BlockManager
from services.engine.host_tier import HostTier, ModeledTierCost, TierCost
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from services.model.timing import load_profile
from tests.unit.engine.conftest import prompt_of, request

BS = 4


def tier(capacity: int) -> HostTier:
    return HostTier(capacity, (2, 3), torch.float32, block_bytes=24)


def block(value: float) -> torch.Tensor:
    return torch.full((1, 2, 3), value)


def test_lru_keeps_the_most_recent_and_round_trips_the_data():
    t = tier(2)
    assert t.offer([(1, None)], block(1.0)) == ([1], [])
    assert t.offer([(2, 1)], block(2.0)) == ([2], [])
    t.touch([1])  # 2 is now the least recently used
    stored, evicted = t.offer([(3, 2)], block(3.0))
    assert (stored, evicted) == ([3], [2])
    assert t.match([1, 2, 3]) == 1  # the leading run only: 2 is gone
    assert t.match([1, 3]) == 2
    assert torch.equal(t.read([1, 3]), torch.cat([block(1.0), block(3.0)]))
    assert t.stats().bytes == 2 * 24


def test_frequency_filter_keeps_popular_blocks_against_a_scan():
    t = tier(2)
    t.record_use([1, 1, 1, 2, 2, 2])
    t.offer([(1, None), (2, 1)], torch.cat([block(1.0), block(2.0)]))
    # A scan of single-use blocks: each used less often than the LRU victim, so refused.
    for h in range(100, 110):
        t.record_use([h])
        assert t.offer([(h, None)], block(h)) == ([], [])
    assert t.match([1, 2]) == 2 and t.stats().rejected == 10
    # One used as often as the victim gets in, evicting the LRU entry.
    t.record_use([7, 7, 7])
    assert t.offer([(7, None)], block(7.0)) == ([7], [1])


def test_use_counts_are_bounded_and_age():
    t = tier(1)
    t.record_use([5] * 4)
    t.record_use(list(range(1000, 1000 + 8)))  # more distinct hashes than 8 x capacity allows
    assert t.uses(5) == 2  # halved; single uses forgotten
    assert len(t._uses) <= 8 * t.capacity_blocks


class Pool:
    """A stand-in KV pool for the BlockManager: block i holds the value of its content."""

    def __init__(self, n: int):
        self.data = torch.zeros((n, 2, 3))

    def read(self, ids):
        return self.data[torch.tensor(ids, dtype=torch.long)]

    def write(self, ids, blocks):
        self.data[torch.tensor(ids, dtype=torch.long)] = blocks


def manager(pool_blocks: int, host_blocks: int, cost: TierCost | None = None):
    bm = BlockManager(pool_blocks, BS, True, 1000)
    pool = Pool(pool_blocks)
    host = tier(host_blocks)
    bm.attach_host_tier(host, cost or TierCost(BS), pool.read, pool.write)
    return bm, pool, host


def run_prompt(sched: Scheduler, pool: Pool, tokens: list[int], rid: str) -> Sequence:
    """Admit `tokens` and 'compute' them: each computed block gets its first token's value."""
    s = Sequence(EngineRequest(rid, tokens), BS, None)
    sched.add(s)
    out = sched.schedule()
    assert [x for x, _ in out.scheduled] == [s]
    for i in range(s.num_computed_tokens // BS, len(s.block_table)):
        pool.data[s.block_table[i]] = float(tokens[i * BS])
    sched.computed(s, out.scheduled[0][1])
    return s


def test_evicted_blocks_go_to_the_host_tier_and_come_back_into_scattered_blocks():
    bm, pool, host = manager(pool_blocks=4, host_blocks=16)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a_tokens = list(range(0, 13))  # 3 full blocks + 1 token
    a = run_prompt(sched, pool, a_tokens, "a")
    sched.finish(a, a.status)
    b = run_prompt(sched, pool, list(range(100, 113)), "b")  # evicts a's blocks
    sched.finish(b, b.status)
    events = bm.events.since(0)
    removed = [e for e in events if e.kind is KvEventKind.REMOVED and e.tier is KvTier.DEVICE]
    offloaded = [e for e in events if e.kind is KvEventKind.STORED and e.tier is KvTier.HOST]
    assert removed and offloaded
    # The same blocks (a chain's events in chain order, while the LRU evicts it backwards)
    assert sorted(h for e in offloaded for h in e.block_hashes) == sorted(
        h for e in removed for h in e.block_hashes
    )
    # ... and one event for a's whole chain, not one per block (each names its parent).
    assert [(e.parent_hash, list(e.block_hashes)) for e in offloaded] == [(None, a.block_hashes(3))]
    assert host.match(a.block_hashes(3)) == 3

    # a again: its 3 blocks are restored (not recomputed) into whatever blocks are free.
    before = bm.events.last_seq
    a2 = run_prompt(sched, pool, a_tokens, "a2")
    assert a2.num_cached_tokens == 12 and a2.num_computed_tokens == 13
    assert [pool.data[b][0, 0].item() for b in a2.block_table[:3]] == [0.0, 4.0, 8.0]
    restored = [
        e for e in bm.events.since(before) if e.kind is KvEventKind.STORED and e.tier is KvTier.DEVICE
    ]
    assert [h for e in restored for h in e.block_hashes][:3] == a2.block_hashes(3)
    assert bm.prompt_tokens_restored == 12 and bm.restores == 1
    assert bm.cached_prefix_tokens(a_tokens) == 12  # cached in the pool again
    sched.finish(a2, a2.status)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_restore_slower_than_recomputing_is_not_taken():
    cost = TierCost(BS)
    cost.observe_prefill(100, 0.001)  # 10 us a token
    cost.observe_restore(1, 1.0)  # 1 s a block: far slower than 40 us of recompute
    bm, pool, host = manager(pool_blocks=4, host_blocks=16, cost=cost)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    tokens = list(range(13))
    sched.finish(a := run_prompt(sched, pool, tokens, "a"), a.status)
    sched.finish(b := run_prompt(sched, pool, list(range(100, 113)), "b"), b.status)
    assert host.match(a.block_hashes(3)) == 3
    again = run_prompt(sched, pool, tokens, "again")
    assert again.num_cached_tokens == 0 and bm.restores == 0 and cost.declined == 1
    sched.finish(again, again.status)
    assert bm.num_free_blocks == bm.num_blocks


def test_modeled_cost_prices_bytes_at_host_bandwidth_against_the_profiles_prefill():
    p = load_profile("splitwise-h100-llama70b")
    cost = ModeledTierCost(16, p.restore_s(16), p.prefill_ms)
    assert cost.restore_s(4) == 4 * 16 * p.kv_bytes_per_token / (p.host_bandwidth_gbps * 1e9)
    saved = cost.recompute_s(4, context_tokens=512, rest_tokens=100)
    assert saved == (p.prefill_ms(164, 512) - p.prefill_ms(100, 576)) / 1000.0
    assert 0.0 <= cost.credit() <= 1.0


def test_credit_follows_the_measured_ratio():
    cost = TierCost(16)
    assert cost.credit() == 1.0  # nothing measured: full credit (restores are taken)
    cost.observe_prefill(16, 0.016)  # 1 ms a token = 16 ms a block
    cost.observe_restore(1, 0.004)  # 4 ms a block
    assert abs(cost.credit() - 0.75) < 1e-9
    cost2 = TierCost(16)
    cost2.observe_prefill(16, 0.016)
    cost2.observe_restore(1, 0.032)
    assert cost2.credit() == 0.0


def test_torch_engine_outputs_are_unchanged_by_a_restore(make_engine):
    engine = make_engine(num_blocks=24, host_tier_bytes=1 << 24)
    reqs = [request(f"e{i}", prompt_of(100, seed=40 + i), max_tokens=12) for i in range(4)]
    seeded = request("s", prompt_of(100, seed=49), max_tokens=12, temperature=0.8, seed=3)
    first = {}
    for r in [*reqs, seeded]:
        first |= engine.generate([r])
    assert any(e.tier is KvTier.HOST for e in engine.kv_events_since(0)), "the pool must have offloaded"
    again = engine.generate([EngineRequest(r.request_id + "'", r.prompt_token_ids, r.sampling) for r in reqs])
    stats = engine.stats()
    assert stats.prompt_tokens_restored > 0 and stats.host_restores > 0
    assert stats.host_blocks > 0 and stats.host_bytes == stats.host_blocks * engine.spec.layout.block_bytes
    assert [again[r.request_id + "'"] for r in reqs] == [first[r.request_id] for r in reqs]
    seeded_again = engine.generate([EngineRequest("s'", seeded.prompt_token_ids, seeded.sampling)])
    assert seeded_again["s'"] == first["s"]


def test_sim_engine_charges_restores_at_the_profiles_host_bandwidth():
    from functools import partial

    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.sim.engine import sim_spec
    from services.engine.sim.runner import SimRunner

    profile = load_profile("splitwise-h100-llama70b")
    block_bytes = profile.kv_bytes_per_token * 16
    config = EngineConfig(
        backend="sim", sim_profile=profile.name, num_blocks=16, host_tier_bytes=64 * block_bytes
    )
    spec = sim_spec(config, profile)
    profile = profile.scaled_to(spec.num_blocks, 16)
    slept: list[float] = []
    engine = LLMEngine(config, spec, partial(SimRunner, profile=profile, speedup=1.0, sleep=slept.append))
    a = request("a", prompt_of(100, seed=1), max_tokens=2)
    engine.generate([a])
    engine.generate([request("b", prompt_of(200, seed=2), max_tokens=2)])  # evicts a's blocks
    engine.add_request(EngineRequest("a'", a.prompt_token_ids, a.sampling))
    out = engine.step()[0]
    stats = engine.stats()
    restored = stats.prompt_tokens_restored
    assert restored > 0 and stats.host_capacity_blocks == 64
    assert out.num_cached_tokens == 96  # the pool's surviving head + the restored rest
    restore_ms = profile.restore_s(restored) * 1000.0
    assert engine.runner.last_pass.restore_ms == restore_ms
    # The pass computed 4 tokens instead of 100: its modeled time is the short prefill plus the copy.
    assert engine.runner.last_pass.ms == profile.prefill_ms(4, 96) + restore_ms
    while engine.has_unfinished_requests():
        engine.step()


def test_a_batch_larger_than_the_tier_keeps_its_last_blocks_with_their_own_data():
    t = tier(2)
    data = torch.cat([block(float(v)) for v in (1, 2, 3)])
    stored, evicted = t.offer([(1, None), (2, 1), (3, 2)], data)
    assert stored == [2, 3] and evicted == []  # 1 was displaced within the batch: never reported
    assert torch.equal(t.read([2, 3]), torch.cat([block(2.0), block(3.0)]))


def test_quantized_tier_round_trips_within_the_schemes_error_and_stores_one_byte_values():
    g = torch.Generator().manual_seed(7)
    shape = (2, 2, 4, 3, 8)  # [L, 2, bs, Hkv, Dh]
    data = torch.randn(5, *shape, generator=g) * torch.linspace(0.1, 10, 8)  # heads of mixed scale
    for quant, rel in (("int8", 0.5 / 127), ("fp8", 1 / 16)):
        t = HostTier(8, shape, torch.float32, block_bytes=1, quant=quant)
        assert t.pool.element_size() == 1
        stored, _ = t.offer([(h, None) for h in range(5)], data)
        got = t.read(stored)
        assert got.dtype == torch.float32
        amax = data.abs().amax(dim=(3, 5), keepdim=True)  # per block, layer, K/V, head
        # int8: half a step of absmax / 127; e4m3: 1/16 relative, plus its subnormal floor
        bound = amax * rel if quant == "int8" else data.abs() * rel + amax / 448 * 2.0**-6
        assert bool(((got - data).abs() <= bound + 1e-6).all()), quant


def test_torch_engine_with_an_int8_host_tier_restores_a_quarter_of_the_bytes(make_engine):
    engine = make_engine(num_blocks=24, host_tier_bytes=1 << 22, host_tier_quant="int8")
    reqs = [request(f"q{i}", prompt_of(100, seed=60 + i), max_tokens=12) for i in range(4)]
    first = {}
    for r in reqs:
        first |= engine.generate([r])
    again = engine.generate([EngineRequest(r.request_id + "'", r.prompt_token_ids, r.sampling) for r in reqs])
    stats = engine.stats()
    assert stats.prompt_tokens_restored > 0 and stats.host_restores > 0
    fp_block = engine.spec.layout.block_bytes
    assert stats.host_bytes <= stats.host_blocks * fp_block * 0.3  # float32 pool, int8 tier
    same = sum(
        a == b for r in reqs for a, b in zip(again[r.request_id + "'"], first[r.request_id], strict=True)
    )
    assert same >= 0.9 * 12 * len(reqs)  # the restored KV is int8's, not bit-identical
    assert stats.free_blocks == engine.spec.num_blocks


def test_a_quantized_host_tier_needs_a_full_precision_torch_pool(make_engine):
    import pytest

    with pytest.raises(ValueError, match="host_tier_quant"):
        make_engine(num_blocks=24, host_tier_bytes=1 << 22, host_tier_quant="int8", kv_cache_quant="int8")
