"""A decode worker whose engine thread is held: its probes still answer at once, and
readiness goes NOT_SERVING only by the forward-progress rule (issue 18 item 1).

A real DecodeServicer on a MeshServer (gRPC on loopback port 0, the metrics/probe
HTTP port on port 0) over a real tiny TorchEngine, with the worker's HealthWatch.
The one stand-in is `StepHold` (tests/service/decode/hold.py): it wraps the engine
core's `step()` so the test can hold the engine's step thread (as a deadlocked or
wedged accelerator would) and let it go again; everything around it runs as in a
worker process.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, worker_pb2
from services.common.http_probe import http_ready
from services.common.server import MeshServer, ServerConfig
from services.common.validation import RequestLimits
from services.decode.disagg_policy import DisaggConfig, DisaggregationPolicy
from services.decode.metrics import DecodeMetrics
from services.decode.servicer import DecodeServicer
from services.engine.factory import create_engine
from services.router.convert import load_from_proto
from services.worker.health import HealthWatch
from tests.service.decode.hold import StepHold
from tests.support.poll import eventually
from tests.unit.engine.conftest import prompt_of, tiny_config

SERVICE = "pdmesh.v1.DecodeService"
PROBE_TIMEOUT_S = 1.0  # what a probe allows; the engine is held for longer than this
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Worker:
    def __init__(self, stall_s: float):
        self.engine = create_engine(tiny_config(num_blocks=32))
        self.registry = CollectorRegistry()
        self.server = MeshServer(
            ServerConfig(port=0, metrics_port=0, drain_grace_s=1), SERVICE, self.registry
        )
        self.watch = HealthWatch(self.engine, self.server, stall_s, interval_s=0.05)
        self.hold: StepHold | None = None

    async def start(self) -> None:
        await self.engine.start()
        self.hold = StepHold(self.engine._core)
        servicer = DecodeServicer(
            self.engine,
            DisaggregationPolicy(DisaggConfig()),
            None,
            DecodeMetrics(self.registry),
            RequestLimits(),
            common_pb2.WorkerInfo(worker_id="decode-0"),
            [],
            health=self.watch,
        )
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, self.server.server)
        await self.server.start()
        await self.server.set_ready(True)
        self.watch.start()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.decode = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def check(self, service: str = SERVICE) -> int:
        """One probe with the probe's timeout: it must answer, not time out."""
        resp = await self.health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=PROBE_TIMEOUT_S
        )
        return resp.status

    async def stats(self) -> worker_pb2.StatsResponse:
        return await self.decode.Stats(worker_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S)

    async def http(self, path: str) -> tuple[bool, str]:
        url = f"http://127.0.0.1:{self.server.metrics.port}{path}"
        return await asyncio.to_thread(http_ready, url, PROBE_TIMEOUT_S)

    async def close(self) -> None:
        if self.hold is not None:
            self.hold.release()
        await self.watch.stop()
        await self.channel.close()
        await self.server.stop()
        await self.engine.close()

    async def assert_pool_back(self) -> None:
        await self.engine.sync()
        s = self.engine.stats()
        assert (s.running, s.waiting, s.held_blocks) == (0, 0, 0)
        assert s.free_blocks == s.total_blocks == 32


@pytest.fixture
async def worker(request):
    w = Worker(stall_s=request.param)
    await w.start()
    try:
        yield w
    finally:
        await w.close()


def generate(w: Worker, max_tokens: int = 24):
    return w.decode.Generate(
        decode_pb2.DecodeServiceGenerateRequest(
            request_id="r1",
            prompt_token_ids=prompt_of(20, seed=3),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        ),
        timeout=60,
    )


async def hold_mid_stream(w: Worker):
    """A stream that produced a token, then its engine thread held in the next step."""
    call = generate(w)
    first = await call.read()
    assert first.tokens.token_ids
    w.hold.hold()
    await eventually(w.hold.entered.is_set, what="the engine thread blocked in a step")
    return call, len(first.tokens.token_ids)


@pytest.mark.parametrize("worker", [0.3], indirect=True)
async def test_a_held_engine_goes_not_serving_by_forward_progress_and_recovers(worker):
    w = worker
    assert await w.check() == SERVING
    call, got = await hold_mid_stream(w)
    held_at = time.monotonic()

    # Readiness flips, as an answer to the probe (the probe never times out) ...
    await eventually(lambda: _status_is(w, NOT_SERVING), what="readiness NOT_SERVING")
    assert await w.check("") == SERVING  # liveness stays OK
    stats = await w.stats()
    assert stats.load.not_serving_reason == "no_progress"
    assert stats.load.no_progress_ms >= 300 and stats.load.running == 1
    # ... the router's reading of the load report carries the reason (ListWorkers, heartbeats) ...
    assert load_from_proto(stats.load).not_serving_reason == "no_progress"
    # ... and the HTTP probes say the same: /livez 200, /readyz 503 with the reason.
    assert await w.http("/livez") == (True, "200")
    ok, text = await w.http("/readyz")
    assert not ok and text.startswith("503") and "no_progress" in text

    # Held longer than the probe timeout: every probe still answers (and says why).
    while time.monotonic() - held_at < 2 * PROBE_TIMEOUT_S:
        assert await w.check() == NOT_SERVING
        assert (await w.stats()).load.not_serving_reason == "no_progress"

    # Tokens flow again: SERVING, the reason cleared, the request completes whole.
    w.hold.release()
    got += await rest_of(call)
    assert got == 24
    await eventually(lambda: _status_is(w, SERVING), what="readiness SERVING again")
    assert (await w.stats()).load.not_serving_reason == ""
    assert await w.http("/readyz") == (True, "200")
    await w.assert_pool_back()


@pytest.mark.parametrize("worker", [3600.0], indirect=True)
async def test_a_held_engine_within_its_stall_time_stays_serving_and_probes_answer(worker):
    """Held for longer than the probe timeout but under --stall-not-serving-s: a busy
    worker is never reported down just because its engine is busy."""
    w = worker
    call, got = await hold_mid_stream(w)
    held_at = time.monotonic()
    while time.monotonic() - held_at < 2 * PROBE_TIMEOUT_S:
        assert await w.check() == SERVING
        stats = await w.stats()
        assert stats.load.not_serving_reason == "" and stats.load.running == 1
        assert await w.http("/readyz") == (True, "200")
    assert (await w.stats()).load.no_progress_ms >= 1000 * PROBE_TIMEOUT_S
    w.hold.release()
    got += await rest_of(call)
    assert got == 24
    await w.assert_pool_back()


async def rest_of(call) -> int:
    """Tokens in the rest of the stream (read with read(): the call was started that way)."""
    n = 0
    while (msg := await call.read()) is not grpc.aio.EOF:
        n += len(msg.tokens.token_ids)
    return n


async def _status_is(w: Worker, status: int) -> bool:
    return await w.check() == status
