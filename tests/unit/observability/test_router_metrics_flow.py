"""The router's ITL histogram and per-worker gauges, fed by real requests through
an in-process router and fake decode workers (tests/service/router)."""

from __future__ import annotations

import grpc
import pytest

from services.router.circuit_breaker import BreakerConfig
from tests.service.router.conftest import Mesh


@pytest.fixture
async def mesh():
    m = Mesh()
    yield m
    await m.close()


async def test_every_token_after_the_first_message_is_an_itl_sample(mesh):
    d1 = await mesh.decode("d1")
    h = await mesh.router([d1])
    deltas, final, _ = await h.generate("hello", max_tokens=7)
    sent = [len(d.token_ids) for d in deltas if d.token_ids]
    assert sum(sent) == 7 and final is not None
    get = h.router.metrics.registry.get_sample_value
    assert get("pdmesh_router_ttft_seconds_count") == 1
    assert get("pdmesh_router_itl_seconds_count") == 7 - sent[0]


async def test_breaker_state_and_queue_depth_per_worker(mesh):
    d1, d2 = await mesh.decode("d1"), await mesh.decode("d2")
    d2.load.waiting = 5
    h = await mesh.router([d1, d2], breaker=BreakerConfig(consecutive_failures=1), policy="round_robin")
    r = h.router
    await r.wait_until(lambda: r.registry.get("d2").load.waiting == 5)
    d1.fail_with = grpc.StatusCode.UNAVAILABLE
    d2.fail_with = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError):
        await h.generate("hello", max_tokens=2)
    r._export_worker_gauges()  # what the housekeeping task does every interval
    get = r.metrics.registry.get_sample_value
    states = {w: get("pdmesh_router_breaker_state", {"worker": w, "role": "decode"}) for w in ("d1", "d2")}
    assert states == {"d1": 2, "d2": 2}  # both failed once: both open
    assert get("pdmesh_router_worker_waiting", {"worker": "d2", "role": "decode"}) == 5
    assert get("pdmesh_router_worker_inflight", {"worker": "d1", "role": "decode"}) == 0
