"""Every RPC of the contract, how to call it with raw bytes, and what it may answer.

`RPCS` lists each method of RouterService, DecodeService, PrefillService,
KvTransferService and KvSourceService with the server that serves it in the
in-process mesh, its request and response types, and the status codes it may
end with besides OK. Nothing in any list is UNKNOWN, INTERNAL or
DEADLINE_EXCEEDED: a crash, a bug and a hang are failures for every method.

`invoke` sends bytes through a generic call with identity serializers (so
malformed wire data reaches the server) under a deadline; `cleanup` undoes
what a successful fuzzed call legitimately holds (a KV lease, a registered
worker or agent), as a well-behaved client would, before the invariants are
checked.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from pdmesh.v1 import (
    decode_pb2,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)
from tests.fuzz.inproc import InProcessMesh

CALL_TIMEOUT_S = 15.0
C = grpc.StatusCode
INVALID = frozenset({C.INVALID_ARGUMENT})


@dataclass(frozen=True)
class Rpc:
    server: str  # key of InProcessMesh.addresses
    method: str  # "/package.Service/Method"
    request: type[Message]
    response: type[Message]
    codes: frozenset[grpc.StatusCode] = frozenset()  # allowed besides OK
    stream: bool = False
    endless: bool = False  # a subscription: read the first message, then hang up

    @property
    def name(self) -> str:
        return self.method.rsplit("/", 1)[-1]


def _rpc(server, service, method, req, resp, codes=(), **kw) -> Rpc:
    return Rpc(server, f"/pdmesh.v1.{service}/{method}", req, resp, frozenset(codes), **kw)


R, D, P, K = "RouterService", "DecodeService", "PrefillService", "KvTransferService"
RPCS = (
    _rpc(
        "router", R, "Generate", router_pb2.GenerateRequest, router_pb2.GenerateResponse, INVALID, stream=True
    ),
    _rpc("router", R, "Cancel", router_pb2.CancelRequest, router_pb2.CancelResponse, INVALID),
    # The router's internal port. A worker speaks only for itself: a fuzzed id of a
    # static worker, or one registered by someone else, is PERMISSION_DENIED.
    _rpc("router_internal", R, "ListWorkers", router_pb2.ListWorkersRequest, router_pb2.ListWorkersResponse),
    _rpc(
        "router_internal",
        R,
        "RegisterWorker",
        router_pb2.RegisterWorkerRequest,
        router_pb2.RegisterWorkerResponse,
        {C.INVALID_ARGUMENT, C.FAILED_PRECONDITION, C.PERMISSION_DENIED},
    ),
    _rpc(
        "router_internal",
        R,
        "Heartbeat",
        router_pb2.RouterServiceHeartbeatRequest,
        router_pb2.RouterServiceHeartbeatResponse,
        {C.INVALID_ARGUMENT, C.PERMISSION_DENIED},
    ),
    _rpc(
        "router_internal",
        R,
        "DeregisterWorker",
        router_pb2.DeregisterWorkerRequest,
        router_pb2.DeregisterWorkerResponse,
        {C.INVALID_ARGUMENT, C.PERMISSION_DENIED},
    ),
    _rpc(
        "router_internal",
        R,
        "Stats",
        router_pb2.RouterServiceStatsRequest,
        router_pb2.RouterServiceStatsResponse,
    ),
    _rpc(
        "decode",
        D,
        "Generate",
        decode_pb2.DecodeServiceGenerateRequest,
        decode_pb2.DecodeServiceGenerateResponse,
        INVALID,
        stream=True,
    ),
    _rpc(
        "decode",
        D,
        "SubscribeKvEvents",
        worker_pb2.SubscribeKvEventsRequest,
        worker_pb2.SubscribeKvEventsResponse,
        stream=True,
        endless=True,
    ),
    _rpc("decode", D, "Stats", worker_pb2.StatsRequest, worker_pb2.StatsResponse),
    _rpc(
        "prefill",
        P,
        "Prefill",
        prefill_pb2.PrefillRequest,
        prefill_pb2.PrefillResponse,
        {C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED},  # shed when leases hold the pool (issue 13)
    ),
    _rpc("prefill", P, "Release", prefill_pb2.ReleaseRequest, prefill_pb2.ReleaseResponse, INVALID),
    _rpc(
        "prefill",
        P,
        "SubscribeKvEvents",
        worker_pb2.SubscribeKvEventsRequest,
        worker_pb2.SubscribeKvEventsResponse,
        stream=True,
        endless=True,
    ),
    _rpc("prefill", P, "Stats", worker_pb2.StatsRequest, worker_pb2.StatsResponse),
    _rpc(
        "kvtransfer",
        K,
        "RegisterAgent",
        kvtransfer_pb2.RegisterAgentRequest,
        kvtransfer_pb2.RegisterAgentResponse,
        INVALID,
    ),
    _rpc(
        "kvtransfer",
        K,
        "Heartbeat",
        kvtransfer_pb2.HeartbeatRequest,
        kvtransfer_pb2.HeartbeatResponse,
        # a malformed owner_secret; a real agent's name with someone else's secret (issue 13)
        {C.NOT_FOUND, C.INVALID_ARGUMENT, C.PERMISSION_DENIED},
    ),
    _rpc(
        "kvtransfer",
        K,
        "DeregisterAgent",
        kvtransfer_pb2.DeregisterAgentRequest,
        kvtransfer_pb2.DeregisterAgentResponse,
        {C.INVALID_ARGUMENT, C.PERMISSION_DENIED},
    ),
    _rpc(
        "kvtransfer",
        K,
        "GetAgent",
        kvtransfer_pb2.GetAgentRequest,
        kvtransfer_pb2.GetAgentResponse,
        {C.NOT_FOUND},
    ),
    _rpc(
        "kvtransfer",
        K,
        "ReportTransfers",
        kvtransfer_pb2.ReportTransfersRequest,
        kvtransfer_pb2.ReportTransfersResponse,
        INVALID,
    ),
    _rpc(
        "kvtransfer",
        K,
        "Stats",
        kvtransfer_pb2.KvTransferServiceStatsRequest,
        kvtransfer_pb2.KvTransferServiceStatsResponse,
    ),
    _rpc(
        "prefill",
        "KvSourceService",
        "ReadBlocks",
        kvtransfer_pb2.ReadBlocksRequest,
        kvtransfer_pb2.ReadBlocksResponse,
        # stale or unknown handle, another worker's handle, bad block ids, another layout
        {C.NOT_FOUND, C.PERMISSION_DENIED, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION},
        stream=True,
    ),
)
BY_NAME = {f"{r.server}.{r.name}": r for r in RPCS}


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[bytes]


def invoke(mesh: InProcessMesh, rpc: Rpc, payload: bytes, timeout: float = CALL_TIMEOUT_S) -> Outcome:
    """Send `payload` as the request bytes (no serializer) and collect the raw answers."""
    channel = mesh.channels[rpc.server]
    out: list[bytes] = []
    try:
        if not rpc.stream:
            out.append(channel.unary_unary(rpc.method)(payload, timeout=timeout))
            return Outcome(C.OK, "", out)
        call = channel.unary_stream(rpc.method)(payload, timeout=timeout)
        for msg in call:
            out.append(msg)
            if rpc.endless:
                call.cancel()
                break
        return Outcome(C.OK, "", out)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", out)


def parse(cls: type[Message], data: bytes) -> Message | None:
    try:
        return cls.FromString(data)
    except DecodeError:
        return None


def cleanup(mesh: InProcessMesh, rpc: Rpc, payload: bytes, outcome: Outcome) -> None:
    """Give back what a successful call holds, as its client would."""
    if outcome.code != C.OK or not outcome.responses:
        return
    resp = parse(rpc.response, outcome.responses[-1])
    req = parse(rpc.request, payload)
    if rpc.method.endswith("PrefillService/Prefill") and resp is not None and resp.handle.handle_id:
        mesh.release(resp.handle.handle_id)
    elif rpc.method.endswith("RouterService/RegisterWorker") and req is not None and resp is not None:
        stub = router_pb2_grpc.RouterServiceStub(mesh.channels["router_internal"])
        stub.DeregisterWorker(
            router_pb2.DeregisterWorkerRequest(worker_id=req.worker.worker_id, incarnation=resp.incarnation),
            timeout=5,
        )
    elif rpc.method.endswith("KvTransferService/RegisterAgent") and req is not None and resp is not None:
        stub = kvtransfer_pb2_grpc.KvTransferServiceStub(mesh.channels["kvtransfer"])
        with contextlib.suppress(grpc.RpcError):
            stub.DeregisterAgent(
                kvtransfer_pb2.DeregisterAgentRequest(
                    name=req.agent.name, incarnation=resp.incarnation, owner_secret=req.owner_secret
                ),
                timeout=5,
            )
