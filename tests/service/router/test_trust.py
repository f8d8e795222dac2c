"""The router's trust boundaries (issue 13 items 2, 4, 8), in process on loopback port 0
over fake workers: the public port serves Generate/Cancel only and refuses oversized
messages before parsing; membership lives on the internal port, where a worker speaks
only for itself (certificate worker id with mTLS, incarnation secret without);
request ids are scoped by tenant; ListWorkers is for operators."""

from __future__ import annotations

import tracemalloc

import grpc
import pytest

from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.errors import InvalidArgument
from services.common.tls import aio_channel, client_tls
from services.common.validation import RequestLimits
from services.router.auth import AuthConfig, append_entry, new_key
from services.router.config import ModelSpec, RouterConfig
from services.router.listeners import public_message_bytes
from services.router.servicer import parse_generate
from tests.service.router.conftest import request
from tests.service.router.fakes import FakeDecode
from tests.service.tls_mesh import (
    bearer,
    close_router,
    make_certs,
    router_settings,
    start_router,
    start_worker,
)

MEMBERSHIP = ("RegisterWorker", "Heartbeat", "DeregisterWorker", "ListWorkers", "Stats")


def _info(worker_id: str, address: str = "127.0.0.1:1") -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=worker_id,
        address=address,
        role=common_pb2.WORKER_ROLE_DECODE,
        model_id="builtin-tiny",
        block_size=16,
    )


def _beat(worker_id: str, incarnation: str = "", waiting: int = 0):
    return router_pb2.RouterServiceHeartbeatRequest(
        worker_id=worker_id, load=common_pb2.WorkerLoad(waiting=waiting), incarnation=incarnation
    )


async def _denied(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
    return e.value.details()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(
        tmp_path_factory.mktemp("certs"), workers=(("decode", "decode-0"), ("decode", "decode-1"))
    )


@pytest.fixture
async def cleanup():
    routers, workers, channels = [], [], []
    yield routers, workers, channels
    for ch in channels:
        await ch.close()
    for h in routers:
        await close_router(h)
    for w in workers:
        await w.stop()


# ---- item 4: the listener split ------------------------------------------------------------


async def test_the_public_port_serves_only_generate_and_cancel(mesh):
    d1 = await mesh.decode("d1")
    h = await mesh.router([d1])
    assert h.server.port != h.listeners.internal.port
    raw = {m: f"/pdmesh.v1.RouterService/{m}" for m in MEMBERSHIP}
    for method, path in raw.items():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.channel.unary_unary(path)(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
    _, final, _ = await h.generate("hi", max_tokens=2)  # the public port still serves requests
    assert final.worker_id == "d1"
    assert (await h.internal.Stats(router_pb2.RouterServiceStatsRequest())).requests_total == 1
    with pytest.raises(grpc.aio.AioRpcError) as e:  # and the internal port serves no client
        await h.internal.Cancel(router_pb2.CancelRequest(request_id="x"))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert d1.calls and len(h.router.registry) == 1


# ---- item 4: a worker speaks only for itself, without TLS ---------------------------------


async def test_without_tls_only_the_registrant_can_heartbeat_or_deregister(mesh):
    d0 = await mesh.decode("d0")
    h = await mesh.router([], wait=False)
    joined = await h.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=d0.info()))
    assert len(joined.incarnation) >= 24
    r = h.router
    for incarnation in ("", "guess", joined.incarnation[:-1] + "x"):
        await _denied(h.internal.Heartbeat(_beat("d0", incarnation, waiting=100_000)))
        await _denied(
            h.internal.DeregisterWorker(
                router_pb2.DeregisterWorkerRequest(worker_id="d0", incarnation=incarnation)
            )
        )
    assert r.registry.get("d0").load.waiting == 0  # the fake load never landed
    # Nobody else can take the id over (a rogue worker at its own address) while it lives.
    rogue = router_pb2.RegisterWorkerRequest(worker=_info("d0", "127.0.0.1:9"))
    assert "registered by another process" in await _denied(h.internal.RegisterWorker(rogue))
    assert r.registry.get("d0").info.address == d0.address
    # The registrant can.
    assert (await h.internal.Heartbeat(_beat("d0", joined.incarnation, waiting=3))).known
    assert r.registry.get("d0").load.waiting == 3
    again = router_pb2.RegisterWorkerRequest(worker=d0.info(), incarnation=joined.incarnation)
    rejoined = await h.internal.RegisterWorker(again)
    await _denied(h.internal.Heartbeat(_beat("d0", joined.incarnation)))  # the old secret is spent
    dereg = router_pb2.DeregisterWorkerRequest(worker_id="d0", incarnation=rejoined.incarnation)
    assert (await h.internal.DeregisterWorker(dereg)).removed
    assert "d0" not in r.registry


