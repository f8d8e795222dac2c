"""The gateway over HTTPS in front of an mTLS router with API keys (both in process):
the Authorization header reaches the router, which answers 401 without a valid key
and 429 for a tenant over its cap; the HTTPS certificate follows its files."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import shutil
import ssl

import pytest
import uvicorn

from services.common.tls import TlsConfig, https_server_context
from services.gateway.app import Gateway
from services.gateway.config import GatewayConfig
from services.gateway.main import bind
from services.router.admission import AdmissionConfig
from services.router.auth import AuthConfig, append_entry, new_key
from tests.service.router.fakes import FakeDecode
from tests.service.tls_mesh import close_router, make_certs, router_settings, start_router, start_worker

BODY = {"model": "builtin-tiny", "prompt": "hi", "max_tokens": 4}


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.ready.set()


@contextlib.asynccontextmanager
async def https_gateway(router_address: str, tls: TlsConfig):
    gateway = Gateway(GatewayConfig(port=0, router_address=router_address, request_timeout_s=30), tls=tls)
    sock = bind("127.0.0.1", 0)
    config = uvicorn.Config(gateway.app(), log_config=None, access_log=False, lifespan="on")
    config.load()
    config.ssl = https_server_context(tls)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await asyncio.wait_for(server.ready.wait(), 30)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


def post(port: int, ca_file: str, key: str | None, body=BODY) -> tuple[int, dict, dict]:
    ctx = ssl.create_default_context(cafile=ca_file)
    conn = http.client.HTTPSConnection("localhost", port, timeout=60, context=ctx)
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


@pytest.fixture
async def stack(tmp_path):
    certs = make_certs(tmp_path / "certs")
    keys = tmp_path / "keys.jsonl"
    key = new_key()
    append_entry(str(keys), "acme", key, max_inflight=1)
    decode = FakeDecode("d1")
    await start_worker(decode, certs.tls("decode"))
    settings = router_settings(
        (decode.address,),
        tls=certs.tls("router"),
        auth=AuthConfig(api_keys_file=str(keys)),
        admission=AdmissionConfig(),
    )
    router = await start_router(settings, certs.tls("client"), wait_workers=1)
    live = tmp_path / "live"
    live.mkdir()
    for name in ("gateway.pem", "gateway-key.pem"):
        shutil.copy(certs.dir / name, live / name)
    tls = TlsConfig(
        cert_file=str(live / "gateway.pem"),
        key_file=str(live / "gateway-key.pem"),
        ca_file=str(certs.dir / "ca.pem"),
        server_name="pdmesh.internal",
    )
    try:
        async with https_gateway(f"127.0.0.1:{router.server.port}", tls) as port:
            yield port, certs, key, decode, router, live
    finally:
        await close_router(router)
        await decode.stop()


async def test_https_gateway_forwards_the_key_and_maps_auth_errors(stack):
    port, certs, key, decode, router, _ = stack
    ca = str(certs.dir / "ca.pem")
    status, _, body = await asyncio.to_thread(post, port, ca, key)
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert decode.calls[-1].tenant == "acme"
    status, headers, body = await asyncio.to_thread(post, port, ca, None)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert body["error"]["type"] == "authentication_error"
    status, _, _ = await asyncio.to_thread(post, port, ca, "pdm_not-a-key")
    assert status == 401
    decode.pause_after = 0  # hold acme's one allowed request open
    first = asyncio.ensure_future(asyncio.to_thread(post, port, ca, key))
    await router.router.wait_until(lambda: router.router.admission.open_requests("acme") == 1)
    status, headers, body = await asyncio.to_thread(post, port, ca, key)
    assert status == 429 and "retry-after" in headers and "acme" in body["error"]["message"]
    decode.resume.set()
    assert (await first)[0] == 200


async def test_the_https_certificate_follows_its_files(stack, tmp_path):
    port, certs, key, *_, live = stack
    ca = str(certs.dir / "ca.pem")
    other = make_certs(tmp_path / "other")  # a new CA: the rotated certificate is only trusted by it
    with pytest.raises(ssl.SSLError):
        await asyncio.to_thread(post, port, str(other.dir / "ca.pem"), key)
    for name in ("gateway-key.pem", "gateway.pem"):
        shutil.copy(other.dir / name, live / "tmp")
        (live / "tmp").replace(live / name)
    status, _, _ = await asyncio.to_thread(post, port, str(other.dir / "ca.pem"), key)
    assert status == 200
    with pytest.raises(ssl.SSLError):
        await asyncio.to_thread(post, port, ca, key)
