"""A FAKE RouterService for the gateway's in-process tests, scripted by prompt text.

It is a real grpc.aio server on port 0 with grpc.health.v1, so the gateway
talks gRPC to it exactly as to the router. It exists to produce what a real
router rarely does on demand: a shed with a given retry hint, a failure after
the first token, a stream that ends without its final message, a deadline, a
stream that never ends (to watch cancellation arrive).

Scripts (the prompt text): "ok" -> "Hel" + "lo", final STOP with usage 2 + 2;
"shed" -> RESOURCE_EXHAUSTED with retry-after-ms 2500; "midfail" -> one delta then
UNAVAILABLE; "nofinal" -> one delta then end; "deadline" -> DEADLINE_EXCEEDED;
"bad" -> INVALID_ARGUMENT; "slow" -> one delta, then wait until cancelled; "hold" -> wait
until cancelled before any delta.

`cancelled` is set when a call is cancelled wherever its handler is at the time: a
client that hangs up while the handler still sends its first message (a CPU-starved
machine did exactly that) cancels the call as surely as one that hangs up later, and
an `except CancelledError` around the waits alone missed it.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

READY = "pdmesh.v1.RouterService"


def _delta(text: str) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(delta=router_pb2.TokenDelta(token_ids=list(text.encode()), text=text))


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []
        self.cancelled = asyncio.Event()
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        router_pb2_grpc.add_RouterServiceServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        await self.set_ready(True)

    async def set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(READY, status)

    async def stop(self) -> None:
        await self.server.stop(0)

    async def Generate(self, request, context):
        try:
            async for response in self._generate(request, context):
                yield response
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: closed at a yield
            self.cancelled.set()
            raise

    async def _generate(self, request, context):
        self.requests.append(request)
        script = request.text
        if script == "shed":
            context.set_trailing_metadata((("retry-after-ms", "2500"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "router queue full")
        if script == "deadline":
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "cannot start in time")
        if script == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens: too large")
        # As the router does: the prompt's token count rides in the initial metadata.
        await context.send_initial_metadata((("x-prompt-tokens", str(len(script))),))
        if script == "hold":
            await asyncio.Event().wait()
        yield _delta("a" if script != "ok" else "Hel")
        if script == "midfail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker lost, no migration left")
        if script == "nofinal":
            return
        if script == "slow":
            await asyncio.Event().wait()
        yield _delta("lo")
        usage = common_pb2.Usage(prompt_tokens=len(script), completion_tokens=2, cached_prompt_tokens=1)
        final = router_pb2.GenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage, request_id=request.request_id
        )
        yield router_pb2.GenerateResponse(final=final)
