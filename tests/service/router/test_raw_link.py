"""The raw token link (services/decode/link_server.py, services/router/link.py
`RawDecodeLink`): what differs from Link over gRPC. The request-level behaviour
(migration on a dead worker, a client that stops reading, cancel, drain) runs
over both transports in test_link.py.

Real parts: real sim decode workers on loopback port 0 serving both gRPC and
the raw link port, real TCP and TLS connections; the one stand-in is a worker
that breaks the protocol, which is the point of its test. Every test checks the
pool is back to its free count.
"""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest

from pdmesh.v1 import decode_pb2
from services.common import link_wire
from services.decode.link_server import LinkServer
from services.router.link import DecodeLink, RawDecodeLink
from tests.service.router.test_link import (
    SimDecode,
    Sink,
    greedy,
    links_of,
    only_the_bad_link_breaks,
    prompt,
    run_flow,
)
from tests.service.tls_mesh import foreign_client, make_certs
from tests.support.poll import eventually


@pytest.fixture
async def sims():
    made: list[SimDecode] = []

    async def make(worker_id: str, **kw) -> SimDecode:
        w = await SimDecode(worker_id, raw=True, **kw).start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.close()


def _open(link_id: int, rid: str, max_tokens: int = 5_000, p=None) -> decode_pb2.DecodeServiceLinkRequest:
    return decode_pb2.DecodeServiceLinkRequest(
        open=decode_pb2.LinkOpen(
            link_id=link_id,
            request=decode_pb2.DecodeServiceGenerateRequest(
                request_id=rid,
                prompt_token_ids=prompt(link_id) if p is None else p,
                sampling=greedy(max_tokens),
            ),
        )
    )


