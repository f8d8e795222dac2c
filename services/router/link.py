"""The router's end of DecodeService.Link: one stream per decode worker, many requests on it.

`DecodeLink` owns one Link call to one worker. `open(request, timeout)` gives
the request a link-local id, queues its `open` frame and returns a `LinkCall`,
which the attempt (services/router/attempt.py) attaches to: the link's reader
demultiplexes each frame of the worker (the requests whose prefill began, the
new tokens of every request, then the requests that ended) straight into the
attempts' buffers, with no task and no gRPC message per request. A writer task
sends the queued frames in order (`open` and `cancel`). With `notify_started`
(set when hedging is on) every open asks the worker to report its request's
start, which a tied hedge races on (services/router/hedge_race.py).

What a per-request call did for free is kept here, per request:
- deadline: a timer per request fails it with DEADLINE_EXCEEDED and cancels
  it on the link (the worker got the same budget in `LinkOpen.timeout_s` and
  ends it too; whichever comes first);
- cancellation: `LinkCall.cancel()` sends a `cancel` frame; the worker aborts
  the request and frees its KV at once;
- failure: when the link breaks (the worker died, the connection dropped, the
  worker refused a frame, or it sent one that breaks the protocol) every
  request still open on it fails with UNAVAILABLE, which is retryable and the
  worker's fault, so each one goes through the usual recovery
  (migration.decide_recovery: retry before the first token, migrate with its
  delivered tokens after it). Only that link is dropped; the next request
  opens a new one.
- a worker that does not serve Link (UNIMPLEMENTED: an older worker, a
  stand-in) is remembered, and the requests that were on the link are started
  again as Generate calls, before any of their tokens was sent. So is every
  request of a link that fails before anything came back on it (no token can
  have been sent): such a worker can surface as INTERNAL when the router's
  writes race its UNIMPLEMENTED.
A slow client cannot stall the link: the reader only appends to the request's
bounded buffer (DecodeAttempt's `max_buffered_tokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf.message import DecodeError

from pdmesh.v1 import decode_pb2
from services.common import link_wire
from services.router.attempt import AttemptError

log = structlog.get_logger()

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Sink(Protocol):
    """What a LinkCall feeds: DecodeAttempt."""

    def push_tokens(self, token_ids: Any) -> None: ...

    def push_final(self, final: decode_pb2.DecodeFinal) -> None: ...

    def push_error(self, error: AttemptError) -> None: ...

    def push_started(self) -> None: ...


class LinkBroken(Exception):
    """The worker broke the Link protocol; the link is dropped."""


class LinkCall:
    """One request on a link, as the attempt sees it (attach, cancel)."""

    def __init__(self, link: DecodeLink, link_id: int, request: Any, timeout: float | None):
        self.link = link
        self.link_id = link_id
        self.request = request
        self.timeout = timeout
        self.sink: Sink | None = None
        self.open = True
        self._fallback: Any = None  # the Generate call, after UNIMPLEMENTED
        self._pump: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        self._opened = loop.time()
        if timeout is not None:
            self._timer = loop.call_later(max(timeout, 0.0), self._expire)

    def attach(self, sink: Sink) -> None:
        self.sink = sink

    def detach(self) -> None:
        """The attempt is done with this call: nothing more goes to it (see DecodeAttempt._release)."""
        self.sink = None

    def cancel(self) -> bool:
        if self._pump is not None:
            self._pump.cancel()
        if self._fallback is not None:
            self._fallback.cancel()
        if not self.open:
            return False
        self._close()
        self.link.cancel(self.link_id)
        return True

    # ---- from the link ---------------------------------------------------------

    def _close(self) -> None:
        self.open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.link.forget(self.link_id)

    def _end(self, end: decode_pb2.LinkEnd) -> None:
        self._close()
        if self.sink is None:
            return
        kind = end.WhichOneof("outcome")
        if kind == "final":
            self.sink.push_final(end.final)
        else:  # "error" (the link checked that one of the two is set)
            code = _CODES.get(end.error.code, grpc.StatusCode.UNKNOWN)
            self.sink.push_error(AttemptError.from_status(code, end.error.message))

    def _fail(self, error: AttemptError) -> None:
        self._close()
        if self.sink is not None:
            self.sink.push_error(error)

    def _expire(self) -> None:
        self._timer = None
        if self.open:
            self.cancel()
            if self.sink is not None:
                self.sink.push_error(
                    AttemptError.from_status(
                        grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"
                    )
                )

    def _generate_instead(self, generate: Callable[[Any, float | None], Any]) -> None:
        """The worker has no Link: run this request as a Generate call (no token was sent yet)."""
        self.open = False
        self.link.forget(self.link_id)
        timeout = self.timeout
        if timeout is not None:
            timeout -= asyncio.get_running_loop().time() - self._opened
        self._fallback = generate(self.request, timeout)
        self._pump = asyncio.get_running_loop().create_task(self._pump_generate())

    async def _pump_generate(self) -> None:
        sink = self.sink
        assert sink is not None
        try:
            async for msg in self._fallback:
                if msg.WhichOneof("chunk") == "tokens":
                    sink.push_tokens(msg.tokens.token_ids)
                else:
                    sink.push_final(msg.final)
                    return
            sink.push_error(
                AttemptError.from_status(
                    grpc.StatusCode.UNKNOWN, "the decode stream ended without a final message"
                )
            )
        except grpc.aio.AioRpcError as e:
            sink.push_error(AttemptError.from_status(e.code(), e.details() or ""))
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


class DecodeLink:
    """One Link call to one decode worker (see the module docstring)."""

    def __init__(
        self,
        worker_id: str,
        open_call: Callable[[], Any],
        generate: Callable[[Any, float | None], Any],
        on_unimplemented: Callable[[], None] = lambda: None,
    ):
        self._setup(worker_id, generate, on_unimplemented)
        self._call = open_call()
        self._out: deque[decode_pb2.DecodeServiceLinkRequest] = deque()
        self._out_ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(), name=f"link-read:{worker_id}")
        self._writer = loop.create_task(self._write(), name=f"link-write:{worker_id}")

    def _setup(
        self,
        worker_id: str,
        generate: Callable[[Any, float | None], Any],
        on_unimplemented: Callable[[], None],
    ) -> None:
        self.worker_id = worker_id
        self._generate = generate
        self._on_unimplemented = on_unimplemented
        self._calls: dict[int, LinkCall] = {}
        self._ending: set[int] = set()  # cancelled by us; their LinkEnd is still to come
        self._ids = itertools.count(1)
        self.broken: str | None = None  # why the link ended; None while it is up
        self._retiring = False
        self._heard = False  # a frame came back on this link
        # Open requests with LinkOpen.notify_started: the worker reports when each one's
        # prefill begins (the hedge's tie, services/router/hedge_race.py).
        self.notify_started = False

    @property
    def alive(self) -> bool:
        return self.broken is None

    @property
    def open_requests(self) -> int:
        return len(self._calls)

    def open(self, request: decode_pb2.DecodeServiceGenerateRequest, timeout: float | None) -> LinkCall:
        lid = next(self._ids)
        call = LinkCall(self, lid, request, timeout)
        self._calls[lid] = call
        self._send_open(lid, request, timeout or 0.0)
        return call

    def _send_open(self, lid: int, request: decode_pb2.DecodeServiceGenerateRequest, timeout: float) -> None:
        self._send(
            decode_pb2.DecodeServiceLinkRequest(
                open=decode_pb2.LinkOpen(
                    link_id=lid, request=request, timeout_s=timeout, notify_started=self.notify_started
                )
            )
        )

    def cancel(self, link_id: int) -> None:
        if self.broken is None:
            self._ending.add(link_id)
            self._send(decode_pb2.DecodeServiceLinkRequest(cancel=decode_pb2.LinkCancel(link_id=link_id)))

    def forget(self, link_id: int) -> None:
        self._calls.pop(link_id, None)
        if self._retiring and not self._calls:
            self._retiring = False
            asyncio.get_running_loop().create_task(self.close())

    def retire(self) -> None:
        """No new requests come (the worker is draining): close once the open ones ended."""
        self._retiring = True
        self.forget(0)

    async def close(self) -> None:
        """End the link now: every request still on it fails over (UNAVAILABLE)."""
        self._break("the router closed the link")
        for task in (self._reader, self._writer):
            task.cancel()
        for task in (self._reader, self._writer):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ---- the two directions ------------------------------------------------------

    def _send(self, frame: decode_pb2.DecodeServiceLinkRequest) -> None:
        self._out.append(frame)
        self._out_ready.set()

    async def _write(self) -> None:
        out = self._out
        try:
            while True:
                await self._out_ready.wait()
                self._out_ready.clear()
                while out:
                    await self._call.write(out.popleft())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call ended: the reader sees its status (UNIMPLEMENTED included)
        except Exception as e:  # a frame that cannot be sent: nothing more would be, so fail over now
            log.error("link_write_failed", worker=self.worker_id, exc_info=e)
            self._break(f"the router could not write to the link ({type(e).__name__})")

    async def _read(self) -> None:
        why = "the worker ended the link"
        try:
            async for frame in self._call:
                self._take(frame)
        except LinkBroken as e:
            why = f"the worker broke the link protocol: {e}"
            log.warning("link_malformed", worker=self.worker_id, error=str(e))
            self._call.cancel()
        except grpc.aio.AioRpcError as e:
            self._ended(e.code(), e.details() or "")
            return
        self._break(why)

    def _take(self, frame: decode_pb2.DecodeServiceLinkResponse) -> None:
        """One frame of the worker: starts, tokens into the requests' buffers, then their ends."""
        self._heard = True
        calls, ending = self._calls, self._ending
        for lid in frame.started:
            call = calls.get(lid)
            if call is not None:
                if call.sink is not None:
                    call.sink.push_started()
            elif lid not in ending:
                raise LinkBroken(f"a start of link_id {lid}, which is not open")
        for t in frame.tokens:
            call = calls.get(t.link_id)
            if call is not None:
                if call.sink is not None:
                    call.sink.push_tokens(t.token_ids)
            elif t.link_id not in ending:
                raise LinkBroken(f"tokens for link_id {t.link_id}, which is not open")
        for e in frame.ends:
            if e.WhichOneof("outcome") is None:
                raise LinkBroken(f"an end of link_id {e.link_id} with neither final nor error")
            call = calls.get(e.link_id)
            if call is not None:
                call._end(e)
            elif e.link_id in ending:
                ending.discard(e.link_id)
            else:
                raise LinkBroken(f"an end for link_id {e.link_id}, which is not open")

    def _ended(self, code: grpc.StatusCode, details: str) -> None:
        """The link ended with a status (not OK)."""
        if code is grpc.StatusCode.UNIMPLEMENTED:
            self.broken = "the worker does not serve Link"
            self._on_unimplemented()
            self._generate_instead()
            return
        if not self._heard:
            # Nothing came back on this link, so none of its requests has a token: run
            # them as Generate calls (a worker without Link can surface as INTERNAL when
            # the router's writes race its UNIMPLEMENTED; a dead worker fails those too,
            # and they recover as usual).
            self.broken = f"{code.name}: {details}"
            self._generate_instead()
            return
        self._break(f"{code.name}: {details}")

    def _break(self, why: str) -> None:
        if self.broken is not None:
            return
        self.broken = why
        self._stop()
        calls, self._calls = list(self._calls.values()), {}
        if calls:
            log.info("link_broken", worker=self.worker_id, requests=len(calls), reason=why)
        error = AttemptError.from_status(grpc.StatusCode.UNAVAILABLE, f"decode link broke: {why}")
        for call in calls:
            call._fail(error)

    def _generate_instead(self) -> None:
        self._stop()
        calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call._generate_instead(self._generate)

    def _stop(self) -> None:
        """End the transport (the worker sees the call cancelled; its requests' KV is freed)."""
        self._call.cancel()
        self._out_ready.set()


