"""The session-7 levers of the planner, each on synthetic load with a fake clock: a faster scale-down
while the forecast falls, per-role hysteresis, the length rules, and prefill sized below the table by
what decode-local prefill absorbs."""

from __future__ import annotations

import pytest

from services.model.timing import load_profile
from services.planner.capacity import ProfileModel
from services.planner.capacity_table import CapacityTable
from services.planner.hysteresis import Hysteresis, HysteresisConfig
from services.planner.planner import Observation, Planner, PlannerConfig

H100 = ProfileModel(load_profile("splitwise-h100-llama70b"))
TABLE = CapacityTable(
    prefill=(4000.0, 12000.0, 20000.0, 28000.0, 36000.0, 44000.0, 52000.0, 60000.0),
    decode=(1500.0, 3400.0, 5200.0, 7000.0, 8800.0, 10500.0, 12300.0, 14000.0),
)
STREAK = HysteresisConfig(up_cooldown_s=0, down_cooldown_s=0, down_after=3, max_step_down=8)


def _obs(requests, p, d, isl=1000.0, osl=200.0):
    return Observation(
        requests=requests, mean_isl=isl, mean_osl=osl, hit_rate=0.0, prefill_workers=p, decode_workers=d
    )


def test_a_decode_streak_of_its_own_and_a_one_off_override():
    h = Hysteresis(HysteresisConfig(up_cooldown_s=0, down_cooldown_s=0, down_after=3, down_after_decode=1))
    assert h.apply("prefill", 4, 3, now=0) == 4  # prefill waits for its streak of 3
    assert h.apply("decode", 4, 3, now=0) == 3  # decode scales down on the first interval
    assert h.apply("prefill", 4, 3, now=10, down_after=2) == 3  # two wishes in a row, override 2
    with pytest.raises(ValueError):
        HysteresisConfig(down_after_decode=-1)


def _run(planner, rates, start=(8, 8), osl=200.0):
    """Feed `rates` (requests/s, 10-s intervals); the pools follow the decisions; return them."""
    p, d = start
    out = []
    for i, r in enumerate(rates):
        dec = planner.tick(_obs(round(10 * r), p, d, osl=osl), now=10.0 * i)
        p, d = dec.prefill, dec.decode
        out.append((p, d))
    return out


def _cfg(**kw):
    """The levers off unless a test turns one on (their defaults are on: each test isolates one)."""
    kw = {"down_margin": 0.0, "falling_down_after": 0, **kw}
    return PlannerConfig(
        interval_s=10, startup_s=20, max_workers=24, table_margin=1.0, hysteresis=STREAK, **kw
    )


def test_while_the_forecast_falls_a_scale_down_needs_a_shorter_streak():
    """A steady fall from 40/s to 8/s: Holt's trend is negative, and the planner with
    falling_down_after=1 follows the load down sooner than with the streak of 3, so it holds fewer
    worker-intervals on the way down; on the way up nothing changes."""
    fall = [40.0] * 10 + [40.0 - 1.0 * i for i in range(33)]
    slow = _run(Planner(_cfg(), H100, capacity=TABLE), fall)
    fast = _run(Planner(_cfg(falling_down_after=1), H100, capacity=TABLE), fall)
    assert slow[:10] == fast[:10]
    assert sum(p + d for p, d in fast) < sum(p + d for p, d in slow)
    assert all(fp <= sp and fd <= sd for (fp, fd), (sp, sd) in zip(fast, slow, strict=True))


def test_a_flat_noisy_load_keeps_the_full_streak():
    """Noise around a flat 20/s is not a fall: the forecast's level and its value ahead stay within
    falling_ratio, so a dip in one interval does not remove a worker the next one needs."""
    noisy = [20.0, 21.0, 19.0, 20.5, 19.5] * 6 + [17.0, 23.0, 20.0]
    a = _run(Planner(_cfg(), H100, capacity=TABLE), noisy)
    b = _run(Planner(_cfg(falling_down_after=1, falling_ratio=0.2), H100, capacity=TABLE), noisy)
    assert a == b


def test_without_length_last_one_long_interval_moves_the_length_only_through_the_recent_mean():
    cfg = _cfg(length_last=False)
    planner = Planner(cfg, H100, capacity=TABLE)
    for i in range(10):
        planner.tick(_obs(100, 2, 2, osl=130), now=10.0 * i)
    dec = planner.tick(_obs(100, 2, 2, osl=270), now=100)
    assert dec.forecast.osl == pytest.approx((5 * 130 + 270) / 6)  # the recent mean (6 intervals)


