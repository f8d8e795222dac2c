"""Random and malformed messages at every RPC of the real mesh, in-process (issue 10, item 4).

For each RPC of RouterService, DecodeService, PrefillService,
KvTransferService and KvSourceService, hypothesis draws requests from the
proto descriptors (strategies.py) and, separately, malformed wire bytes, and
sends them through a generic call with a deadline. Every call must end with
OK or one of the codes that method may answer (rpcs.py: never UNKNOWN,
INTERNAL or a deadline, so a crash, a bug or a hang fails), every answer must
parse as the method's response type, and once the call is over (and whatever
it legitimately holds is given back) the mesh must be as it was: engines' free
blocks and queues, held leases, router in-flight/queued counts, the router's
worker view, the registered KV agents, and every server SERVING.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdmesh.v1 import (
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.e2e.helpers import wait_until
from tests.fuzz.conftest import fuzz_settings
from tests.fuzz.inproc import MAX_MESSAGE_BYTES, InProcessMesh
from tests.fuzz.rpcs import BY_NAME, INVALID, RPCS, Rpc, cleanup, invoke, parse
from tests.fuzz.strategies import MessageStrategies, wire_strategy

C = grpc.StatusCode
MEMBERSHIP = {
    "router_internal.RegisterWorker",
    "router_internal.DeregisterWorker",
    "kvtransfer.RegisterAgent",
    "kvtransfer.DeregisterAgent",
}


class Baseline:
    """What the mesh looks like at rest; every fuzzed call must leave it so."""

    def __init__(self, mesh: InProcessMesh):
        self.snapshot = mesh.snapshot()
        self.workers = router_workers(mesh)
        self.agents = kv_agents(mesh)
        assert self.snapshot.decode_free > 0 and self.snapshot.leases_held == 0
        assert len(self.workers) == 2 and self.agents == 2


def router_workers(mesh: InProcessMesh) -> dict[str, int]:
    stub = router_pb2_grpc.RouterServiceStub(mesh.channels["router_internal"])
    resp = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return {w.info.worker_id: w.health for w in resp.workers}


def kv_agents(mesh: InProcessMesh) -> int:
    stub = kvtransfer_pb2_grpc.KvTransferServiceStub(mesh.channels["kvtransfer"])
    return stub.Stats(kvtransfer_pb2.KvTransferServiceStatsRequest(), timeout=5).agents


@pytest.fixture(scope="module")
def baseline(mesh):
    return Baseline(mesh)


class LiveHandle:
    """A real lease on the prefill worker, issued to the decode worker, for ReadBlocks."""

    def __init__(self, mesh: InProcessMesh):
        self.mesh = mesh
        self.handle_id = ""
        self.block_ids: list[int] = [0]

    def renew(self) -> None:
        stub = prefill_pb2_grpc.PrefillServiceStub(self.mesh.channels["prefill"])
        req = prefill_pb2.PrefillRequest(
            request_id="fuzz-live",
            prompt_token_ids=list(range(40)),
            requester_id=self.mesh.decode_worker_id,
            requester_agent=self.mesh.decode.transport.agent_name,
        )
        req.sampling.max_tokens = 4
        resp = stub.Prefill(req, timeout=10)
        self.handle_id = resp.handle.handle_id
        self.block_ids = list(resp.handle.nixl_blocks.block_ids)

    def drop(self) -> None:
        self.mesh.release(self.handle_id)


_STRATEGIES: dict[str, MessageStrategies] = {}


def strategies_for(mesh: InProcessMesh, rpc: Rpc, live: LiveHandle) -> MessageStrategies:
    """Hints that get draws past validation, chosen so that membership calls never
    name the mesh's own workers or agents (taking over a live worker's identity is
    an authorization question, not malformed input)."""
    key = f"{rpc.server}.{rpc.name}"
    if key in _STRATEGIES:
        return _STRATEGIES[key]
    token = st.integers(0, 257)
    ident = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=16)
    hints = {
        "prompt_token_ids": token,
        "resume_token_ids": token,
        "ids": token,
        "stop_token_ids": token,
        "token_ids": token,
        "prompt_token_ids[]": st.lists(token, min_size=1, max_size=120),
        "ids[]": st.lists(token, min_size=1, max_size=120),
        "resume_token_ids[]": st.lists(token, max_size=3),
        "max_tokens": st.integers(-1, 40),
        "temperature": st.sampled_from([0.0, 0.7]),
        "top_p": st.sampled_from([0.0, 0.9]),
        "top_k": st.integers(0, 8),
        "priority": st.integers(-11, 11),
        "request_id": ident,
        "tenant": ident,
        "output_position": st.integers(0, 3),
        "lease_ms": st.integers(0, 3000),
        "disagg_mode": st.sampled_from([0, 1, 2]),
        "model": st.sampled_from(["", "builtin-tiny"]),
        "model_id": st.sampled_from(["builtin-tiny"]),
        "block_size": st.sampled_from([16]),
        "role": st.sampled_from([1, 2]),
        "requester_id": st.just(mesh.decode_worker_id),
        "transport": st.sampled_from(["grpc", "nixl"]),
        "handle_id": st.builds(lambda: live.handle_id),
        "block_ids": st.builds(lambda i: live.block_ids[i % len(live.block_ids)], st.integers(0, 64)),
        "layout": st.builds(mesh.decode_layout),
        "MemoryRegion.address": None,  # a uint64 there
    }
    real_agents = [rt.transport.agent_name for rt in (mesh.decode, mesh.prefill) if rt.transport]
    if key in MEMBERSHIP:
        hints["worker_id"] = ident
        hints["name"] = ident
        hints["address"] = st.sampled_from(["127.0.0.1:1", "[::1]:1", "localhost:1"])
    else:
        hints["worker_id"] = st.sampled_from([mesh.decode_worker_id, mesh.prefill_worker_id, "nobody"])
        hints["name"] = st.sampled_from([*real_agents, "nobody"])
        hints["address"] = st.sampled_from([mesh.addresses["prefill"], "127.0.0.1:1", "garbage"])
    _STRATEGIES[key] = MessageStrategies(hints)
    return _STRATEGIES[key]


def assert_no_fake_heartbeat(mesh: InProcessMesh, payload: bytes, outcome) -> None:
    """The mesh's workers are static: a fuzzed heartbeat in their name, claiming any load,
    is refused (issue 13 item 4; it used to land and was reported back here)."""
    req = parse(router_pb2.RouterServiceHeartbeatRequest, payload)
    if req is not None and req.worker_id in (mesh.decode_worker_id, mesh.prefill_worker_id):
        assert outcome.code in (C.PERMISSION_DENIED, C.INVALID_ARGUMENT), outcome


def assert_settled(mesh: InProcessMesh, base: Baseline, what: str) -> None:
    wait_until(
        lambda: mesh.snapshot() == base.snapshot, timeout=20, what=f"pools and queues back after {what}"
    )
    wait_until(
        lambda: router_workers(mesh) == base.workers, timeout=20, what=f"router view back after {what}"
    )
    wait_until(lambda: kv_agents(mesh) == base.agents, timeout=20, what=f"KV agents back after {what}")
    assert set(mesh.healthy().values()) == {"SERVING"}, what


def check_call(mesh: InProcessMesh, base: Baseline, rpc: Rpc, payload: bytes, extra=frozenset()) -> None:
    live = LIVE[mesh]
    if rpc.name == "ReadBlocks":
        live.renew()
    outcome = invoke(mesh, rpc, payload)
    allowed = {C.OK, *rpc.codes, *extra}
    if len(payload) > mesh.message_cap(rpc.server):
        allowed = {C.RESOURCE_EXHAUSTED}
    assert outcome.code in allowed, f"{rpc.method} answered {outcome.code.name}: {outcome.details!r}"
    for raw in outcome.responses:
        assert parse(rpc.response, raw) is not None, f"{rpc.method} sent an unparsable response"
    cleanup(mesh, rpc, payload, outcome)
    if rpc.name == "ReadBlocks":
        live.drop()
    if rpc.method.endswith("RouterService/Heartbeat"):
        assert_no_fake_heartbeat(mesh, payload, outcome)
    assert_settled(mesh, base, f"{rpc.method} -> {outcome.code.name}")


LIVE: dict[InProcessMesh, LiveHandle] = {}


@pytest.fixture(scope="module", autouse=True)
def live_handle(mesh):
    LIVE[mesh] = LiveHandle(mesh)
    yield
    LIVE.pop(mesh)


def rpc_id(rpc: Rpc) -> str:
    return f"{rpc.server}.{rpc.name}"


def _short(rpc: Rpc) -> int:
    return 12 if rpc.stream and not rpc.endless else 20


@pytest.mark.parametrize("rpc", RPCS, ids=rpc_id)
def test_random_messages_get_a_status_and_leave_the_mesh_as_it_was(mesh, baseline, rpc):
    @fuzz_settings(_short(rpc))
    @given(data=st.data())
    def run(data):
        msg = data.draw(strategies_for(mesh, rpc, LIVE[mesh]).message(rpc.request), label="request")
        check_call(mesh, baseline, rpc, msg.SerializeToString())

    run()


@pytest.mark.parametrize("rpc", RPCS, ids=rpc_id)
def test_malformed_wire_data_gets_a_status_and_leaves_the_mesh_as_it_was(mesh, baseline, rpc):
    @fuzz_settings(_short(rpc))
    @given(data=st.data())
    def run(data):
        payload = data.draw(wire_strategy(rpc.request, strategies_for(mesh, rpc, LIVE[mesh])), label="bytes")
        check_call(mesh, baseline, rpc, payload, extra=INVALID)

    run()


@pytest.mark.parametrize(
    "name", ["router.Generate", "decode.Generate", "prefill.Prefill", "kvtransfer.ReportTransfers"]
)
def test_a_request_over_the_message_limit_is_resource_exhausted(mesh, baseline, name):
    rpc = BY_NAME[name]
    payload = b"\x12" + _varint(MAX_MESSAGE_BYTES) + b"\x00" * MAX_MESSAGE_BYTES  # field 2, one huge blob
    outcome = invoke(mesh, rpc, payload)
    assert outcome.code == C.RESOURCE_EXHAUSTED, outcome
    assert_settled(mesh, baseline, name)


def _generate_with(field: int, count: int, item: bytes) -> bytes:
    """A GenerateRequest whose field `field` repeats `item` `count` times, as raw wire data."""
    return (bytes([field << 3 | 2]) + _varint(len(item)) + item) * count


def _sampling_stops(count: int, stop: bytes = b"x") -> bytes:
    inner = (b"\x3a" + _varint(len(stop)) + stop) * count  # SamplingParams.stop = 7
    return b"\x22" + _varint(len(inner)) + inner  # GenerateRequest.sampling = 4


def _token_ids(count: int) -> bytes:
    packed = b"\x7f" * count  # one byte a token id
    inner = b"\x0a" + _varint(len(packed)) + packed  # TokenIds.ids = 1, packed
    return b"\x1a" + _varint(len(inner)) + inner  # GenerateRequest.token_ids = 3


# Issue 13 item 2: one 60 MB Generate once added ~600 MB of router RSS. The public port
# takes only what the request limits can need; under that cap, counts are checked before
# anything is copied.
OVERSIZED_GENERATE = {
    "just over the public cap (well under the old 64 MiB)": (
        lambda cap: _token_ids(cap + 1),
        {C.RESOURCE_EXHAUSTED},
    ),
    "a text prompt of 3 MiB": (
        lambda cap: b"\x12" + _varint(3 << 20) + b"a" * (3 << 20),
        {C.RESOURCE_EXHAUSTED},
    ),
    "token ids over the prompt limit, under the cap": (lambda cap: _token_ids(cap // 2), INVALID),
    "20,000 one-byte stop strings": (lambda cap: _sampling_stops(min(20_000, cap // 4)), INVALID),
    "a request id of 16 KiB": (lambda cap: _generate_with(1, 1, b"r" * 16384), INVALID),
    "a tenant of 16 KiB": (lambda cap: _generate_with(5, 1, b"t" * 16384), INVALID),
}


@pytest.mark.parametrize("case", list(OVERSIZED_GENERATE), ids=list(OVERSIZED_GENERATE))
def test_oversized_router_requests_are_refused_before_anything_runs(mesh, baseline, case):
    make, codes = OVERSIZED_GENERATE[case]
    rpc = BY_NAME["router.Generate"]
    payload = make(mesh.message_cap("router"))
    outcome = invoke(mesh, rpc, payload)
    assert outcome.code in codes, outcome
    assert outcome.responses == []
    assert_settled(mesh, baseline, case)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)
