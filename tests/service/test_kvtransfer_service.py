"""KvTransferService in-process on port 0, with the library's directory and reporter as clients."""

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtransfer.agents import AgentDirectory, AgentRecord
from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.layout import KvLayout, layout_to_proto
from kvtransfer.reporting import ServiceReporter
from pdmesh.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.server import MeshServer, ServerConfig
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry
from services.kvtransfer.servicer import SERVICE_NAME, KvTransferServicer
from services.kvtransfer.stats import TransferStatistics
from tests.support.poll import eventually

LAYOUT = KvLayout(2, 2, 16, "float32", 4)
SECRET = b"owner-secret-of-the-test-process"  # what AgentDirectory sends for its process


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
async def svc():
    clock = Clock()
    metrics = CollectorRegistry()
    servicer = KvTransferServicer(
        AgentRegistry(clock=clock, default_lease_s=10), TransferStatistics(), KvServiceMetrics(metrics)
    )
    server = MeshServer(ServerConfig(port=0), SERVICE_NAME, registry=None)
    kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(servicer, server.server)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    stub = kvtransfer_pb2_grpc.KvTransferServiceStub(channel)
    yield clock, servicer, stub, metrics, server
    await channel.close()
    await server.stop()


def record(name="prefill-1", meta=b"nixl-md"):
    return AgentRecord(
        name=name,
        metadata=meta,
        layout=LAYOUT,
        num_blocks=8,
        address=4096,
        length=8 * LAYOUT.block_bytes,
        worker_id="prefill-1",
        kv_source_address="127.0.0.1:1",
    )


def metric(registry, line_start):
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


async def code_of(coro):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await coro
    return e.value.code(), e.value.details()


async def test_register_get_heartbeat_deregister(svc):
    _, _, stub, metrics, _ = svc
    resp = await stub.RegisterAgent(
        kvtransfer_pb2.RegisterAgentRequest(agent=record().to_proto(), lease_ms=0, owner_secret=SECRET)
    )
    assert resp.incarnation == 1 and resp.lease_ms == 10_000
    got = AgentRecord.from_proto(
        (await stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name="prefill-1"))).agent
    )
    assert got.metadata == b"nixl-md" and got.layout == LAYOUT and got.incarnation == 1
    hb = await stub.Heartbeat(
        kvtransfer_pb2.HeartbeatRequest(name="prefill-1", incarnation=1, owner_secret=SECRET)
    )
    assert hb.lease_ms == 10_000
    bye = await stub.DeregisterAgent(
        kvtransfer_pb2.DeregisterAgentRequest(name="prefill-1", incarnation=1, owner_secret=SECRET)
    )
    assert bye.removed
    code, _ = await code_of(stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name="prefill-1")))
    assert code == grpc.StatusCode.NOT_FOUND
    assert metric(metrics, "pdmesh_kv_agent_registrations_total") == 1
    assert metric(metrics, "pdmesh_kv_agents ") == 0


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda a: a.ClearField("name"), "name"),
        (lambda a: setattr(a.layout, "dtype", "int8"), "dtype"),
        (lambda a: setattr(a, "num_blocks", 0), "num_blocks"),
        (lambda a: setattr(a.region, "length", 10), "region.length"),
        (lambda a: setattr(a.region, "memory_type", "HBM"), "memory_type"),
        (lambda a: setattr(a.layout, "block_bytes", 7), "block_bytes"),
    ],
)
async def test_malformed_agents_are_invalid_arguments(svc, mutate, field):
    _, _, stub, _, _ = svc
    info = record().to_proto()
    mutate(info)
    code, details = await code_of(
        stub.RegisterAgent(kvtransfer_pb2.RegisterAgentRequest(agent=info, owner_secret=SECRET))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details


async def test_unknown_and_stale_agents_are_not_found(svc):
    _, _, stub, _, _ = svc
    code, details = await code_of(stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name="ghost")))
    assert code == grpc.StatusCode.NOT_FOUND and "ghost" in details
    await stub.RegisterAgent(
        kvtransfer_pb2.RegisterAgentRequest(agent=record().to_proto(), owner_secret=SECRET)
    )
    await stub.RegisterAgent(
        kvtransfer_pb2.RegisterAgentRequest(agent=record().to_proto(), owner_secret=SECRET)
    )
    code, details = await code_of(
        stub.Heartbeat(kvtransfer_pb2.HeartbeatRequest(name="prefill-1", incarnation=1, owner_secret=SECRET))
    )
    assert code == grpc.StatusCode.NOT_FOUND and "stale" in details


