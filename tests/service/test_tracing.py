"""Tracing through the real mesh in this process: router -> decode -> prefill.

kvtransfer, one prefill worker, one decode worker and a router, each a real
servicer on its own MeshServer wired the way the mains wire them (tiny model,
KV over the gRPC transport so KvSource.ReadBlocks is a real call). With
tracing on, each service has its own `Tracing` (its own provider and
service.name) over one shared InMemorySpanExporter; a request whose prompt is
prefilled remotely must leave one trace whose spans link up:

    router  pdmesh.v1.RouterService/Generate            (root)
    decode    pdmesh.v1.DecodeService/Generate
    prefill     pdmesh.v1.PrefillService/Prefill
    decode      kv.pull
    prefill       pdmesh.v1.KvSourceService/ReadBlocks

With tracing off, no interceptor is installed and nothing is recorded, even
with an SDK provider installed globally and a caller that sends a trace context.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvtransfer.grpc_transport import KvSourceServicer, add_kv_source
from kvtransfer.leases import LeaseManager
from kvtransfer.pool import PoolView
from pdmesh.v1 import (
    common_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from services.common.server import MeshServer, ServerConfig
from services.common.tracing import Tracing, client_interceptors
from services.common.validation import RequestLimits
from services.decode.disagg_policy import DisaggConfig, DisaggregationPolicy
from services.decode.metrics import DecodeMetrics
from services.decode.remote_prefill import RemotePrefill
from services.decode.servicer import DecodeServicer
from services.engine.config import EngineConfig
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry
from services.kvtransfer.servicer import SERVICE_NAME as KV_SERVICE
from services.kvtransfer.servicer import KvTransferServicer
from services.kvtransfer.stats import TransferStatistics
from services.prefill.metrics import PrefillMetrics
from services.prefill.servicer import PrefillServicer
from services.router.config import ModelSpec, RouterConfig, RouterSettings
from services.router.router import Router
from services.router.servicer import SERVICE_NAME as ROUTER_SERVICE
from services.router.servicer import add_to_server
from services.worker.runtime import WorkerConfig, WorkerRuntime
from tests.support.poll import eventually
from tests.unit.observability.otel_globals import global_tracer_provider

ENGINE = EngineConfig(preset="tiny", num_threads=1, num_blocks=128)
LIMITS = RequestLimits()
SERVER = ServerConfig(port=0, drain_grace_s=1)
LONG_PROMPT = "a prompt longer than the decode worker's local prefill limit"  # byte tokens: > 8


@dataclass
class InProcessMesh:
    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    servers: dict[str, MeshServer] = field(default_factory=dict)
    runtimes: list[WorkerRuntime] = field(default_factory=list)
    router: Router | None = None

    def tracer(self, service: str, on: bool) -> Tracing | None:
        """This service's own provider (its service.name), all exporting to one exporter."""
        return Tracing.with_exporter(self.exporter, f"pdmesh-{service}", batch=False) if on else None

    async def start(self, traced: bool) -> None:
        kv = MeshServer(SERVER, KV_SERVICE, tracing=self.tracer("kvtransfer", traced))
        kv_servicer = KvTransferServicer(
            AgentRegistry(default_lease_s=10), TransferStatistics(), KvServiceMetrics(CollectorRegistry())
        )
        kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(kv_servicer, kv.server)
        await kv.start()
        self.servers["kvtransfer"] = kv
        prefill = await self._worker("prefill", kv.address, traced)
        leases = LeaseManager(default_ttl_s=30.0)
        pool = prefill.engine.kv_pool()
        assert pool is not None and prefill.engine.info.layout is not None
        add_kv_source(
            prefill.server.server, KvSourceServicer(PoolView(pool, prefill.engine.info.layout), leases)
        )
        assert prefill.transport is not None
        prefill.transport.attach_source(leases)
        servicer = PrefillServicer(
            prefill.engine, leases, PrefillMetrics(prefill.registry), LIMITS, prefill.info(), prefill.address,
            prefill.transport.agent_name,
        )  # fmt: skip
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, prefill.server.server)
        await prefill.server.start()
        await prefill.server.set_ready(True)
        decode = await self._worker("decode", kv.address, traced)
        assert decode.transport is not None
        decode_servicer = DecodeServicer(
            engine=decode.engine,
            policy=DisaggregationPolicy(DisaggConfig(max_local_prefill_tokens=8)),
            remote=RemotePrefill(decode.engine, decode.transport, decode.channels, decode.worker_id),
            metrics=DecodeMetrics(decode.registry),
            limits=LIMITS,
            worker_info=decode.info(),
            static_candidates=[],
        )
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode_servicer, decode.server.server)
        await decode.server.start()
        await decode.server.set_ready(True)
        await self._router(decode.address, prefill.address, traced)

    async def _worker(self, role: str, kv_address: str, traced: bool) -> WorkerRuntime:
        config = WorkerConfig(worker_id=f"{role}-0", kvtransfer_address=kv_address, kv_transport="grpc")
        rt = WorkerRuntime(
            role,
            f"pdmesh.v1.{role.title()}Service",
            SERVER,
            config,
            ENGINE,
            tracing=self.tracer(role, traced),
        )
        self.runtimes.append(rt)
        await rt.setup()
        return rt

    async def _router(self, decode: str, prefill: str, traced: bool) -> None:
        cfg = RouterConfig(
            decode_workers=(decode,), prefill_workers=(prefill,), health_interval_s=0.1, stats_interval_s=0.1,
            dns_refresh_s=0, seed=0,
        )  # fmt: skip
        settings = RouterSettings(server=SERVER, router=cfg)
        tracing = self.tracer("router", traced)
        self.router = Router(settings, ModelSpec.load(cfg), interceptors=client_interceptors(tracing))
        server = MeshServer(SERVER, ROUTER_SERVICE, tracing=tracing)
        add_to_server(self.router, server.server)
        await server.start()
        self.servers["router"] = server
        await self.router.start()
        r = self.router
        await r.wait_until(lambda: len(r.registry) == 2 and all(w.healthy for w in r.registry.workers()))

    async def generate(self, metadata: tuple[tuple[str, str], ...] = ()) -> router_pb2.GenerateFinal:
        async with grpc.aio.insecure_channel(self.servers["router"].address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            request = router_pb2.GenerateRequest(
                text=LONG_PROMPT,
                request_id="traced-1",
                tenant="acme",
                sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
            )
            msgs = [m async for m in stub.Generate(request, timeout=60, metadata=metadata)]
        return msgs[-1].final

    async def close(self) -> None:
        if self.router is not None:
            await self.router.close()
        if "router" in self.servers:
            await self.servers["router"].stop()
        for rt in self.runtimes:
            await rt.server.stop()
            await rt.shutdown()  # deregisters its agent: kvtransfer goes last
        if "kvtransfer" in self.servers:
            await self.servers["kvtransfer"].stop()


async def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll `predicate` (a server's span ends just after its last message is sent)."""
    await eventually(predicate, timeout=timeout, what="spans")


@pytest.fixture
async def traced_mesh() -> AsyncIterator[InProcessMesh]:
    mesh = InProcessMesh()
    try:
        await mesh.start(traced=True)
        yield mesh
    finally:
        await mesh.close()


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    out: dict[str, ReadableSpan] = {}
    for s in spans:
        assert s.name not in out, f"two spans named {s.name}"
        out[s.name] = s
    return out


EXPECTED = {
    "pdmesh.v1.RouterService/Generate": "pdmesh-router",
    "pdmesh.v1.DecodeService/Generate": "pdmesh-decode",
    "pdmesh.v1.PrefillService/Prefill": "pdmesh-prefill",
    "kv.pull": "pdmesh-decode",
    "pdmesh.v1.KvSourceService/ReadBlocks": "pdmesh-prefill",
}


async def test_a_remote_prefill_request_is_one_trace_router_decode_prefill(traced_mesh):
    final = await traced_mesh.generate()
    assert final.prefill_path == "remote" and final.usage.completion_tokens == 4
    exporter = traced_mesh.exporter
    await wait_for(lambda: set(EXPECTED) <= {s.name for s in exporter.get_finished_spans()})
    spans = tuple(s for s in exporter.get_finished_spans() if s.name in EXPECTED)
    got = by_name(spans)
    assert {name: s.resource.attributes["service.name"] for name, s in got.items()} == EXPECTED
    assert len({s.context.trace_id for s in spans}) == 1

    router, decode = got["pdmesh.v1.RouterService/Generate"], got["pdmesh.v1.DecodeService/Generate"]
    prefill, pull = got["pdmesh.v1.PrefillService/Prefill"], got["kv.pull"]
    read = got["pdmesh.v1.KvSourceService/ReadBlocks"]
    assert router.parent is None
    assert decode.parent.span_id == router.context.span_id
    assert prefill.parent.span_id == decode.context.span_id
    assert pull.parent.span_id == decode.context.span_id
    assert read.parent.span_id == pull.context.span_id
    for s in (router, decode, prefill, read):
        assert s.kind is trace.SpanKind.SERVER and s.attributes["rpc.grpc.status_code"] == 0

    a = router.attributes
    assert (a["pdmesh.request_id"], a["pdmesh.tenant"], a["pdmesh.worker"]) == (
        "traced-1",
        "acme",
        "decode-0",
    )
    assert (a["pdmesh.attempts"], a["pdmesh.migrations"]) == (1, 0)
    attempts = [dict(e.attributes) for e in router.events if e.name == "attempt"]
    assert attempts == [{"pdmesh.worker": "decode-0", "pdmesh.resume_tokens": 0}]
    d = decode.attributes
    assert (d["pdmesh.path"], d["pdmesh.reason"], d["pdmesh.prefill_worker"]) == (
        "remote",
        "long_prompt",
        "prefill-0",
    )
    assert d["pdmesh.kv_bytes"] == pull.attributes["pdmesh.kv_bytes"] > 0
    assert pull.attributes["pdmesh.transport"] == "grpc"
    p = prefill.attributes
    assert p["pdmesh.computed"] == len(LONG_PROMPT) and p["pdmesh.cached"] == 0
    assert p["pdmesh.requester"] == "decode-0"


async def test_background_calls_are_not_traced_and_a_callers_context_is_continued(traced_mesh):
    # The router's health/Stats/KV-event loops have run many times by now: none left a span.
    assert traced_mesh.exporter.get_finished_spans() == ()
    caller = TracerProvider()
    caller_exporter = InMemorySpanExporter()
    caller.add_span_processor(SimpleSpanProcessor(caller_exporter))
    with caller.get_tracer("client").start_as_current_span("client") as client_span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        await traced_mesh.generate(metadata=tuple(carrier.items()))
    exporter = traced_mesh.exporter
    await wait_for(
        lambda: "pdmesh.v1.PrefillService/Prefill" in {s.name for s in exporter.get_finished_spans()}
    )
    router = by_name(exporter.get_finished_spans())["pdmesh.v1.RouterService/Generate"]
    assert router.context.trace_id == client_span.get_span_context().trace_id
    assert router.parent.span_id == client_span.get_span_context().span_id


async def test_with_tracing_off_nothing_is_installed_or_recorded():
    mesh = InProcessMesh()
    with global_tracer_provider() as global_exporter:  # as if someone had set up the SDK globally
        try:
            await mesh.start(traced=False)
            caller = trace.get_tracer("client")
            with caller.start_as_current_span("client"):
                carrier: dict[str, str] = {}
                propagate.inject(carrier)
                assert "traceparent" in carrier
                final = await mesh.generate(metadata=tuple(carrier.items()))
            assert final.prefill_path == "remote"
            for server in [*mesh.servers.values(), *(rt.server for rt in mesh.runtimes)]:
                assert all(type(i).__module__ != "services.common.tracing" for i in server.interceptors)
            assert all(rt.channels.interceptors == () for rt in mesh.runtimes)
            assert mesh.router is not None and mesh.router.pool.interceptors == ()
        finally:
            await mesh.close()
        assert [s.name for s in global_exporter.get_finished_spans()] == ["client"]
    assert mesh.exporter.get_finished_spans() == ()
