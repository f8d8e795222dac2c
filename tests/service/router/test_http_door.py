"""The router's HTTP door (services/router/http_door.py) in-process, on port 0, in front of
the real router and fake decode workers (fakes.py), over a real socket.

What the process-level tests (tests/e2e/test_gateway_e2e.py, test_http_door_e2e.py)
cannot stage: a worker dying mid-stream (the SSE stream is migrated and reads as the
undisturbed one), a stream the client closes while the worker stalls (the decode call
is cancelled), and the door's drain state (503 before the listener closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ssl
import time

from services.common.server import ServerConfig
from services.common.tls import TlsConfig
from services.gateway.app import DisconnectWatch
from services.gateway.protocol import RequestClockProtocol
from services.router import http_door
from services.router.config import HttpDoorConfig
from services.router.generate import RequestFlow
from services.router.http_door import HttpDoor
from tests.service.gateway import httpio
from tests.service.tls_mesh import make_certs
from tests.support.cycles import CycleWatch
from tests.support.poll import eventually

MODEL = "builtin-tiny"


@contextlib.asynccontextmanager
async def door_of(handle):
    door = HttpDoor(
        handle.router, HttpDoorConfig(port=0, request_timeout_s=30), ServerConfig(port=0), TlsConfig()
    )
    await door.start()
    try:
        yield door
    finally:
        await door.stop()


async def post(address: str, body: dict):
    return await asyncio.to_thread(
        httpio.request, address, "POST", "/v1/completions", {"model": MODEL, **body}
    )


def streamed_text(raw: bytes) -> tuple[str, list]:
    events = httpio.sse_events(raw)
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    return text, events


async def test_a_stream_migrated_mid_way_reads_as_the_undisturbed_one(mesh):
    a, b = await mesh.decode("a"), await mesh.decode("b")
    h = await mesh.router([a, b], policy="round_robin")
    async with door_of(h) as door:
        body = {
            "prompt": "migrate me",
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, _, raw = await post(door.address, body)
        want, events = streamed_text(raw)
        assert status == 200 and events[-1] == "[DONE]"
        victim = a if not a.calls else b  # round robin: the worker the first request skipped
        victim.die_after = 5
        status, _, raw = await post(door.address, body)
        assert victim.reached.is_set() and victim.calls
        got, events = streamed_text(raw)
        assert status == 200 and got == want
        assert events[-2]["usage"]["completion_tokens"] == 12
        assert h.router.stats().migrations >= 1


async def test_a_client_closing_its_stream_cancels_the_decode_call(mesh):
    a = await mesh.decode("a")
    a.stall_after = 3
    h = await mesh.router([a])
    async with door_of(h) as door:
        body = {"model": MODEL, "prompt": "stall", "max_tokens": 50, "stream": True}
        sock = await asyncio.to_thread(httpio.open_request, door.address, "/v1/completions", body)
        await asyncio.to_thread(httpio.read_until, sock, b'"text":')
        await asyncio.wait_for(a.reached.wait(), 30)
        httpio.hang_up(sock)
        await asyncio.wait_for(a.cancelled_event.wait(), 30)  # the worker saw its call cancelled
        await eventually(lambda: not h.router.flows, what="the flow to close")
        assert h.router.stats().requests_cancelled == 1


async def test_a_draining_door_answers_503_and_no_worker_is_503_too(mesh):
    a = await mesh.decode("a")
    h = await mesh.router([a])
    async with door_of(h) as door:
        status, _, _ = await asyncio.to_thread(httpio.request, door.address, "GET", "/health")
        assert status == 200
        door.upstream.draining = True  # what SIGTERM sets before the listener closes
        status, _, _ = await asyncio.to_thread(httpio.request, door.address, "GET", "/health")
        assert status == 503
        status, headers, _ = await post(door.address, {"prompt": "x", "max_tokens": 2})
        assert status == 503 and headers["retry-after"] == "1"
        door.upstream.draining = False
        await a.stop()  # no decode worker: the flow's Unavailable is a 503 as well
        await eventually(lambda: h.healthy_decode() == 0, what="the router to see the worker gone")
        status, _, raw = await post(door.address, {"prompt": "x", "max_tokens": 2})
        assert status == 503 and b"service_unavailable_error" in raw


async def test_a_drain_does_not_wait_on_an_idle_https_client_that_keeps_its_socket(mesh, tmp_path):
    # A keep-alive HTTPS client that never reads again never answers the server's TLS
    # close_notify: uvicorn's shutdown waited the whole drain grace for it (30 s here), and
    # `pdmesh up` SIGKILLed the router after its 15 s stop grace.
    certs = make_certs(tmp_path / "certs")
    a = await mesh.decode("a")
    h = await mesh.router([a])
    door = HttpDoor(
        h.router,
        HttpDoorConfig(port=0, request_timeout_s=30),
        ServerConfig(port=0, drain_grace_s=30),
        certs.tls("router", mtls=False),
    )
    await door.start()
    context = ssl.create_default_context(cafile=str(certs.dir / "ca.pem"))
    client = http.client.HTTPSConnection("localhost", door.port, context=context, timeout=60)
    try:
        await asyncio.to_thread(client.request, "GET", "/health")
        resp = await asyncio.to_thread(client.getresponse)
        assert resp.status == 200 and resp.getheader("connection") != "close"
        resp.read()  # the connection stays open, idle, and the client reads no more
        await asyncio.wait_for(door.drain(), timeout=10)  # well inside the grace
        # The door closed the connection itself: the client's socket is at its end.
        client.sock.settimeout(10)
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            assert client.sock.recv(1) == b""
    finally:
        client.close()
        await door.stop()


async def test_a_finished_http_request_leaves_nothing_in_a_cycle(mesh):
    """The door's per-request disconnect watcher ends without keeping its CancelledError
    (a cycle with its frame and task per request, for the garbage collector otherwise)."""
    a = await mesh.decode("a")
    h = await mesh.router([a])
    async with door_of(h) as door:
        await post(door.address, {"prompt": "warm", "max_tokens": 2})
        with CycleWatch() as watch:
            for stream in (True, False, True, False):
                status, _, _ = await post(door.address, {"prompt": "hi", "max_tokens": 4, "stream": stream})
                assert status == 200
            await eventually(lambda: not h.router.flows, what="every flow ended", timeout=30)
            h.router.outliers.evaluate()
    assert watch.left(DisconnectWatch, RequestFlow) == []


async def clock_samples(mesh, monkeypatch, protocol) -> dict[str, float]:
    """One streamed request through a door served with `protocol`; the door's clock samples
    (queue count and sum, TTFT count and sum, request duration sum)."""
    monkeypatch.setattr(http_door, "http_protocol", lambda: protocol)
    a = await mesh.decode("a")
    h = await mesh.router([a])
    async with door_of(h) as door:
        status, _, raw = await post(door.address, {"prompt": "clock", "max_tokens": 2, "stream": True})
        assert status == 200 and httpio.sse_events(raw)[-1] == "[DONE]"
        value = door.gateway.metrics.registry.get_sample_value
        labels = {"endpoint": "/v1/completions"}
        return {
            "queue_count": value("pdmesh_gateway_queue_seconds_count"),
            "queue_sum": value("pdmesh_gateway_queue_seconds_sum"),
            "ttft_count": value("pdmesh_gateway_ttft_seconds_count", labels),
            "ttft_sum": value("pdmesh_gateway_ttft_seconds_sum", labels),
            "request_sum": value("pdmesh_gateway_request_seconds_sum", labels),
        }


async def test_the_ttft_clock_starts_when_the_request_head_is_parsed_not_in_the_handler(mesh, monkeypatch):
    """A request that waits for a busy loop between its parsed head and its handler counts
    the wait in TTFT and in pdmesh_gateway_queue_seconds (the clients see it too)."""
    held_s = 0.3

    class BusyLoop(RequestClockProtocol):
        def on_headers_complete(self) -> None:
            super().on_headers_complete()  # stamps the scope and creates the request's task
            busy_until = time.monotonic() + held_s  # the loop runs other work before that task
            while time.monotonic() < busy_until:  # first runs (running, as measured, not asleep)
                pass

    got = await clock_samples(mesh, monkeypatch, BusyLoop)
    assert got["queue_count"] == 1
    assert got["queue_sum"] >= held_s
    assert got["ttft_sum"] >= held_s
    assert got["request_sum"] >= held_s


async def test_without_the_stamping_protocol_the_clock_starts_in_the_handler(mesh, monkeypatch):
    """uvicorn's h11 implementation (what serves when httptools is missing) stamps nothing:
    the request is served as usual and its clock starts in the handler (no queue wait)."""
    got = await clock_samples(mesh, monkeypatch, "h11")
    assert got["queue_count"] == 1
    assert got["queue_sum"] == 0.0
    assert got["ttft_count"] == 1
