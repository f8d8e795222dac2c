"""The official `openai` client against the real HTTP door (the router process's
--http-port, which serves the gateway's app in-process), router and decode worker
(processes on loopback, the tiny built-in model).

- completions and chat, streaming and not, return exactly what the router
  returns for the same prompt (chat: the documented built-in template);
- seed makes sampling repeatable; stop strings end the text with "stop";
- 400 for a malformed body, n > 1, out-of-range values and what the router refuses; 404
  for an unknown model;
- 429 with Retry-After when the router sheds (a router admitting one request
  and queueing none), 503 when the router has no decode worker to reach;
- a client that hangs up mid-stream cancels the request at the router, and the
  decode worker frees its blocks.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass

import grpc
import openai
import pytest

from pdmesh.launcher import Launcher, RunningService, ServiceSpec, flags
from pdmesh.v1 import common_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2
from tests.e2e.helpers import wait_until
from tests.service.gateway import httpio

pytestmark = pytest.mark.e2e

MODEL = "builtin-tiny"
ROUTER_FAST = flags(health_interval_s=0.2, stats_interval_s=0.2, http_port=0)


@dataclass(frozen=True)
class Door:
    """A router's HTTP door, where the tests' HTTP clients connect (logs: the router's)."""

    address: str
    router: RunningService

    def log_tail(self, lines: int = 30) -> str:
        return self.router.log_tail(lines)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """decode worker, a normal router and a router that sheds at 1, each with its HTTP door."""
    launcher = Launcher(tmp_path_factory.mktemp("gateway-e2e"))
    try:
        decode = launcher.start_ready(
            ServiceSpec(
                "decode",
                "services.decode.main",
                flags(engine_preset="tiny", engine_num_threads=1),
                ready_service="pdmesh.v1.DecodeService",
            )
        )
        routers = [
            launcher.start(
                ServiceSpec(
                    name,
                    "services.router.main",
                    ROUTER_FAST + flags(decode_workers=decode.address) + extra,
                    ready_service="pdmesh.v1.RouterService",
                )
            )
            for name, extra in (
                ("router", ()),
                ("tight-router", flags(admission_max_inflight=1, admission_queue_limit_per_priority=0)),
            )
        ]
        for r in routers:
            launcher.wait_ready(r)
        gateways = [Door(r.http_address, r) for r in routers]
        yield {
            "router": routers[0],
            "gateway": gateways[0],
            "tight": gateways[1],
            "launcher": launcher,
            "decode": decode,
        }
    finally:
        launcher.close()


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=60)


def router_text(router, text: str, **sampling) -> tuple[str, router_pb2.GenerateFinal]:
    stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.address))
    out, final = [], None
    req = router_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(**sampling))
    for msg in stub.Generate(req, timeout=60):
        if msg.HasField("delta"):
            out.append(msg.delta.text)
        else:
            final = msg.final
    assert final is not None
    return "".join(out), final


def free_blocks(decode) -> int:
    stub = decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(decode.address))
    return stub.Stats(worker_pb2.StatsRequest(), timeout=10).load.free_blocks


def router_stats(router) -> router_pb2.RouterServiceStatsResponse:
    stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.internal_address))
    return stub.Stats(router_pb2.RouterServiceStatsRequest(), timeout=10)


GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_completion_equals_the_router_answer(mesh):
    want, final = router_text(mesh["router"], "Hello there", max_tokens=12, temperature=0.0, ignore_eos=True)
    got = client(mesh["gateway"]).completions.create(model=MODEL, prompt="Hello there", **GREEDY)
    assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
    assert (
        (got.usage.prompt_tokens, got.usage.completion_tokens) == (11, 12) == (final.usage.prompt_tokens, 12)
    )
    assert got.usage.total_tokens == 23 and got.model == MODEL


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(mesh):
    c = client(mesh["gateway"])
    whole = c.completions.create(model=MODEL, prompt="Stream me", **GREEDY).choices[0].text
    chunks = list(
        c.completions.create(
            model=MODEL, prompt="Stream me", stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_uses_the_builtin_template_streaming_and_not(mesh):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    want, _ = router_text(mesh["router"], prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    c = client(mesh["gateway"])
    whole = c.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == want
    assert whole.usage.prompt_tokens == len(prompt.encode())
    stream = list(c.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == want
    assert stream[-1].choices[0].finish_reason == "length"


def test_seed_repeats_sampling_and_stop_ends_the_text(mesh):
    c = client(mesh["gateway"])
    seeded = {**GREEDY, "temperature": 1.0, "seed": 7}
    sampled = [c.completions.create(model=MODEL, prompt="Seeded", **seeded).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    full = c.completions.create(model=MODEL, prompt="Hello there", **GREEDY).choices[0].text
    stop = next(ch for ch in full[1:] if ch.isascii() and ch.isprintable())  # some character past the first
    cut = c.completions.create(model=MODEL, prompt="Hello there", stop=[stop], **GREEDY).choices[0]
    # The stop string ends the text at its first occurrence and is not part of it (common.proto).
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_models_lists_the_served_model(mesh):
    assert [m.id for m in client(mesh["gateway"]).models.list().data] == [MODEL]


def test_bad_requests_are_400_openai_errors(mesh):
    c = client(mesh["gateway"])
    # An unknown model is a 404, as OpenAI and vLLM answer (openai.NotFoundError).
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n=1"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens") as info:
        c.completions.create(model=MODEL, prompt="x", max_tokens=1_000_000)  # refused by the router
    # The router's refusal names the public field and states the serving limit.
    assert info.value.param == "max_tokens" and "(the serving limit)" in info.value.message
    assert "sampling." not in info.value.message
    for raw in (
        b'{"prompt": "x", "max_tokens": 2147483648}',
        b'{"prompt": [1, 1099511627776]}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    ):
        status, _, body = httpio.request(mesh["gateway"].address, "POST", "/v1/completions", raw=raw)
        assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error", body[:200]
    assert "Traceback" not in mesh["gateway"].log_tail(10_000)
    status, _, body = httpio.request(
        mesh["gateway"].address, "POST", "/v1/chat/completions", raw=b'{"messages": ['
    )
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_router_shedding_is_429_with_retry_after(mesh):
    gateway = mesh["tight"]
    long = client(gateway).completions.create(
        model=MODEL,
        prompt="occupy",
        max_tokens=2000,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        next(iter(long))  # the one admission slot is now held
        with pytest.raises(openai.RateLimitError) as info:
            client(gateway).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert info.value.status_code == 429
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["type"] == "rate_limit_error"
    finally:
        long.close()


def test_unreachable_router_is_503(mesh, tmp_path):
    # One process now: what the door cannot reach is the router's decode worker.
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    launcher: Launcher = mesh["launcher"]
    router = launcher.start(
        ServiceSpec("router-dead", "services.router.main", ROUTER_FAST + flags(decode_workers=dead))
    )
    wait_until(lambda: router.port_file.exists(), what="the router's port file")
    gw = Door(f"127.0.0.1:{json.loads(router.port_file.read_text())['http_port']}", router)
    try:
        assert httpio.request(gw.address, "GET", "/health")[0] == 503
        with pytest.raises(openai.APIStatusError) as info:
            client(gw).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        launcher.stop(router)


def test_client_hanging_up_mid_stream_cancels_at_the_router(mesh):
    before = router_stats(mesh["router"]).requests_cancelled
    free = free_blocks(mesh["decode"])
    body = {"prompt": "cancel me", "max_tokens": 2030, "temperature": 0, "ignore_eos": True, "stream": True}
    sock = httpio.open_request(mesh["gateway"].address, "/v1/completions", body)
    httpio.read_until(sock, b'"text":')  # tokens are flowing
    httpio.hang_up(sock)
    wait_until(lambda: router_stats(mesh["router"]).requests_cancelled > before, what="the router to cancel")
    assert router_stats(mesh["router"]).inflight == 0
    wait_until(lambda: free_blocks(mesh["decode"]) == free, what="the decode worker to free the blocks")


def test_client_hanging_up_before_a_whole_answer_cancels_too(mesh):
    router = mesh["router"]
    before = router_stats(router).requests_cancelled
    free = free_blocks(mesh["decode"])
    body = {"prompt": "cancel me too", "max_tokens": 2030, "temperature": 0, "ignore_eos": True}
    sock = httpio.open_request(mesh["gateway"].address, "/v1/completions", body)
    wait_until(lambda: router_stats(router).inflight >= 1, what="the request to reach the router")
    httpio.hang_up(sock)
    wait_until(lambda: router_stats(router).requests_cancelled > before, what="the router to cancel")
    wait_until(lambda: free_blocks(mesh["decode"]) == free, what="the decode worker to free the blocks")
