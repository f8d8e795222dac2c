"""The measured capacity table, the planner sizing from it, and the tick's new forecasting rules
(burst windows, length jumps, the forecast-error margin, decode's quantile batch) on synthetic load."""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import pytest

from services.model.timing import load_profile
from services.planner.capacity import MeasuredModel, ProfileModel, decode_batch
from services.planner.capacity_table import CapacityTable, CapacityTableError
from services.planner.hysteresis import HysteresisConfig
from services.planner.planner import Observation, Planner, PlannerConfig
from services.planner.sizing import Slo, quantile_decode_batch

H100 = ProfileModel(load_profile("splitwise-h100-llama70b"))
TABLE = CapacityTable(prefill=(4000.0, 12000.0, 20000.0), decode=(1500.0, 3400.0, 5200.0), goal=0.95)
NO_HYSTERESIS = HysteresisConfig(up_cooldown_s=0, down_cooldown_s=0, down_after=1, max_step_down=8)


def _obs(requests, p, d, isl=1000.0, osl=200.0, **kw):
    return Observation(
        requests=requests, mean_isl=isl, mean_osl=osl, hit_rate=0.0, prefill_workers=p, decode_workers=d, **kw
    )


def test_the_fewest_workers_whose_capacity_covers_the_demand():
    assert TABLE.workers("prefill", 0) == 0
    assert TABLE.workers("prefill", 4000) == 1
    assert TABLE.workers("prefill", 4001) == 2
    assert TABLE.workers("decode", 5200) == 3
    # beyond the largest pool measured: at its per-worker rate (20000 / 3 tokens/s a worker)
    assert TABLE.workers("prefill", 40000) == math.ceil(40000 / (20000 / 3))


def test_a_table_round_trips_through_its_json_and_refuses_impossible_ones(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE.to_doc()))
    assert CapacityTable.load(path) == TABLE
    with pytest.raises(CapacityTableError, match="must not fall"):
        CapacityTable(prefill=(5000.0, 4000.0), decode=(1.0,))
    with pytest.raises(CapacityTableError, match="positive finite"):
        CapacityTable(prefill=(), decode=(1.0,))
    with pytest.raises(CapacityTableError, match="malformed"):
        CapacityTable.from_doc({"prefill": [1.0]})


def test_the_planner_sizes_from_the_table_when_it_has_one():
    cfg = PlannerConfig(
        interval_s=10, startup_s=0, max_workers=16, table_margin=1.0, hysteresis=NO_HYSTERESIS
    )
    # 15 requests/s x 1000 tokens = 15000 prefill tokens/s -> 3 (12000 < 15000 <= 20000);
    # 15 x 200 = 3000 output tokens/s -> 2 decode workers
    with_table = Planner(cfg, H100, capacity=TABLE).tick(_obs(150, 3, 3), now=0)
    assert (with_table.prefill, with_table.decode) == (3, 2)
    assert with_table.reason.startswith("prefill:table decode:table")
    formulas = Planner(cfg, H100).tick(_obs(150, 3, 3), now=0)
    assert "table" not in formulas.reason
    # the margin: size so the demand is at most that share of the capacity
    tight = PlannerConfig(
        interval_s=10, startup_s=0, max_workers=16, table_margin=0.8, hysteresis=NO_HYSTERESIS
    )
    dec = Planner(tight, H100, capacity=TABLE).tick(_obs(100, 3, 3), now=0)  # 10000/0.8 = 12500 -> 3
    assert dec.prefill == 3


def test_the_planner_loads_the_table_named_in_its_config(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE.to_doc()))
    planner = Planner(PlannerConfig(capacity_table=str(path)), H100)
    assert planner.capacity == TABLE


def test_a_burst_window_sizes_for_the_burst_not_for_holts_extrapolation_of_it():
    """Holt reads a 5x step as a trend and forecast ~54/s after two 40/s intervals (bench/planner.py's
    bursty trace ran 10-13 prefill workers where 7-8 serve); in a bursty window the forecast is the
    busiest interval seen."""
    cfg = PlannerConfig(interval_s=10, startup_s=20, peak_window_s=300, hysteresis=NO_HYSTERESIS)
    planner = Planner(cfg, H100)
    for i in range(10):
        planner.tick(_obs(80, 2, 2), now=10.0 * i)
    for i in range(10, 12):
        dec = planner.tick(_obs(400, 2, 2), now=10.0 * i)
    assert dec.forecast.rate == pytest.approx(40)


