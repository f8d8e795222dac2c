"""The time rule of the disaggregation policy, branch by branch, and the rates it
runs on (PathRates) on a fake clock."""

import math

import pytest

from services.common.config import ConfigError
from services.common.wait_estimator import PathRates, Rates
from services.decode.disagg_policy import (
    Candidate,
    DisaggConfig,
    DisaggregationPolicy,
    Mode,
    Path,
    Reason,
    RunningDecode,
)

RULE = DisaggregationPolicy(DisaggConfig())
# A GPU-like worker: 10,000 prompt tokens/s here and there, 30 ms decode steps, KV at 1 GB/s.
GPU = Rates(
    local_tokens_per_s=10_000,
    remote_tokens_per_s=10_000,
    kv_bytes_per_token=100_000,
    link_bytes_per_s=1e9,
    tpot_s=0.03,
    unloaded_tpot_s=0.03,
)
IDLE = Candidate("p", "a:1", estimated_wait_s=0.0)


def decide(prompt, candidates=(IDLE,), wait=0.0, rates=GPU, running=(), cached=0, rule=RULE):
    return rule.decide(prompt, cached, list(candidates), wait, Mode.AUTO, rates=rates, running=running)


def test_the_default_is_the_time_rule_and_the_token_threshold_an_override():
    assert DisaggConfig().max_local_prefill_tokens is None and not DisaggConfig().token_rule
    # The override restores the old rule exactly.
    old = DisaggregationPolicy(DisaggConfig(max_local_prefill_tokens=100))
    assert decide(100, rule=old).reason is Reason.SHORT_PROMPT
    assert decide(101, rule=old).reason is Reason.LONG_PROMPT


def test_idle_everywhere_the_cheaper_path_wins_a_tie():
    # Both meet the TTFT SLO and no decode runs here: local skips the transfer.
    d = decide(2000)
    assert (d.path, d.reason) == (Path.LOCAL, Reason.LOCAL_CHEAPER)
    p = d.prediction
    assert p.local_ttft_s == pytest.approx(0.2)
    assert p.remote_ttft_s == pytest.approx(0.2 + 2000 * 100_000 / 1e9)
    assert p.ttft_slo_s == pytest.approx(3.0 * (0.2 + 0.03)) and p.tpot_slo_s == pytest.approx(0.045)
    # With a local queue longer than the transfer, remote is the faster of two that meet.
    d = decide(2000, wait=0.3)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_CHEAPER) and d.candidate == IDLE


def test_a_local_queue_past_the_ttft_slo_sends_the_request_remote():
    d = decide(2000, wait=1.0)  # local 1.2 s > SLO 0.69 s; remote 0.4 s
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_SLO)


def test_running_decodes_with_little_slack_make_a_local_prefill_too_expensive():
    # 8 decodes, 100 tokens in and 100 to go at 44.5 ms a token against a 45 ms SLO: 0.15 s of
    # slack each; a 0.2 s local prefill pushes all 8 past it: worth more than this request's TTFT.
    tight = [RunningDecode(decoded=100, remaining=100, elapsed_s=4.4)] * 8
    tight_rates = Rates(**{**GPU.__dict__, "tpot_s": 0.0445})
    d = decide(2000, rates=tight_rates, running=tight)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_SLO)
    assert d.prediction.stall_cost == 8.0
    # A 5 ms stall uses 1/30 of each slack: a (1/30)^2 chance each of losing it, small but not
    # free, and remote costs none: remote.
    d = decide(50, rates=tight_rates, running=tight)
    assert d.prediction.stall_cost == pytest.approx(8 * (0.005 / 0.15) ** 2)
    assert d.reason is Reason.REMOTE_SLO
    # Half a slack: a quarter of a request each.
    half = [RunningDecode(decoded=100, remaining=100, elapsed_s=9 - 4.45 - 0.4)] * 4
    assert decide(2000, rates=tight_rates, running=half).prediction.stall_cost == pytest.approx(1.0)


