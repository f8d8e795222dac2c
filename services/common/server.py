"""Server bootstrap shared by every pdmesh service.

`MeshServer` owns one grpc.aio server with:
  - grpc.health.v1: "" = live (SERVING once started), the service's own name =
    ready (set by the service once its model is loaded / peers reachable);
  - gRPC reflection;
  - a drain gate: on SIGTERM health goes NOT_SERVING, new application calls
    get UNAVAILABLE, in-flight calls finish (up to `drain_grace_s`), then the
    server stops;
  - optionally the Prometheus metrics HTTP server, with the HTTP probes
    `/livez` and `/readyz` (the same readiness as grpc.health.v1, with its
    reason), and a port file that tells a parent process (pdmesh up, e2e
    tests) the ports bound when asked for port 0;
  - with a `TlsConfig` holding a certificate: TLS (mTLS with require_client_cert)
    on the port, the certificate re-read when its files change, per-method mesh
    roles (services/common/call_guards.py), and optionally a plaintext port that
    serves only grpc.health.v1 (`health_port`, for kubelet's gRPC probes);
  - optionally a cap on concurrent calls per client connection;
  - with a `Tracing` (services/common/tracing.py): a server span per traced
    call, its parent taken from the caller's W3C trace context.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import select
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2
from prometheus_client import CollectorRegistry

from services.common.call_guards import ConnectionLimit, MeshAuthorizer
from services.common.channels import KEEPALIVE_TIME_MS, server_keepalive_options
from services.common.config import require, setting
from services.common.errors import retry_after_ms
from services.common.metrics import LoopLag, MetricsServer, start_metrics_server
from services.common.request_guard import MalformedRequestGuard
from services.common.tls import TlsConfig, server_credentials
from services.common.tracing import Tracing

log = structlog.get_logger()

_ALWAYS_ALLOWED = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Long-lived subscriptions (the router's KV-event streams) never finish on
# their own: a drain does not wait for them; stopping the server ends them and
# the subscriber resubscribes elsewhere.
_SUBSCRIPTIONS = ("/SubscribeKvEvents",)


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "gRPC port (0 = any free port; see --port-file)")
    metrics_port: int = setting(-1, "Prometheus /metrics HTTP port (0 = any free port, -1 = off)")
    port_file: str = setting("", "write the bound ports as JSON to this file once serving")
    drain_grace_s: float = setting(30.0, "seconds in-flight calls may take to finish on SIGTERM")
    max_message_bytes: int = setting(64 * 1024 * 1024, "largest gRPC message accepted or sent")
    log_level: str = setting("info", "debug, info, warning or error")
    so_reuseport: bool = setting(
        False, "set SO_REUSEPORT so several processes can share one listening port (same host and port)"
    )
    max_concurrent_streams: int = setting(
        0, "HTTP/2 streams one client connection may have open (gRPC's own cap; 0 = gRPC's default)"
    )
    max_calls_per_connection: int = setting(
        0, "concurrent calls per client connection; one more is RESOURCE_EXHAUSTED (0 = no limit)"
    )
    health_port: int = setting(
        -1, "with TLS: a plaintext port serving only grpc.health.v1, for kubelet probes (0 = any, -1 = off)"
    )
    keepalive_time_ms: int = setting(
        KEEPALIVE_TIME_MS,
        "keepalive ping interval of this server's clients (the mesh's ping every 10000 ms); pings at half "
        "of it are accepted, more often is GOAWAY too_many_pings: never set it above the clients'",
    )

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        require(
            -1 <= self.metrics_port <= 65535, f"metrics_port must be in [-1, 65535], got {self.metrics_port}"
        )
        require(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        require(self.max_message_bytes >= 4096, "max_message_bytes must be >= 4096")
        require(self.max_concurrent_streams >= 0, "max_concurrent_streams must be >= 0")
        require(self.max_calls_per_connection >= 0, "max_calls_per_connection must be >= 0")
        require(
            -1 <= self.health_port <= 65535, f"health_port must be in [-1, 65535], got {self.health_port}"
        )
        require(self.keepalive_time_ms >= 2, "keepalive_time_ms must be >= 2")


class _DrainGate(grpc.aio.ServerInterceptor):
    """Counts in-flight application calls and refuses new ones while draining."""

    def __init__(self) -> None:
        self.draining = False
        # Methods still served while draining: calls that end what the drain waits for
        # (a KV holder's reads and releases of held blocks), set by `MeshServer.serve_during_drain`.
        self.served_while_draining: tuple[str, ...] = ()
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _exit(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_ALWAYS_ALLOWED):
            return handler
        served = bool(self.served_while_draining) and details.method.startswith(self.served_while_draining)
        return self._wrap(handler, counted=not details.method.endswith(_SUBSCRIPTIONS), refused=not served)

    def _wrap(
        self, h: grpc.RpcMethodHandler, counted: bool = True, refused: bool = True
    ) -> grpc.RpcMethodHandler:
        gate = self
        ser = {"request_deserializer": h.request_deserializer, "response_serializer": h.response_serializer}

        async def refuse(context: grpc.aio.ServicerContext) -> None:
            if refused:
                # A hint like every UNAVAILABLE's: a client with no other instance waits for the restart.
                retry_ms = retry_after_ms(None, grpc.StatusCode.UNAVAILABLE)
                context.set_trailing_metadata((("retry-after-ms", str(retry_ms)),))
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another instance"
                )

        if h.unary_unary is not None:

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if gate.draining:
                    await refuse(context)
                gate._enter()
                try:
                    return await h.unary_unary(request, context)
                finally:
                    gate._exit()

            return grpc.unary_unary_rpc_method_handler(unary_unary, **ser)

        if h.unary_stream is not None:
            inner = h.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if gate.draining:
                    await refuse(context)
                if counted:
                    gate._enter()
                try:
                    if inspect.isasyncgenfunction(inner) or inspect.isasyncgenfunction(
                        getattr(inner, "__func__", None)
                    ):
                        async for item in inner(request, context):
                            yield item
                    else:
                        await inner(request, context)
                finally:
                    if counted:
                        gate._exit()

            return grpc.unary_stream_rpc_method_handler(unary_stream, **ser)

        if h.stream_stream is not None:  # DecodeService.Link: counted while open; it ends itself on drain
            inner_ss = h.stream_stream

            async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                if gate.draining:
                    await refuse(context)
                gate._enter()
                try:
                    async for item in inner_ss(requests, context):
                        yield item
                finally:
                    gate._exit()

            return grpc.stream_stream_rpc_method_handler(stream_stream, **ser)

        return h  # stream-unary: not used by pdmesh services


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def reflection_v1_handler(names: Sequence[str]) -> grpc.GenericRpcHandler:
    """grpc.reflection.v1 (what current grpcurl, buf curl and Postman ask first).

    grpcio-reflection ships only v1alpha; v1's messages are v1alpha's with the package
    renamed (same fields and numbers), so v1alpha's servicer answers v1 on the wire."""
    servicer = reflection_aio.ReflectionServicer(names)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method})


