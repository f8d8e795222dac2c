"""The prefix-pull decision (services/router/prefix_pull.py): route + optional pull source."""

from __future__ import annotations

import pytest

from services.router.prefix_pull import PrefixPullConfig, PrefixPullPlanner, WorkerView, rate_of

BS = 16


def planner(**kw) -> PrefixPullPlanner:
    # 1 MB per block over 1 GB/s = 1 ms a block; recompute of a block at 1,600 tok/s = 10 ms.
    cfg = PrefixPullConfig(
        enabled=True, link_bytes_per_s=1e9, kv_bytes_per_token=1e6 / BS, latency_s=0.0, **kw
    )
    return PrefixPullPlanner(cfg, BS)


def w(wid: str, overlap: int, wait_s: float = 0.0, rate: float = 1600.0) -> WorkerView:
    return WorkerView(wid, overlap, wait_s, rate)


def test_preferred_worker_pulls_the_loaded_holders_prefix():
    # The policy chose b (idle); a holds 50 of the 60 blocks but is busy.
    p = planner().plan([w("a", 50, wait_s=2.0), w("b", 0)], prompt_blocks=60, preferred="b")
    assert (p.target, p.source, p.pull_blocks) == ("b", "a", 50)
    # pull 50 ms + remainder 10 blocks x 10 ms, against 600 ms of recompute.
    assert p.predicted_s == pytest.approx(0.05 + 0.1)
    assert p.recompute_s == pytest.approx(0.6)


def test_no_pull_when_the_link_is_slower_than_recompute():
    # 1 MB blocks over 50 MB/s = 20 ms a block > 10 ms to recompute it.
    cfg = PrefixPullConfig(enabled=True, link_bytes_per_s=5e7, kv_bytes_per_token=1e6 / BS, latency_s=0.0)
    p = PrefixPullPlanner(cfg, BS).plan([w("a", 50, wait_s=2.0), w("b", 0)], 60, "b")
    assert (p.target, p.source) == ("b", "")


def test_a_measured_link_prices_the_pull_not_the_configured_one():
    # Configured: 1 ms a block (a pull pays). b measured 20 ms a block on its own transfers, more
    # than the 10 ms a recompute costs: no pull to b. c measured 0.5 ms: pulls, at its price.
    slow = WorkerView("b", 0, 0.0, 1600.0, link_s_per_block=0.020)
    assert planner().plan([w("a", 50, wait_s=2.0), slow], 60, "b").source == ""
    fast = WorkerView("c", 0, 0.0, 1600.0, link_s_per_block=0.0005)
    p = planner().plan([w("a", 50, wait_s=2.0), fast], 60, "c")
    assert (p.source, p.pull_blocks) == ("a", 50)
    assert p.predicted_s == pytest.approx(50 * 0.0005 + 0.1)
    # A measured fixed part replaces the configured latency: 500 ms of it make the pull lose.
    late = WorkerView("c", 0, 0.0, 1600.0, link_s_per_block=0.0005, link_latency_s=0.5)
    assert planner().plan([w("a", 50, wait_s=2.0), late], 60, "c").source == ""
    configured = PrefixPullPlanner(PrefixPullConfig(latency_s=0.3), BS)
    assert configured.pull_s(10, 0.001, 0.002) == pytest.approx(0.012)  # measured: no configured 0.3 s
    # And the other way: a configured link too slow to pull, a measured one fast enough.
    cfg = PrefixPullConfig(enabled=True, link_bytes_per_s=5e7, kv_bytes_per_token=1e6 / BS, latency_s=0.0)
    assert PrefixPullPlanner(cfg, BS).plan([w("a", 50, wait_s=2.0), fast], 60, "c").source == "a"


def test_the_ranking_hook_reads_each_workers_measured_link_from_its_load():
    from services.router.policy import Candidate, Choice, WorkerLoad
    from services.router.prefix_pull import plan_for_ranking

    cands = [
        Candidate("a", WorkerLoad(tokens_waiting=16_000, estimated_wait_ms=2000.0)),
        Candidate("b", WorkerLoad(link_ms_per_block=20.0)),  # measured: slower than recomputing
    ]
    ranked = [Choice("b", 60.0, 0), Choice("a", 90.0, 50)]
    p = planner(prior_tokens_per_s=1600.0)
    assert plan_for_ranking(p, ranked, cands, {"a": 50}, 60)[1] is None
    cands[1] = Candidate("b", WorkerLoad())  # nothing measured: the configured 1 ms a block
    assert plan_for_ranking(p, ranked, cands, {"a": 50}, 60)[1].source == "a"


def test_no_pull_when_the_preferred_worker_has_the_prefix_too():
    p = planner().plan([w("a", 50, wait_s=2.0), w("b", 50)], 60, "b")
    assert (p.target, p.source) == ("b", "")


def test_short_prefix_is_not_worth_a_pull():
    p = planner(min_pull_blocks=4).plan([w("a", 3, wait_s=2.0), w("b", 0)], 60, "b")
    assert p.source == ""


def test_moves_off_a_loaded_holder_chosen_by_the_policy():
    # The policy picked the holder a (its overlap outweighed its queue); a 1 s queue
    # against an idle b that can pull the 50 blocks in 50 ms.
    p = planner().plan([w("a", 50, wait_s=1.0), w("b", 0), w("c", 0, wait_s=0.5)], 60, "a")
    assert (p.target, p.source, p.pull_blocks) == ("b", "a", 50)
    assert p.predicted_s < 1.0 * 0.8


def test_stays_on_the_holder_without_a_clear_gain():
    # a waits 120 ms: local(a) = 0.12 + 0.1 = 0.22 s; b pulling = 0.05 + 0.1 = 0.15 s,
    # a 32% gain; with min_gain 0.5 that is not enough.
    views = [w("a", 50, wait_s=0.12), w("b", 0)]
    assert planner(min_gain=0.5).plan(views, 60, "a").source == ""
    assert planner(min_gain=0.2).plan(views, 60, "a").target == "b"


def test_an_idle_holder_keeps_its_request():
    p = planner().plan([w("a", 50), w("b", 0)], 60, "a")
    assert (p.target, p.source) == ("a", "")


def test_pull_counts_only_the_blocks_the_target_lacks():
    p = planner().plan([w("a", 50, wait_s=2.0), w("b", 20)], 60, "b")
    assert (p.source, p.pull_blocks) == ("a", 50)
    assert p.predicted_s == pytest.approx(0.03 + 0.1)  # 30 blocks moved


def test_overlap_beyond_the_prompt_is_clamped():
    p = planner().plan([w("a", 90, wait_s=2.0), w("b", 0)], 60, "b")
    assert p.pull_blocks == 60


def test_rate_of_reads_backlog_over_wait_or_the_prior():
    assert rate_of(2000, 1000.0, 50.0) == pytest.approx(2000.0)
    assert rate_of(0, 0.0, 50.0) == 50.0


def test_config_is_validated():
    with pytest.raises(ValueError):
        PrefixPullConfig(link_bytes_per_s=0)
    with pytest.raises(ValueError):
        PrefixPullConfig(min_gain=1.0)
