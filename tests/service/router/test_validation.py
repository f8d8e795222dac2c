"""Bad requests are refused with INVALID_ARGUMENT before any worker is touched."""

import grpc
import pytest

from pdmesh.v1 import common_pb2, router_pb2
from tests.service.router.conftest import read_all, request


def _bad_requests():
    long_text = "a" * 3000  # the tiny model's context is 2048 tokens
    yield "empty text", request("")
    yield "no prompt", router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4))
    yield "empty token ids", request([])
    yield "max_tokens 0", request("hi", max_tokens=0)
    yield "max_tokens negative", request("hi", max_tokens=-3)
    yield "max_tokens over the limit", request("hi", max_tokens=5000)
    yield "prompt over the context", request(long_text, max_tokens=4)
    yield "prompt + output over the context", request("a" * 2040, max_tokens=16)
    yield "token out of vocabulary", request([1, 2, 999])
    yield "unknown model", request("hi", model="gpt-9")
    yield "priority too high", request("hi", priority=11)
    yield "priority too low", request("hi", priority=-11)
    yield "request id too long", request("hi", request_id="x" * 129)
    # it goes back as the x-request-id header: printable ASCII only
    yield "request id with a NUL", request("hi", request_id="a\x00b")
    yield "request id with a newline", request("hi", request_id="a\nb")
    yield "request id not ASCII", request("hi", request_id="caf\u00e9")
    yield "tenant too long", request("hi", tenant="t" * 129)
    bad_temp = request("hi")
    bad_temp.sampling.temperature = 3.0
    yield "temperature", bad_temp
    bad_top_p = request("hi")
    bad_top_p.sampling.top_p = 1.5
    yield "top_p", bad_top_p
    bad_stop = request("hi")
    bad_stop.sampling.stop.append("")
    yield "empty stop string", bad_stop
    bad_stop_id = request("hi")
    bad_stop_id.sampling.stop_token_ids.append(100000)
    yield "stop token out of vocabulary", bad_stop_id
    wf = request("hi")
    wf.workflow.workflow_id = "w" * 200
    yield "workflow id too long", wf


BAD = list(_bad_requests())


async def test_invalid_requests_never_reach_a_worker(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    for name, req in BAD:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in h.stub.Generate(req, timeout=10):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert e.value.details(), name
    assert d.calls == []
    stats = await h.internal.Stats(router_pb2.RouterServiceStatsRequest())
    assert stats.requests_total == 0 and stats.requests_failed == 0


async def test_the_message_names_the_field(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("hi", max_tokens=0)
    assert e.value.details().startswith("max_tokens: ")  # the public name, not sampling.max_tokens
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("hi", model="gpt-9")
    assert "model" in e.value.details() and "builtin-tiny" in e.value.details()


async def test_the_served_model_id_is_accepted(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    _, final, _ = await h.generate("hi", max_tokens=2, model="builtin-tiny")
    assert final.usage.completion_tokens == 2


async def test_a_duplicate_running_request_id_is_refused(mesh):
    d = await mesh.decode("d1")
    d.pause_after = 1
    h = await mesh.router([d])
    first = h.stub.Generate(request("hi", request_id="same"), timeout=30)
    await first.read()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("hi", request_id="same")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    d.resume.set()
    await read_all(first)
    assert await first.code() == grpc.StatusCode.OK
    assert len(d.calls) == 1