def test_decodes_already_past_their_slack_are_priced_against_their_whole_budget():
    # 100 tokens in at 60 ms against a 45 ms SLO, 10 to go: past their slack at the current step.
    # Not certainly lost, and a stall makes them later still: the 0.2 s stall is 0.2 / (0.045 x 110)
    # of each one's whole budget (priced at nothing, a worker of late decodes took every prompt).
    late = [RunningDecode(decoded=100, remaining=10, elapsed_s=100 * 0.06)] * 8
    d = decide(2000, running=late)
    x = 0.2 / (0.045 * 110)
    assert d.prediction.stall_cost == pytest.approx(8 * x * x)
    assert d.prediction.slack_used == pytest.approx(8 * x)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_SLO)  # remote meets the TTFT at no cost
    # A small price: where remote would miss the TTFT, this request's TTFT is worth more.
    busy = Candidate("p", "a:1", estimated_wait_s=5.0)
    assert decide(2000, candidates=[busy], running=late).reason is Reason.LOCAL_SLO


def test_a_busy_prefill_worker_keeps_the_request_local_when_local_meets_the_slo():
    busy = Candidate("p", "a:1", estimated_wait_s=5.0)
    roomy = [RunningDecode(decoded=10, remaining=1000, elapsed_s=10 * 0.03)]  # ~15 s of slack
    d = decide(2000, candidates=[busy], running=roomy)
    assert (d.path, d.reason) == (Path.LOCAL, Reason.LOCAL_SLO)
    assert 0 < d.prediction.stall_cost < 0.001 and 0 < d.prediction.slack_used < 0.1


def test_when_both_miss_the_stall_decides_and_else_the_cheaper_path():
    busy = Candidate("p", "a:1", estimated_wait_s=5.0)
    # Slack 9 - (2.4 elapsed + 2.0 queued locally + 100 x 44.5 ms) = 0.15 s < the 0.2 s stall.
    running = [RunningDecode(decoded=100, remaining=100, elapsed_s=2.4)]
    rates = Rates(**{**GPU.__dict__, "tpot_s": 0.0445})
    d = decide(2000, candidates=[busy], wait=2.0, running=running, rates=rates)  # both miss; local stalls
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_SLO)
    d = decide(2000, candidates=[busy], wait=2.0)  # both miss, nothing to stall: local is sooner
    assert (d.path, d.reason) == (Path.LOCAL, Reason.LOCAL_CHEAPER)


def test_the_rule_is_the_same_on_a_cpu_and_a_gpu():
    """One default across hardware: scale every time by 20x (a CPU at 500 tokens/s against
    a GPU at 10,000) and every decision stays the same."""
    cpu = Rates(
        local_tokens_per_s=500,
        remote_tokens_per_s=500,
        kv_bytes_per_token=100_000,
        link_bytes_per_s=1e9 / 20,
        tpot_s=0.6,
        unloaded_tpot_s=0.6,
    )
    cases = [
        dict(prompt=2000),
        dict(prompt=2000, wait=1.0),
        dict(prompt=100, wait=0.3),
        dict(prompt=2000, running=[RunningDecode(100, 100, 4.0)] * 8),
        dict(prompt=2000, candidates=[Candidate("p", "a", 5.0)], running=[RunningDecode(10, 1000, 0.3)]),
    ]
    for case in cases:
        scaled = dict(case)
        scaled["wait"] = case.get("wait", 0.0) * 20
        scaled["candidates"] = [
            Candidate("p", "a", c.estimated_wait_s * 20) for c in case.get("candidates", [IDLE])
        ]
        scaled["running"] = [
            RunningDecode(r.decoded, r.remaining, r.elapsed_s * 20) for r in case.get("running", [])
        ]
        tpot = 0.04 if case.get("running") and case["running"][0].remaining == 100 else 0.03
        g = decide(**case, rates=Rates(**{**GPU.__dict__, "tpot_s": tpot}))
        c = decide(**scaled, rates=Rates(**{**cpu.__dict__, "tpot_s": tpot * 20}))
        assert g.label == c.label, case


