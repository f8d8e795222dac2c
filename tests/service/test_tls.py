"""MeshServer with TLS and mTLS on port 0, with certificates from `pdmesh certs`'s code:
who may connect, which role may call what, certificate rotation without a restart,
the plaintext health-only port, and the per-connection call cap."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.certs import issue, write_ca
from services.common.channels import ChannelCache
from services.common.server import MeshServer, ServerConfig
from services.common.tls import TlsConfig, aio_channel, client_tls
from tests.service.tls_mesh import Certs, call_raw, foreign_client, make_certs

READY = "pdmesh.v1.DecodeService"
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)  # channels to one target share a connection otherwise
METHODS = {
    "pdmesh.v1.RouterService": ("Generate", "Cancel", "ListWorkers", "RegisterWorker", "Stats"),
    "pdmesh.v1.PrefillService": ("Prefill", "Release", "Stats"),
    "pdmesh.v1.KvSourceService": ("ReadBlocks",),
    "pdmesh.v1.KvTransferService": ("RegisterAgent",),
}


class Held:
    """A method that waits until released (for the per-connection cap)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0
        self.changed = asyncio.Event()

    async def __call__(self, request: bytes, context) -> bytes:
        self.entered += 1
        self.changed.set()
        await self.release.wait()
        return b"done"


async def _ok(request: bytes, context) -> bytes:
    return b"ok"


async def serve(tls: TlsConfig | None, held: Held | None = None, **server_kw) -> MeshServer:
    server = MeshServer(ServerConfig(port=0, drain_grace_s=1, **server_kw), READY, tls=tls)
    for service, names in METHODS.items():
        handlers = {n: grpc.unary_unary_rpc_method_handler(_ok) for n in names}
        server.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    if held is not None:
        hold = {"Hold": grpc.unary_unary_rpc_method_handler(held)}
        server.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Held", hold),))
    await server.start()
    await server.set_ready(True)
    return server


def channel(server: MeshServer, tls: TlsConfig | None, host: str = "localhost") -> grpc.aio.Channel:
    return aio_channel(f"{host}:{server.port}", client_tls(tls))


async def ready(ch: grpc.aio.Channel) -> str:
    resp = await health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=READY), timeout=10
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"), workers=(("decode", "decode-0"),))


@pytest.fixture
async def mtls_server(certs):
    server = await serve(certs.tls("decode"))
    yield server
    await server.stop()


async def test_a_mesh_certificate_is_served_over_mtls(certs, mtls_server):
    async with channel(mtls_server, certs.tls("router")) as ch:
        assert await ready(ch) == "SERVING"
        assert await call_raw(ch, "/pdmesh.v1.PrefillService/Stats") == b"ok"


async def test_a_client_without_a_certificate_is_refused(certs, mtls_server):
    async with channel(mtls_server, certs.ca_only()) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ready(ch)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_plaintext_client_is_refused(mtls_server):
    async with channel(mtls_server, None) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ready(ch)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_certificate_signed_by_another_ca_is_refused(certs, mtls_server, tmp_path):
    async with channel(mtls_server, foreign_client(tmp_path, certs)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ready(ch)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("role", "method", "allowed"),
    [
        ("client", "/pdmesh.v1.RouterService/Generate", True),
        ("client", "/pdmesh.v1.RouterService/Cancel", True),
        ("client", "/pdmesh.v1.RouterService/ListWorkers", True),
        ("client", "/pdmesh.v1.RouterService/RegisterWorker", False),
        ("client", "/pdmesh.v1.RouterService/Stats", False),
        ("client", "/pdmesh.v1.PrefillService/Prefill", False),
        ("client", "/pdmesh.v1.PrefillService/Release", False),
        ("client", "/pdmesh.v1.PrefillService/Stats", False),
        ("client", "/pdmesh.v1.KvSourceService/ReadBlocks", False),
        ("client", "/pdmesh.v1.KvTransferService/RegisterAgent", False),
        ("gateway", "/pdmesh.v1.RouterService/Generate", True),
        ("gateway", "/pdmesh.v1.PrefillService/Prefill", False),
        ("decode", "/pdmesh.v1.RouterService/RegisterWorker", True),
        ("decode", "/pdmesh.v1.PrefillService/Prefill", True),
        ("decode", "/pdmesh.v1.KvSourceService/ReadBlocks", True),
        ("decode-decode-0", "/pdmesh.v1.PrefillService/Release", True),
        ("prefill", "/pdmesh.v1.PrefillService/Prefill", False),
        ("prefill", "/pdmesh.v1.KvTransferService/RegisterAgent", True),
        ("router", "/pdmesh.v1.RouterService/RegisterWorker", False),
        ("router", "/pdmesh.v1.PrefillService/Stats", True),
        ("kvtransfer", "/pdmesh.v1.PrefillService/Release", False),
    ],
)
async def test_each_role_reaches_only_its_methods(certs, mtls_server, role, method, allowed):
    async with channel(mtls_server, certs.tls(role)) as ch:
        if allowed:
            assert await call_raw(ch, method) == b"ok"
            return
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_raw(ch, method)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert repr(role.split("-")[0]) in e.value.details() and method in e.value.details()
    assert mtls_server.authorizer is not None and mtls_server.authorizer.denied == 1