async def test_static_workers_cannot_be_changed_by_rpc(mesh):
    d0 = await mesh.decode("d0")
    h = await mesh.router([d0])
    r = h.router
    assert "static" in await _denied(h.internal.Heartbeat(_beat("d0", waiting=100_000)))
    await _denied(h.internal.DeregisterWorker(router_pb2.DeregisterWorkerRequest(worker_id="d0")))
    await _denied(
        h.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=_info("d0", "127.0.0.1:9")))
    )
    # Another id at the static worker's address would replace (remove) it.
    await _denied(
        h.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=_info("evil", d0.address)))
    )
    rec = r.registry.get("d0")
    assert rec is not None and rec.load.waiting == 0 and rec.info.address == d0.address
    assert "evil" not in r.registry
    _, final, _ = await h.generate("still served", max_tokens=2)
    assert final.worker_id == "d0"


# ---- item 4: with mTLS, the certificate's worker id ---------------------------------------


async def test_with_mtls_a_worker_certificate_speaks_only_for_its_worker(certs, cleanup):
    h = await start_router(router_settings(tls=certs.tls("router")), certs.tls("decode-decode-0"))
    cleanup[0].append(h)
    as_1 = aio_channel(f"localhost:{h.listeners.internal.port}", client_tls(certs.tls("decode-decode-1")))
    cleanup[2].append(as_1)
    stub_1 = router_pb2_grpc.RouterServiceStub(as_1)
    await h.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=_info("decode-0")))
    r = h.router
    # decode-1's certificate can neither fake decode-0's load, remove it, nor register as it.
    assert "'decode-1'" in await _denied(stub_1.Heartbeat(_beat("decode-0", waiting=100_000)))
    await _denied(stub_1.DeregisterWorker(router_pb2.DeregisterWorkerRequest(worker_id="decode-0")))
    await _denied(
        stub_1.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=_info("decode-0", "127.0.0.1:9")))
    )
    rec = r.registry.get("decode-0")
    assert rec.load.waiting == 0 and rec.info.address == "127.0.0.1:1"
    # decode-0's own certificate is its identity: no incarnation needed.
    assert (await h.internal.Heartbeat(_beat("decode-0", waiting=2))).known
    assert r.registry.get("decode-0").load.waiting == 2
    await stub_1.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=_info("decode-1", "127.0.0.1:2")))
    assert (
        await h.internal.DeregisterWorker(router_pb2.DeregisterWorkerRequest(worker_id="decode-0"))
    ).removed
    assert {w.worker_id for w in r.registry.workers()} == {"decode-1"}


async def test_the_internal_port_is_mtls_only_when_tls_is_on(certs, cleanup):
    """The public port may be TLS without client certificates; the internal one never is."""
    h = await start_router(router_settings(tls=certs.tls("router", mtls=False)), certs.ca_only())
    cleanup[0].append(h)
    await h.stub.Cancel(router_pb2.CancelRequest(request_id="x"), timeout=10)  # public: no cert needed
    with pytest.raises(grpc.aio.AioRpcError) as e:  # internal: the handshake wants a certificate
        await h.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=_info("w")), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(h.router.registry) == 0


# ---- item 8: tenant-scoped request ids and ListWorkers for operators ----------------------


async def keyed(tmp_path, cleanup):
    keys = tmp_path / "keys.jsonl"
    acme, zeta, ops = new_key(), new_key(), new_key()
    append_entry(str(keys), "acme", acme)
    append_entry(str(keys), "zeta", zeta)
    append_entry(str(keys), "ops", ops, admin=True)
    decode = FakeDecode("d1")
    await start_worker(decode, None)
    cleanup[1].append(decode)
    h = await start_router(
        router_settings((decode.address,), auth=AuthConfig(api_keys_file=str(keys))), wait_workers=1
    )
    cleanup[0].append(h)
    return h, decode, acme, zeta, ops