class MeshServer:
    """A grpc.aio server with health, reflection (v1 and v1alpha), drain and metrics."""

    def __init__(
        self,
        config: ServerConfig,
        service_name: str,
        registry: CollectorRegistry | None = None,
        reflection_names: Sequence[str] = (),
        tls: TlsConfig | None = None,
        tracing: Tracing | None = None,
    ):
        self.config = config
        self.service_name = service_name
        self.registry = registry
        self.tls = tls if tls is not None and tls.serves_tls else None
        self._gate = _DrainGate()
        self.drain_started = asyncio.Event()
        options: list[tuple[str, int]] = [
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 1 if config.so_reuseport else 0),
            *server_keepalive_options(config.keepalive_time_ms),  # else GOAWAY too_many_pings
        ]
        if config.max_concurrent_streams:
            options.append(("grpc.max_concurrent_streams", config.max_concurrent_streams))
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if tracing is not None:  # first, so a span covers refusals too; absent when tracing is off
            interceptors.append(tracing.server_interceptor())
        self.authorizer: MeshAuthorizer | None = None
        if self.tls is not None:
            self.authorizer = MeshAuthorizer(self.tls.require_client_cert)
            interceptors.append(self.authorizer)
        if config.max_calls_per_connection:
            interceptors.append(ConnectionLimit(config.max_calls_per_connection))
        # Bytes that do not parse as the request are INVALID_ARGUMENT (gRPC alone says UNKNOWN).
        interceptors.append(MalformedRequestGuard())
        self.options = tuple(options)
        self.interceptors = (*interceptors, self._gate)
        self.server = grpc.aio.server(interceptors=list(self.interceptors), options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [
            *reflection_names,
            service_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
            REFLECTION_V1,
        ]
        reflection.enable_server_reflection(names, self.server)
        self.server.add_generic_rpc_handlers((reflection_v1_handler(names),))
        self.port = 0
        self.health_port: int | None = None
        self.cert_watcher = None
        self.metrics: MetricsServer | None = None
        self.loop_lag: LoopLag | None = None  # this process's event-loop lag, on the metrics port
        self._stopped = asyncio.Event()
        self._drain_task: asyncio.Future[None] | None = None
        # Readiness as the HTTP probe reports it (read from the metrics thread).
        self._ready = False
        self._not_ready_reason = "starting"
        # A further check for the HTTP probe: a non-empty reason means not ready
        # (a worker's HealthWatch: its event loop stopped ticking).
        self.readiness_check: Callable[[], str] | None = None
        self._settle: Callable[[], Awaitable[bool]] | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def inflight(self) -> int:
        return self._gate.inflight

    @property
    def draining(self) -> bool:
        return self._gate.draining

    def track_call(self) -> Callable[[], None]:
        """Count a call that does not come through gRPC (the raw token link) as in flight,
        so the drain waits for it like any other; returns its end (call it once)."""
        self._gate._enter()
        return self._gate._exit

    def bind(self) -> int:
        """Bind the listening port (before servicers that need our address are made)."""
        if not self.port:
            where = f"{self.config.host}:{self.config.port}"
            if self.tls is not None:
                creds, self.cert_watcher = server_credentials(self.tls)
                self.port = self.server.add_secure_port(where, creds)
            else:
                self.port = self.server.add_insecure_port(where)
            if self.port == 0:
                raise OSError(f"could not bind {where}")
            if self.tls is not None and self.config.health_port >= 0:
                # Plaintext, but MeshAuthorizer lets only grpc.health.v1 through it.
                self.health_port = self.server.add_insecure_port(
                    f"{self.config.host}:{self.config.health_port}"
                )
        return self.port

    async def start(self) -> int:
        """Bind if needed, start serving ("" = SERVING, ready = NOT_SERVING), return the port."""
        self.bind()
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.registry is not None:
            self.metrics = start_metrics_server(
                self.registry, self.config.host, self.config.metrics_port, self.http_readiness
            )
            if self.loop_lag is None:
                self.loop_lag = LoopLag(self.registry, metric_service(self.service_name))
            self.loop_lag.start()
        self._write_port_file()
        log.info(
            "serving",
            service=self.service_name,
            address=self.address,
            metrics_port=self.metrics.port if self.metrics else None,
            tls="mtls" if self.tls and self.tls.require_client_cert else ("tls" if self.tls else "off"),
        )
        return self.port

    def _write_port_file(self) -> None:
        if not self.config.port_file:
            return
        data = {
            "port": self.port,
            "metrics_port": self.metrics.port if self.metrics else None,
            "health_port": self.health_port,
            "pid": os.getpid(),
        }
        tmp = self.config.port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.config.port_file)  # atomic: readers never see half a file

    async def set_ready(self, ready: bool, reason: str = "") -> None:
        """Readiness of the service's own name; `reason` says why not (the HTTP probe's body)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if not self._gate.draining:
            self._ready, self._not_ready_reason = ready, "" if ready else (reason or "not ready")
            await self.health.set(self.service_name, status)

    def http_readiness(self) -> tuple[bool, str]:
        """(ready, reason) for `/readyz`: what grpc.health.v1 says for the service's name,
        from state this server keeps (never a call into the loop)."""
        if self._gate.draining:
            return False, "draining"
        if not self._ready:
            return False, self._not_ready_reason
        extra = self.readiness_check() if self.readiness_check is not None else ""
        return (not extra, extra or "serving")

    def serve_during_drain(
        self, method_prefixes: Sequence[str], settle: Callable[[], Awaitable[bool]]
    ) -> None:
        """Keep serving `method_prefixes` while draining and await `settle()` after the in-flight
        calls finish, before the server stops. For a KV holder (the prefill worker): its handles
        are still out after the Prefill calls that made them return, and stopping then fails the
        decodes that have not pulled yet. `settle` bounds its own wait (the leases' ends) and
        returns whether everything settled."""
        self._gate.served_while_draining = tuple(method_prefixes)
        self._settle = settle

    async def drain(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let in-flight calls finish (then `settle`), stop."""
        if self._gate.draining:
            await self._stopped.wait()
            return
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        self._gate.draining = True
        self.drain_started.set()  # long-lived streams (Link) finish their requests and end
        await self.health.enter_graceful_shutdown()
        log.info("draining", service=self.service_name, inflight=self._gate.inflight, grace_s=grace)
        finished = await self._gate.wait_idle(grace)
        if not finished:
            log.warning("drain_grace_expired", service=self.service_name, inflight=self._gate.inflight)
        if self._settle is not None:
            settled = await self._settle()
            log.info("drain_settled" if settled else "drain_settle_expired", service=self.service_name)
            await self._gate.wait_idle(grace)  # reads the settle let in finish too
        await self.server.stop(0.5)
        if self.metrics is not None:
            self.metrics.close()
        if self.loop_lag is not None:
            self.loop_lag.stop()
        self._stopped.set()
        log.info("stopped", service=self.service_name)

    async def stop(self) -> None:
        """Stop at once (tests, failures): in-flight calls are cancelled."""
        self._gate.draining = True
        await self.server.stop(0)
        if self.metrics is not None:
            self.metrics.close()
        if self.loop_lag is not None:
            self.loop_lag.stop()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self, on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """SIGTERM / SIGINT start a drain (then `on_drain`, e.g. closing the engine)."""
        loop = asyncio.get_running_loop()

        async def drain_then() -> None:
            await self.drain()
            if on_drain is not None:
                await on_drain()

        def handler(signame: str) -> None:
            log.info("signal", signal=signame, service=self.service_name)
            if not self._gate.draining and self._drain_task is None:
                self._drain_task = asyncio.ensure_future(drain_then())

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, handler, sig.name)