def test_absolute_slos_replace_the_relative_ones():
    strict = DisaggregationPolicy(DisaggConfig(ttft_slo_s=0.1, tpot_slo_s=0.05))
    d = decide(2000, rule=strict)  # both predicted past 0.1 s; nothing running: the faster
    assert d.prediction.ttft_slo_s == 0.1 and d.prediction.tpot_slo_s == 0.05
    loose = DisaggregationPolicy(DisaggConfig(ttft_slo_s=10.0))
    # Local's 1.2 s meets 10 s: no longer an SLO decision (as with the default), only the faster path.
    assert decide(2000, wait=1.0, rule=loose).reason is Reason.REMOTE_CHEAPER
    with pytest.raises(ConfigError, match="ttft_slo_s"):
        DisaggConfig(ttft_slo_s=0)
    with pytest.raises(ConfigError, match="slo_x"):
        DisaggConfig(tpot_slo_x=0)


def test_forced_and_candidate_less_requests_bypass_the_time_rule():
    assert decide(2000, candidates=[]).reason is Reason.NO_CANDIDATE
    assert RULE.decide(5, 0, [IDLE], 9.0, Mode.REMOTE, rates=GPU).reason is Reason.FORCED_REMOTE
    assert RULE.decide(5000, 0, [IDLE], 0.0, Mode.LOCAL, rates=GPU).reason is Reason.FORCED_LOCAL
    assert RULE.may_go_remote(1, Mode.AUTO) and not RULE.may_go_remote(10_000, Mode.LOCAL)


def test_the_cached_prefix_is_not_prefilled_or_moved():
    d = decide(2000, cached=1900)
    assert d.prediction.stall_s == pytest.approx(100 / 10_000)
    assert d.prediction.remote_ttft_s == pytest.approx(0.01 + 100 * 100_000 / 1e9)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_path_rates_measure_every_prefill_pull_and_decode_interval():
    clock = Clock()
    rates = PathRates(prior_tokens_per_s=1000.0, alpha=1.0, clock=clock)
    # Nothing measured: the priors, and an unmeasured link costs nothing.
    r = rates.snapshot()
    assert (r.local_tokens_per_s, r.remote_tokens_per_s, r.link_bytes_per_s) == (1000.0, 1000.0, math.inf)
    # A remote prefill of 4,000 tokens: 1.5 s sent-to-first-token (pull excluded), 0.5 s of it
    # the predicted queue: 4,000 tokens/s. Until a local prefill is measured, local borrows it.
    rates.remote_done(4000, queue_compute_s=1.5, predicted_wait_s=0.5)
    rates.pulled(nbytes=400_000_000, seconds=0.2, tokens=4000)
    r = rates.snapshot()
    assert r.remote_tokens_per_s == pytest.approx(4000) and r.local_tokens_per_s == pytest.approx(4000)
    # One transfer is not the link yet (a first connection's setup may be in it): three are.
    assert r.link_bytes_per_s == math.inf and r.kv_bytes_per_token == pytest.approx(100_000)
    rates.pulled(nbytes=400_000_000, seconds=0.2, tokens=4000)
    rates.pulled(nbytes=400_000_000, seconds=0.2, tokens=4000)
    r = rates.snapshot()
    assert r.link_bytes_per_s == pytest.approx(2e9) and r.link_latency_s == 0.0
    # A local prefill of 3,000 tokens, first token 1.5 s after its decision, 0.5 s of it the
    # predicted queue: 3,000 tokens/s, and the local wait follows it.
    rates.local_done(3000, queue_compute_s=1.5, predicted_wait_s=0.5)
    assert rates.snapshot().local_tokens_per_s == pytest.approx(3000)
    assert rates.snapshot().remote_tokens_per_s == pytest.approx(4000)
    assert rates.local_wait_s(6000) == pytest.approx(2.0)
    # The token rule's estimate still learns from the engine's counters.
    rates.observe_local(prompt_tokens_computed=0, tokens_waiting=0)
    rates.local.started()
    clock.t = 1.0
    rates.observe_local(prompt_tokens_computed=2000, tokens_waiting=0)
    assert rates.local.tokens_per_s == pytest.approx(2000)
    # Decode intervals: the current step and a low quantile of it (the unloaded step).
    for itl in (0.05, 0.03, 0.03, 0.05, 0.05):
        rates.decode_interval(itl, 1)
    r = rates.snapshot()
    assert r.unloaded_tpot_s < 0.036 and 0.04 < r.tpot_s < 0.05


