"""The gateway app in-process (uvicorn on port 0) in front of a scripted fake router.

What only a fake can stage on demand: a shed with a known retry hint, a failure
after the first token, a stream without its final message, a deadline, a stream
that never ends (to see the client's disconnect cancel the upstream call).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import structlog
import uvicorn

from services.gateway.app import Gateway
from services.gateway.config import GatewayConfig
from services.gateway.main import bind
from tests.service.gateway import httpio
from tests.service.gateway.fake_router import FakeRouter
from tests.support.poll import eventually


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.ready.set()


@contextlib.asynccontextmanager
async def serving(router_address: str):
    gateway = Gateway(GatewayConfig(port=0, router_address=router_address, request_timeout_s=30))
    sock = bind("127.0.0.1", 0)
    server = _Server(uvicorn.Config(gateway.app(), log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await asyncio.wait_for(server.ready.wait(), 30)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def fake():
    router = FakeRouter()
    await router.start()
    yield router
    await router.stop()


@pytest.fixture
async def gw(fake):
    async with serving(fake.address) as address:
        yield address


async def post(address: str, path: str, body) -> tuple[int, dict, bytes]:
    return await asyncio.to_thread(httpio.request, address, "POST", path, body)


async def test_completion_relays_text_usage_and_finish_reason(gw, fake):
    status, headers, raw = await post(gw, "/v1/completions", {"prompt": "ok", "max_tokens": 5})
    body = json.loads(raw)
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert headers["x-request-id"] == body["id"] == fake.requests[-1].request_id


async def test_streamed_chat_has_role_first_content_then_finish_then_usage_then_done(gw):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, raw = await post(gw, "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = httpio.sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["a", "lo"]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop" and chunks[3]["usage"] is None
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_shed_is_429_with_retry_after_even_for_streams(gw, stream):
    status, headers, raw = await post(gw, "/v1/completions", {"prompt": "shed", "stream": stream})
    assert status == 429
    assert headers["retry-after"] == "3" and headers["retry-after-ms"] == "2500"
    assert json.loads(raw)["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize(
    "script, status", [("deadline", 504), ("bad", 400), ("nofinal", 502), ("midfail", 503)]
)
async def test_router_failures_map_to_http_statuses(gw, script, status):
    got, _, raw = await post(gw, "/v1/completions", {"prompt": script})
    assert got == status
    assert json.loads(raw)["error"]["message"]


async def test_failure_after_the_first_token_is_reported_in_the_stream(gw):
    status, _, raw = await post(gw, "/v1/completions", {"prompt": "midfail", "stream": True})
    events = httpio.sse_events(raw)
    assert status == 200 and events[0]["choices"][0]["text"] == "a"
    assert events[1]["error"]["code"] == "unavailable" and events[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_router_call(gw, fake, stream):
    sock = await asyncio.to_thread(
        httpio.open_request, gw, "/v1/completions", {"prompt": "slow", "stream": stream}
    )
    if stream:
        await asyncio.to_thread(httpio.read_until, sock, b'"text":"a"')
    else:
        # the call reached the router; nothing is sent back until it ends
        await eventually(lambda: fake.requests, what="the call to reach the router")
    httpio.hang_up(sock)
    await asyncio.wait_for(fake.cancelled.wait(), 10)

    async def counted() -> bool:
        _, _, metrics = await asyncio.to_thread(httpio.request, gw, "GET", "/metrics")
        return b"pdmesh_gateway_client_disconnects_total 1.0" in metrics

    # The router sees the cancel before the gateway finishes its own bookkeeping: poll.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not await counted():
        assert loop.time() < deadline, "the disconnect was never counted"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_before_the_first_token_cancels_the_call_and_the_gateway_serves_on(
    gw, fake, stream
):
    with structlog.testing.capture_logs() as logs:
        sock = await asyncio.to_thread(
            httpio.open_request, gw, "/v1/completions", {"prompt": "hold", "stream": stream}
        )
        await eventually(lambda: fake.requests, what="the call to reach the router")
        httpio.hang_up(sock)
        await asyncio.wait_for(fake.cancelled.wait(), 10)
        await eventually(lambda: [e for e in logs if e["event"] == "request"], what="the request's log line")
    (line,) = [e for e in logs if e["event"] == "request"]
    assert line["status"] == 499 and line["upstream_cancelled"] is True
    assert line["completion_tokens"] == 0 and line["ttft_ms"] is None
    # The same app answers the next request in full (nothing of the cancel is left behind).
    status, _, raw = await post(gw, "/v1/completions", {"prompt": "ok", "stream": stream})
    assert status == 200 and b"Hel" in raw


async def test_the_log_of_a_stream_the_client_closed_has_its_real_counts(gw, fake):
    with structlog.testing.capture_logs() as logs:
        sock = await asyncio.to_thread(
            httpio.open_request, gw, "/v1/completions", {"prompt": "slow", "stream": True}
        )
        await asyncio.to_thread(httpio.read_until, sock, b'"text":"a"')
        httpio.hang_up(sock)
        await asyncio.wait_for(fake.cancelled.wait(), 10)

        async def logged() -> None:
            while not [e for e in logs if e["event"] == "request"]:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(logged(), 10)
    (line,) = [e for e in logs if e["event"] == "request"]
    assert line["status"] == 499 and line["upstream_cancelled"] is True
    assert line["prompt_tokens"] == len("slow") and line["completion_tokens"] == 1


async def test_unknown_model_is_a_404_as_openai_answers(gw, fake):
    status, _, raw = await post(gw, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    err = json.loads(raw)["error"]
    assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert not fake.requests  # refused before the router


async def test_health_follows_router_readiness(gw, fake):
    assert (await asyncio.to_thread(httpio.request, gw, "GET", "/health"))[0] == 200
    await fake.set_ready(False)
    status, _, raw = await asyncio.to_thread(httpio.request, gw, "GET", "/health")
    assert status == 503 and json.loads(raw)["router"] == "NOT_SERVING"


async def test_unknown_routes_and_huge_bodies_get_openai_errors(gw):
    status, _, raw = await asyncio.to_thread(httpio.request, gw, "GET", "/v1/nope")
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    huge = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    status, _, raw = await asyncio.to_thread(httpio.request, gw, "POST", "/v1/completions", None, huge)
    assert status == 413 and "larger than" in json.loads(raw)["error"]["message"]


async def test_metrics_count_requests_by_status(gw):
    await post(gw, "/v1/completions", {"prompt": "ok"})
    await post(gw, "/v1/completions", {"prompt": "shed"})
    await asyncio.to_thread(httpio.request, gw, "POST", "/v1/completions", None, b"not json")
    _, _, raw = await asyncio.to_thread(httpio.request, gw, "GET", "/metrics")
    text = raw.decode()
    for status in ("200", "429", "400"):
        assert f'pdmesh_gateway_requests_total{{endpoint="/v1/completions",status="{status}"}} 1.0' in text
    assert 'pdmesh_gateway_tokens_total{kind="completion"} 2.0' in text


async def test_continuous_usage_gives_the_running_token_count_in_every_chunk(gw):
    body = {
        "prompt": "ok",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    status, _, raw = await post(gw, "/v1/completions", body)
    assert status == 200
    chunks = httpio.sse_events(raw)[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    # The fake router streams "Hel" then "lo" (one token per byte): 3, then 5, then the closing chunk.
    assert texts[:2] == ["Hel", "lo"] and counts == [3, 5, 5]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2  # the router's final
