"""Server interceptors that guard every call before a servicer sees it.

`MeshAuthorizer` (installed by MeshServer when it serves TLS):
  - a call that did not come over TLS (the plaintext health port kubelet's gRPC
    probes use, which cannot speak TLS) may only reach grpc.health.v1;
  - with mTLS on, the caller's certificate must name a mesh role
    (`pdmesh://<role>`, see services/common/tls.py) that `POLICY` lists for
    the method. The table names every RPC of pdmesh.v1 and the roles that
    call it in the mesh's own data flow (decode Generate is the router's alone,
    Prefill/Release/ReadBlocks decode's, KV-agent registration the workers',
    KV-event subscriptions the router's); a method it does not name is closed to
    every role, so a new RPC is unreachable until someone decides who calls it.
    Refusals are PERMISSION_DENIED naming the role and method.
    Finer checks that need the request (a worker speaks only for itself, an
    admin key for ListWorkers) are the servicers' (services/router/membership.py).

`ConnectionLimit`: at most `limit` concurrent calls per client connection
(`context.peer()` is the connection's remote address); one more is refused
with RESOURCE_EXHAUSTED. gRPC's own `grpc.max_concurrent_streams` (ServerConfig)
bounds the streams of a connection at the HTTP/2 layer, where extra calls wait
in the client instead of failing; this gives a caller a clear error instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.common.tls import is_tls_call, peer_identity

PUBLIC_ROLES = frozenset({"client", "gateway"})
INTERNAL_ROLES = frozenset({"router", "decode", "prefill", "kvtransfer"})
# An operator's certificate (`pdmesh certs` issues any role name): ListWorkers, Stats. The
# planner (services/planner) reads exactly those, so it runs with an admin certificate
# (`pdmesh up --planner` uses the router's, whose process it supervises).
ADMIN_ROLES = frozenset({"admin", "router"})
ROLES = PUBLIC_ROLES | INTERNAL_ROLES | {"admin"}
WORKER_ROLES = frozenset({"decode", "prefill"})
NOBODY: frozenset[str] = frozenset()

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_ROUTER = frozenset({"router"})
_DECODE = frozenset({"decode"})
# (method or service prefix, roles allowed); the first match wins, NOBODY otherwise.
# Who calls what: the router calls the workers (Generate, SubscribeKvEvents, Stats
# polls of static workers); decode calls prefill (Prefill, Release, Stats for its
# load view) and reads KV blocks; workers register with the router and with
# kvtransfer. Keep it in step with docs/SECURITY.md's table.
POLICY: tuple[tuple[str, frozenset[str]], ...] = (
    (HEALTH_PREFIX, ROLES),
    ("/grpc.reflection.", ROLES),
    # The router's public listener (a client key decides the tenant).
    ("/pdmesh.v1.RouterService/Generate", ROLES),
    ("/pdmesh.v1.RouterService/Cancel", ROLES),
    # The router's internal listener. ListWorkers: any role may ask, the servicer then
    # wants an admin/router certificate or an admin API key (item 8 of issue 13).
    ("/pdmesh.v1.RouterService/ListWorkers", ROLES),
    ("/pdmesh.v1.RouterService/Stats", ADMIN_ROLES),
    ("/pdmesh.v1.RouterService/RegisterWorker", WORKER_ROLES),
    ("/pdmesh.v1.RouterService/Heartbeat", WORKER_ROLES),
    ("/pdmesh.v1.RouterService/DeregisterWorker", WORKER_ROLES),
    # Decode workers: the router's alone (no key, admission or quota behind them).
    ("/pdmesh.v1.DecodeService/Generate", _ROUTER),
    ("/pdmesh.v1.DecodeService/Link", _ROUTER),  # the multiplexed token path
    ("/pdmesh.v1.DecodeService/SubscribeKvEvents", _ROUTER),
    ("/pdmesh.v1.DecodeService/Stats", ADMIN_ROLES),
    # Prefill workers: held KV is decode's to take and release.
    ("/pdmesh.v1.PrefillService/Prefill", _DECODE),
    ("/pdmesh.v1.PrefillService/Release", _DECODE),
    ("/pdmesh.v1.PrefillService/SubscribeKvEvents", _ROUTER),
    ("/pdmesh.v1.PrefillService/Stats", ADMIN_ROLES | _DECODE),
    # The KV control plane: agents are the workers' (kvtrust binds a name to its owner).
    ("/pdmesh.v1.KvTransferService/RegisterAgent", WORKER_ROLES),
    ("/pdmesh.v1.KvTransferService/Heartbeat", WORKER_ROLES),
    ("/pdmesh.v1.KvTransferService/DeregisterAgent", WORKER_ROLES),
    ("/pdmesh.v1.KvTransferService/GetAgent", WORKER_ROLES),
    ("/pdmesh.v1.KvTransferService/ReportTransfers", WORKER_ROLES),
    ("/pdmesh.v1.KvTransferService/Stats", ADMIN_ROLES),
    ("/pdmesh.v1.KvSourceService/ReadBlocks", _DECODE),
    # Cached prefixes leased to a decode worker that pulls them instead of recomputing
    # (issue 17): decode's to take and release, like a prefill worker's held KV.
    ("/pdmesh.v1.PrefixSourceService/LeasePrefix", _DECODE),
    ("/pdmesh.v1.PrefixSourceService/ReleasePrefix", _DECODE),
)


def allowed_roles(method: str) -> frozenset[str]:
    for prefix, roles in POLICY:
        if method.startswith(prefix):
            return roles
    return NOBODY


Check = Callable[[grpc.aio.ServicerContext], Awaitable[Callable[[], None] | None]]


def guard(h: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """`h` with `check(context)` awaited first; it aborts the call or returns a cleanup (or None)."""
    ser = {"request_deserializer": h.request_deserializer, "response_serializer": h.response_serializer}
    if h.unary_unary is not None:
        inner_uu = h.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            done = await check(context)
            try:
                return await inner_uu(request, context)
            finally:
                if done is not None:
                    done()

        return grpc.unary_unary_rpc_method_handler(unary_unary, **ser)
    if h.unary_stream is not None:
        inner = h.unary_stream
        is_gen = inspect.isasyncgenfunction(inner) or inspect.isasyncgenfunction(
            getattr(inner, "__func__", None)
        )

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            done = await check(context)
            try:
                if is_gen:
                    async for item in inner(request, context):
                        yield item
                else:
                    await inner(request, context)
            finally:
                if done is not None:
                    done()

        return grpc.unary_stream_rpc_method_handler(unary_stream, **ser)
    if h.stream_stream is not None:  # DecodeService.Link
        inner_ss = h.stream_stream

        async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            done = await check(context)
            try:
                async for item in inner_ss(requests, context):
                    yield item
            finally:
                if done is not None:
                    done()

        return grpc.stream_stream_rpc_method_handler(stream_stream, **ser)
    return h  # stream-unary: not used by pdmesh services


class MeshAuthorizer(grpc.aio.ServerInterceptor):
    """Per-method mesh roles with mTLS; health only on a plaintext connection."""

    def __init__(self, require_client_cert: bool):
        self.require_client_cert = require_client_cert
        self.denied = 0

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        roles = allowed_roles(method)

        async def check(context: grpc.aio.ServicerContext) -> None:
            if not is_tls_call(context):
                if not method.startswith(HEALTH_PREFIX):
                    await self._deny(context, f"{method} needs TLS; this plaintext port serves health only")
                return None
            if not self.require_client_cert:
                return None
            ident = peer_identity(context)
            if ident is None:
                await self._deny(context, f"{method}: the client certificate names no pdmesh:// role")
            elif ident.role not in roles:
                await self._deny(context, f"{method} is not open to role {ident.role!r}")
            return None

        return guard(handler, check)

    async def _deny(self, context: grpc.aio.ServicerContext, message: str) -> None:
        self.denied += 1
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)


class ConnectionLimit(grpc.aio.ServerInterceptor):
    """At most `limit` concurrent calls per client connection (RESOURCE_EXHAUSTED beyond)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open: dict[str, int] = {}

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler

        async def check(context: grpc.aio.ServicerContext) -> Callable[[], None]:
            peer = context.peer()
            n = self.open.get(peer, 0)
            if n >= self.limit:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this connection has {n} calls open (limit {self.limit} per connection); "
                    "wait for one to finish",
                )
            self.open[peer] = n + 1

            def done() -> None:
                left = self.open[peer] - 1
                if left:
                    self.open[peer] = left
                else:
                    del self.open[peer]

            return done

        return guard(handler, check)