def metric_service(service_name: str) -> str:
    """The `<service>` of metric names: "pdmesh.v1.RouterService" -> "router"."""
    return service_name.rsplit(".", 1)[-1].removesuffix("Service").lower()


PARENT_PID_ENV = "PDMESH_PARENT_PID"


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run a service's async main on uvloop (tied to its launcher's life, see `die_with_parent`)."""
    import uvloop

    die_with_parent()
    return uvloop.run(main())


def die_with_parent() -> None:
    """SIGTERM (a drain) when the launcher that set `PDMESH_PARENT_PID` dies, so a killed `pdmesh up`
    or test run leaves no orphan services. Done here in the service, not in a `preexec_fn`: Python
    code between fork and exec in a threaded launcher (gRPC, engine threads) can crash the child.

    Watches the launcher *process* through a pidfd (readable once every thread of it has exited).
    Not `PR_SET_PDEATHSIG`, the fallback where pidfds are missing: that fires when the launcher's
    *thread* that forked us exits, so a service started from a short-lived thread (a restart from a
    fault schedule or a supervisor's worker thread) was terminated as soon as that thread ended."""
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected or sys.platform != "linux":
        return
    parent = int(expected)
    try:
        pidfd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):  # Python or kernel without pidfds, or the launcher already gone
        pidfd = None
    if os.getppid() != parent:  # the launcher died before we watched it: nobody will signal us
        log.warning("launcher gone before start", parent_pid=parent)
        sys.exit(0)
    if pidfd is None:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:
            sys.exit(0)
        return
    threading.Thread(target=_terminate_when_readable, args=(pidfd,), name="parent-watch", daemon=True).start()


def _terminate_when_readable(pidfd: int) -> None:
    select.select([pidfd], [], [])
    os.kill(os.getpid(), signal.SIGTERM)