def test_path_rates_ignore_what_cannot_be_a_rate():
    rates = PathRates(prior_tokens_per_s=1000.0, alpha=1.0, clock=Clock())
    rates.remote_done(0, 1.0, 0.0)  # nothing computed (all cached there)
    rates.local_done(100, 0.0, 0.0)  # no time
    rates.pulled(0, 0.0, 0)
    rates.decode_interval(0.0, 1)
    r = rates.snapshot()
    assert (r.remote_tokens_per_s, r.local_tokens_per_s) == (1000.0, 1000.0)
    assert r.link_bytes_per_s == math.inf and r.unloaded_tpot_s == 0.0
    # A wait over-predicted past the whole time floors the compute at a tenth of it.
    rates.remote_done(100, 0.5, 0.9)
    assert rates.snapshot().remote_tokens_per_s == pytest.approx(100 / 0.05)


def test_remote_prefills_in_flight_here_count_as_running_decodes():
    """They join the batch when their KV lands, and a local prefill then stalls them too."""
    incoming = [RunningDecode(decoded=0, remaining=200, elapsed_s=0.0)] * 8
    d = decide(2000, running=incoming)  # a 0.2 s stall against 200 x 15 ms of slack each
    assert d.prediction.slack_used == pytest.approx(8 * 0.2 / (0.045 * 200 - 0.03 * 200))
    assert d.prediction.stall_cost == pytest.approx(8 * (0.2 / 3.0) ** 2)
    assert d.reason is Reason.REMOTE_SLO
    assert decide(2000).reason is Reason.LOCAL_CHEAPER  # nothing in flight: local skips the pull


def test_before_any_decode_step_is_measured_every_running_decode_counts_as_lost():
    fresh = Rates(local_tokens_per_s=10_000, remote_tokens_per_s=10_000)  # no TPOT measured yet
    d = decide(2000, rates=fresh, running=[RunningDecode(1, 100, 0.01)] * 2)
    assert d.prediction.tpot_slo_s == 0.0 and d.prediction.stall_cost == 2.0
    assert d.path is Path.REMOTE
    assert decide(2000, rates=fresh).reason is Reason.LOCAL_CHEAPER  # nothing to stall


def test_the_local_wait_eats_into_the_slack():
    running = [RunningDecode(decoded=100, remaining=100, elapsed_s=100 * 0.03)]
    near = decide(200, wait=0.2, running=running).prediction.slack_used
    far = decide(200, wait=0.0, running=running).prediction.slack_used
    assert near > far > 0


def test_the_unloaded_step_rises_with_time_not_with_the_number_of_samples():
    # Issue 19: a loaded worker reports one interval per running request per pass. Counted per
    # sample, 60 requests at a 44 ms step took the "unloaded" 30 ms step to ~44 ms within a few
    # passes, and the TPOT SLO (1.5x it) from 45 to 66 ms: every decode's slack overstated.
    clock = Clock()
    rates = PathRates(clock=clock)
    rates.decode_interval(0.030, 1)  # the first decode, alone
    for _pass in range(10):  # ten passes of 60 decodes at 44 ms, 0.44 s in all
        clock.t += 0.044
        for _ in range(60):
            rates.decode_interval(0.044, 1)
    r = rates.snapshot()
    assert r.unloaded_tpot_s == pytest.approx(0.030, abs=0.0005)
    assert RULE.predict(100, 100, IDLE, 0.0, r, ()).tpot_slo_s == pytest.approx(0.045, abs=0.001)
    # 20 minutes at 44 ms and no faster step: the hardware is slower than it was, and the
    # estimate follows (it falls at once to a faster step).
    for _ in range(1200):
        clock.t += 1.0
        rates.decode_interval(0.044, 1)
    assert rates.snapshot().unloaded_tpot_s > 0.043
    rates.decode_interval(0.025, 1)
    assert rates.snapshot().unloaded_tpot_s == 0.025


