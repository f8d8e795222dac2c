"""LoopLag (services/common/metrics.py): a timer's lateness, observed on the loop it watches."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import LoopLag
from services.common.server import metric_service
from tests.support.poll import eventually


def ticks(lag: LoopLag) -> int:
    return lag.histogram.snapshot()[1][-1]


async def test_a_blocked_loop_shows_as_a_late_tick():
    registry = CollectorRegistry()
    lag = LoopLag(registry, "router", interval_s=0.01)
    lag.start()
    try:
        await eventually(lambda: ticks(lag) >= 2, what="a few on-time ticks")
        before = ticks(lag)
        time.sleep(0.12)  # the loop is blocked: the tick due in this window runs late
        await eventually(lambda: ticks(lag) > before, what="the late tick")
    finally:
        lag.stop()
    bounds, cumulative, total = lag.histogram.snapshot()
    over_50ms = cumulative[-1] - cumulative[bounds.index(0.05)]
    assert over_50ms >= 1 and total >= 0.1
    assert registry.get_sample_value("pdmesh_router_event_loop_lag_seconds_count") == cumulative[-1]


async def test_stop_ends_the_ticks():
    lag = LoopLag(CollectorRegistry(), "decode", interval_s=0.005)
    lag.start()
    await eventually(lambda: ticks(lag) >= 2, what="ticks")
    lag.stop()
    count = ticks(lag)
    await asyncio.sleep(0.03)  # six intervals in which a running monitor would tick
    assert ticks(lag) == count


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        LoopLag(CollectorRegistry(), "router", interval_s=0)


@pytest.mark.parametrize(
    "name, service",
    [
        ("pdmesh.v1.RouterService", "router"),
        ("pdmesh.v1.DecodeService", "decode"),
        ("pdmesh.v1.KvTransferService", "kvtransfer"),
        ("pdmesh.planner", "planner"),
    ],
)
def test_metric_names_follow_the_service(name, service):
    assert metric_service(name) == service
