"""The router's end of DecodeService.Link: one stream per decode worker, many requests on it.

`DecodeLink` owns one Link call to one worker. `open(request, timeout)` gives
the request a link-local id, queues its `open` frame and returns a `LinkCall`,
which the attempt (services/router/attempt.py) attaches to: the link's reader
demultiplexes each frame of the worker (the new tokens of every request, then
the requests that ended) straight into the attempts' buffers, with no task
and no gRPC message per request. A writer task sends the queued frames in
order (`open` and `cancel`).

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
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import grpc
import structlog

from pdmesh.v1 import decode_pb2
from services.router.attempt import AttemptError

log = structlog.get_logger()

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Sink(Protocol):
    """What a LinkCall feeds: DecodeAttempt."""

    def push_tokens(self, token_ids: Any) -> None: ...

    def push_final(self, final: decode_pb2.DecodeFinal) -> None: ...

    def push_error(self, error: AttemptError) -> None: ...


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
        self.worker_id = worker_id
        self._generate = generate
        self._on_unimplemented = on_unimplemented
        self._call = open_call()
        self._calls: dict[int, LinkCall] = {}
        self._ending: set[int] = set()  # cancelled by us; their LinkEnd is still to come
        self._ids = itertools.count(1)
        self._out: deque[decode_pb2.DecodeServiceLinkRequest] = deque()
        self._out_ready = asyncio.Event()
        self.broken: str | None = None  # why the link ended; None while it is up
        self._retiring = False
        self._heard = False  # a frame came back on this link
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(), name=f"link-read:{worker_id}")
        self._writer = loop.create_task(self._write(), name=f"link-write:{worker_id}")

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
        self._send(
            decode_pb2.DecodeServiceLinkRequest(
                open=decode_pb2.LinkOpen(link_id=lid, request=request, timeout_s=timeout or 0.0)
            )
        )
        return call

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
        calls, ending = self._calls, self._ending
        why = "the worker ended the link"
        try:
            async for frame in self._call:
                self._heard = True
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
        except LinkBroken as e:
            why = f"the worker broke the link protocol: {e}"
            log.warning("link_malformed", worker=self.worker_id, error=str(e))
            self._call.cancel()
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                self.broken = "the worker does not serve Link"
                self._on_unimplemented()
                self._generate_instead()
                return
            if not self._heard:
                # Nothing came back on this link, so none of its requests has a token: run
                # them as Generate calls (a worker without Link can surface as INTERNAL when
                # the router's writes race its UNIMPLEMENTED; a dead worker fails those too,
                # and they recover as usual).
                self.broken = f"{e.code().name}: {e.details()}"
                self._generate_instead()
                return
            why = f"{e.code().name}: {e.details()}"
        self._break(why)

    def _break(self, why: str) -> None:
        if self.broken is not None:
            return
        self.broken = why
        self._call.cancel()
        self._out_ready.set()
        calls, self._calls = list(self._calls.values()), {}
        if calls:
            log.info("link_broken", worker=self.worker_id, requests=len(calls), reason=why)
        error = AttemptError.from_status(grpc.StatusCode.UNAVAILABLE, f"decode link broke: {why}")
        for call in calls:
            call._fail(error)

    def _generate_instead(self) -> None:
        self._call.cancel()
        calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call._generate_instead(self._generate)
