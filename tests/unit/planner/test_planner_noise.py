"""Session 8: the planner does not size for one interval's sampling noise (fake clock, synthetic load).

`rate_floor_z`: the forecast rate's floor (the rate just observed) less z Poisson standard errors of
the interval's count; `length_last_z`: the last interval's mean lengths less z standard errors of a
mean of n requests. Each test fails with the option at 0 (the behaviour before)."""

from __future__ import annotations

import pytest

from services.model.timing import load_profile
from services.planner.capacity import ProfileModel
from services.planner.capacity_table import CapacityTable
from services.planner.hysteresis import HysteresisConfig
from services.planner.planner import Observation, Planner, PlannerConfig

H100 = ProfileModel(load_profile("splitwise-h100-llama70b"))
TABLE = CapacityTable(
    prefill=(4000.0, 12000.0, 20000.0, 28000.0, 36000.0, 44000.0, 52000.0, 60000.0),
    decode=(1500.0, 3400.0, 5200.0, 7000.0, 8800.0, 10500.0, 12300.0, 14000.0),
)
FREE = HysteresisConfig(up_cooldown_s=0, down_cooldown_s=0, down_after=1, max_step_down=8)


def _planner(**kw) -> Planner:
    cfg = PlannerConfig(
        interval_s=10,
        startup_s=20,
        max_workers=24,
        table_margin=1.0,
        down_margin=0.0,
        falling_down_after=0,
        hysteresis=FREE,
        **kw,
    )
    return Planner(cfg, H100, capacity=TABLE)


def _tick(planner, requests, p, d, now, isl=1000.0, osl=200.0):
    obs = Observation(
        requests=requests, mean_isl=isl, mean_osl=osl, hit_rate=0.0, prefill_workers=p, decode_workers=d
    )
    return planner.tick(obs, now)


def _fall(planner):
    """A steady fall from 40/s to 10/s in 10-s intervals; (forecast rates, observed rates, prefill pools)."""
    p, d = 8, 8
    forecasts, rates, pools = [], [], []
    for i in range(16):
        rate = 40.0 - 2.0 * i
        dec = _tick(planner, round(10 * rate), p, d, now=10.0 * i)
        p, d = dec.prefill, dec.decode
        forecasts.append(dec.forecast.rate)
        rates.append(rate)
        pools.append(p)
    return forecasts, rates, pools


def test_on_a_steady_fall_the_rate_floor_less_its_noise_lets_the_trend_lead():
    """With the floor at the observed rate the forecast never goes below it, so on a fall the pools are
    sized for the load of now, not the lower one a start-up ahead; with z = 2 the trend leads below it
    (by at most 2 standard errors) and the pools hold fewer worker-intervals on the way down."""
    f0, rates, pools0 = _fall(_planner())
    f2, _, pools2 = _fall(_planner(rate_floor_z=2.0))
    assert all(f >= r - 1e-9 for f, r in zip(f0, rates, strict=True))  # z = 0: never below the observed
    late = list(zip(f2, rates, strict=True))[4:]  # once Holt has the trend
    assert all(f < r for f, r in late)
    assert all(f >= (10 * r - 2 * (10 * r) ** 0.5) / 10 - 1e-9 for f, r in late)  # the floor still holds
    assert sum(pools2) < sum(pools0)


def test_on_a_rise_the_floor_less_its_noise_changes_nothing():
    """Rising, Holt's forecast is above the observed rate: the floor does not bind either way."""
    for z in (0.0, 2.0):
        planner = _planner(rate_floor_z=z)
        p, d, out = 2, 2, []
        for i in range(12):
            dec = _tick(planner, round(10 * (10.0 + 2.0 * i)), p, d, now=10.0 * i)
            p, d = dec.prefill, dec.decode
            out.append((p, d))
        if z == 0.0:
            base = out
    assert out == base


def _lengths(planner, last_isl, n=400):
    """Ten flat intervals at 1000-token prompts, then one of `last_isl` (n requests each); its forecast ISL."""
    for i in range(10):
        _tick(planner, n, 8, 8, now=10.0 * i)
    return _tick(planner, n, 8, 8, now=100.0, isl=last_isl).forecast.isl


def test_a_last_interval_within_its_sampling_noise_is_not_sized_for():
    """400 prompts of mean 1040 (4% up; one standard error of such a mean is ~5%) after a flat 1000: with
    the mean as measured the planner sizes for 1040; with length_last_z = 1 for the recent mean."""
    assert _lengths(_planner(), 1040.0) == pytest.approx(1040.0)
    isl = _lengths(_planner(length_last_z=1.0), 1040.0)
    assert isl < 1010.0


def test_a_real_jump_in_length_is_still_sized_for_at_once():
    """A 50% jump is far outside the noise: sized for (less its 5% standard error) on the same interval."""
    isl = _lengths(_planner(length_last_z=1.0), 1500.0)
    assert isl == pytest.approx(1500.0 * (1 - 1 / 400**0.5))
    assert isl > 1400.0


def test_the_noise_options_reject_negative_values():
    with pytest.raises(ValueError):
        PlannerConfig(rate_floor_z=-1.0)
    with pytest.raises(ValueError):
        PlannerConfig(length_last_z=-0.5)
