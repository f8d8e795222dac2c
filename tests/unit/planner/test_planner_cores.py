"""The planner's cores on synthetic load: forecasters, capacity, sizing, hysteresis, the tick."""

from __future__ import annotations

import math

import pytest

from services.model.timing import load_profile
from services.planner.capacity import MeasuredModel, ProfileModel, decode_batch, prefill_rate
from services.planner.forecast import Holt, MovingAverage, make_forecaster
from services.planner.hysteresis import Hysteresis, HysteresisConfig
from services.planner.planner import Observation, Planner, PlannerConfig
from services.planner.sizing import Budget, Load, Slo, dynamo_throughput_sizing, size_pools

H100 = ProfileModel(load_profile("splitwise-h100-llama70b"))
SLO = Slo(ttft_s=1.0, itl_s=0.05)
BUDGET = Budget(max_workers=16)


# ---- forecasters ----


def test_moving_average_is_the_mean_of_its_window():
    f = MovingAverage(window=3)
    assert f.predict() == 0.0
    for x in (1, 2, 3, 10):
        f.observe(x)
    assert f.predict() == pytest.approx(5.0)  # (2 + 3 + 10) / 3


def test_holt_follows_a_linear_ramp_ahead():
    f = Holt(alpha=0.8, beta=0.5)
    for t in range(20):
        f.observe(10 + 2 * t)  # last value 48, slope 2
    assert f.predict(1) == pytest.approx(50, abs=0.5)
    assert f.predict(5) == pytest.approx(58, abs=1.0)
    ma = MovingAverage(6)
    for t in range(20):
        ma.observe(10 + 2 * t)
    assert ma.predict(5) < f.predict(5) - 10  # a flat forecast lags a ramp


def test_holt_never_forecasts_negative_load():
    f = Holt(alpha=0.9, beta=0.9)
    for x in (100, 50, 10, 1):
        f.observe(x)
    assert f.predict(10) == 0.0


def test_unknown_forecaster_is_refused():
    with pytest.raises(ValueError, match="unknown forecaster"):
        make_forecaster("arima")


# ---- capacity ----


def test_decode_batch_is_the_largest_within_the_itl():
    # splitwise h100: step = 29.4 + 0.23 * B ms; 50 ms allows B = 89
    assert decode_batch(H100, ctx=1000, itl_s=0.050) == 89
    assert decode_batch(H100, ctx=1000, itl_s=0.029) == 0  # below the floor of one step
    # the KV pool bounds it too: 16384 blocks x 16 tokens / 20,000-token contexts = 13
    assert decode_batch(H100, ctx=20_000, itl_s=1.0) == 13


def test_short_prompts_share_a_prefill_pass():
    long_rate = prefill_rate(H100, 8192)
    short_rate = prefill_rate(H100, 128)
    assert short_rate > 30 * long_rate
    assert long_rate == pytest.approx(1 / H100.prefill_s(8192))


def test_measured_model_learns_and_falls_back_until_it_has_samples():
    m = MeasuredModel(H100, weight=0.5, min_samples=3)
    assert m.prefill_s(1000) == H100.prefill_s(1000)
    for _ in range(3):
        m.observe_prefill(1000, 0.5)  # 2,000 tokens/s: much slower than the profile
    assert m.prefill_s(1000) == pytest.approx(0.5)
    for b, ctx in ((1, 100), (8, 8000), (32, 4000), (64, 64000), (1, 2000), (16, 500)):
        m.observe_decode(b, ctx, (10 + 0.5 * b + 2 * ctx / 1000) / 1000)
    assert m.decode_step_s(20, 10_000) == pytest.approx((10 + 0.5 * 20 + 20) / 1000, rel=1e-3)


def test_measured_decode_fit_holds_when_batch_and_context_move_together():
    m = MeasuredModel(H100, weight=0.5, min_samples=3)
    for b in (1, 8, 32, 64, 1, 16):
        m.observe_decode(b, b * 500, (10 + 0.5 * b) / 1000)  # context = 500 x batch: collinear
    assert m.decode_step_s(20, 10_000) == pytest.approx((10 + 0.5 * 20) / 1000, rel=1e-2)


# ---- sizing ----


def test_sizing_grows_with_the_rate_and_keeps_minimums():
    small = size_pools(Load(rate=0.5, isl=2000, osl=200), H100, SLO, BUDGET)
    big = size_pools(Load(rate=8, isl=2000, osl=200), H100, SLO, BUDGET)
    assert (small.prefill, small.decode) >= (1, 1)
    assert big.prefill > small.prefill and big.decode >= small.decode
    idle = size_pools(Load(rate=0, isl=0, osl=0), H100, SLO, BUDGET)
    assert (idle.prefill, idle.decode) == (1, 1)


