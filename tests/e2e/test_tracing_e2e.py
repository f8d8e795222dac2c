"""Tracing across real processes: router, decode and prefill started with
`--otlp-endpoint` pointing at an OTLP/gRPC TraceService stand-in in this test
(port 0). A request prefilled remotely must reach the collector as one trace:
the router's span the root, the decode worker's a child of it, the prefill
worker's Prefill and the KV pull children of the decode worker's, each from
its own process with its own service.name. Spans are exported in batches and
flushed when a process drains on SIGTERM, so the test stops the mesh and then
waits for what the collector received.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdmesh.launcher import ServiceSpec, flags
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.helpers import start_mesh, wait_until

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class ExportedSpan:
    service: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    attributes: dict


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent (the OTLP collector's Export, nothing more)."""

    def __init__(self) -> None:
        self.spans: list[ExportedSpan] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        attrs = {kv.key: _value(kv.value) for kv in s.attributes}
                        self.spans.append(
                            ExportedSpan(
                                resource.get("service.name", ""),
                                s.name,
                                s.trace_id,
                                s.span_id,
                                s.parent_span_id,
                                attrs,
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def names(self) -> set[str]:
        with self._lock:
            return {s.name for s in self.spans}


def _value(v) -> object:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def collector():
    c = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield c, f"127.0.0.1:{port}"
    server.stop(0)


def test_one_trace_across_router_decode_and_prefill_processes(tmp_path, collector):
    spans, endpoint = collector
    traced = flags(otlp_endpoint=endpoint)
    mesh = start_mesh(
        tmp_path,
        prefill_args=traced,
        decode_args=traced + flags(max_local_prefill_tokens=16),
    )
    try:
        router = mesh.launcher.start_ready(
            ServiceSpec(
                "router",
                "services.router.main",
                traced
                + flags(
                    decode_workers=mesh.decodes[0].address,
                    prefill_workers=mesh.prefills[0].address,
                    health_interval_s=0.2,
                    stats_interval_s=0.2,
                ),
                ready_service="pdmesh.v1.RouterService",
            )
        )
        stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.address))
        request = router_pb2.GenerateRequest(
            text="A prompt long enough to be prefilled on the prefill worker. " * 2,
            request_id="e2e-traced",
            sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
        )
        final = list(stub.Generate(request, timeout=60))[-1].final
        assert final.prefill_path == "remote"
    finally:
        mesh.launcher.stop(mesh.launcher.find("router"))  # first: its KV subscriptions hold the workers
        mesh.close()  # SIGTERM: each process drains, then flushes its spans

    wanted = {
        "pdmesh.v1.RouterService/Generate",
        "pdmesh.v1.DecodeService/Generate",
        "pdmesh.v1.PrefillService/Prefill",
        "kv.pull",
    }
    wait_until(lambda: wanted <= spans.names(), timeout=30, what=f"spans {sorted(wanted)}")
    got = {s.name: s for s in spans.spans if s.name in wanted}
    router, decode = got["pdmesh.v1.RouterService/Generate"], got["pdmesh.v1.DecodeService/Generate"]
    prefill, pull = got["pdmesh.v1.PrefillService/Prefill"], got["kv.pull"]
    assert (router.service, decode.service, prefill.service, pull.service) == (
        "pdmesh-router",
        "pdmesh-decode",
        "pdmesh-prefill",
        "pdmesh-decode",
    )
    assert len({s.trace_id for s in got.values()}) == 1
    assert router.parent_span_id == b""
    assert decode.parent_span_id == router.span_id
    assert prefill.parent_span_id == decode.span_id
    assert pull.parent_span_id == decode.span_id
    assert router.attributes["pdmesh.request_id"] == "e2e-traced"
    assert decode.attributes["pdmesh.path"] == "remote"
    assert pull.attributes["pdmesh.kv_bytes"] > 0
