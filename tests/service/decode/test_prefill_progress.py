"""A prefill worker whose engine thread is held mid-Prefill goes NOT_SERVING by the
forward-progress rule, says why in Stats, and comes back when the prefill completes
(issue 18 item 1, the prefill role).

A real `WorkerRuntime` (engine, server on port 0, its HealthWatch made from
`WorkerConfig.stall_not_serving_s`) with the real PrefillServicer, started the way
`WorkerRuntime.serve` starts it; `StepHold` (tests/service/decode/hold.py) holds the
engine's step thread.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.leases import LeaseManager
from pdmesh.v1 import prefill_pb2, prefill_pb2_grpc, worker_pb2
from services.common.server import ServerConfig
from services.common.validation import RequestLimits
from services.engine.config import EngineConfig
from services.prefill.metrics import PrefillMetrics
from services.prefill.servicer import PrefillServicer
from services.worker.runtime import WorkerConfig, WorkerRuntime
from tests.service.decode.hold import StepHold
from tests.support.poll import eventually

SERVICE = "pdmesh.v1.PrefillService"
POOL = 32
PROBE_TIMEOUT_S = 1.0


@pytest.fixture
async def prefill():
    rt = WorkerRuntime(
        "prefill",
        SERVICE,
        ServerConfig(port=0, drain_grace_s=1),
        WorkerConfig(stall_not_serving_s=0.3),
        EngineConfig(preset="tiny", num_threads=1, num_blocks=POOL, max_model_len=512),
    )
    await rt.setup()
    assert rt.health is not None
    rt.health.interval_s = 0.05  # the default is a quarter of the stall time: test faster
    leases = LeaseManager(default_ttl_s=30.0)
    servicer = PrefillServicer(
        engine=rt.engine,
        leases=leases,
        metrics=PrefillMetrics(rt.registry),
        limits=RequestLimits(),
        worker_info=rt.info(),
        kv_source_address=rt.address,
        agent_name="",
        health=rt.health,
    )
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, rt.server.server)
    await rt.server.start()  # what WorkerRuntime.serve does, without its signal handlers
    await rt.server.set_ready(True)
    rt.health.start()
    hold = StepHold(rt.engine._core)
    channel = grpc.aio.insecure_channel(rt.address)
    try:
        yield rt, hold, channel, leases
    finally:
        hold.release()
        leases.close()
        await channel.close()
        await rt.server.stop()
        await rt.shutdown()  # stops the watch, closes the engine


async def test_a_held_prefill_goes_not_serving_and_recovers(prefill):
    rt, hold, channel, leases = prefill
    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)

    async def ready() -> int:
        check = health_pb2.HealthCheckRequest(service=SERVICE)
        return (await health.Check(check, timeout=PROBE_TIMEOUT_S)).status

    hold.hold()
    req = prefill_pb2.PrefillRequest(
        request_id="p1", prompt_token_ids=list(range(1, 41)), requester_id="dec-a", requester_agent="dec-a-ag"
    )
    req.sampling.max_tokens = 4
    call = asyncio.ensure_future(stub.Prefill(req, timeout=60))
    await eventually(hold.entered.is_set, what="the engine thread blocked in a step")
    await eventually(
        lambda: _is(ready(), health_pb2.HealthCheckResponse.NOT_SERVING), what="readiness NOT_SERVING"
    )
    stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S)
    assert stats.load.not_serving_reason == "no_progress" and stats.load.no_progress_ms >= 300
    assert not call.done()

    hold.release()
    resp = await call
    assert resp.handle.handle_id and resp.computed_tokens == 40
    await eventually(lambda: _is(ready(), health_pb2.HealthCheckResponse.SERVING), what="SERVING again")
    stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S)
    assert stats.load.not_serving_reason == ""

    await stub.Release(prefill_pb2.ReleaseRequest(handle_id=resp.handle.handle_id), timeout=10)
    await rt.engine.sync()
    await eventually(lambda: rt.engine.stats().free_blocks == POOL, what="every block back")
    s = rt.engine.stats()
    assert (s.running, s.waiting, s.held_blocks) == (0, 0, 0) and leases.held == 0


async def _is(status, want: int) -> bool:
    return await status == want
