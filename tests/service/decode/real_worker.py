"""A real decode worker in-process for service tests: DecodeServicer on a MeshServer
(gRPC on loopback port 0, metrics/probe HTTP on port 0) over a real tiny TorchEngine,
with its HealthWatch and a `StepHold` on the engine's step thread."""

from __future__ import annotations

import asyncio

import grpc
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
from services.worker.health import HealthWatch
from tests.service.decode.hold import StepHold
from tests.support.poll import eventually
from tests.unit.engine.conftest import prompt_of, tiny_config

SERVICE = "pdmesh.v1.DecodeService"
PROBE_TIMEOUT_S = 1.0  # what a probe allows; tests hold the engine for longer than this


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
        self.server.bind()
        e = self.engine.info
        info = common_pb2.WorkerInfo(  # what a worker reports, so a router can take it as a member
            worker_id="decode-0",
            address=self.server.address,
            role=common_pb2.WORKER_ROLE_DECODE,
            model_id=e.model_id,
            block_size=e.block_size,
            kv_capacity_blocks=e.num_blocks,
            max_model_len=e.max_model_len,
        )
        servicer = DecodeServicer(
            self.engine,
            DisaggregationPolicy(DisaggConfig()),
            None,
            DecodeMetrics(self.registry),
            RequestLimits(),
            info,
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


async def rest_of(call) -> int:
    """Tokens in the rest of the stream (read with read(): the call was started that way)."""
    n = 0
    while (msg := await call.read()) is not grpc.aio.EOF:
        n += len(msg.tokens.token_ids)
    return n
