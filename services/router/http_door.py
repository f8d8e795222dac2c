"""The router's OpenAI-compatible HTTP door: the gateway's app in the router process.

The gateway's code (services/gateway: bodies, parameters, chat template, SSE,
error objects, metrics) serves HTTP here on the router's own event loop, under
uvicorn, and reaches the request flow in-process through `FlowUpstream`: the
same `Generation` the gRPC servicer runs (API key, validation, tenant scoping,
detokenization, stop strings), with no gRPC hop between door and flow.

- Errors: a flow's `MeshError` becomes the HTTP error its gRPC status maps to
  (services/gateway/errors.py `from_grpc`, the one map), retry hints included.
- A client that goes away: the app calls `cancel()`, which cancels the flow
  (the decode call is cancelled, the worker frees the request's blocks).
- Drain (SIGTERM): `/health` answers 503 at once, new generation requests get
  503, uvicorn stops accepting and lets in-flight streams finish for up to
  `--drain-grace-s`.
- Several router processes may share the port (`--so-reuseport 1`): the socket
  is bound here with SO_REUSEPORT, as gRPC binds the public port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import structlog
import uvicorn

from pdmesh.v1 import router_pb2
from services.common.errors import Unavailable, retry_after_ms, status_of
from services.common.server import ServerConfig
from services.common.tls import TlsConfig, https_server_context
from services.gateway.app import Gateway
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError, from_grpc
from services.gateway.metrics import GatewayMetrics
from services.gateway.params import GenerationPlan
from services.gateway.protocol import http_protocol
from services.router.config import HttpDoorConfig
from services.router.router import Router
from services.router.servicer import DeltaItem, Deltas, Generation

log = structlog.get_logger()

CLIENT_GONE = "the HTTP client went away"


def http_error(exc: BaseException) -> GatewayError:
    """The HTTP error of a failure inside the router, as the gRPC door's status would map."""
    mapped = status_of(exc)
    if mapped is None:
        log.error("internal_error", method="http_door", exc_info=exc)
        return GatewayError(500, f"internal error ({type(exc).__name__})", "internal_error", code="internal")
    code, message = mapped
    retry_ms = retry_after_ms(exc, code)  # jittered, as the gRPC door's trailer
    trailing = (("retry-after-ms", str(retry_ms)),) if retry_ms is not None else ()
    return from_grpc(code, message, trailing)


class FlowStream:
    """One generation request on the flow, read like the gateway's `UpstreamStream`
    (GenerateResponse messages; a failure raises its GatewayError)."""

    def __init__(
        self,
        upstream: FlowUpstream,
        request: router_pb2.GenerateRequest,
        metadata: Any,
        prompt_ids: tuple[int, ...] | None = None,
    ):
        self._upstream = upstream
        self._request = request
        self._metadata = metadata
        self._prompt_ids = prompt_ids  # a token-id prompt, kept out of `request`
        self._gen: Generation | None = None
        self._it: Any = None  # the flow's items (Generation.light)
        self._deltas: Deltas | None = None
        self._after: list[Any] = []  # messages of the final item still to return, last first
        self._closing: asyncio.Task[None] | None = None
        self.finished = False
        self.cancelled = False

    def __aiter__(self) -> FlowStream:
        return self

    async def __anext__(self) -> router_pb2.GenerateResponse | DeltaItem:
        if self.finished:
            raise StopAsyncIteration
        if self._after:  # the final item's messages: its held-back text, then the final
            msg = self._after.pop()
        else:
            try:
                if self._gen is None:  # opened at the first read: the app's generate() must not raise
                    if self._upstream.draining:
                        raise Unavailable("the router is draining")
                    up = self._upstream
                    self._gen = Generation(
                        up.router, self._request, self._metadata, up.timeout_s, prompt_ids=self._prompt_ids
                    )
                    self._it, self._deltas = self._gen.light()
                item = await self._it.__anext__()
                if type(item) is list:
                    return self._deltas.tokens(item)  # type: ignore[union-attr]
                self._after = self._deltas.end(item)[::-1]  # type: ignore[union-attr]
                msg = self._after.pop()
            except StopAsyncIteration:
                self._end()
                raise
            except Exception as e:  # MeshErrors map to their status, anything else to a 500
                self._end()
                raise http_error(e) from e
        if msg.HasField("final"):
            # Run the flow to its end now (admission slot, ledger), before the client has it.
            async for _ in self._it:
                pass
            self._end()
        return msg

    def _end(self) -> None:
        self.finished = True
        if self._gen is not None:
            self._gen.close()

    def cancel(self) -> bool:
        """Cancel the request if it is still running (the client went away); True when it was
        cancelled before its final message (a relay task cancelled mid-read ends it too)."""
        if self.finished:
            return self.cancelled
        self.finished = self.cancelled = True
        gen = self._gen
        if gen is None:
            return True
        gen.cancel(CLIENT_GONE)  # a keyed (shared) request runs on for its retry
        if self._it is not None and not self._it.ag_running:
            self._closing = asyncio.ensure_future(self._close(gen))
        else:
            gen.close()
        return True

    async def _close(self, gen: Generation) -> None:
        try:
            await self._it.aclose()  # the flow's cleanup runs here (see Generation.responses)
        except Exception:  # a cancelled flow ending with its error: nobody reads it now
            log.debug("flow_close_error", exc_info=True)
        finally:
            gen.close()

    async def prompt_tokens(self) -> int | None:
        return self._gen.prompt_tokens if self._gen is not None else None


