"""The HTTP door's streams when the client misbehaves, over a real link to a real worker.

Real parts: decode workers are the real DecodeServicer on the sim engine over a
real link (tests/service/router/test_link.py's SimDecode, gRPC Link and the raw
link port), the router and its HTTP door (uvicorn) in-process on port 0, clients
on real sockets. Every test checks the worker's pool is back to its free count.

- a client that stops reading (issue 16's fault): its socket backs up, the
  request's buffer fills and the request is cancelled on the worker
  (RESOURCE_EXHAUSTED, reported in-band when the client reads again), while
  another stream on the same link finishes whole;
- a client that hangs up mid-stream cancels its request on the worker.
"""

from __future__ import annotations

import asyncio
import socket

from tests.service.gateway import httpio
from tests.service.router.test_http_door import door_of, post, streamed_text
from tests.service.router.test_link import sims  # noqa: F401  (fixture)
from tests.support.poll import eventually


def _read_to_end(sock: socket.socket) -> bytes:
    """The rest of a chunked response, to its last (empty) chunk or the connection's end."""
    buf = b""
    while not buf.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


async def test_a_client_that_stops_reading_is_cut_off_and_the_other_stream_finishes(mesh, sims):  # noqa: F811
    w = await sims("d0")
    h = await mesh.router(decode=[w], max_buffered_tokens=64)
    free = w.free()
    async with door_of(h) as door:
        body = {"model": "builtin-tiny", "prompt": "a slow reader", "max_tokens": 2000, "stream": True}
        # A small receive buffer: a client that stops reading backs the server up quickly.
        slow = await asyncio.to_thread(httpio.open_request, door.address, "/v1/completions", body, 4096)
        try:
            await asyncio.to_thread(httpio.read_until, slow, b'"text":')  # under way, then not read
            # The server's side of the socket with a small send buffer too (no autotuning up to
            # megabytes on loopback): the door's writes back up within a few hundred tokens.
            for conn in list(door._server.server_state.connections):
                conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            status, _, raw = await post(
                door.address, {"prompt": "a fast reader", "max_tokens": 300, "stream": True}
            )
            text, events = streamed_text(raw)
            assert status == 200 and events[-1] == "[DONE]" and len(text) > 0
            # Cut off on the worker while its client still reads nothing: the router holds at
            # most 64 of its tokens, the worker none.
            await eventually(lambda: w.running() == 0, what="its request cut off on the worker", timeout=60)
            await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)
            (flow,) = h.router.flows.values()
            assert flow._attempt is None or len(flow._attempt._tokens) <= 64
            rest = await asyncio.to_thread(_read_to_end, slow)  # the client reads again
        finally:
            slow.close()
    # What it had not read ends with the error, in-band (the status line went out long ago).
    assert b"stopped reading" in rest and b"limit 64" in rest, rest[-400:]
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    await eventually(lambda: not h.router.flows, what="the flow to close", timeout=30)
    assert h.router.stats().requests_failed == 1
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_a_client_hanging_up_mid_stream_cancels_its_request_on_the_worker(mesh, sims):  # noqa: F811
    w = await sims("d0")
    h = await mesh.router(decode=[w])
    free = w.free()
    async with door_of(h) as door:
        body = {"model": "builtin-tiny", "prompt": "hang up", "max_tokens": 2000, "stream": True}
        sock = await asyncio.to_thread(httpio.open_request, door.address, "/v1/completions", body)
        buf = await asyncio.to_thread(httpio.read_until, sock, b'"text":')
        while buf.count(b'"text":') < 50:  # well into the stream
            buf += await asyncio.to_thread(sock.recv, 65536)
        httpio.hang_up(sock)
        await eventually(lambda: not h.router.flows, what="the flow to close", timeout=30)
        await eventually(lambda: w.running() == 0, what="the request ended on the worker", timeout=30)
    assert h.router.stats().requests_cancelled == 1
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)
