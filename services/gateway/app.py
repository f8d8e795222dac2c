"""The gateway's ASGI app: routes, the request lifecycle, disconnect handling.

Flow of a generation request: read the body (bounded), parse it into a
`GenerationPlan`, open one Generate stream to the router, and wait for its first
message *before* answering, so that a refusal (shed, bad argument, router down)
still becomes an HTTP status (429/400/503) even for `stream: true`. Then the
answer is either collected into one JSON body or relayed as SSE chunks.

The client's `Authorization: Bearer <key>` header goes to the router as gRPC
metadata; the router authenticates the key and maps it to a tenant (401 on
UNAUTHENTICATED, 429 when that tenant is over quota). A request's place in an
agent workflow comes in headers (X-Workflow-Id / -Step / -Tokens-Spent /
-Final, or Dynamo's X-Dynamo-Session-ID / -Final; params.workflow_from_headers)
and goes to the router as the request's WorkflowContext; a malformed one is a 400.

While the answer is being produced the gateway watches the ASGI `receive`
channel; when the client disconnects the upstream gRPC call is cancelled (the
router then aborts the request on its workers and frees their KV).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from services.common.metrics import add_process_metrics
from services.common.tls import TlsConfig
from services.gateway import responses as R
from services.gateway.chat_template import ChatTemplate, load_chat_template
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError
from services.gateway.metrics import GatewayMetrics
from services.gateway.params import GenerationPlan, parse_chat, parse_completion, workflow_from_headers
from services.gateway.protocol import RECEIVED_AT
from services.gateway.upstream import RouterClient, Upstream, UpstreamStream

log = structlog.get_logger()
T = TypeVar("T")

# Status recorded for a request whose client went away (nginx's convention).
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was complete."""


class DisconnectWatch:
    """Watches one request's client for `http.disconnect` while the work runs in the
    request's own task.

    `run(work)` awaits `work` in the calling task; if the client disconnects meanwhile,
    the watcher cancels that task (the work unwinds: the flow is cancelled, the worker frees
    the request's blocks) and `run` raises ClientGone. A disconnect between two `run`s is
    remembered and the next `run` raises at once. One watcher task per request and no task
    per await: the first token and every SSE event used to cross two tasks and an
    `asyncio.wait` each (loop turns that queued behind a burst's other requests). Start it
    after the body is read (the watcher reads the rest of the request's messages); `close()`
    before the last response message is sent, since `receive` reports a disconnect once
    the response is complete."""

    def __init__(self, receive: Receive):
        self.gone = False
        self._task = asyncio.current_task()
        self._running = False
        self._closed = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:
            # `close()`: end quietly. A watcher that ended *with* the CancelledError would
            # keep it, its traceback and this frame (self, and so the task) in a cycle: one
            # per request for the garbage collector, whose collections of them paused the
            # router's loop for ~14 ms every few hundred requests (issue 16's tail).
            return
        if self._closed:
            return
        self.gone = True
        if self._running and self._task is not None:
            self._task.cancel()

    async def run(self, work: Awaitable[T]) -> T:
        if self.gone:
            _discard(work)
            raise ClientGone()
        self._running = True
        try:
            return await work
        except asyncio.CancelledError:
            if self.gone and self._task is not None and self._task.uncancel() == 0:
                raise ClientGone() from None
            raise
        finally:
            self._running = False

    def close(self) -> None:
        self._closed = True
        self._watcher.cancel()


def _discard(work: Awaitable[Any]) -> None:
    close = getattr(work, "close", None)
    if close is not None:  # a coroutine never awaited: no "never awaited" warning
        close()


@dataclass
class Outcome:
    """What one generation request did, for its log line and metrics."""

    plan: GenerationPlan
    endpoint: str
    start: float
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    error: str | None = None