async def test_expired_agents_disappear_and_are_counted(svc):
    clock, servicer, stub, metrics, _ = svc
    await stub.RegisterAgent(
        kvtransfer_pb2.RegisterAgentRequest(agent=record("a").to_proto(), lease_ms=1000, owner_secret=SECRET)
    )
    await stub.RegisterAgent(
        kvtransfer_pb2.RegisterAgentRequest(agent=record("b").to_proto(), lease_ms=5000, owner_secret=SECRET)
    )
    clock.t = 2.0
    assert servicer.expire() == 1
    code, _ = await code_of(stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name="a")))
    assert code == grpc.StatusCode.NOT_FOUND
    clock.t = 6.0  # b expires too; Stats sweeps before answering
    stats = await stub.Stats(kvtransfer_pb2.KvTransferServiceStatsRequest())
    assert (stats.agents, stats.registrations, stats.expirations) == (0, 2, 2)
    assert metric(metrics, "pdmesh_kv_agent_expirations_total") == 2


async def test_reported_transfers_feed_stats_and_metrics(svc):
    _, _, stub, metrics, _ = svc
    reporter = ServiceReporter(stub)
    for ms in (1.0, 2.0, 3.0, 100.0):
        reporter.record(
            transport="nixl", source_agent="p", target_agent="d", nbytes=1 << 20, seconds=ms / 1000
        )
    reporter.record(
        transport="grpc", source_agent="p", target_agent="d", nbytes=0, seconds=0.5, error="timeout"
    )
    assert await reporter.flush() == 5 and reporter.pending == 0
    stats = await stub.Stats(kvtransfer_pb2.KvTransferServiceStatsRequest())
    assert (stats.transfers, stats.transfer_failures, stats.bytes) == (5, 1, 4 << 20)
    assert stats.latency_ms_p50 == pytest.approx(2.0) and stats.latency_ms_p99 == pytest.approx(100.0)
    assert metric(metrics, 'pdmesh_kv_transfer_bytes_total{transport="nixl"}') == 4 << 20
    assert metric(metrics, 'pdmesh_kv_transfer_failures_total{error="timeout",transport="grpc"}') == 1
    assert metric(metrics, 'pdmesh_kv_transfer_latency_seconds_count{transport="nixl"}') == 4


async def test_a_bad_record_is_refused_and_nothing_is_counted(svc):
    _, _, stub, _, _ = svc
    good = kvtransfer_pb2.TransferRecord(transport="nixl", bytes=10, duration_ms=1, ok=True)
    bad = kvtransfer_pb2.TransferRecord(transport="nixl", duration_ms=float("nan"))
    code, details = await code_of(
        stub.ReportTransfers(kvtransfer_pb2.ReportTransfersRequest(records=[good, bad]))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "records[1]" in details
    stats = await stub.Stats(kvtransfer_pb2.KvTransferServiceStatsRequest())
    assert stats.transfers == 0


async def test_byte_totals_past_uint64_saturate_instead_of_breaking_stats(svc):
    _, _, stub, _, _ = svc
    huge = kvtransfer_pb2.TransferRecord(transport="grpc", bytes=2**64 - 1, duration_ms=1, ok=True)
    await stub.ReportTransfers(kvtransfer_pb2.ReportTransfersRequest(records=[huge, huge]))
    stats = await stub.Stats(kvtransfer_pb2.KvTransferServiceStatsRequest())
    assert stats.transfers == 2 and stats.bytes == 2**64 - 1


async def test_directory_reregisters_when_its_lease_lapsed(svc):
    clock, _, stub, _, _ = svc
    d = AgentDirectory(stub, lease_ms=1000)
    own = await d.register(record())
    assert own.incarnation == 1
    await d.heartbeat_once()
    clock.t = 5.0  # missed heartbeats: the service dropped us
    await d.heartbeat_once()
    assert d.own.incarnation == 2 and d.registrations == 2
    await d.deregister()
    code, _ = await code_of(stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name="prefill-1")))
    assert code == grpc.StatusCode.NOT_FOUND


