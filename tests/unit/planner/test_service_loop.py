"""The planner service's loop: interval observations from cumulative counters, the loop over
a fake source (decisions, actuation, start-up measurement, state file, metrics), and the
Stats reader against a real router on loopback (fake decode workers behind it)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from services.planner.actuators import ActuatorError, DryRunActuator
from services.planner.capacity import profile_model
from services.planner.hysteresis import HysteresisConfig
from services.planner.loop import PlannerLoop
from services.planner.metrics import PlannerMetrics
from services.planner.observe import Histogram, Snapshot, observation_between
from services.planner.planner import Planner, PlannerConfig
from services.planner.stats_reader import StatsReader, StatsUnavailable

INF = float("inf")
BOUNDS = (0.01, 0.1, 1.0, INF)


def test_histogram_quantile_interpolates_within_its_bucket():
    h = Histogram(BOUNDS, (0, 10, 10, 10))  # all ten in (0.01, 0.1]
    assert h.quantile(0.5) == pytest.approx(0.055)
    assert Histogram(BOUNDS, (0, 0, 0, 4)).quantile(0.9) == 1.0  # +Inf bucket: the last finite bound
    assert Histogram(BOUNDS, (0, 0, 0, 0)).quantile(0.9) is None


def test_histogram_minus_is_the_interval_and_a_restart_its_own_baseline():
    old, new = Histogram(BOUNDS, (1, 2, 3, 3)), Histogram(BOUNDS, (1, 5, 9, 9))
    assert new.minus(old).counts == (0, 3, 6, 6)
    assert old.minus(new).counts == old.counts  # counts went down: the router restarted


def test_observation_between_two_reads():
    prev = Snapshot(
        0.0,
        arrivals=10,
        finished=8,
        prompt_tokens=800,
        completion_tokens=80,
        prompt_counters={"d0": (0, 100)},
    )
    cur = Snapshot(
        10.0,
        arrivals=30,
        finished=28,
        prompt_tokens=2800,
        completion_tokens=480,
        itl=Histogram(BOUNDS, (5, 10, 10, 10)),
        prompt_counters={"d0": (300, 400), "d1": (1000, 1000)},  # d1 is new: no interval of its own
        ready={"prefill": 1, "decode": 2},
    )
    obs = observation_between(prev, cur, {"prefill": 1, "decode": 2}, 0.9)
    assert (obs.requests, obs.mean_isl, obs.mean_osl) == (20, 100.0, 20.0)
    assert obs.hit_rate == pytest.approx(300 / 600)
    assert obs.itl_q_s == pytest.approx(0.01 + 0.09 * (9 - 5) / 5)
    assert obs.ttft_q_s is None and obs.ready_prefill_workers == 1 and obs.decode_workers == 2


class FakeSource:
    def __init__(self, snaps):
        self.snaps = list(snaps)

    async def read(self, now):
        if not self.snaps:
            raise StatsUnavailable("router: UNAVAILABLE")
        return self.snaps.pop(0)


def planner(**kw):
    cfg = PlannerConfig(
        interval_s=1.0,
        max_prefill=0,
        min_prefill=0,
        max_decode=3,
        max_workers=3,
        startup_s=30.0,
        hysteresis=HysteresisConfig(up_cooldown_s=0, down_cooldown_s=0, down_after=1),
        **kw,
    )
    return Planner(cfg, profile_model("splitwise-h100-llama70b"))


def slow_itl(n):
    return Histogram(BOUNDS, (0, 0, n, n))  # every token gap in (0.1, 1] s: over a 0.05 s SLO


async def test_loop_scales_up_on_measured_itl_and_measures_the_startup(tmp_path):
    p = planner()
    snaps = [
        Snapshot(0.0, ready={"decode": 1}),
        Snapshot(1.0, arrivals=2, finished=2, prompt_tokens=20, completion_tokens=20, itl=slow_itl(18),
                 ready={"decode": 1}),
        Snapshot(2.0, arrivals=2, finished=2, prompt_tokens=20, completion_tokens=20, itl=slow_itl(18),
                 ready={"decode": 2}),
    ]  # fmt: skip
    act = DryRunActuator({"prefill": 0, "decode": 1})
    reg = CollectorRegistry()
    clock = iter([0.0, 1.0, 2.0]).__next__
    loop = PlannerLoop(
        p, FakeSource(snaps), act, PlannerMetrics(reg), state_file=tmp_path / "p.json", clock=clock
    )
    assert await loop.step() is None  # the first read is the baseline
    d = await loop.step()
    assert (d.decode, d.prefill) == (2, 0) and "itl_measured_over_slo" in d.reason
    assert act.calls == [("decode", 2)]
    state = json.loads((tmp_path / "p.json").read_text())
    assert state["decode"] == 2 and "itl_measured_over_slo" in state["reason"]
    assert state["inputs"]["measured_itl_q_s"] > 0.05
    assert reg.get_sample_value("pdmesh_planner_desired_replicas", {"role": "decode"}) == 2
    assert (
        reg.get_sample_value(
            "pdmesh_planner_decisions_total", {"reason": "itl_measured_over_slo", "changed": "true"}
        )
        == 1
    )
    await loop.step()  # the router lists 2 ready decode workers 1 s after the scale call
    assert p.startup_s == pytest.approx(15.0)  # max(1.0, 0.5 * 30): the slowest seen lately


async def test_loop_skips_an_interval_without_stats_and_counts_it():
    reg = CollectorRegistry()
    loop = PlannerLoop(planner(), FakeSource([]), DryRunActuator(), PlannerMetrics(reg), clock=lambda: 0.0)
    assert await loop.step() is None
    assert reg.get_sample_value("pdmesh_planner_stats_errors_total") == 1


class FailingActuator(DryRunActuator):
    async def scale(self, role, replicas):
        raise ActuatorError("kubernetes patch: 403 Forbidden")


async def test_an_actuator_error_is_counted_and_the_wish_kept():
    snaps = [Snapshot(0.0), Snapshot(1.0, arrivals=1, finished=1, itl=slow_itl(5), ready={"decode": 1})]
    reg = CollectorRegistry()
    act = FailingActuator({"prefill": 0, "decode": 1})
    clock = iter([0.0, 1.0]).__next__
    loop = PlannerLoop(planner(), FakeSource(snaps), act, PlannerMetrics(reg), clock=clock)
    await loop.step()
    d = await loop.step()
    assert d.decode == 2 and act.desired["decode"] == 1
    assert reg.get_sample_value("pdmesh_planner_actuator_errors_total", {"role": "decode"}) == 1


async def test_reader_against_a_real_router(mesh):
    d1 = await mesh.decode("d1")
    h = await mesh.router([d1])
    reader = StatsReader(h.listeners.internal_address, None, worker_stats=True)
    try:
        before = await reader.read(0.0)
        await h.generate("abcd", max_tokens=5)
        await h.generate("abcdefgh", max_tokens=3)
        after = await reader.read(1.0)
    finally:
        await reader.close()
    assert after.ready == {"prefill": 0, "decode": 1}
    obs = observation_between(before, after, {"prefill": 0, "decode": 1}, 0.9)
    assert (obs.requests, obs.mean_isl, obs.mean_osl) == (2, 6.0, 4.0)
    assert obs.ttft_q_s is not None and obs.ttft_q_s > 0
    assert "d1" in after.prompt_counters  # the worker's own Stats answered


async def test_reader_raises_when_the_router_is_gone():
    reader = StatsReader("127.0.0.1:1", None, timeout_s=0.5)
    try:
        with pytest.raises(StatsUnavailable):
            await reader.read(0.0)
    finally:
        await reader.close()
