"""bench/routing_quality.py's pure parts: the ideal hit rate, the workload and the scale studies."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.loadgen import WorkItem
from bench.routing_quality import (
    FULL,
    QUICK,
    VARIANTS,
    PolicyResult,
    _pulls,
    ideal_hit,
    paired_by_request,
    repeat_order,
    scale_study,
    workload,
)
from bench.stats import RequestRecord, summarize


def test_ideal_hit_counts_full_blocks_of_prefixes_seen_before():
    a = tuple(range(40))
    items = [
        WorkItem(0.0, a, 1),  # 40 tokens, nothing seen: 0 cached
        WorkItem(1.0, (*a, 7, 7), 1),  # the first 32 tokens (2 full blocks of 16) were seen
        WorkItem(2.0, a[:32], 1),  # all 32 seen, but the last token is always computed: 16
    ]
    assert ideal_hit(items, 16) == pytest.approx((0 + 32 + 16) / (40 + 42 + 32))


def test_workload_shares_prefixes_and_differs_per_seed():
    study = replace(QUICK, requests=60)
    one, again, other = workload(study, 0), workload(study, 0), workload(study, 1)
    assert one == again and len(one) == 60
    assert [len(i.prompt_ids) for i in one] == [len(i.prompt_ids) for i in other]
    assert [i.arrival_s for i in one] == [i.arrival_s for i in other]
    assert one[0].prompt_ids != other[0].prompt_ids  # another policy never hits the last one's cache
    assert ideal_hit(one, 16) > 0  # Mooncake rows share hash ids: shared prefixes


def test_scale_studies_keep_the_load_per_worker_and_the_wall_rate():
    for n in (8, 16, 32):
        s = scale_study(n)
        assert s.workers == n and s.requests == FULL.requests
        assert s.wall_factor == pytest.approx(FULL.wall_factor)
        # Offered model-time rate per worker: 1 / (time_factor * workers) stays the same.
        assert s.time_factor * n == pytest.approx(FULL.time_factor * FULL.workers)


def test_repeated_policies_alternate_their_order():
    assert repeat_order(("a", "b"), 1) == ("a", "b")
    assert repeat_order(("a", "b"), 4) == ("a", "b", "b", "a", "a", "b", "b", "a")
    firsts = repeat_order(("a", "b", "c"), 2)[::3]
    assert firsts == ("a", "c")  # each policy's place in the run moves


def _record(run: str, i: int, ttft_s: float, cached: int) -> RequestRecord:
    r = RequestRecord(f"lg-{run}-{i}", 0.0, 0.0, 100, 2, cached_tokens=cached)
    r.add_message(ttft_s, 1)
    r.ok = True
    return r


def test_a_paired_comparison_splits_the_requests_that_gained_cached_tokens_from_the_rest():
    """Paired by trace position (the run ids differ); times in model ms (wall x speedup)."""
    study = replace(QUICK, speedup=2.0)
    a = [_record("a", 0, 0.100, 0), _record("a", 1, 0.050, 16), _record("a", 2, 0.040, 0)]
    b = [_record("b", 0, 0.060, 64), _record("b", 1, 0.055, 16), _record("b", 2, 0.040, 0)]
    pa = PolicyResult("kv_aware@lv", study, summarize(a), a)
    pb = PolicyResult("kv_aware@lvpull", study, summarize(b), b)
    line = paired_by_request(pa, pb)
    # request 0 had more cached in B: (0.060 - 0.100) s x 2 = -80 ms; 1 and 2 are the rest: +10 and 0
    assert "more cached 1: TTFT change mean -80 ms, median -80" in line
    assert "the rest 2: TTFT change mean +5 ms, median +5" in line


def test_pull_variants_are_recognised_by_their_flag_not_their_name():
    assert _pulls("kv_aware@pull") and _pulls("kv_aware@lvpull") and _pulls("kv_aware@pullkeep")
    assert not _pulls("kv_aware@lv") and not _pulls("kv_aware") and not _pulls("kv_aware@opt")
    assert VARIANTS["lvpull"]["optimistic_prefix_ttl_s"] == 0  # the default router's index, plus pulls
