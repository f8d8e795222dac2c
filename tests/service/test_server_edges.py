"""MeshServer edges a new user hit (issue 15 item 5): keepalive agreement with the mesh's
channels, reflection v1 next to v1alpha, and the process metrics on /metrics. Real server
on port 0, real channels."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client import CollectorRegistry

from services.common.channels import ChannelCache, client_keepalive_options
from services.common.server import MeshServer, ServerConfig

SERVICE = "pdmesh.v1.DecodeService"
KEEPALIVE_MS = 200  # small so that three pings (a GOAWAY with the old settings) fit in the wait


async def connection_survives_idle(server_config: ServerConfig, idle_s: float) -> bool:
    """True when a channel that made one call is still READY (no GOAWAY) after `idle_s`."""
    server = MeshServer(server_config, SERVICE)
    await server.start()
    cache = ChannelCache(options=client_keepalive_options(KEEPALIVE_MS))
    try:
        channel = cache.get(server.address)
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        state = channel.get_state()
        assert state == grpc.ChannelConnectivity.READY
        try:  # a deadline, not a sleep: any state change ends the wait at once
            await asyncio.wait_for(channel.wait_for_state_change(state), idle_s)
        except TimeoutError:
            return True
        return False
    finally:
        await cache.close()
        await server.stop()


async def test_clients_pinging_between_calls_are_not_sent_away():
    # The mesh's own numbers: the server accepts what the clients send.
    assert await connection_survives_idle(ServerConfig(port=0, keepalive_time_ms=KEEPALIVE_MS), 3.0)


async def test_the_check_sees_a_mismatch():
    # A server that expects 10 s pings sends GOAWAY too_many_pings to a 200 ms client.
    assert not await connection_survives_idle(ServerConfig(port=0, keepalive_time_ms=10_000 * 60), 30.0)


@pytest.mark.parametrize(
    "service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]
)
async def test_reflection_v1_and_v1alpha_list_the_services(service):
    server = MeshServer(ServerConfig(port=0), SERVICE)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        resp = await call.read()
        names = {s.name for s in resp.list_services_response.service}
        assert {SERVICE, "grpc.reflection.v1.ServerReflection", "grpc.health.v1.Health"} <= names
    finally:
        await channel.close()
        await server.stop()


async def test_metrics_port_serves_process_and_python_metrics():
    server = MeshServer(ServerConfig(port=0, metrics_port=0), SERVICE, registry=CollectorRegistry())
    await server.start()
    try:
        assert server.metrics is not None
        url = f"http://127.0.0.1:{server.metrics.port}/metrics"
        text = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
        assert "process_resident_memory_bytes" in text and "python_gc_objects_collected_total" in text
        assert "python_info" in text
    finally:
        await server.stop()