async def test_a_rotated_server_certificate_is_served_to_new_connections(certs, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for name in ("decode.pem", "decode-key.pem"):
        shutil.copy(certs.dir / name, live / name)
    tls = TlsConfig(
        cert_file=str(live / "decode.pem"),
        key_file=str(live / "decode-key.pem"),
        ca_file=str(certs.dir / "ca.pem"),
        require_client_cert=True,
    )
    server = await serve(tls)
    # A client that trusts only a new CA (and presents its mesh certificate).
    new = tmp_path / "new"
    write_ca(new)
    fresh = issue(new, "decode")
    trusts_new = TlsConfig(
        cert_file=str(certs.dir / "router.pem"),
        key_file=str(certs.dir / "router-key.pem"),
        ca_file=str(new / "ca.pem"),
    )
    try:
        async with channel(server, trusts_new) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await ready(ch)
        # Rotate: key first, then certificate (a server mid-rotation keeps the old pair).
        shutil.copy(fresh.key_file, live / "decode-key.pem.tmp")
        (live / "decode-key.pem.tmp").replace(live / "decode-key.pem")
        async with channel(server, certs.tls("router")) as ch:
            assert await ready(ch) == "SERVING"  # mismatched pair ignored: the old one still serves
        shutil.copy(fresh.cert_file, live / "decode.pem.tmp")
        (live / "decode.pem.tmp").replace(live / "decode.pem")
        async with channel(server, trusts_new) as ch:
            assert await ready(ch) == "SERVING"
        assert server.cert_watcher is not None and server.cert_watcher.reloads == 1
    finally:
        await server.stop()


async def test_the_plaintext_health_port_serves_health_only(certs):
    server = await serve(certs.tls("decode"), health_port=0)
    try:
        assert server.health_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
            assert await ready(ch) == "SERVING"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call_raw(ch, "/pdmesh.v1.PrefillService/Stats")
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "health only" in e.value.details()
    finally:
        await server.stop()


async def test_tls_without_mtls_accepts_a_client_without_certificate(certs):
    server = await serve(certs.tls("router", mtls=False))
    try:
        async with channel(server, certs.ca_only()) as ch:
            assert await call_raw(ch, "/pdmesh.v1.RouterService/Generate") == b"ok"
        async with channel(server, None, "127.0.0.1") as ch:  # plaintext to a TLS port
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ready(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()


async def test_a_connection_over_its_call_cap_is_refused(certs):
    held = Held()
    server = await serve(None, held, max_calls_per_connection=2, max_concurrent_streams=16)
    try:
        async with (
            grpc.aio.insecure_channel(server.address) as ch,
            grpc.aio.insecure_channel(server.address, options=[OWN_CONNECTION]) as other,
        ):
            hold = ch.unary_unary("/test.Held/Hold")
            calls = [asyncio.ensure_future(hold(b"", timeout=30)) for _ in range(2)]
            while held.entered < 2:
                held.changed.clear()
                await held.changed.wait()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call_raw(ch, "/pdmesh.v1.PrefillService/Stats")
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit 2 per connection" in e.value.details()
            assert await call_raw(other, "/pdmesh.v1.PrefillService/Stats") == b"ok"  # another connection
            held.release.set()
            assert await asyncio.gather(*calls) == [b"done", b"done"]
            assert await call_raw(ch, "/pdmesh.v1.PrefillService/Stats") == b"ok"
        assert ("grpc.max_concurrent_streams", 16) in server.options
    finally:
        await server.stop()


async def test_cached_channels_follow_rotated_client_certificates(certs, tmp_path):
    live = tmp_path / "client"
    live.mkdir()
    for name in ("router.pem", "router-key.pem"):
        shutil.copy(certs.dir / name, live / name)
    tls = TlsConfig(
        cert_file=str(live / "router.pem"),
        key_file=str(live / "router-key.pem"),
        ca_file=str(certs.dir / "ca.pem"),
    )
    cache = ChannelCache(tls=tls)
    server = await serve(certs.tls("decode"))
    try:
        first = cache.get(f"localhost:{server.port}")
        assert cache.get(f"localhost:{server.port}") is first
        assert await ready(first) == "SERVING"
        for src, dst in (("prefill.pem", "router.pem"), ("prefill-key.pem", "router-key.pem")):
            shutil.copy(certs.dir / src, live / "tmp")  # rotate to another certificate
            (live / "tmp").replace(live / dst)
        second = cache.get(f"localhost:{server.port}")
        assert second is not first
        # The new channel presents the new certificate: role prefill may not Prefill.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_raw(second, "/pdmesh.v1.PrefillService/Prefill")
        assert "'prefill'" in e.value.details()
    finally:
        await cache.close()
        await server.stop()