class EventStream(Response):
    """SSE relay of an async byte iterator; `on_close` runs however it ends."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[bool], None],
        headers: dict[str, str],
        watch: DisconnectWatch,
    ):
        # No body attribute: init_headers must not declare a Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self._events = events
        self._on_close = on_close
        self._watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self._watch
        # The server's own send for the events: starlette's wrappers around `send` only note
        # that the response started (the start message below goes through them), and cost
        # three Python calls per streamed token.
        body_send = scope.get(RAW_SEND, send)

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data in self._events:
                await body_send({"type": "http.response.body", "body": data, "more_body": True})
            watch.close()  # the last message completes the response: no disconnect after it
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        gone = False
        try:
            # The events flow in a task of their own: a task's every wake-up re-enters each
            # coroutine it awaits through, and this one's chain (uvicorn's run_asgi,
            # starlette's routing and middleware, this call) cost ~9 Python calls per
            # streamed token (BENCHMARKS.md, session 14). The request's task awaits it once;
            # a disconnect cancels the request's task, and so the awaited one.
            await watch.run(asyncio.get_running_loop().create_task(pump()))
        except (ClientGone, OSError):
            gone = True
        finally:
            watch.close()
            try:
                await self._events.aclose()  # type: ignore[attr-defined]
            except Exception:  # closing the relay must not lose the log line below; say why
                log.warning("event_stream_close_failed", exc_info=True)
            self._on_close(gone)


RAW_SEND = "pdmesh.raw_send"  # scope key: the ASGI server's send, under starlette's wrappers


class _App(Starlette):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


class Gateway:
    """Owns the router client, the chat template and the metrics of one gateway."""

    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics | None = None,
        template: ChatTemplate | None = None,
        tls: TlsConfig | None = None,
        upstream: Upstream | None = None,
    ):
        self.config = config
        self.tls = tls
        self.metrics = metrics or GatewayMetrics()
        self.template = template if template is not None else load_chat_template(config.model_path)
        self.client: Upstream | None = None
        # The router process passes its request flow here (services/router/http_door.py):
        # then there is no gRPC hop; without it the app reaches a router over gRPC.
        self._upstream = upstream
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        cfg = self.config
        if self._upstream is not None:
            self.client = self._upstream
        else:
            self.client = RouterClient(
                cfg.router_address, cfg.request_timeout_s, cfg.health_timeout_s, self.tls
            )
        log.info(
            "gateway_started",
            router="in-process" if self._upstream is not None else cfg.router_address,
            model=cfg.model_id,
            chat_template=self.template.name,
        )
        try:
            yield
        finally:
            await self.client.close()

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ]
        handlers = {GatewayError: _error_response, HTTPException: _http_error}
        return _App(routes=routes, lifespan=self.lifespan, exception_handlers=handlers)  # type: ignore[arg-type]

    # ---- plain endpoints -------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        assert self.client is not None
        ready, status = await self.client.ready()
        body = {"status": "ok" if ready else "unavailable", "router": status}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def prometheus(self, request: Request) -> Response:
        registry = add_process_metrics(self.metrics.registry)  # process_*/python_* too
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        model = {"id": self.config.model_id, "object": "model", "created": self.created, "owned_by": "pdmesh"}
        return JSONResponse({"object": "list", "data": [model]})

    # ---- generation -------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, kind: str) -> Response:
        now = time.monotonic()
        # The clock starts when the server parsed the request's head, not here: the wait
        # for the loop in between is part of what the client sees.
        start = request.scope.get(RECEIVED_AT, now)
        self.metrics.queue.observe(now - start)
        endpoint = request.url.path
        try:
            raw = await self._read_body(request)
            if kind == "chat":
                plan = parse_chat(raw, self.config.model_id, self.template)
            else:
                plan = parse_completion(raw, self.config.model_id)
            credentials = forwarded_authorization(request)
            workflow = workflow_from_headers(request.headers)
            if workflow is not None:
                plan = dataclasses.replace(plan, workflow=workflow)
        except GatewayError as e:
            self.metrics.finished(endpoint, e.status, time.monotonic() - start)
            log.info("request_refused", endpoint=endpoint, status=e.status, error=e.message)
            return _error_response(request, e)
        out = Outcome(plan, endpoint, start)
        assert self.client is not None
        upstream = self.client.generate(plan, credentials)
        self.metrics.inflight.inc()
        watch = DisconnectWatch(request.receive)
        try:
            first = await watch.run(_next(upstream))
            self._first_token(out, first)
            # Known before the final message, so a stream the client closes logs it too.
            out.prompt_tokens = await watch.run(upstream.prompt_tokens()) or 0
            if plan.stream:
                streaming = EventStream(
                    self._events(out, upstream, first),
                    on_close=lambda gone: self._close(out, upstream, gone),
                    headers={"x-request-id": plan.request_id},
                    watch=watch,
                )
                watch = None  # the stream closes it
                return streaming
            text, final = await watch.run(self._collect(out, upstream, first))
        except ClientGone:
            self._close(out, upstream, gone=True)
            return Response(status_code=CLIENT_CLOSED)
        except GatewayError as e:
            out.status, out.error = e.status, e.message
            self._close(out, upstream, gone=False)
            return _error_response(request, e)
        finally:
            if watch is not None:
                watch.close()
        body = R.full_body(plan, int(time.time()), text, final)
        self._close(out, upstream, gone=False)
        return JSONResponse(body, headers={"x-request-id": plan.request_id})

    async def _read_body(self, request: Request) -> bytes:
        limit, parts, size = self.config.max_body_bytes, [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise GatewayError(413, f"the request body is larger than {limit} bytes")
            parts.append(part)
        return b"".join(parts)

    def _first_token(self, out: Outcome, msg: Any) -> None:
        if out.first_token_at is None and msg.HasField("delta"):
            out.first_token_at = time.monotonic()
            self.metrics.ttft.labels(out.endpoint).observe(out.first_token_at - out.start)

    def _final(self, out: Outcome, final: Any) -> None:
        out.prompt_tokens = final.usage.prompt_tokens
        out.completion_tokens = final.usage.completion_tokens
        out.finish_reason = R.finish_reason(final.finish_reason)
        self.metrics.count_tokens(out.prompt_tokens, out.completion_tokens)

    async def _collect(self, out: Outcome, upstream: UpstreamStream, first: Any) -> tuple[str, Any]:
        texts: list[str] = []
        msg = first
        while not msg.HasField("final"):
            texts.append(msg.delta.text)
            out.completion_tokens += len(msg.delta.token_ids)
            msg = await _next(upstream)
            self._first_token(out, msg)
        self._final(out, msg.final)
        return "".join(texts), msg.final

    async def _events(self, out: Outcome, upstream: UpstreamStream, first: Any) -> AsyncIterator[bytes]:
        plan, created = out.plan, int(time.time())
        if plan.kind == "chat":
            yield R.sse(R.chunk(plan, created, "", first=True))
        msg = first
        done = 0  # tokens streamed so far
        # Pre-encoded templates: only the text (and the running count) is encoded per event.
        text_event = None if plan.continuous_usage else R.TextEvents(plan, created).event
        counted_event = R.CountedTextEvents(plan, created).event if plan.continuous_usage else None
        try:
            while not msg.HasField("final"):
                delta = msg.delta
                done += len(delta.token_ids)
                out.completion_tokens = done  # the log's count if the client hangs up
                if delta.text:
                    if text_event is not None:
                        yield text_event(delta.text)
                    else:
                        yield counted_event(delta.text, done)  # type: ignore[misc]
                elif counted_event is not None and delta.token_ids:  # tokens without text yet still count
                    yield counted_event("", done)
                try:  # `_next` inlined: one coroutine frame less per streamed token
                    msg = await upstream.__anext__()
                except StopAsyncIteration:
                    raise _ended_early() from None
                if out.first_token_at is None:
                    self._first_token(out, msg)
            self._final(out, msg.final)
            yield R.sse(R.chunk(plan, created, None, out.finish_reason, completion_tokens=done))
            if plan.include_usage:
                yield R.sse(R.usage_chunk(plan, created, msg.final.usage))
        except GatewayError as e:  # after the first token the status line is sent: report in-band
            out.error = e.message
            yield R.sse(e.body())
        yield R.DONE

    def _close(self, out: Outcome, upstream: UpstreamStream, gone: bool) -> None:
        cancelled = upstream.cancel()
        if gone:
            out.status = CLIENT_CLOSED
            self.metrics.disconnects.inc()
        self.metrics.inflight.dec()
        elapsed = time.monotonic() - out.start
        self.metrics.finished(out.endpoint, out.status, elapsed)
        log.info(
            "request",
            request_id=out.plan.request_id,
            endpoint=out.endpoint,
            status=out.status,
            stream=out.plan.stream,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            finish_reason=out.finish_reason,
            ttft_ms=round((out.first_token_at - out.start) * 1000, 2) if out.first_token_at else None,
            duration_ms=round(elapsed * 1000, 2),
            upstream_cancelled=cancelled,
            error=out.error,
        )


def forwarded_authorization(request: Request) -> tuple[tuple[str, str], ...]:
    """The client's Authorization header as gRPC metadata: the router checks the API key
    (one place holds the keys; its UNAUTHENTICATED comes back as a 401)."""
    out: tuple[tuple[str, str], ...] = ()
    value = request.headers.get("authorization")
    if value is not None:
        if not (value.isascii() and value.isprintable()) or len(value) > 1024:
            raise GatewayError(401, "malformed Authorization header", "authentication_error")
        out = (("authorization", value),)
    # Issue 18: a client's retry with the same Idempotency-Key joins the running request
    # (services/router/retries.py checks the value).
    key = request.headers.get("idempotency-key")
    if key is not None and key.isascii() and key.isprintable() and len(key) <= 255:
        out += (("idempotency-key", key),)
    return out


async def _next(upstream: UpstreamStream) -> Any:
    try:
        return await upstream.__anext__()
    except StopAsyncIteration:
        raise _ended_early() from None


def _ended_early() -> GatewayError:
    return GatewayError(502, "the router ended the stream without a final message", "upstream_error")


def _error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = GatewayError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=dict(exc.headers or {}))


def create_app(
    config: GatewayConfig, metrics: GatewayMetrics | None = None, tls: TlsConfig | None = None
) -> Starlette:
    return Gateway(config, metrics, tls=tls).app()
