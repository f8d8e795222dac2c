"""Every resource a caller controls has a limit; pushing past each one at the router
gets INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for message size) naming what was
exceeded, and no worker is touched. Concurrent calls per tenant and per connection:
tests/service/test_tls_router.py and tests/service/test_tls.py."""

from __future__ import annotations

import grpc
import pytest

from services.common.server import ServerConfig
from services.common.validation import RequestLimits
from tests.service.router.conftest import request
from tests.service.router.fakes import FakeDecode
from tests.service.tls_mesh import close_router, router_settings, start_router, start_worker

LIMITS = RequestLimits(
    max_prompt_tokens=8,
    max_tokens_limit=16,
    max_stop_strings=2,
    max_stop_string_bytes=4,
    max_stop_token_ids=2,
    max_request_id_bytes=8,
)


def _over_limits():
    # The router names fields as clients know them (issue 15: no sampling.max_tokens, prompt_token_ids).
    yield "prompt", request(list(range(1, 10)), max_tokens=2), grpc.StatusCode.INVALID_ARGUMENT
    yield "prompt", request("x" * 65, max_tokens=2), grpc.StatusCode.INVALID_ARGUMENT  # > 8 chars a token
    yield "max_tokens", request("hi", max_tokens=17), grpc.StatusCode.INVALID_ARGUMENT
    stops = request("hi", max_tokens=2)
    stops.sampling.stop.extend(["a", "b", "c"])
    yield "stop", stops, grpc.StatusCode.INVALID_ARGUMENT
    long_stop = request("hi", max_tokens=2)
    long_stop.sampling.stop.append("abcde")
    yield "stop", long_stop, grpc.StatusCode.INVALID_ARGUMENT
    stop_ids = request("hi", max_tokens=2)
    stop_ids.sampling.stop_token_ids.extend([1, 2, 3])
    yield "stop_token_ids", stop_ids, grpc.StatusCode.INVALID_ARGUMENT
    yield "request_id", request("hi", max_tokens=2, request_id="r" * 9), grpc.StatusCode.INVALID_ARGUMENT
    yield "tenant", request("hi", max_tokens=2, tenant="t" * 129), grpc.StatusCode.INVALID_ARGUMENT
    yield "message", request("x" * 5000, max_tokens=2), grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture
async def router():
    decode = FakeDecode("d1")
    await start_worker(decode, None)
    settings = router_settings(
        (decode.address,), server=ServerConfig(port=0, drain_grace_s=1, max_message_bytes=4096), limits=LIMITS
    )
    h = await start_router(settings, wait_workers=1)
    yield h, decode
    await close_router(h)
    await decode.stop()


@pytest.mark.parametrize(
    ("what", "req", "code"), list(_over_limits()), ids=lambda v: v if isinstance(v, str) else ""
)
async def test_each_limit_refuses_what_goes_past_it(router, what, req, code):
    h, decode = router
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in h.stub.Generate(req, timeout=10):
            pass
    assert e.value.code() == code
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert e.value.details().startswith(what), e.value.details()
    else:
        assert "4096" in e.value.details() or "larger than max" in e.value.details()
    assert decode.calls == []


async def test_requests_at_the_limits_are_served(router):
    h, decode = router
    req = request(list(range(1, 9)), max_tokens=16, request_id="r" * 8)
    req.sampling.stop.extend(["abcd", "b"])
    req.sampling.stop_token_ids.extend([250, 251])
    msgs = [m async for m in h.stub.Generate(req, timeout=10)]
    assert msgs[-1].HasField("final") and len(decode.calls) == 1
