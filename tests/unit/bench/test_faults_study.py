"""bench/faults.py's pure parts: the SDK's retry wait, the router flags of each side, the figures."""

from __future__ import annotations

import random
from types import SimpleNamespace

from bench import faults
from bench.faults_client import Logical, sdk_wait_s
from bench.faults_report import RunResult, healthy_peak, hung, slow_share, waste


def test_sdk_wait_honours_a_hint_up_to_60_s_else_backs_off_with_jitter():
    rng = random.Random(0)
    assert sdk_wait_s(0, 1.5, rng) == 1.5
    for n, top in ((0, 0.5), (1, 1.0), (4, 8.0), (9, 8.0)):  # min(0.5 * 2**n, 8) x (0.75..1]
        w = sdk_wait_s(n, 120.0, rng)  # a hint over 60 s is ignored
        assert 0.75 * top <= w <= top


def test_naive_turns_every_switch_off_and_pdmesh_turns_hedging_on():
    known = {n for sw in faults.SWITCHES.values() for n in sw}
    naive, pdmesh = faults.router_flags("naive", known), faults.router_flags("pdmesh", known)
    assert naive["breaker_enabled"] == naive["retry_budget_enabled"] == naive["hedge_enabled"] == "false"
    assert naive["max_migrations"] == 0 and naive["stall_timeout_s"] == 0
    assert "breaker_consecutive_failures" not in naive  # the switch, not the legacy stand-in
    assert pdmesh["hedge_enabled"] == "true" and pdmesh["outlier_enabled"] == "true"
    old = faults.router_flags("naive", set())  # a router without the switches
    assert old["breaker_consecutive_failures"] == 1_000_000 and "breaker_enabled" not in old


def _rec(i, ok, tokens=10, computed=0, migrations=0, failed=(), end=2.0):
    r = Logical(i, 0.0, 100, tokens, deadline_s=10.0)
    r.ok, r.tokens, r.computed, r.migrations, r.end_s = ok, tokens if ok else 0, computed, migrations, end
    r.first_token_s = 0.5 if ok else None
    r.failed_attempt_tokens = list(failed)
    return r


def _result(records, samples=(), faulted=None, computed=0):
    win = SimpleNamespace(faulted=faulted or (lambda w, t: False))
    stats0 = SimpleNamespace(computed_tokens=0, wasted_tokens=0)
    stats1 = SimpleNamespace(computed_tokens=computed, wasted_tokens=0)
    return RunResult("x", list(records), list(samples), win, stats0, stats1, span_s=20.0)


def test_waste_is_computed_minus_useful_split_by_cause():
    recs = [
        _rec(0, True, computed=109),  # one clean attempt: 100 + 10 - 1
        _rec(1, True, computed=159, migrations=1),  # 50 recomputed after a migration
        _rec(2, True, computed=109, failed=[3]),  # a client retry lost 100 + 3
        _rec(3, False, failed=[0, 5]),  # failed: one retried attempt, then the last one
    ]
    w = waste(_result(recs, computed=109 + 159 + 109 + 205))
    assert w["useful"] == 3 * 109 and w["wasted"] == 50 + 205
    assert w["migrated"] == 50 and w["client_retried"] == 103 + 100 and w["failed"] == 105
    assert w["per_success"] == w["wasted"] / 3


def test_healthy_peak_skips_faulted_workers_and_hung_counts_late_or_unfinished():
    s = SimpleNamespace
    samples = [s(t=1.0, worker=0, waiting=9, running=4), s(t=1.0, worker=1, waiting=2, running=3)]
    res = _result([], samples, faulted=lambda w, t: w == 0)
    assert healthy_peak(res) == (5, 2)
    late = _rec(1, True, end=11.5)
    unfinished = _rec(2, False, end=None)
    assert hung([_rec(0, True), late, unfinished], slack_s=1.0) == 2


def test_slow_share_from_requests_total_deltas():
    s = SimpleNamespace
    samples = [
        s(t=0.5, worker=0, incarnation="a", waiting=0, running=0, requests_total=0),
        s(t=0.5, worker=1, incarnation="b", waiting=0, running=0, requests_total=0),
        s(t=4.5, worker=0, incarnation="a", waiting=0, running=0, requests_total=1),
        s(t=4.5, worker=1, incarnation="b", waiting=0, running=0, requests_total=9),
    ]
    assert slow_share(_result([], samples), 2.0, 6.0) == 0.1


def test_waste_counts_what_the_engines_computed_not_the_routers_estimate():
    # The router estimated a losing hedge or a cancelled attempt as its whole prefill (here
    # 205 tokens beyond the useful ones); the engines computed 20 beyond them. Worker "a" was
    # restarted: its first incarnation's last count is kept beside the new one's.
    s = SimpleNamespace
    samples = [
        s(t=1.0, worker=0, incarnation="a1", waiting=0, running=1, requests_total=1, computed=60),
        s(t=2.0, worker=0, incarnation="a1", waiting=0, running=1, requests_total=1, computed=80),
        s(t=3.0, worker=0, incarnation="a2", waiting=0, running=0, requests_total=1, computed=109),
        s(t=3.0, worker=1, incarnation="b", waiting=0, running=0, requests_total=1, computed=109),
    ]
    recs = [_rec(0, True, computed=109), _rec(1, True, computed=109)]
    w = waste(_result(recs, samples, computed=2 * 109 + 205))
    assert w["engine_measured"] and w["computed"] == 80 + 2 * 109
    assert w["wasted"] == 80 and w["router_computed"] == 2 * 109 + 205


