"""The router with API keys and mTLS, in process over fake workers: the key decides
the tenant (quota, priority cap, in-flight cap), a request field never does; a
worker without a mesh certificate never joins; a worker registers only in its
certificate's role."""

from __future__ import annotations

import grpc
import pytest

from pdmesh.v1 import common_pb2, router_pb2
from services.router.admission import AdmissionConfig
from services.router.auth import AuthConfig, append_entry, hash_key, new_key
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


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def cleanup():
    routers, workers = [], []
    yield routers, workers
    for h in routers:
        await close_router(h)
    for w in workers:
        await w.stop()


async def keyed_router(tmp_path, cleanup, tls=None, client=None, **admission):
    """A router with a keys file: tenant "acme" (cap 1, 2 open at most) and "zeta"."""
    keys = tmp_path / "keys.jsonl"
    acme, zeta = new_key(), new_key()
    append_entry(str(keys), "acme", acme, max_priority=1, max_inflight=2)
    append_entry(str(keys), "zeta", zeta)
    decode = FakeDecode("d1")
    await start_worker(decode, tls)
    cleanup[1].append(decode)
    settings = router_settings(
        (decode.address,),
        auth=AuthConfig(api_keys_file=str(keys)),
        admission=AdmissionConfig(**admission),
        **({"tls": tls} if tls is not None else {}),
    )
    h = await start_router(settings, client, wait_workers=1)
    cleanup[0].append(h)
    return h, decode, acme, zeta, keys


async def test_no_key_or_a_wrong_key_is_unauthenticated(tmp_path, cleanup):
    h, decode, *_ = await keyed_router(tmp_path, cleanup)
    for metadata in (None, bearer("pdm_wrong"), (("authorization", "Basic abc"),)):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.generate("hi", metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for call in (
        h.internal.ListWorkers(router_pb2.ListWorkersRequest()),
        h.stub.Cancel(router_pb2.CancelRequest(request_id="x")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert decode.calls == []


async def test_the_key_sets_the_tenant_and_caps_priority(tmp_path, cleanup):
    h, decode, acme, zeta, _ = await keyed_router(tmp_path, cleanup)
    _, final, _ = await h.generate("hi", metadata=bearer(acme), tenant="zeta", priority=9)
    assert final is not None
    sent = decode.calls[-1]
    assert (sent.tenant, sent.priority) == ("acme", 1)  # not the request's "zeta" / 9
    await h.generate("hi", metadata=bearer(zeta), tenant="acme", priority=9)
    assert (decode.calls[-1].tenant, decode.calls[-1].priority) == ("zeta", 9)


async def test_a_tenant_over_its_open_requests_is_resource_exhausted(tmp_path, cleanup):
    h, decode, acme, zeta, _ = await keyed_router(tmp_path, cleanup)
    decode.pause_after = 0  # streams wait for `resume`
    calls = [h.stub.Generate(request("hi", request_id=f"a{i}"), metadata=bearer(acme)) for i in range(2)]
    for c in calls:
        await c.initial_metadata()
    await h.router.wait_until(lambda: h.router.admission.open_requests("acme") == 2)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("hi", metadata=bearer(acme), request_id="a3")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'acme' has 2 requests open" in e.value.details()
    # Another tenant is not affected, and a tenant cannot cancel another's request.
    cancel = await h.stub.Cancel(router_pb2.CancelRequest(request_id="a0"), metadata=bearer(zeta))
    assert cancel.cancelled is False
    cancel = await h.stub.Cancel(router_pb2.CancelRequest(request_id="a0"), metadata=bearer(acme))
    assert cancel.cancelled is True
    decode.resume.set()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in calls[0]:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert [m async for m in calls[1]][-1].HasField("final")


async def test_the_default_cap_per_tenant_applies_to_keys_without_one(tmp_path, cleanup):
    h, decode, _, zeta, _ = await keyed_router(tmp_path, cleanup, tenant_max_inflight=1)
    decode.pause_after = 0
    call = h.stub.Generate(request("hi", request_id="z0"), metadata=bearer(zeta))
    await call.initial_metadata()
    await h.router.wait_until(lambda: h.router.admission.open_requests("zeta") == 1)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("hi", metadata=bearer(zeta), request_id="z1")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "'zeta' has 1" in e.value.details()
    decode.resume.set()
    async for _ in call:
        pass


async def test_a_key_added_to_the_file_works_without_a_restart(tmp_path, cleanup):
    h, _, _, _, keys = await keyed_router(tmp_path, cleanup)
    late = new_key()
    with pytest.raises(grpc.aio.AioRpcError):
        await h.generate("hi", metadata=bearer(late))
    append_entry(str(keys), "late", late, requests_per_s=0.001, request_burst=1)
    _, final, _ = await h.generate("hi", metadata=bearer(late))
    assert final is not None
    with pytest.raises(grpc.aio.AioRpcError) as e:  # its quota from the file: one request, then 429
        await h.generate("hi", metadata=bearer(late), timeout=None)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "late" in e.value.details()
    assert "pdm_" not in keys.read_text() and hash_key(late) in keys.read_text()


async def test_an_mtls_router_serves_a_client_certificate_with_a_key(tmp_path, cleanup, certs):
    h, decode, acme, *_ = await keyed_router(
        tmp_path, cleanup, tls=certs.tls("router"), client=certs.tls("client")
    )
    # The router reached its worker over mTLS (decode's cert, checked against the CA).
    _, final, _ = await h.generate("hi", metadata=bearer(acme))
    assert final is not None and final.worker_id == "d1"
    with pytest.raises(grpc.aio.AioRpcError) as e:  # a client certificate may not join as a worker
        await h.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=decode.info()))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_worker_without_a_mesh_certificate_never_joins(tmp_path, cleanup, certs):
    plain = FakeDecode("plain")
    await start_worker(plain, None)
    cleanup[1].append(plain)
    outsider_tls = make_certs(tmp_path / "other")  # same names, another CA
    outsider = FakeDecode("outsider")
    await start_worker(outsider, outsider_tls.tls("decode"))
    cleanup[1].append(outsider)
    good = FakeDecode("good")
    await start_worker(good, certs.tls("decode"))
    cleanup[1].append(good)
    settings = router_settings((plain.address, outsider.address, good.address), tls=certs.tls("router"))
    h = await start_router(settings, certs.tls("client"))
    cleanup[0].append(h)
    await h.router.wait_until(lambda: "good" in h.router.registry)
    assert outsider.stats_calls == 0  # the handshake failed before any call
    assert {r.worker_id for r in h.router.registry.workers()} == {"good"}


async def test_a_worker_registers_only_in_its_certificates_role(tmp_path, cleanup, certs):
    settings = router_settings(tls=certs.tls("router"))
    as_prefill = await start_router(settings, certs.tls("prefill"))
    cleanup[0].append(as_prefill)
    info = common_pb2.WorkerInfo(
        worker_id="w1",
        address="127.0.0.1:1",
        role=common_pb2.WORKER_ROLE_DECODE,
        model_id="builtin-tiny",
        block_size=16,
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await as_prefill.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=info))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "'prefill'" in e.value.details()
    info.role = common_pb2.WORKER_ROLE_PREFILL
    await as_prefill.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=info))
    assert "w1" in as_prefill.router.registry
