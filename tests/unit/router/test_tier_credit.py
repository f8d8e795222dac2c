"""Tier-aware overlap credit: weights from measured restore vs recompute time."""

import random

import pytest

from services.router.policy import (
    Candidate,
    PolicyConfig,
    TierOverlap,
    make_policy,
    overlap_credit,
    tier_weight,
)


def test_a_device_block_restores_for_free_and_gets_full_credit():
    assert tier_weight(0.0, 0.010) == 1.0


def test_the_weight_is_the_share_of_recompute_time_saved():
    # Host tier: 64 KiB block at 16 GB/s = 4 us restore; 16 tokens at 4,000 tok/s = 4 ms.
    assert tier_weight(4e-6, 4e-3) == pytest.approx(0.999)
    assert tier_weight(1.0, 4.0) == pytest.approx(0.75)


def test_a_tier_no_faster_than_recompute_earns_nothing():
    assert tier_weight(5.0, 4.0) == 0.0
    assert tier_weight(4.0, 4.0) == 0.0
    assert tier_weight(1.0, 0.0) == 0.0  # nothing to recompute, nothing to save


@pytest.mark.parametrize("restore,recompute", [(-1, 1), (1, -1), (float("nan"), 1), (1, float("inf"))])
def test_bad_measurements_are_refused(restore, recompute):
    with pytest.raises(ValueError):
        tier_weight(restore, recompute)


def test_credit_sums_each_tiers_blocks_times_its_weight():
    assert overlap_credit([TierOverlap(10, 1.0), TierOverlap(20, tier_weight(1.0, 2.0))]) == 20.0
    assert overlap_credit([]) == 0.0
    with pytest.raises(ValueError):
        TierOverlap(3, 1.5)


def test_kv_aware_scores_on_credits_when_given():
    p = make_policy("kv_aware", PolicyConfig(block_size=16), random.Random(0))
    cands = [Candidate("dev"), Candidate("host"), Candidate("none")]
    overlaps = {"dev": 8}
    # "host" holds 16 blocks in host memory restoring at 3/4 of recompute time: credit 4.
    credits = {"dev": 8.0, "host": overlap_credit([TierOverlap(16, tier_weight(3.0, 4.0))])}
    ranked = p.rank(cands, prompt_blocks=16, overlaps=overlaps, credits=credits)
    assert [c.worker_id for c in ranked] == ["dev", "host", "none"]
    assert [c.cost for c in ranked] == [8.0, 12.0, 16.0]
    assert ranked[1].overlap_blocks == 0  # device overlap: what the worker will find cached
    # A faster host tier (restore 1/16 of recompute): credit 15 beats 8 device blocks.
    credits["host"] = overlap_credit([TierOverlap(16, tier_weight(1.0, 16.0))])
    assert p.rank(cands, 16, overlaps, credits)[0].worker_id == "host"


def test_the_weight_follows_the_measured_rates_not_a_constant():
    from services.router.policy import measured_tier_weight

    # 16-token blocks of 2 MiB (SmolLM-sized KV x 16), host link 20 GB/s, 1 ms per transfer;
    # prefill 10k tokens/s -> recompute 1.6 ms per block.
    kw = {"block_bytes": 2 << 20, "restore_latency_s": 1e-3, "block_tokens": 16}
    one = measured_tier_weight(restore_bytes_per_s=20e9, prefill_tokens_per_s=10_000, blocks=1, **kw)
    many = measured_tier_weight(restore_bytes_per_s=20e9, prefill_tokens_per_s=10_000, blocks=100, **kw)
    assert 0 < one < many < 1  # the transfer latency weighs on a short prefix
    assert many == pytest.approx(1 - (1e-3 + 100 * (2 << 20) / 20e9) / (100 * 16 / 10_000))
    # A faster prefill (a bigger GPU) makes restoring worth less; a slower link too.
    assert (
        measured_tier_weight(restore_bytes_per_s=20e9, prefill_tokens_per_s=40_000, blocks=100, **kw) < many
    )
    assert measured_tier_weight(restore_bytes_per_s=5e9, prefill_tokens_per_s=10_000, blocks=100, **kw) < many
    # Not measured yet: no credit rather than a guess.
    assert measured_tier_weight(restore_bytes_per_s=0, prefill_tokens_per_s=10_000, blocks=100, **kw) == 0.0
    assert measured_tier_weight(restore_bytes_per_s=20e9, prefill_tokens_per_s=0, blocks=100, **kw) == 0.0