def test_the_decode_step_is_the_median_interval_of_the_last_seconds():
    clock = Clock()
    rates = PathRates(clock=clock)
    # 12 ms steps, one pass in five stalled 300 ms by a prefill: the mean carries the stalls,
    # the median is the decode-only step.
    for i in range(50):
        clock.t += 0.012
        rates.decode_interval(0.3 if i % 5 == 0 else 0.012, 1)
    r = rates.snapshot()
    assert r.decode_step_s == pytest.approx(0.012) and r.tpot_s > 0.05
    # Samples older than the window no longer count.
    clock.t += 11.0
    rates.decode_interval(0.02, 1)
    assert rates.snapshot().decode_step_s == pytest.approx(0.02)


def test_decodes_slowed_by_stalls_are_projected_at_the_decode_step_and_still_priced():
    # Issue 19, llmd 8B on one decode GPU: 50 decodes 10 tokens in, 200 to go; 12 ms steps
    # (18 ms SLO), but local prefills have stalled them to a 50 ms mean. Projected at the
    # mean, each is past its SLO, "lost either way", and a local prefill looks free: the rule
    # kept prefilling locally and kept them slow. At the decode step each has 1.18 s of
    # slack, a 1,000-token prefill (0.33 s here) uses 28% of it: remote.
    rates = Rates(
        local_tokens_per_s=3000,
        remote_tokens_per_s=3000,
        tpot_s=0.05,
        decode_step_s=0.012,
        unloaded_tpot_s=0.012,
    )
    running = [RunningDecode(decoded=10, remaining=200, elapsed_s=0.2)] * 50
    d = decide(1000, rates=rates, running=running)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_SLO)
    assert d.prediction.stall_cost == pytest.approx(50 * ((1000 / 3000) / 1.18) ** 2, rel=0.01)
    # The same decodes really past their slack at the decode step too: the stall against each
    # one's whole budget (210 x 18 ms), far less than against its slack.
    late = [RunningDecode(decoded=10, remaining=200, elapsed_s=2.0)] * 50
    whole = 50 * ((1000 / 3000) / (0.018 * 210)) ** 2
    assert decide(1000, rates=rates, running=late).prediction.stall_cost == pytest.approx(whole)
    # Before the median has a sample, the mean stands in (as before it existed): past at 50 ms.
    no_step = Rates(**{**rates.__dict__, "decode_step_s": 0.0})
    assert decide(1000, rates=no_step, running=running).prediction.stall_cost == pytest.approx(whole)


def test_a_tie_before_any_remote_prefill_is_measured_goes_remote_once():
    # A fresh decode worker: both paths priced at the same prior, the link free: a tie that
    # would keep every idle request local and the remote path unmeasured for good.
    rates = PathRates(clock=Clock())
    d = decide(2000, rates=rates.snapshot())
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_UNMEASURED) and d.candidate == IDLE
    # Once one remote prefill is measured, the tie-break is the budgets' again: local skips the pull.
    rates.remote_done(1000, 1.0, 0.0)
    rates.pulled(nbytes=1000 * 100_000, seconds=0.1, tokens=1000)
    d = decide(2000, rates=rates.snapshot())
    assert (d.path, d.reason) == (Path.LOCAL, Reason.LOCAL_CHEAPER)
    # Not a tie (a local queue past the TTFT SLO): the scores decide, measured or not.
    assert decide(2000, wait=10.0, rates=PathRates(clock=Clock()).snapshot()).reason is Reason.REMOTE_SLO


