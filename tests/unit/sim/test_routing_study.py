"""bench/routing_quality.py's pure parts: the ideal hit rate, the workload and the scale studies."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.loadgen import WorkItem
from bench.routing_quality import FULL, QUICK, ideal_hit, repeat_order, scale_study, workload


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
