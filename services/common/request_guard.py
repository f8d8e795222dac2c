"""Malformed request bytes end with INVALID_ARGUMENT, not gRPC's UNKNOWN.

grpc.aio parses a request with the handler's deserializer before any servicer
code runs; when that raises (corrupt wire data, a string field holding invalid
UTF-8) the call ends with UNKNOWN "Unexpected <class DecodeError>: ...",
which tells a client nothing it can act on and looks like a server bug.
`MalformedRequestGuard` gives every handler a deserializer that turns such
bytes into a `Malformed` marker instead, and aborts those calls with
INVALID_ARGUMENT naming the expected message before the servicer sees them.
MeshServer installs it on every server.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class Malformed:
    """What the guarded deserializer returns for bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return Malformed(str(e))

    return parse


async def _refuse(context: grpc.aio.ServicerContext, bad: Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {bad.error}")


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]], details: Any) -> Any:
        h = await continuation(details)
        if h is None or h.request_deserializer is None or h.request_streaming:
            return h  # pdmesh has no client-streaming methods
        ser = {
            "request_deserializer": _tolerant(h.request_deserializer),
            "response_serializer": h.response_serializer,
        }
        if h.unary_unary is not None:
            inner_uu = h.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    await _refuse(context, request)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **ser)

        inner = h.unary_stream
        is_gen = inspect.isasyncgenfunction(inner) or inspect.isasyncgenfunction(
            getattr(inner, "__func__", None)
        )

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            if is_gen:
                async for item in inner(request, context):
                    yield item
            else:
                await inner(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_stream, **ser)