def test_a_jump_in_output_length_is_sized_for_at_once():
    """The Azure conversations' mean output length moves 130 <-> 270 over minutes: a moving average
    of it lagged the jump by a minute and left decode short (0.55 attainment for that minute)."""
    cfg = PlannerConfig(interval_s=10, hysteresis=NO_HYSTERESIS)
    planner = Planner(cfg, H100)
    for i in range(10):
        planner.tick(_obs(100, 2, 2, osl=130), now=10.0 * i)
    dec = planner.tick(_obs(100, 2, 2, osl=270), now=100)
    assert dec.forecast.osl == pytest.approx(270)
    for i in range(11, 14):  # and a short stretch after a long one does not drop it at once
        dec = planner.tick(_obs(100, 2, 2, osl=130), now=10.0 * i)
    assert dec.forecast.osl > 130


def test_the_forecast_error_margin_widens_when_the_forecast_falls_behind():
    kw = dict(
        interval_s=10, startup_s=0, forecaster="moving_average", error_quantile=0.5, hysteresis=NO_HYSTERESIS
    )
    lagging = Planner(PlannerConfig(error_window=10, **kw), H100)
    off = Planner(PlannerConfig(error_window=0, **kw), H100)
    for i in range(12):  # a steady ramp: a flat forecast is always behind it
        obs = _obs(100 + 30 * i, 4, 4)
        dec, dec_off = lagging.tick(obs, now=10.0 * i), off.tick(obs, now=10.0 * i)
    assert dec.sizing.inputs["forecast_margin_prefill"] > 1.0
    assert dec_off.sizing.inputs["forecast_margin_prefill"] == 1.0


def test_decode_is_sized_for_its_batch_at_the_slo_quantile():
    """A worker's batch moves around its mean like a Poisson count: the mean batch b leaves b + z sqrt(b)
    within the ITL SLO's batch; a flat 0.85 x ITL target (the old rule) left a third of it unused."""
    slo = Slo(1.0, 0.05, 0.9)
    limit = decode_batch(H100, 1260, 0.05)
    b = quantile_decode_batch(H100, 1260, slo)
    z = NormalDist().inv_cdf(0.9)
    assert b + z * math.sqrt(b) <= limit < (b + 1) + z * math.sqrt(b + 1)
    assert decode_batch(H100, 1260, 0.05 * 0.85) < b < limit


def test_a_budget_too_small_for_both_wishes_is_split_by_the_split_tables_prior_until_rates_are_measured():
    """split_table.json's best split for this profile on Azure lengths is 5:3 of 8; the proportional
    cut of the wishes is what the planner does without the prior, or once it measures its own rates."""
    cfg = dict(interval_s=10, startup_s=0, max_workers=8, hysteresis=NO_HYSTERESIS)
    load = _obs(600, 4, 4, isl=1155, osl=211)  # 60 requests/s: both pools want far more than 8
    prior = Planner(PlannerConfig(split_prior="splitwise-h100-llama70b/nvlink/azure", **cfg), H100)
    dec = prior.tick(load, now=0)
    assert (dec.prefill, dec.decode) == (5, 3) and "split_prior:5:3" in dec.reason
    plain = Planner(PlannerConfig(**cfg), H100).tick(load, now=0)
    assert plain.prefill + plain.decode == 8 and "split_prior" not in plain.reason
    measured = MeasuredModel(H100, min_samples=1)
    measured.observe_prefill(8192, 0.99)
    measured.observe_decode(64, 64 * 1200, 0.044)
    assert measured.measured
    dec = Planner(PlannerConfig(split_prior="splitwise-h100-llama70b/nvlink/azure", **cfg), measured).tick(
        load, now=0
    )
    assert "split_prior" not in dec.reason  # measured rates win
    with pytest.raises(ValueError, match="profile/link/workload"):
        PlannerConfig(split_prior="azure")


def test_a_slow_worker_whose_slo_batch_is_tiny_still_decodes_one_sequence():
    """With 2 sequences within the ITL there is no room for the quantile margin; the rule must say 1,
    not 0 (which reads as 'the ITL SLO is infeasible' and asks for the whole budget: the
    `pdmesh up --planner` e2e never scaled back down to 1 decode worker)."""
    slo = Slo(1.0, 0.05, 0.9)
    ctx = 1260
    limit_itl = next(t / 1000 for t in range(30, 200) if decode_batch(H100, ctx, t / 1000) == 2)
    tight = Slo(1.0, limit_itl, 0.9)
    assert decode_batch(H100, ctx, tight.itl_s) == 2
    assert quantile_decode_batch(H100, ctx, tight) == 1
    assert quantile_decode_batch(H100, ctx, Slo(1.0, 0.029, 0.9)) == 0  # infeasible stays infeasible
    assert quantile_decode_batch(H100, ctx, slo) > 1
