"""The metrics-only and dry-run actuators."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.planner.actuators import DryRunActuator, MetricsOnlyActuator


async def test_metrics_only_publishes_the_desired_replicas():
    reg = CollectorRegistry()
    act = MetricsOnlyActuator(reg, {"prefill": 1, "decode": 1})
    await act.scale("decode", 4)
    assert reg.get_sample_value("pdmesh_planner_desired_replicas", {"role": "decode"}) == 4
    assert reg.get_sample_value("pdmesh_planner_desired_replicas", {"role": "prefill"}) == 1
    assert await act.replicas() == {"prefill": 1, "decode": 4}


async def test_dry_run_records_and_changes_nothing_else():
    act = DryRunActuator()
    await act.scale("prefill", 3)
    assert act.calls == [("prefill", 3)]
    assert (await act.replicas())["prefill"] == 3
