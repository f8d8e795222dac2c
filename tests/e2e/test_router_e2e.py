"""The router in front of real decode workers, all as processes on loopback.

- migration: a decode worker SIGKILLed mid-stream; the client's stream equals
  an undisturbed greedy run token for token;
- readiness and runtime join: a router with no static workers is not ready
  until a decode worker joins with --router-address (the router's internal
  port); a joined worker gets traffic, and none once it has left;
- trust (issue 13 item 4): no membership RPC answers on the public port, and a
  process that is not decode-0 can neither fake its load, remove it nor take
  its id over;
- overload at 10x the admission capacity: fast RESOURCE_EXHAUSTED with a
  retry hint, the rest served, nothing hangs;
- two router processes share one port with SO_REUSEPORT, each serving;
- SIGTERM drains: an in-flight stream finishes, the process exits 0.
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdmesh.client import health_check
from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.helpers import metric_value, scrape, wait_until

pytestmark = pytest.mark.e2e

TINY = flags(engine_preset="tiny", engine_num_threads=1)
ROUTER_READY = "pdmesh.v1.RouterService"
DECODE_READY = "pdmesh.v1.DecodeService"
FAST = flags(health_interval_s=0.2, stats_interval_s=0.2, resubscribe_max_s=0.5, metrics_port=0)


def decode_spec(i: int, *extra: str) -> ServiceSpec:
    return ServiceSpec(
        f"decode-{i}",
        "services.decode.main",
        flags(worker_id=f"decode-{i}") + TINY + extra,
        ready_service=DECODE_READY,
    )


def router_spec(name: str = "router", *extra: str) -> ServiceSpec:
    return ServiceSpec(name, "services.router.main", FAST + extra, ready_service=ROUTER_READY)


def channel_for(address: str) -> grpc.Channel:
    # A local subchannel pool gives each channel its own TCP connection (gRPC shares
    # connections across channels to one target otherwise), so SO_REUSEPORT can spread them.
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def stub_for(address: str) -> router_pb2_grpc.RouterServiceStub:
    return router_pb2_grpc.RouterServiceStub(channel_for(address))


def greedy(text: str, max_tokens: int) -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return router_pb2.GenerateRequest(text=text, sampling=sampling)


def run(stub, req, timeout: float = 120.0) -> tuple[list[int], router_pb2.GenerateFinal]:
    tokens: list[int] = []
    final = None
    for msg in stub.Generate(req, timeout=timeout):
        if msg.HasField("delta"):
            tokens += msg.delta.token_ids
        else:
            final = msg.final
    assert final is not None
    return tokens, final


def workers(stub) -> dict[str, router_pb2.WorkerStatus]:
    resp = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    return {w.info.worker_id: w for w in resp.workers}


def test_sigkill_mid_stream_migrates_with_identical_tokens(tmp_path):
    with Launcher(tmp_path) as launcher:
        decodes = [launcher.start(decode_spec(i)) for i in range(2)]
        for d in decodes:
            launcher.wait_ready(d)
        static = flags(decode_workers=[d.address for d in decodes], policy="round_robin")
        router = launcher.start_ready(router_spec("router", *static))
        stub = stub_for(router.address)
        req = greedy("Migration keeps the stream whole. " * 4, max_tokens=1500)
        reference, ref_final = run(stub, req)
        assert len(reference) == 1500 and ref_final.migrations == 0

        internal = stub_for(router.internal_address)  # ListWorkers and Stats live there
        stream = stub.Generate(req, timeout=120)
        got = list(next(stream).delta.token_ids)
        serving = [w for w, s in workers(internal).items() if s.inflight == 1]
        assert len(serving) == 1
        launcher.kill(serving[0])  # SIGKILL: no goodbye, the connection just breaks
        final = None
        for msg in stream:
            if msg.HasField("delta"):
                got += msg.delta.token_ids
            else:
                final = msg.final
        assert got == reference
        assert final.migrations == 1 and final.worker_id != serving[0]
        assert final.usage.completion_tokens == 1500
        stats = internal.Stats(router_pb2.RouterServiceStatsRequest(), timeout=10)
        assert stats.migrations == 1 and stats.wasted_tokens > 0
        wait_until(
            lambda: workers(internal)[serving[0]].health != router_pb2.WORKER_HEALTH_SERVING,
            what="the killed worker marked unhealthy",
        )


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    """A router with no static workers (SO_REUSEPORT on) and decode-0 joined at run time."""
    launcher = Launcher(tmp_path_factory.mktemp("router"))
    try:
        admission = flags(admission_max_inflight=4, admission_queue_limit_per_priority=4, so_reuseport=1)
        router = launcher.start(router_spec("router", *admission, "--policy", "round_robin"))
        wait_until(router.port_file.exists, what="the router's port file")
        ports = json.loads(router.port_file.read_text())
        router.port, router.metrics_port = ports["port"], ports["metrics_port"]
        router.internal_port = ports["internal_port"]
        assert health_check(router.address, "")[0] == "SERVING"  # live
        assert health_check(router.address, ROUTER_READY)[0] == "NOT_SERVING"  # no decode worker yet
        launcher.start_ready(decode_spec(0, "--router-address", router.internal_address))
        launcher.wait_ready(router)  # ready once a decode worker joined
        yield launcher, router
    finally:
        launcher.close()


def test_runtime_join_gets_traffic_and_leaving_stops_it(joined):
    launcher, router = joined
    stub, internal = stub_for(router.address), stub_for(router.internal_address)
    assert workers(internal)["decode-0"].source == "registered"
    d1 = launcher.start_ready(
        decode_spec(1, "--router-address", router.internal_address, "--router-lease-ms", "2000")
    )
    wait_until(
        lambda: (
            workers(internal).get("decode-1", router_pb2.WorkerStatus()).health
            == router_pb2.WORKER_HEALTH_SERVING
        ),
        what="decode-1 joined and healthy",
    )
    served = {run(stub, greedy("who serves?", 4))[1].worker_id for _ in range(4)}
    assert served == {"decode-0", "decode-1"}
    launcher.stop(d1)  # SIGTERM: the worker drains and deregisters
    wait_until(lambda: "decode-1" not in workers(internal), what="decode-1 gone from the router")
    served = {run(stub, greedy("who serves now?", 4))[1].worker_id for _ in range(4)}
    assert served == {"decode-0"}


def test_membership_is_not_on_the_public_port_and_no_one_speaks_for_decode_0(joined):
    """Issue 13 item 4 with real processes: decode-0 joined over the internal port; a
    stranger (this test) reaches no membership RPC publicly and is refused internally."""
    _, router = joined
    public, internal = stub_for(router.address), stub_for(router.internal_address)
    fake_load = common_pb2.WorkerLoad(waiting=100_000)
    before = workers(internal)["decode-0"]
    calls = {
        "RegisterWorker": lambda s: s.RegisterWorker(
            router_pb2.RegisterWorkerRequest(worker=_rogue(before.info)), timeout=10
        ),
        "Heartbeat": lambda s: s.Heartbeat(
            router_pb2.RouterServiceHeartbeatRequest(worker_id="decode-0", load=fake_load), timeout=10
        ),
        "DeregisterWorker": lambda s: s.DeregisterWorker(
            router_pb2.DeregisterWorkerRequest(worker_id="decode-0", incarnation="guessed"), timeout=10
        ),
        "ListWorkers": lambda s: s.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10),
        "Stats": lambda s: s.Stats(router_pb2.RouterServiceStatsRequest(), timeout=10),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as e:
            call(public)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, name
    for name in ("RegisterWorker", "Heartbeat", "DeregisterWorker"):
        with pytest.raises(grpc.RpcError) as e:
            calls[name](internal)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
    after = workers(internal)["decode-0"]
    assert after.info.address == before.info.address and after.load.waiting < 100_000
    assert run(public, greedy("still decode-0", 4))[1].worker_id == "decode-0"


def _rogue(info: common_pb2.WorkerInfo) -> common_pb2.WorkerInfo:
    rogue = common_pb2.WorkerInfo()
    rogue.CopyFrom(info)
    rogue.address = "127.0.0.1:1"  # a process of the attacker's
    return rogue


def _one(address: str, i: int) -> tuple[grpc.StatusCode, str | None]:
    try:
        with channel_for(address) as channel:
            run(router_pb2_grpc.RouterServiceStub(channel), greedy(f"overload {i}", 64), timeout=120)
        return grpc.StatusCode.OK, None
    except grpc.RpcError as e:
        md = dict(e.trailing_metadata() or ())
        return e.code(), md.get("retry-after-ms")


def test_overload_at_10x_sheds_fast_and_serves_the_rest(joined):
    _, router = joined
    n = 80  # capacity is 4 running + 4 queued
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: _one(router.address, i), range(n)))
    codes = [c for c, _ in results]
    shed = [ms for c, ms in results if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert codes.count(grpc.StatusCode.OK) >= 8 and len(shed) >= n // 2
    assert all(ms is not None and int(ms) > 0 for ms in shed)
    stats = stub_for(router.internal_address).Stats(router_pb2.RouterServiceStatsRequest(), timeout=10)
    assert stats.inflight == 0 and stats.queued == 0 and stats.requests_shed >= len(shed)


def test_two_router_processes_share_one_port(joined):
    launcher, router = joined
    # decode-0 registered with the first router only; the second one gets it statically
    # (it subscribes to the same KV events and keeps its own view: no shared state).
    decode0 = launcher.find("decode-0").address
    shared = flags(port=router.port, so_reuseport=1, decode_workers=[decode0])
    second = launcher.start_ready(router_spec("router-2", *shared))
    try:
        assert second.port == router.port
        for i in range(24):  # a new connection each: the kernel spreads them over both
            assert _one(router.address, i)[0] == grpc.StatusCode.OK
        served = [
            metric_value(scrape(svc), "pdmesh_router_requests_total", outcome="succeeded")
            for svc in (router, second)
        ]
        assert all(s > 0 for s in served), served
    finally:
        launcher.stop(second)


def test_sigterm_drains_in_flight_streams(tmp_path):
    with Launcher(tmp_path) as launcher:
        d = launcher.start_ready(decode_spec(0))
        router = launcher.start_ready(router_spec("router", *flags(decode_workers=[d.address])))
        stream = stub_for(router.address).Generate(greedy("drain me", 800), timeout=120)
        got = list(next(stream).delta.token_ids)
        router.proc.send_signal(signal.SIGTERM)
        for msg in stream:
            if msg.HasField("delta"):
                got += msg.delta.token_ids
        assert len(got) == 800
        assert router.proc.wait(30) == 0


def test_stop_string_ends_the_stream_and_is_not_in_the_text(joined):
    _, router = joined
    stub = stub_for(router.address)
    req = greedy("stop strings", 48)
    text = "".join(m.delta.text for m in stub.Generate(req, timeout=60) if m.HasField("delta"))
    stop = next(
        (
            text[i : i + 2]
            for i in range(8, len(text) - 2)
            if text[i : i + 2].isprintable() and text[i : i + 2].strip()
        ),
        None,
    )
    assert stop, f"no usable stop string in {text!r}"
    req.sampling.stop.append(stop)
    req.sampling.ignore_eos = False
    msgs = list(stub.Generate(req, timeout=60))
    got = "".join(m.delta.text for m in msgs if m.HasField("delta"))
    assert got == text[: text.find(stop)]
    assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_STOP