def test_long_run_lengths_ignore_the_recent_stretch():
    planner = Planner(_cfg(osl_rule="long_run", length_window=20), H100, capacity=TABLE)
    for i in range(10):
        planner.tick(_obs(100, 2, 2, osl=130), now=10.0 * i)
    for i in range(10, 12):
        dec = planner.tick(_obs(100, 2, 2, osl=270), now=10.0 * i)
    assert dec.forecast.osl == pytest.approx((10 * 130 + 2 * 270) / 12)
    assert dec.forecast.isl == pytest.approx(1000)  # prefill's rule is its own (fast_up)
    with pytest.raises(ValueError):
        PlannerConfig(isl_rule="median")


def test_decode_with_spare_capacity_takes_prefill_off_the_table():
    """15/s x 1000 tokens = 15,000 prefill tokens/s: 3 workers by the table (12,000 < 15,000). 15 x 200 =
    3,000 output tokens/s: 2 decode workers (3,400), a spare of 12% of their capacity. Counted at
    local_prefill_share 3 (each spare-free decode worker would be worth 3 x 4,000 tokens/s),
    2 x 0.12 x 3 x 4,000 = 2,800 comes off: 12,200 is still 3; at share 4, 3,760 off: 11,240 -> 2."""
    obs = _obs(150, 3, 2)
    plain = Planner(_cfg(), H100, capacity=TABLE).tick(obs, now=0)
    assert (plain.prefill, plain.decode) == (3, 2)
    some = Planner(_cfg(local_prefill_share=3.0), H100, capacity=TABLE).tick(obs, now=0)
    assert some.prefill == 3 and some.sizing.inputs["table_prefill_absorbed"] == pytest.approx(
        2823.5, rel=1e-3
    )
    more = Planner(_cfg(local_prefill_share=4.0), H100, capacity=TABLE).tick(obs, now=0)
    assert (more.sizing.prefill, more.sizing.decode) == (2, 2)  # (the streak then decides when)
    # a decode pool with no spare absorbs nothing: 17/s x 200 = 3,400 fills the 2 decode workers
    full = Planner(_cfg(local_prefill_share=4.0), H100, capacity=TABLE).tick(_obs(170, 3, 2), now=0)
    assert full.sizing.inputs["table_prefill_absorbed"] == 0


def test_the_capacity_of_a_pool_size_and_beyond_the_table():
    assert TABLE.capacity("decode", 2) == 3400
    assert TABLE.capacity("decode", 0) == 0
    assert TABLE.capacity("prefill", 10) == pytest.approx(60000 / 8 * 10)


def test_the_down_band_holds_a_pool_whose_smaller_size_would_run_at_its_edge():
    """19.5/s x 1000 = 19,500 prefill tokens/s fits 3 workers (20,000) at table_margin 1.0: with 4
    running, the plain rule shrinks to 3 (at 97.5% of its capacity); with down_margin 0.9 the band asks
    19,500 / 0.9 = 21,667 of the smaller pool, so 4 stay. At 15/s (15,000 / 0.9 = 16,667) it shrinks."""
    quick = HysteresisConfig(up_cooldown_s=0, down_cooldown_s=0, down_after=1, max_step_down=8)

    def cfg(**kw):
        kw = {"down_margin": 0.0, "falling_down_after": 0, **kw}
        return PlannerConfig(
            interval_s=10, startup_s=0, max_workers=24, table_margin=1.0, hysteresis=quick, **kw
        )

    edge = _obs(195, 4, 3, osl=100.0)  # decode: 1,950 tokens/s -> 2 workers, the band too (3,400 x 0.9)
    plain = Planner(cfg(), H100, capacity=TABLE).tick(edge, now=0)
    banded = Planner(cfg(down_margin=0.9), H100, capacity=TABLE).tick(edge, now=0)
    assert (plain.prefill, banded.prefill) == (3, 4)
    assert banded.decode == 2  # decode's demand is clearly under the smaller pool's capacity
    fallen = Planner(cfg(down_margin=0.9), H100, capacity=TABLE).tick(_obs(150, 4, 3, osl=100.0), now=0)
    assert fallen.prefill == 3
    # the band never scales up: a pool below its wish is sized by table_margin alone
    up = Planner(cfg(down_margin=0.9), H100, capacity=TABLE).tick(_obs(195, 2, 2, osl=100.0), now=0)
    assert up.prefill == 3
