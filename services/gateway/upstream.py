"""The gateway's side of the router: one gRPC channel, Generate streams, readiness.

`RouterClient` owns the channel (made on the serving event loop; TLS/mTLS
with the gateway's `TlsConfig`, presenting the "gateway" certificate). Each request
gets an `UpstreamStream` over one `RouterService.Generate` call; a failed call
raises the `GatewayError` its status maps to (errors.from_grpc), and `cancel()`
cancels the call, which the router propagates to the decode and prefill
workers (the HTTP client went away).
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.v1 import router_pb2_grpc
from services.common.tls import TlsConfig, aio_channel, client_tls
from services.gateway.errors import from_grpc
from services.gateway.params import GenerationPlan

ROUTER_READY = "pdmesh.v1.RouterService"


class Upstream(Protocol):
    """What the app needs of a router: `RouterClient` over gRPC, or the router's own
    request flow in-process (services/router/http_door.py `FlowUpstream`)."""

    def generate(self, plan: GenerationPlan, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
        """A stream like `UpstreamStream`; must not raise (errors come from reading it)."""
        ...

    async def ready(self) -> tuple[bool, str]: ...

    async def close(self) -> None: ...


class UpstreamStream:
    """One Generate call: iterate for GenerateResponse messages; `cancel()` to abort it."""

    def __init__(self, call: Any):
        self._call = call
        self.finished = False
        self.cancelled = False

    def __aiter__(self) -> UpstreamStream:
        return self

    async def __anext__(self) -> Any:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            self.finished = True
            self.cancelled = e.code() == grpc.StatusCode.CANCELLED
            raise from_grpc(e.code(), e.details() or "", e.trailing_metadata()) from e
        if msg is grpc.aio.EOF:
            self.finished = True
            raise StopAsyncIteration
        if msg.HasField("final"):
            self.finished = True
        return msg

    def cancel(self) -> bool:
        """Cancel the call if it is still running; True when it was (or already is) cancelled
        before its final message: a relay task cancelled mid-read cancels the call itself."""
        if self.finished:
            return self.cancelled
        self.finished = True
        self.cancelled = bool(self._call.cancel()) or self._call.cancelled()
        return self.cancelled

    async def prompt_tokens(self) -> int | None:
        """The prompt's token count from the router's initial metadata (None if not sent)."""
        for key, value in await self._call.initial_metadata() or ():
            if key == "x-prompt-tokens" and value.isdigit():
                return int(value)
        return None


class RouterClient:
    def __init__(self, address: str, timeout_s: float, health_timeout_s: float, tls: TlsConfig | None = None):
        self.address = address
        self._timeout_s = timeout_s
        self._health_timeout_s = health_timeout_s
        self._channel = aio_channel(address, client_tls(tls))
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, plan: GenerationPlan, metadata: tuple[tuple[str, str], ...] = ()) -> UpstreamStream:
        """One Generate call; `metadata` carries the client's `authorization` to the router."""
        return UpstreamStream(
            self._stub.Generate(plan.to_proto(), timeout=self._timeout_s, metadata=metadata)
        )

    async def ready(self) -> tuple[bool, str]:
        """(router reports RouterService SERVING, status text)."""
        try:
            resp = await self._health.Check(
                health_pb2.HealthCheckRequest(service=ROUTER_READY), timeout=self._health_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            return False, e.code().name
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return resp.status == health_pb2.HealthCheckResponse.SERVING, name

    async def close(self) -> None:
        await self._channel.close()