async def test_another_tenant_reusing_a_running_id_neither_collides_nor_cancels_it(tmp_path, cleanup):
    h, decode, acme, zeta, _ = await keyed(tmp_path, cleanup)
    decode.pause_after = 0
    mine = h.stub.Generate(request("acme's", request_id="job-1"), metadata=bearer(acme))
    assert dict(await mine.initial_metadata())["x-request-id"] == "job-1"
    with pytest.raises(grpc.aio.AioRpcError) as e:  # the same tenant: still one id, one request
        await h.generate("again", request_id="job-1", metadata=bearer(acme))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    theirs = h.stub.Generate(request("zeta's", request_id="job-1"), metadata=bearer(zeta))
    assert dict(await theirs.initial_metadata())["x-request-id"] == "job-1"  # not ALREADY_EXISTS
    await h.router.wait_until(lambda: len(decode.calls) == 2)
    assert len({c.request_id for c in decode.calls}) == 2  # distinct ids on the worker too
    cancelled = await h.stub.Cancel(router_pb2.CancelRequest(request_id="job-1"), metadata=bearer(zeta))
    assert cancelled.cancelled
    decode.resume.set()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in theirs:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    msgs = [m async for m in mine]  # acme's request was not touched
    assert msgs[-1].HasField("final") and msgs[-1].final.request_id == "job-1"


async def test_list_workers_needs_an_admin_key(tmp_path, cleanup):
    h, _, acme, _, ops = await keyed(tmp_path, cleanup)
    details = await _denied(h.internal.ListWorkers(router_pb2.ListWorkersRequest(), metadata=bearer(acme)))
    assert "admin" in details
    listed = await h.internal.ListWorkers(router_pb2.ListWorkersRequest(), metadata=bearer(ops))
    assert [w.info.worker_id for w in listed.workers] == ["d1"]


async def test_list_workers_over_mtls_needs_an_operator_certificate(certs, cleanup):
    h = await start_router(router_settings(tls=certs.tls("router")), certs.tls("client"))
    cleanup[0].append(h)
    await _denied(h.internal.ListWorkers(router_pb2.ListWorkersRequest()))
    as_router = aio_channel(f"localhost:{h.listeners.internal.port}", client_tls(certs.tls("router")))
    cleanup[2].append(as_router)
    listed = await router_pb2_grpc.RouterServiceStub(as_router).ListWorkers(router_pb2.ListWorkersRequest())
    assert list(listed.workers) == []


# ---- item 2: bounded memory per request ----------------------------------------------------


def test_the_public_message_cap_follows_the_request_limits():
    small, default = (
        public_message_bytes(RequestLimits(max_prompt_tokens=1024)),
        public_message_bytes(RequestLimits()),
    )
    assert small < default < 4 * 1024 * 1024  # a few MiB at most, not the server's 64 MiB
    assert default >= 32768 * 8 * 4  # the longest text prompt parse_generate accepts fits


async def test_a_message_over_the_public_cap_is_refused_before_parsing(mesh):
    d1 = await mesh.decode("d1")
    h = await mesh.router([d1])
    cap = public_message_bytes(h.router.settings.limits)
    prompt = [200] * cap  # 2 bytes a token on the wire: twice the cap
    assert request(prompt, max_tokens=1).ByteSize() > cap
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate(prompt, max_tokens=1)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert d1.calls == [] and h.router.requests_total == 0  # never reached the servicer
    _, final, _ = await h.generate("small", max_tokens=2)
    assert final is not None


def test_a_huge_token_list_is_refused_without_copying_it():
    cfg = RouterConfig()
    model = ModelSpec.load(cfg)
    limits = RequestLimits()
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=1))
    req.token_ids.ids.extend(range(2_000_000))  # 2M ids: 60x the prompt limit
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match=r"^prompt: 2000000 tokens exceed the limit of"):
            parse_generate(req, model, limits, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # a list of 2M ints would be > 16 MB


def test_huge_stop_lists_are_refused_without_copying_them():
    model, limits = ModelSpec.load(RouterConfig()), RequestLimits()
    req = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=1))
    req.sampling.stop_token_ids.extend([1] * 2_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match="at most 64 ids"):
            parse_generate(req, model, limits, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # a tuple of 2M ids is 16 MB


async def test_a_bad_keys_file_revokes_what_it_no_longer_holds_and_is_counted(tmp_path, cleanup):
    """Issue 13 item 6 through the router: a revoked key stops working at once even though
    the same edit broke another line; the failed reload shows in the router's metrics."""
    h, _, acme, zeta, _ = await keyed(tmp_path, cleanup)
    keys = tmp_path / "keys.jsonl"
    await h.generate("hi", max_tokens=1, metadata=bearer(zeta))
    kept = [line for line in keys.read_text().splitlines() if '"zeta"' not in line]
    keys.write_text("\n".join([*kept, '{"key_sha256": "broken']) + "\n")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("hi", max_tokens=1, metadata=bearer(zeta))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _, final, _ = await h.generate("hi", max_tokens=1, metadata=bearer(acme))
    assert final is not None
    registry = h.router.metrics.registry
    assert registry.get_sample_value("pdmesh_router_api_keys_reload_errors_total") == 1