def test_figures_and_their_mean_over_repetitions():
    from bench.faults_report import mean_figures, spread_line, summary_line

    reps = [
        dict(
            goodput_vs_clean=0.9,
            waste_vs_naive=0.5,
            queue_peak_vs_clean=1.0,
            naive_queue_peak_vs_clean=2.0,
            hung=0.0,
            slow_share_10s=0.1,
        ),
        dict(
            goodput_vs_clean=1.0,
            waste_vs_naive=0.3,
            queue_peak_vs_clean=3.0,
            naive_queue_peak_vs_clean=float("nan"),
            hung=1.0,
            slow_share_10s=0.2,
        ),
    ]
    collapsed = {**reps[0], "goodput_vs_clean": 5.0, "clean_slo": 0.1}  # a machine too busy
    for r in reps:
        r["clean_slo"] = 0.95
    m = mean_figures([*reps, collapsed])
    assert abs(m["goodput_vs_clean"] - 0.95) < 1e-9 and m["hung"] == 1.0  # hung: summed
    assert m["naive_queue_peak_vs_clean"] == 2.0  # a missing run does not count
    assert summary_line(m).startswith("faults goodput_vs_clean=0.95 waste_vs_naive=0.40 ")
    assert "queue_peak_vs_clean 2.00 [1.00, 3.00]" in spread_line(reps)


def test_rerouted_late_counts_first_tokens_past_the_bound_from_the_routers_histogram():
    from bench.faults_report import REROUTE_FIRST, rerouted_within

    deltas = {
        f'{REROUTE_FIRST}_bucket{{le="1.0"}}': 3.0,
        f'{REROUTE_FIRST}_bucket{{le="2.0"}}': 4.0,
        f'{REROUTE_FIRST}_bucket{{le="5.0"}}': 6.0,
        f"{REROUTE_FIRST}_count": 6.0,
    }
    assert rerouted_within(deltas) == (6.0, 4.0)  # 2 of 6 came after 2 s
    assert rerouted_within({}) == (0.0, 0.0)


def test_queue_lines_sum_each_workers_mean_waiting_and_split_the_misses():
    from bench.faults_report import _queue_lines

    s = SimpleNamespace
    samples = [
        s(t=1.0, worker=0, incarnation="a", waiting=2, running=4, requests_total=0),
        s(t=3.0, worker=0, incarnation="a", waiting=4, running=4, requests_total=3),
        s(t=1.0, worker=1, incarnation="b", waiting=1, running=4, requests_total=0),
        s(t=6.0, worker=1, incarnation="b", waiting=0, running=1, requests_total=2),
    ]
    slow = _rec(1, True)
    slow.first_token_s = 1.5  # over a 1 s TTFT SLO
    lines = _queue_lines(_result([_rec(0, True), slow, _rec(2, False)], samples), 1.0, 0.5)
    assert lines[0].endswith("by 5 s bin: 0: 4.0")  # worker 0's mean 3 + worker 1's 1; 0 at 5 s left out
    assert lines[1].endswith("TTFT/TPOT/failed-or-late: 0: 1/0/1")
    assert "by 4 s bin: 0: 3/0, 4: 0/2, 8: 0/0," in lines[2]


def test_misses_of_each_fault_are_split_by_where_they_ended():
    from bench.faults_report import _misses_by_fault

    def late(i, arrival, worker, migrations=0, ok=True):
        r = _rec(i, ok)
        r.arrival_s, r.worker_id, r.migrations = arrival, worker, migrations
        r.first_token_s = arrival + 2.0  # over a 1 s TTFT SLO
        r.end_s = arrival + 3.0
        return r

    on_time = _rec(9, True)
    on_time.arrival_s, on_time.first_token_s, on_time.end_s, on_time.worker_id = 21.0, 21.1, 21.5, "decode-2"
    recs = [
        late(0, 20.5, "decode-3"),  # on the flapping worker
        late(1, 22.0, "decode-0", migrations=1),  # moved off mid-stream
        late(2, 30.0, "decode-1"),  # elsewhere, inside the 5 s tail
        late(3, 36.0, "decode-1"),  # after the tail: not the flap's
        late(4, 21.0, "", ok=False),
        on_time,
    ]
    res = _result(recs)
    res.windows = SimpleNamespace(faults={3: [(20.0, 22.0), (26.0, 28.0)]})
    assert _misses_by_fault(res, 1.0, 0.5) == "flap 20-33 s: 1 on it / 1 migrated / 1 elsewhere / 1 failed"
