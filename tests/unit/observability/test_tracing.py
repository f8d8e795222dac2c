"""services/common/tracing.py: the config, the interceptors on a real server on
port 0, sampling, and that with tracing off nothing of the SDK is loaded."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from pdmesh.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.channels import ChannelCache
from services.common.config import ConfigError, build
from services.common.server import MeshServer, ServerConfig
from services.common.tracing import Tracing, TracingConfig, client_interceptors
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry
from services.kvtransfer.servicer import SERVICE_NAME, KvTransferServicer
from services.kvtransfer.stats import TransferStatistics
from tests.unit.deploy import repo

ROOT_METHOD = "/pdmesh.v1.PrefillService/Prefill"  # an entry RPC: traced even without a caller's context


def test_config_is_off_by_default_and_one_env_var_turns_it_on():
    assert not TracingConfig().enabled
    assert Tracing.start(TracingConfig(), "router") is None
    assert client_interceptors(None) == ()
    cfg = build(
        TracingConfig, None, {"PDMESH_OTLP_ENDPOINT": "collector:4317", "PDMESH_TRACE_SAMPLE_RATIO": "0.25"}
    )
    assert cfg.enabled and cfg.otlp_endpoint == "collector:4317" and cfg.trace_sample_ratio == 0.25
    with pytest.raises(ConfigError, match="trace_sample_ratio"):
        build(TracingConfig, None, {"PDMESH_TRACE_SAMPLE_RATIO": "1.5"})


def test_with_tracing_off_no_service_loads_the_sdk():
    # Every main imported and its tracing started from an empty config: the SDK and the
    # exporter stay unimported (the API alone is, for the no-op helpers).
    code = (
        "import sys\n"
        "for s in ('kvtransfer', 'prefill', 'decode', 'router', 'gateway'):\n"
        "    __import__(f'services.{s}.main')\n"
        "from services.common.tracing import Tracing, TracingConfig\n"
        "assert Tracing.start(TracingConfig(), 'router') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk') or 'exporter' in m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo.ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


class Mesh:
    """A kvtransfer servicer (GetAgent: not an entry RPC) and a fake entry RPC on one
    traced MeshServer, and a caller-side provider whose spans the calls continue."""

    def __init__(self, sample_ratio: float = 1.0):
        self.exporter = InMemorySpanExporter()
        self.tracing = Tracing.with_exporter(self.exporter, "pdmesh-test", sample_ratio, batch=False)
        self.server = MeshServer(ServerConfig(port=0), SERVICE_NAME, tracing=self.tracing)
        servicer = KvTransferServicer(
            AgentRegistry(default_lease_s=10), TransferStatistics(), KvServiceMetrics(CollectorRegistry())
        )
        kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(servicer, self.server.server)
        entry = grpc.unary_unary_rpc_method_handler(self._entry)
        self.server.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("pdmesh.v1.PrefillService", {"Prefill": entry}),)
        )
        self.caller_exporter = InMemorySpanExporter()
        self.caller = TracerProvider()
        self.caller.add_span_processor(SimpleSpanProcessor(self.caller_exporter))
        self.channels = ChannelCache(interceptors=self.tracing.client_interceptors())

    async def _entry(self, request: bytes, context) -> bytes:
        return b"ok"

    def stub(self) -> kvtransfer_pb2_grpc.KvTransferServiceStub:
        return kvtransfer_pb2_grpc.KvTransferServiceStub(self.channels.get(self.server.address))

    async def entry(self) -> bytes:
        return await self.channels.get(self.server.address).unary_unary(ROOT_METHOD)(b"", timeout=10)


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    m = Mesh()
    await m.server.start()
    yield m
    await m.channels.close()
    await m.server.stop()


async def test_a_call_made_inside_a_span_gets_a_child_server_span_with_its_status(mesh):
    assert type(mesh.server.interceptors[0]).__module__ == "services.common.tracing"  # outermost
    tracer = mesh.caller.get_tracer("t")
    with tracer.start_as_current_span("caller") as caller, pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stub().GetAgent(kvtransfer_pb2.GetAgentRequest(name="nobody"), timeout=10)
    (span,) = mesh.exporter.get_finished_spans()
    assert span.name == "pdmesh.v1.KvTransferService/GetAgent" and span.kind is trace.SpanKind.SERVER
    assert span.context.trace_id == caller.get_span_context().trace_id
    assert span.parent.span_id == caller.get_span_context().span_id
    assert span.attributes["rpc.service"] == "pdmesh.v1.KvTransferService"
    assert span.attributes["rpc.method"] == "GetAgent"
    assert span.attributes["rpc.grpc.status_code"] == err.value.code().value[0] != 0
    assert span.status.status_code is trace.StatusCode.ERROR
    assert span.resource.attributes["service.name"] == "pdmesh-test"


async def test_only_entry_rpcs_start_a_trace_without_a_callers_context(mesh):
    with pytest.raises(grpc.aio.AioRpcError):
        await mesh.stub().GetAgent(kvtransfer_pb2.GetAgentRequest(name="nobody"), timeout=10)
    assert mesh.exporter.get_finished_spans() == ()  # background-like call: not traced
    assert await mesh.entry() == b"ok"
    (span,) = mesh.exporter.get_finished_spans()
    assert span.name == ROOT_METHOD.lstrip("/") and span.parent is None
    assert span.attributes["rpc.grpc.status_code"] == 0 and span.status.is_ok


async def test_sampling_starts_few_traces_but_follows_a_sampled_caller():
    m = Mesh(sample_ratio=0.0)
    await m.server.start()
    try:
        await m.entry()
        assert m.exporter.get_finished_spans() == ()  # a new trace, not sampled at ratio 0
        with m.caller.get_tracer("t").start_as_current_span("caller"):  # sampled by its own provider
            await m.entry()
        (span,) = m.exporter.get_finished_spans()
        assert span.parent is not None
    finally:
        await m.channels.close()
        await m.server.stop()