def test_prefill_keeps_queueing_headroom_that_dynamos_formula_does_not():
    load, slo = Load(rate=6, isl=4000, osl=100), Slo(ttft_s=3.0, itl_s=0.05)
    ours = size_pools(load, H100, slo, BUDGET)
    dyn = dynamo_throughput_sizing(load, H100, slo, BUDGET)
    assert "ttft_infeasible" not in ours.reason
    s = H100.prefill_s(4000)
    assert dyn.prefill == math.ceil(6 * s)  # full utilisation
    rho = 6 * s / ours.prefill
    # M/M/1 at quantile 0.9: ln(10) * s / (1 - rho) + transfer <= TTFT
    assert math.log(10) * s / (1 - rho) + H100.transfer_s(4000) <= slo.ttft_s
    assert ours.prefill > dyn.prefill


def test_prefix_hits_reduce_prefill_workers():
    cold = size_pools(Load(rate=8, isl=4000, osl=100), H100, SLO, BUDGET)
    warm = size_pools(Load(rate=8, isl=4000, osl=100, hit_rate=0.75), H100, SLO, BUDGET)
    assert warm.prefill < cold.prefill


def test_an_impossible_ttft_asks_for_the_budget_and_says_so():
    s = size_pools(Load(rate=1, isl=20_000, osl=10), H100, Slo(ttft_s=0.5, itl_s=0.05), BUDGET)
    assert "ttft_infeasible" in s.reason
    assert s.total <= BUDGET.max_workers


def test_the_budget_cuts_both_roles_in_proportion():
    s = size_pools(Load(rate=40, isl=4000, osl=400), H100, SLO, Budget(max_workers=6))
    assert s.total == 6 and s.prefill >= 1 and s.decode >= 1
    assert "budget" in s.reason
    assert s.inputs["want_prefill"] + s.inputs["want_decode"] > 6


# ---- hysteresis ----


def test_scale_up_is_immediate_then_cools_down():
    h = Hysteresis(HysteresisConfig(up_cooldown_s=30, max_step_up=2))
    assert h.apply("decode", 1, 5, now=0) == 3  # at most 2 at once
    assert h.apply("decode", 3, 5, now=10) == 3  # cooling down
    assert h.apply("decode", 3, 5, now=31) == 5


def test_scale_down_needs_a_streak_and_never_flaps():
    h = Hysteresis(HysteresisConfig(down_cooldown_s=0, down_after=3, max_step_down=1))
    # a load that wants 2, 4, 2, 4, ... never scales 4 down
    sizes = []
    cur = 4
    for i, want in enumerate([2, 4] * 5):
        cur = h.apply("decode", cur, want, now=float(i))
        sizes.append(cur)
    assert sizes == [4] * 10
    # three quiet intervals in a row: down by one, to the largest recent wish
    for i, want in enumerate([3, 2, 2]):
        cur = h.apply("decode", cur, want, now=100.0 + i)
    assert cur == 3


# ---- the tick ----


def _obs(requests, p, d, **kw):
    return Observation(
        requests=requests,
        mean_isl=2000,
        mean_osl=200,
        hit_rate=0.0,
        prefill_workers=p,
        decode_workers=d,
        **kw,
    )


def test_a_ramp_scales_up_ahead_and_a_quiet_spell_scales_back_down():
    cfg = PlannerConfig(
        interval_s=10,
        startup_s=20,
        max_workers=16,
        hysteresis=HysteresisConfig(up_cooldown_s=0, down_cooldown_s=0, down_after=2),
    )
    planner = Planner(cfg, H100)
    p, d, now, peak = 1, 1, 0.0, (1, 1)
    for rps in [0.5, 1, 2, 3, 4, 5, 6, 7, 8]:
        dec = planner.tick(_obs(int(rps * 10), p, d), now)
        p, d, now = dec.prefill, dec.decode, now + 10
        peak = max(peak, (p, d))
        assert dec.forecast.rate >= rps  # never below what was just seen
    at_peak = size_pools(Load(8, 2000, 200), H100, planner._target, planner.budget)
    assert p >= at_peak.prefill  # the forecast led the ramp
    for _ in range(40):
        dec = planner.tick(_obs(5, p, d), now)
        p, d, now = dec.prefill, dec.decode, now + 10
    assert (p, d) == (1, 1)
    assert planner.decisions[-1].reason


def test_a_measured_slo_miss_adds_a_worker_the_model_did_not_ask_for():
    cfg = PlannerConfig(interval_s=10, hysteresis=HysteresisConfig(up_cooldown_s=0))
    planner = Planner(cfg, H100)
    dec = planner.tick(_obs(5, 2, 2, itl_q_s=0.2), now=0)
    assert dec.decode == 3 and "itl_measured_over_slo" in dec.reason


def test_decisions_stay_within_the_budget():
    cfg = PlannerConfig(interval_s=1, max_workers=4, hysteresis=HysteresisConfig(up_cooldown_s=0))
    planner = Planner(cfg, H100)
    dec = planner.tick(_obs(1000, 1, 1, ttft_q_s=9.0, itl_q_s=9.0), now=0)
    assert dec.prefill + dec.decode <= 4