class RawDecodeLink(DecodeLink):
    """The same link on the worker's raw link port (services/decode/link_server.py).

    Everything per request is DecodeLink's; only the transport differs, and it
    costs no task and no awaited write: `open` and `cancel` write their frame
    into the connection at once (frames written before the connection is up
    wait in a list and go in order when it is), and the protocol's callback
    hands each frame of the worker to `_take` as it is parsed. Where gRPC ends
    a call with a status the worker's last frame carries it; a connection that
    closes without one broke (UNAVAILABLE). A connection that cannot be made in
    `connect_timeout_s` (no listener, a TLS failure) fails like a link on
    which nothing came back: its requests run as Generate calls, and
    `on_connect_failed` lets the caller use gRPC for a while.
    """

    def __init__(
        self,
        worker_id: str,
        host: str,
        port: int,
        generate: Callable[[Any, float | None], Any],
        ssl_context: Any = None,
        server_hostname: str | None = None,
        on_connect_failed: Callable[[str], None] = lambda why: None,
        max_frame_bytes: int = 64 * 1024 * 1024,
        connect_timeout_s: float = 5.0,
    ):
        self._setup(worker_id, generate, lambda: None)
        self._transport: Any = None
        self._early: list[bytes] = []  # frames before the connection is up
        self._frames = link_wire.FrameBuffer(max_frame_bytes)
        self._backlog: deque[bytes] = deque()  # frames read, not yet taken (_next_frame)
        self._paused = False
        self._on_connect_failed = on_connect_failed
        self._connect = asyncio.get_running_loop().create_task(
            self._dial(host, port, ssl_context, server_hostname, connect_timeout_s),
            name=f"link-dial:{worker_id}",
        )

    async def _dial(
        self, host: str, port: int, ssl_context: Any, server_hostname: str | None, timeout: float
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport, _ = await loop.create_connection(
                    lambda: _RawLinkProtocol(self),
                    host,
                    port,
                    ssl=ssl_context,
                    server_hostname=server_hostname if ssl_context is not None else None,
                )
        except (OSError, TimeoutError, ssl.SSLError) as e:
            why = f"raw link to {host}:{port} failed: {type(e).__name__}: {e}"
            log.warning("link_connect_failed", worker=self.worker_id, error=why)
            self._on_connect_failed(why)
            self._ended(grpc.StatusCode.UNAVAILABLE, why)
            return
        if self.broken is not None:  # closed while connecting
            transport.abort()
            return
        self._transport = transport
        log.info("link_connected", worker=self.worker_id, transport="raw", tls=ssl_context is not None)
        early, self._early = self._early, []
        if early:
            transport.write(b"".join(early))

    def _send(self, frame: decode_pb2.DecodeServiceLinkRequest) -> None:
        self._put(link_wire.encode(frame))

    def _send_open(self, lid: int, request: decode_pb2.DecodeServiceGenerateRequest, timeout: float) -> None:
        self._put(link_wire.encode_open(lid, request.SerializeToString(), timeout, self.notify_started))

    def _put(self, data: bytes) -> None:
        if self.broken is not None:
            return
        if self._transport is not None:
            self._transport.write(data)
        else:
            self._early.append(data)

    def _stop(self) -> None:
        self._connect.cancel()
        if self._transport is not None:
            self._transport.abort()  # the worker sees the connection drop: it cancels the requests

    async def close(self) -> None:
        self._break("the router closed the link")
        with contextlib.suppress(asyncio.CancelledError):
            await self._connect

    # ---- from the protocol --------------------------------------------------------

    def _received(self, data: bytes) -> None:
        if self.broken is not None:
            return
        try:
            self._backlog.extend(self._frames.feed(data))
        except link_wire.FrameTooLarge as e:
            self._malformed(e)
            return
        if not self._paused:
            self._next_frame()

    def _next_frame(self) -> None:
        """Take one frame; the rest of a burst one per loop turn, reading paused meanwhile.

        Over gRPC the reader task took one frame per wake-up, and the stream's flow
        control held the worker back while the router was behind. Here one read can
        carry hundreds of frames: taken at once they would wake every flow with
        tokens faster than its client drains them. So between two frames the flows
        woken by the first run, and the socket is not read until the backlog is
        gone: a router that is behind holds the worker back through TCP (its writes
        wait, and its session puts the tokens of every request into the next frame).
        No request waits for another's client: the buffers are per request."""
        backlog = self._backlog
        if self.broken is not None or not backlog:
            return
        try:
            frame = decode_pb2.DecodeServiceLinkResponse.FromString(backlog.popleft())
            if (
                frame.tokens or frame.ends or frame.started
            ):  # a status alone is not "heard" (a refused link's)
                self._take(frame)
            if frame.HasField("status"):
                self._status(frame.status)
                return
        except (LinkBroken, DecodeError) as e:
            self._malformed(e)
            return
        transport = self._transport
        if backlog:
            if not self._paused and transport is not None:
                transport.pause_reading()
            self._paused = True
            asyncio.get_running_loop().call_soon(self._next_frame)
        elif self._paused:
            self._paused = False
            if transport is not None and self.broken is None:
                transport.resume_reading()

    def _malformed(self, e: Exception) -> None:
        log.warning("link_malformed", worker=self.worker_id, error=str(e))
        self._break(f"the worker broke the link protocol: {e}")

    def _status(self, status: decode_pb2.LinkStatus) -> None:
        code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
        if code is grpc.StatusCode.OK:
            self._break("the worker ended the link")
        else:
            self._ended(code, status.message)
        if self._transport is not None:
            self._transport.close()

    def _lost(self, exc: Exception | None) -> None:
        if self.broken is None:
            self._ended(grpc.StatusCode.UNAVAILABLE, f"the link's connection closed ({exc or 'EOF'})")


class _RawLinkProtocol(asyncio.Protocol):
    def __init__(self, link: RawDecodeLink):
        self.link = link

    def data_received(self, data: bytes) -> None:
        self.link._received(data)

    def eof_received(self) -> bool:
        return False  # close; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._lost(exc)
