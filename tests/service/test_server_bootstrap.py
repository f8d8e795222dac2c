"""MeshServer: health (live/ready), reflection, error mapping and drain, on port 0."""

import asyncio
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdmesh.v1 import decode_pb2, decode_pb2_grpc, worker_pb2
from services.common.errors import InvalidArgument, grpc_errors
from services.common.server import MeshServer, ServerConfig

SERVICE = "pdmesh.v1.DecodeService"


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Generate streams one chunk, then waits for `release` before finishing."""

    def __init__(self):
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    @grpc_errors
    async def Generate(self, request, context):
        if request.request_id == "bad":
            raise InvalidArgument("request_id: not allowed")
        if request.request_id == "bug":
            raise RuntimeError("secret internal detail")
        yield decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=[1]))
        self.started.set()
        await self.release.wait()
        yield decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=[2]))

    @grpc_errors
    async def Stats(self, request, context):
        return worker_pb2.StatsResponse(requests_total=7)


@pytest.fixture
async def served():
    server = MeshServer(ServerConfig(port=0, drain_grace_s=10), SERVICE)
    fake = FakeDecode()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(fake, server.server)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    yield server, fake, channel
    await channel.close()
    await server.stop()


async def check(channel, service):
    stub = health_pb2_grpc.HealthStub(channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


async def test_live_then_ready(served):
    server, _, channel = served
    assert server.port > 0
    assert await check(channel, "") == "SERVING"
    assert await check(channel, SERVICE) == "NOT_SERVING"
    await server.set_ready(True)
    assert await check(channel, SERVICE) == "SERVING"


async def test_reflection_lists_the_service(served):
    _, _, channel = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for resp in stub.ServerReflectionInfo(requests()):
        names = {s.name for s in resp.list_services_response.service}
        assert SERVICE in names and "grpc.health.v1.Health" in names
        break


async def test_domain_errors_become_statuses_without_tracebacks(served):
    _, _, channel = served
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.Generate(decode_pb2.DecodeServiceGenerateRequest(request_id="bad")):
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.Generate(decode_pb2.DecodeServiceGenerateRequest(request_id="bug")):
            pass
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in e.value.details() and "Traceback" not in e.value.details()


async def test_drain_reports_not_serving_and_finishes_inflight(served):
    server, fake, channel = served
    await server.set_ready(True)
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    call = stub.Generate(decode_pb2.DecodeServiceGenerateRequest(request_id="long"))
    first = await call.read()
    assert list(first.tokens.token_ids) == [1]
    await fake.started.wait()

    drain = asyncio.create_task(server.drain())
    # The gate flips synchronously before drain awaits anything; health follows.
    while not server.draining:
        await asyncio.sleep(0)
    assert await check(channel, SERVICE) == "NOT_SERVING"
    assert await check(channel, "") == "NOT_SERVING"
    # The CLI sees the same thing an orchestrator's probe would.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdmesh.cli",
        "health",
        server.address,
        SERVICE,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 1 and b"NOT_SERVING" in out
    # New application calls are refused while in-flight ones continue.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not drain.done() and server.inflight == 1

    fake.release.set()
    second = await call.read()
    assert list(second.tokens.token_ids) == [2]
    assert await call.code() == grpc.StatusCode.OK
    await asyncio.wait_for(drain, 10)
    assert server.inflight == 0


async def test_cli_health_reports_serving(served):
    server, _, _ = served
    await server.set_ready(True)
    for service in ("", SERVICE):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pdmesh.cli",
            "health",
            server.address,
            service,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0, out
        assert b"SERVING" in out


async def test_open_kv_subscriptions_do_not_hold_up_a_drain():
    from pdmesh.v1 import worker_pb2 as wpb

    class Subscribed(decode_pb2_grpc.DecodeServiceServicer):
        def __init__(self):
            self.subscribed = asyncio.Event()

        async def SubscribeKvEvents(self, request, context):
            yield wpb.SubscribeKvEventsResponse(worker_id="w")
            self.subscribed.set()
            await asyncio.Event().wait()  # a subscription never ends on its own

    server = MeshServer(ServerConfig(port=0, drain_grace_s=30), SERVICE)
    fake = Subscribed()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(fake, server.server)
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        stream = decode_pb2_grpc.DecodeServiceStub(channel).SubscribeKvEvents(wpb.SubscribeKvEventsRequest())
        await stream.read()
        await fake.subscribed.wait()
        assert server.inflight == 0
        # Finishes without waiting the 30 s grace for the subscription.
        await asyncio.wait_for(server.drain(), 10)
        with pytest.raises(grpc.aio.AioRpcError):
            await stream.read()