# The CPU study's worker (issue 19): 500 prompt tokens/s, 40 ms decode steps, an idle prefill worker.
CPU_STUDY = Rates(
    local_tokens_per_s=500,
    remote_tokens_per_s=500,
    kv_bytes_per_token=20_000,
    link_bytes_per_s=1e9,
    tpot_s=0.04,
    decode_step_s=0.04,
    unloaded_tpot_s=0.04,
)


def test_an_idle_worker_sends_a_long_prompt_away_while_requests_keep_arriving():
    # No decode runs here, so a local 2,300-token prefill stalls nobody *now*: a tie, and local
    # skips the transfer. But it holds this worker for 4.6 s, and at 0.5 requests/s about 2.3
    # requests arrive meanwhile and start decoding into the stall: 2.3 s each on average
    # against a fresh 32-token request's whole slack of (60 - 40 ms) x 31 = 0.62 s.
    assert decide(2300, rates=CPU_STUDY).reason is Reason.LOCAL_CHEAPER
    arriving = Rates(**{**CPU_STUDY.__dict__, "arrivals_per_s": 0.5, "mean_output_tokens": 32})
    d = decide(2300, rates=arriving)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_CHEAPER)
    # A tie-break, not a score: the arrivals are expected, not running, and a score that a
    # small expected bite could flip sent every prompt to a scarce prefill worker (1:7 splits
    # lost a third of their goodput in bench/disagg_gpu.py's model).
    assert d.prediction.stall_cost == 0.0 and d.prediction.slack_used == pytest.approx(0.5 * 4.6)
    # A short prompt's stall is a small bite of an arrival's slack, and few arrive during it.
    short = decide(150, rates=arriving).prediction
    assert short.slack_used == pytest.approx(0.5 * 0.3 * 0.15 / 0.62)
    # Only against an idle prefill worker: with a queue there, sending the prompt delays the
    # requests arriving behind it at that worker too, which this worker cannot price, so
    # neither side is charged for its arrivals (the old tie-break).
    queued = decide(2300, rates=arriving, candidates=[Candidate("p", "a", 0.5)])
    assert queued.prediction.slack_used == 0.0 and queued.reason is Reason.LOCAL_CHEAPER
    # With the prefill worker's queue past the TTFT SLO, both prompts stay local.
    for prompt in (150, 2300):
        busy = decide(prompt, rates=arriving, candidates=[Candidate("p", "a", 30.0)])
        assert (busy.path, busy.reason) == (Path.LOCAL, Reason.LOCAL_SLO), prompt


def test_the_arrival_term_is_the_same_on_a_cpu_and_a_gpu():
    # Scale every time by 20x (rates and arrivals down, waits up): the same decisions and costs.
    gpu = Rates(
        **{
            **CPU_STUDY.__dict__,
            "local_tokens_per_s": 10_000,
            "remote_tokens_per_s": 10_000,
            "tpot_s": 0.002,
            "decode_step_s": 0.002,
            "unloaded_tpot_s": 0.002,
            "link_bytes_per_s": 2e10,
            "arrivals_per_s": 10.0,
            "mean_output_tokens": 32,
        }
    )
    cpu = Rates(**{**CPU_STUDY.__dict__, "arrivals_per_s": 0.5, "mean_output_tokens": 32})
    for prompt in (150, 800, 2300):
        g, c = decide(prompt, rates=gpu), decide(prompt, rates=cpu)
        assert g.label == c.label, prompt
        assert g.prediction.slack_used == pytest.approx(c.prediction.slack_used), prompt


def test_path_rates_measure_the_arrival_rate_and_output_length():
    clock = Clock()
    rates = PathRates(alpha=1.0, clock=clock)
    assert (rates.snapshot().arrivals_per_s, rates.snapshot().mean_output_tokens) == (0.0, 0.0)
    for i in range(5):  # 5 arrivals 0.5 s apart: 2 per second
        clock.t = 0.5 * i
        rates.arrived(64)
    r = rates.snapshot()
    assert r.arrivals_per_s == pytest.approx(2.0) and r.mean_output_tokens == 64
    clock.t = 30.0  # nothing for longer than the window: no rate
    assert rates.snapshot().arrivals_per_s == 0.0