class RawClient:
    """A bare client of the raw link port: frames out, frames in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int, **kw) -> RawClient:
        return cls(*await asyncio.open_connection("127.0.0.1", port, **kw))

    def send(self, frame) -> None:
        self.writer.write(link_wire.encode(frame))

    async def read(self) -> decode_pb2.DecodeServiceLinkResponse | None:
        """The next frame; None at EOF."""
        try:
            (size,) = struct.unpack(">I", await self.reader.readexactly(4))
            return decode_pb2.DecodeServiceLinkResponse.FromString(await self.reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None

    async def status(self) -> tuple[decode_pb2.LinkStatus, bool]:
        """Read until the status frame; (it, whether the connection closed right after it)."""
        while True:
            frame = await asyncio.wait_for(self.read(), 30)
            assert frame is not None, "the connection closed with no status frame"
            if frame.HasField("status"):
                return frame.status, await asyncio.wait_for(self.read(), 30) is None

    def close(self) -> None:
        self.writer.close()


async def test_the_worker_ends_only_a_raw_link_with_a_malformed_frame(sims):
    w = await sims("d0")
    free = w.free()
    port = w.link_server.port
    good = await RawClient.connect(port)
    try:
        good.send(_open(1, "g"))
        frame = await asyncio.wait_for(good.read(), 30)
        assert frame.tokens[0].link_id == 1
        for bad in (
            struct.pack(">I", 1 << 30),  # a length far above the limit
            struct.pack(">I", 3) + b"\xff\xff\xff",  # bytes that do not parse
            struct.pack(">I", 0),  # an empty frame: neither open nor cancel
            link_wire.encode(decode_pb2.DecodeServiceLinkRequest(open=decode_pb2.LinkOpen(link_id=0))),
            link_wire.encode(_open(7, "m")) * 2,  # an id already open
        ):
            c = await RawClient.connect(port)
            try:
                c.writer.write(bad)
                status, closed = await c.status()
                assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], status
                assert closed
            finally:
                c.close()
        # A bad request (not a bad frame) ends only that request, with its status.
        good.send(
            decode_pb2.DecodeServiceLinkRequest(
                open=decode_pb2.LinkOpen(
                    link_id=2,
                    request=decode_pb2.DecodeServiceGenerateRequest(request_id="e", sampling=greedy(4)),
                )
            )
        )
        while True:
            frame = await asyncio.wait_for(good.read(), 30)
            ends = [e for e in frame.ends if e.link_id == 2]
            if ends:
                break
        assert ends[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        frame = await asyncio.wait_for(good.read(), 30)
        assert sum(len(t.token_ids) for t in frame.tokens if t.link_id == 1) >= 1  # streams on
        good.send(decode_pb2.DecodeServiceLinkRequest(cancel=decode_pb2.LinkCancel(link_id=1)))
        while True:
            frame = await asyncio.wait_for(good.read(), 30)
            assert frame is not None
            ends = [e for e in frame.ends if e.link_id == 1]
            if ends:
                break
        assert ends[0].error.code == grpc.StatusCode.CANCELLED.value[0]
    finally:
        good.close()
    await eventually(
        lambda: w.free() == free and w.running() == 0, what="the pool back to its free count", timeout=30
    )
    await eventually(lambda: w.rt.server.inflight == 0, what="every link's session ended", timeout=30)


async def test_a_dropped_connection_cancels_its_requests_on_the_worker(sims):
    w = await sims("d0", speedup=5.0)
    free = w.free()
    c = await RawClient.connect(w.link_server.port)
    c.send(_open(1, "a"))
    c.send(_open(2, "b"))
    await asyncio.wait_for(c.read(), 30)
    await eventually(lambda: w.running() == 2, what="both running", timeout=30)
    c.writer.transport.abort()
    await eventually(lambda: w.free() == free and w.running() == 0, what="their KV freed", timeout=30)
    assert w.rt.server.inflight == 0


class BadRawWorker:
    """A STAND-IN raw link port that breaks the protocol: an end for an id it was never given."""

    async def start(self) -> int:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.readexactly(4)
                writer.write(
                    link_wire.encode(
                        decode_pb2.DecodeServiceLinkResponse(
                            ends=[decode_pb2.LinkEnd(link_id=999, error=decode_pb2.LinkStatus(code=2))]
                        )
                    )
                )
                await reader.read()  # until the router drops it
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


def _no_generate(request, timeout):
    raise AssertionError("this link should not fall back to Generate")


async def test_the_router_drops_only_the_raw_link_whose_worker_broke_the_protocol(sims):
    w = await sims("d0")
    free = w.free()
    bad_worker = BadRawWorker()
    bad_port = await bad_worker.start()
    links = [
        RawDecodeLink("bad", "127.0.0.1", bad_port, _no_generate),
        RawDecodeLink("good", "127.0.0.1", w.link_server.port, _no_generate),
    ]
    try:
        await only_the_bad_link_breaks(*links)
    finally:
        for link in links:
            await link.close()
        bad_worker.server.close()
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_a_raw_link_port_that_refuses_falls_back_to_grpc(mesh, sims):
    w = await sims("d0")
    free = w.free()
    # The worker offers a port nobody listens on (closed after binding it).
    probe = await asyncio.start_server(lambda r, wr: None, "127.0.0.1", 0)
    dead = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    w.servicer.info.link_port = dead
    h = await mesh.router(decode=[w])
    toks, final = await run_flow(h.router, "r0", prompt(1), 30)  # its first link fails to connect
    assert len(toks) == 30 and final.migrations == 0
    toks, final = await run_flow(h.router, "r1", prompt(2), 30)
    assert len(toks) == 30
    link = links_of(h.router)["d0"]
    assert type(link) is DecodeLink and link.alive  # gRPC for a while, not a connect per request
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_a_draining_worker_refuses_new_raw_links(sims):
    w = await sims("d0")
    w.rt.server._gate.draining = True  # the state drain() puts the gate in, without stopping
    try:
        c = await RawClient.connect(w.link_server.port)
        try:
            status, closed = await c.status()
        finally:
            c.close()
        assert status.code == grpc.StatusCode.UNAVAILABLE.value[0] and "draining" in status.message
        assert closed and w.rt.server.inflight == 0
        # The router's side: nothing came back on that link but its refusal, so its request
        # runs as a Generate call (which the drain answers as it would any), not failed here.
        sent = []

        async def generate_stub():
            yield decode_pb2.DecodeServiceGenerateResponse(final=decode_pb2.DecodeFinal())

        def generate(request, timeout):
            sent.append(request.request_id)
            return generate_stub()

        link = RawDecodeLink("d0", "127.0.0.1", w.link_server.port, generate)
        sink = Sink()
        req = decode_pb2.DecodeServiceGenerateRequest(
            request_id="late", prompt_token_ids=prompt(1), sampling=greedy(3)
        )
        link.open(req, 30).attach(sink)
        await asyncio.wait_for(sink.done.wait(), 30)
        assert sent == ["late"] and sink.error is None and sink.final is not None
        await link.close()
    finally:
        w.rt.server._gate.draining = False


# ---- TLS --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


async def _tls_link_server(w: SimDecode, tls) -> LinkServer:
    server = LinkServer(w.servicer.link_session, w.rt.server, "127.0.0.1", 0, tls=tls)
    await server.start()
    w.rt.on_shutdown.append(server.close)
    return server


async def test_over_mtls_only_a_router_certificate_may_open_a_raw_link(sims, certs, tmp_path):
    w = await sims("d0")
    free = w.free()
    server = await _tls_link_server(w, certs.tls("decode"))
    req = decode_pb2.DecodeServiceGenerateRequest(
        request_id="t", prompt_token_ids=prompt(3), sampling=greedy(12)
    )

    # The router's certificate: served, over TLS.
    link = RawDecodeLink(
        "d0",
        "127.0.0.1",
        server.port,
        _no_generate,
        ssl_context=link_wire.client_context(certs.tls("router")),
        server_hostname="localhost",
    )
    s = Sink()
    link.open(req, 30).attach(s)
    await asyncio.wait_for(s.done.wait(), 30)
    assert s.final is not None and len(s.tokens) == 12
    await link.close()

    # A decode worker's certificate (a mesh role that may not call Link): refused.
    c = await RawClient.connect(
        server.port, ssl=link_wire.client_context(certs.tls("decode")), server_hostname="localhost"
    )
    try:
        c.send(_open(1, "x"))
        status, closed = await c.status()
    finally:
        c.close()
    assert status.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "'decode'" in status.message
    assert closed

    # No certificate, or one of another CA: the handshake fails; plaintext gets nothing back.
    for client in (certs.ca_only(), foreign_client(tmp_path / "other", certs)):
        with pytest.raises((OSError, asyncio.IncompleteReadError)):
            c = await RawClient.connect(
                server.port, ssl=link_wire.client_context(client), server_hostname="localhost"
            )
            try:
                c.send(_open(1, "y"))
                await c.reader.readexactly(4)
            finally:
                c.close()
    plain = await RawClient.connect(server.port)
    try:
        plain.send(_open(1, "z"))
        assert await asyncio.wait_for(plain.read(), 30) is None
    finally:
        plain.close()
    assert w.running() == 0
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)