async def test_directory_caches_and_refreshes_when_asked(svc):
    _, _, stub, _, _ = svc
    holder = AgentDirectory(stub)
    await holder.register(record(meta=b"first"))
    reader = AgentDirectory(stub, max_age_s=3600)
    assert (await reader.get("prefill-1")).metadata == b"first"
    await holder.register(record(meta=b"second"))  # the holder restarted
    assert (await reader.get("prefill-1")).incarnation == 1  # cached
    fresh = await reader.get("prefill-1", refresh=True)
    assert (fresh.metadata, fresh.incarnation) == (b"second", 2)
    assert await reader.is_alive("prefill-1") is True
    await holder.deregister()
    assert await reader.is_alive("prefill-1") is False
    with pytest.raises(KvTransferFailed) as e:
        await reader.get("prefill-1")  # the failed refresh also dropped the cache entry
    assert e.value.kind == FailureKind.UNKNOWN_AGENT


async def test_directory_falls_back_to_its_cache_when_the_service_is_down(svc):
    _, _, stub, _, server = svc
    await AgentDirectory(stub).register(record())
    reader = AgentDirectory(stub, max_age_s=0, rpc_timeout_s=0.5)
    assert (await reader.get("prefill-1")).incarnation == 1
    await server.stop()
    assert (await reader.get("prefill-1")).incarnation == 1
    assert await reader.is_alive("prefill-1") is True
    with pytest.raises(KvTransferFailed) as e:
        await reader.get("never-seen")
    assert e.value.kind == FailureKind.TRANSPORT
    assert await reader.is_alive("never-seen") is None  # unknown: holders keep the lease


def test_layout_proto_carries_block_bytes():
    assert layout_to_proto(LAYOUT).block_bytes == LAYOUT.block_bytes


async def test_reporter_keeps_records_while_the_service_is_down(svc):
    _, _, stub, _, server = svc
    reporter = ServiceReporter(stub, rpc_timeout_s=0.5, max_buffer=2)
    for _ in range(3):
        reporter.record(transport="grpc", source_agent="p", target_agent="d", nbytes=1, seconds=0.001)
    assert reporter.dropped == 1 and reporter.pending == 2
    await server.stop()
    assert await reporter.flush() == 0 and reporter.pending == 2


# -- who may write a name (issue 13, item 1) ---------------------------------------------------