def test_a_bursty_window_keeps_capacity_for_the_burst():
    cfg = PlannerConfig(interval_s=30, peak_window_s=300, hysteresis=HysteresisConfig(up_cooldown_s=0))
    planner = Planner(cfg, H100)
    dec = None
    for i in range(10):
        rps = 25 if i == 4 else 5  # one 5x interval in ten
        dec = planner.tick(_obs(int(rps * 30), 4, 4), now=30.0 * i)
    assert dec.forecast.rate == pytest.approx(25)  # five intervals after the burst, still sized for it
    smooth = Planner(cfg, H100)
    for i in range(10):
        dec = smooth.tick(_obs(int((5 + 0.5 * i) * 30), 4, 4), now=30.0 * i)
    assert dec.forecast.rate < 12  # a smooth ramp is tracked, not held at its top


def test_a_bursts_queue_does_not_refit_the_queueing_coefficient():
    """The backlog a burst leaves is a transient: learning A from it sized 20 prefill workers
    where 7 serve the bursts (bench/planner.py, bursty); steady load still refits A.
    (The single-queue model, which refits at any utilisation; the pooled one below.)"""
    cfg = PlannerConfig(interval_s=30, peak_window_s=300, queue_model="single")
    bursty = Planner(cfg, H100)
    for i in range(6):
        rps, ttft = (25, 30.0) if i == 2 else (5, 0.5)
        bursty.tick(_obs(int(rps * 30), 4, 4, ttft_q_s=ttft), now=30.0 * i)
    steady = Planner(cfg, H100)
    steady.tick(_obs(5 * 30, 4, 4, ttft_q_s=0.5), now=0.0)
    assert steady.wait_coeff is not None
    fitted = bursty.wait_coeff
    assert fitted is not None  # the intervals before the burst refit it
    bursty.tick(_obs(5 * 30, 4, 4, ttft_q_s=40.0), now=200.0)  # the backlog still draining
    assert bursty.wait_coeff == fitted


def test_the_pooled_model_refits_only_where_it_sees_queueing_and_not_from_a_burst():
    """Pooled (the default): at low utilisation the model sees no queueing, so the TTFT there is
    the prompts' own prefill and says nothing about A; a steadily busy pool refits it; a burst's
    backlog does not."""
    cfg = PlannerConfig(interval_s=30, peak_window_s=300)
    idle = Planner(cfg, H100)
    idle.tick(_obs(5 * 30, 4, 4, ttft_q_s=0.9), now=0.0)  # rho ~0.3 on 4 workers
    assert idle.wait_coeff is None
    busy = Planner(cfg, H100)
    busy.tick(_obs(14 * 30, 4, 4, ttft_q_s=2.5), now=0.0)  # rho ~0.84: queueing is the TTFT
    assert busy.wait_coeff is not None and busy.wait_coeff != 1.0
    fitted = busy.wait_coeff
    for i in range(1, 5):
        rps, ttft = (70, 30.0) if i == 2 else (14, 2.5)
        busy.tick(_obs(rps * 30, 4, 4, ttft_q_s=ttft), now=30.0 * i)
    during = busy.wait_coeff
    busy.tick(_obs(14 * 30, 4, 4, ttft_q_s=40.0), now=200.0)  # a burst's backlog still draining
    assert busy.wait_coeff == during and fitted is not None


def test_pooled_prefill_sizing_lets_a_big_pool_run_hotter():
    """Erlang C: at 8x the load the pooled rule asks for fewer than 8x the workers, the single-queue
    rule for about 8x; both meet the TTFT model they size for."""
    small, big = Load(rate=2, isl=2000, osl=200), Load(rate=16, isl=2000, osl=200)
    p_small = size_pools(small, H100, SLO, BUDGET, pooled=True).prefill
    p_big = size_pools(big, H100, SLO, BUDGET, pooled=True).prefill
    assert p_big < 8 * p_small
    s = size_pools(big, H100, SLO, BUDGET, pooled=True)
    assert s.inputs["p_rho_max"] > size_pools(small, H100, SLO, BUDGET, pooled=True).inputs["p_rho_max"]
    assert s.prefill <= size_pools(big, H100, SLO, BUDGET).prefill


def test_a_breach_while_workers_start_adds_nothing_more():
    cfg = PlannerConfig(interval_s=10, hysteresis=HysteresisConfig(up_cooldown_s=0))
    planner = Planner(cfg, H100)
    starting = planner.tick(_obs(5, 2, 3, itl_q_s=0.2, ready_decode_workers=2), now=0)
    assert starting.decode == 3 and "itl_over_slo_capacity_starting" in starting.reason
    ready = planner.tick(_obs(5, 2, 3, itl_q_s=0.2, ready_decode_workers=3), now=10)
    assert ready.decode == 4 and "itl_measured_over_slo" in ready.reason
