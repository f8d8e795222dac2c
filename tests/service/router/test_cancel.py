"""Cancellation reaches the decode worker at once: client disconnect and Router.Cancel."""

import grpc
import pytest

from pdmesh.v1 import router_pb2
from services.router.admission import AdmissionConfig
from tests.service.router.conftest import read_all, request


async def _started(h, d, request_id, after=2):
    d.pause_after = after
    call = h.stub.Generate(request("cancel me", max_tokens=16, request_id=request_id), timeout=30)
    got = 0
    while got < after:
        got += len((await call.read()).delta.token_ids)
    return call


async def test_client_disconnect_cancels_the_downstream_call(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    r = h.router
    call = await _started(h, d, "c-1")
    call.cancel()
    await d.cancelled_event.wait()
    assert d.cancelled == ["c-1"]
    await r.wait_until(lambda: not r.flows)
    s = await h.internal.Stats(router_pb2.RouterServiceStatsRequest())
    assert s.requests_cancelled == 1 and s.inflight == 0 and s.requests_failed == 0


async def test_router_cancel_ends_the_stream_and_the_downstream_call(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    call = await _started(h, d, "c-2")
    resp = await h.stub.Cancel(router_pb2.CancelRequest(request_id="c-2"))
    assert resp.cancelled
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await read_all(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    await d.cancelled_event.wait()
    assert d.cancelled == ["c-2"]
    again = await h.stub.Cancel(router_pb2.CancelRequest(request_id="c-2"))
    assert not again.cancelled
    unknown = await h.stub.Cancel(router_pb2.CancelRequest(request_id="nope"))
    assert not unknown.cancelled


async def test_router_cancel_of_a_queued_request(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d], admission=AdmissionConfig(max_inflight=1))
    r = h.router
    held = await _started(h, d, "holder")
    queued = h.stub.Generate(request("waiting", request_id="q-1"), timeout=30)
    await r.wait_until(lambda: r.admission.queued == 1)
    assert (await h.stub.Cancel(router_pb2.CancelRequest(request_id="q-1"))).cancelled
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await read_all(queued)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert r.admission.queued == 0 and len(d.calls) == 1
    d.resume.set()
    await read_all(held)


async def test_client_gone_while_queued_frees_its_place(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d], admission=AdmissionConfig(max_inflight=1))
    r = h.router
    held = await _started(h, d, "holder")
    queued = h.stub.Generate(request("waiting", request_id="q-2"), timeout=30)
    await r.wait_until(lambda: r.admission.queued == 1)
    queued.cancel()
    await r.wait_until(lambda: "q-2" not in r.flows)
    assert r.admission.queued == 0
    d.resume.set()
    await read_all(held)
    assert len(d.calls) == 1 and r.admission.inflight == 0


async def test_cancel_needs_a_request_id(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.stub.Cancel(router_pb2.CancelRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