async def test_a_hostile_reregistration_is_refused_without_tls(svc):
    """The attack of issue 13: re-register the prefill worker's agent with its pool
    shifted by one block. Before the fix the service took it and decode workers
    read the wrong blocks."""
    _, servicer, stub, _, _ = svc
    holder = AgentDirectory(stub)
    own = await holder.register(record())
    hostile = record().to_proto()
    hostile.region.address += LAYOUT.block_bytes
    hostile.num_blocks -= 1
    code, details = await code_of(
        stub.RegisterAgent(kvtransfer_pb2.RegisterAgentRequest(agent=hostile, owner_secret=b"x" * 32))
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "prefill-1" in details
    code, _ = await code_of(stub.RegisterAgent(kvtransfer_pb2.RegisterAgentRequest(agent=hostile)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # no secret, no certificate: no owner at all
    for call in (
        stub.DeregisterAgent(
            kvtransfer_pb2.DeregisterAgentRequest(
                name="prefill-1", incarnation=own.incarnation, owner_secret=b"x" * 32
            )
        ),
        stub.Heartbeat(
            kvtransfer_pb2.HeartbeatRequest(
                name="prefill-1", incarnation=own.incarnation, owner_secret=b"x" * 32
            )
        ),
    ):
        code, _ = await code_of(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED
    got = (await stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name="prefill-1"))).agent
    assert (got.region.address, got.num_blocks, got.incarnation) == (4096, 8, own.incarnation)
    assert servicer.registry.refusals == 3
    await holder.heartbeat_once()  # the owner is unaffected
    assert holder.own.incarnation == own.incarnation


@pytest.fixture(scope="module")
def mesh_certs(tmp_path_factory):
    from tests.service.tls_mesh import make_certs

    return make_certs(
        tmp_path_factory.mktemp("kvcerts"), workers=(("prefill", "prefill-0"), ("decode", "decode-1"))
    )


@pytest.fixture
async def mtls_svc(mesh_certs):
    servicer = KvTransferServicer(
        AgentRegistry(default_lease_s=10), TransferStatistics(), KvServiceMetrics(CollectorRegistry())
    )
    server = MeshServer(ServerConfig(port=0), SERVICE_NAME, registry=None, tls=mesh_certs.tls("kvtransfer"))
    kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(servicer, server.server)
    await server.start()
    channels = []

    def stub_as(cert: str):
        from services.common.tls import aio_channel, client_tls

        ch = aio_channel(f"localhost:{server.port}", client_tls(mesh_certs.tls(cert)))
        channels.append(ch)
        return kvtransfer_pb2_grpc.KvTransferServiceStub(ch)

    yield servicer, stub_as
    for ch in channels:
        await ch.close()
    await server.stop()


def prefill0(name="prefill-0-11", address=4096):
    r = record(name)
    return AgentRecord(**{**r.__dict__, "worker_id": "prefill-0", "address": address})


async def test_with_mtls_a_name_belongs_to_the_certified_worker(mtls_svc):
    servicer, stub_as = mtls_svc
    await AgentDirectory(stub_as("prefill-prefill-0")).register(prefill0())
    hostile = prefill0(address=4096 + LAYOUT.block_bytes).to_proto()
    # decode-1's certificate (the issue's attempt), as itself and pretending to be prefill-0.
    decode1 = stub_as("decode-decode-1")
    for worker_id in ("decode-1", "prefill-0"):
        hostile.worker_id = worker_id
        code, details = await code_of(
            decode1.RegisterAgent(kvtransfer_pb2.RegisterAgentRequest(agent=hostile, owner_secret=b"x" * 32))
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
    # A role-only certificate (no worker in it) and any secret: the name is bound to prefill-0's certificate.
    hostile.worker_id = "prefill-0"
    code, _ = await code_of(
        stub_as("decode").RegisterAgent(
            kvtransfer_pb2.RegisterAgentRequest(agent=hostile, owner_secret=b"x" * 32)
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = await code_of(
        decode1.DeregisterAgent(kvtransfer_pb2.DeregisterAgentRequest(name="prefill-0-11", incarnation=1))
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert servicer.registry.get("prefill-0-11").address == 4096
    # prefill-0 restarted: a new process (new secret), the same certificate, takes its name back.
    back = await AgentDirectory(stub_as("prefill-prefill-0")).register(prefill0(address=8192))
    assert back.incarnation == 2 and servicer.registry.get("prefill-0-11").address == 8192


async def test_a_restarted_process_claims_its_name_once_the_old_lease_lapses(svc):
    """Without TLS a restarted process (same agent name, e.g. pid 1 in a container) has a
    new secret: it is refused while its predecessor's lease runs, then gets the name."""
    clock, servicer, stub, _, _ = svc
    await AgentDirectory(stub).register(record())  # the process that crashed
    restarted = asyncio.create_task(AgentDirectory(stub, lease_ms=10_000).register(record(meta=b"new")))
    await eventually(lambda: servicer.registry.refusals > 0, what="the restarted process's attempt")
    assert not restarted.done()
    clock.t += 10.5  # the crashed process's lease lapses
    own = await asyncio.wait_for(restarted, 10)
    assert own.incarnation == 2
    got = (await stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name="prefill-1"))).agent
    assert got.metadata == b"new"