class FlowUpstream:
    """The gateway app's `Upstream` in the router process: the request flow itself."""

    def __init__(self, router: Router, timeout_s: float):
        self.router = router
        self.timeout_s = timeout_s
        self.draining = False

    def generate(self, plan: GenerationPlan, metadata: tuple[tuple[str, str], ...] = ()) -> FlowStream:
        return FlowStream(self, plan.to_proto(token_ids=False), metadata, plan.prompt_token_ids)

    async def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "NOT_SERVING"
        ready = self.router.ready()
        return ready, "SERVING" if ready else "NOT_SERVING"

    async def close(self) -> None:
        pass


# How long a connection with no request left may take to close when the door stops.
CLOSE_LINGER_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn on the router's loop: signals stay the router's (it drains both doors)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.up = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the router's SIGTERM handler drains gRPC and HTTP together

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.up.set()

    async def _wait_tasks_to_complete(self) -> None:
        """uvicorn waits for every connection to close, then for the requests in flight, both
        until `timeout_graceful_shutdown` (the drain grace). An idle keep-alive connection has
        already been told to close by then, but over TLS that close waits for the client's
        close_notify, which a client that keeps the socket without reading never sends: the
        drain then lasted the whole grace (`pdmesh up` SIGKILLed the router after 15 s).
        Here the requests in flight get the grace; a connection with none left gets
        CLOSE_LINGER_S to finish its close, then is aborted."""
        state = self.server_state
        while state.tasks and not self.force_exit:
            await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        linger_until = loop.time() + CLOSE_LINGER_S
        while state.connections and loop.time() < linger_until and not self.force_exit:
            await asyncio.sleep(0.05)
        for connection in list(state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()


def bind(host: str, port: int, reuseport: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:  # several router processes on one HTTP port; the kernel spreads connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class HttpDoor:
    """The HTTP listener of one router process."""

    def __init__(self, router: Router, config: HttpDoorConfig, server: ServerConfig, tls: TlsConfig):
        self.host = config.host or server.host
        self.upstream = FlowUpstream(router, config.request_timeout_s)
        model = router.settings.router
        gw_config = GatewayConfig(
            host=self.host,
            port=max(config.port, 0),
            router_address="in-process:0",  # unused: the upstream is the flow itself
            served_model_name=config.served_model_name or router.model.model_id,
            model_path=model.model_path,
            preset=model.preset,
            request_timeout_s=config.request_timeout_s,
            max_body_bytes=config.max_body_bytes,
            drain_grace_s=server.drain_grace_s,
            log_level=server.log_level,
        )
        # One registry: the router's metrics port shows pdmesh_gateway_* too, and /metrics here
        # shows the router's.
        metrics = GatewayMetrics(router.metrics.registry)
        self.gateway = Gateway(gw_config, metrics, upstream=self.upstream)
        self._sock = bind(self.host, gw_config.port, server.so_reuseport)
        self.port: int = self._sock.getsockname()[1]
        uv_config = uvicorn.Config(
            self.gateway.app(),
            log_config=None,
            access_log=False,  # one structured line per request comes from the app
            lifespan="on",
            timeout_graceful_shutdown=server.drain_grace_s,
            proxy_headers=False,
            http=http_protocol(),  # stamps when a request's head was parsed (the TTFT clock)
        )
        self.https = tls.serves_tls
        if self.https:
            uv_config.load()
            uv_config.ssl = https_server_context(tls)  # the router's certificate, followed on change
        self._server = _Server(uv_config)
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        up = asyncio.create_task(self._server.up.wait())
        await asyncio.wait({self._task, up}, return_when=asyncio.FIRST_COMPLETED)
        if not up.done():
            up.cancel()
            await self._task  # raises what stopped it (SystemExit from a failed startup)
            raise OSError(f"the HTTP door on {self.address} stopped while starting")
        log.info("serving", service="http", address=f"{'https' if self.https else 'http'}://{self.address}")

    async def drain(self) -> None:
        """503 on /health and new requests, stop accepting, let in-flight requests finish."""
        self.upstream.draining = True
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        log.info("stopped", service="http")

    async def stop(self) -> None:
        """Stop at once (tests, failures): in-flight requests are cut off."""
        self.upstream.draining = True
        # No grace: cancel the requests in flight, then let uvicorn shut down as usual (its
        # force_exit would skip the app's shutdown and leave the lifespan task to be cancelled).
        for task in list(self._server.server_state.tasks):
            task.cancel()
        self._server.should_exit = True
        if self._task is not None:
            await self._task
