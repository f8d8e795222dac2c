"""`status_of`: every domain error of every layer maps to the status it had when
services/common imported the engine and kvtransfer to map them (now the errors
name their own status), and what the edge does with them on a real server."""

from __future__ import annotations

import grpc
import pytest
import structlog.testing

from kvtransfer.errors import FailureKind, KvTransferFailed, NotOwner, StaleHandle
from kvtransfer.layout import LayoutMismatch
from services.common.errors import (
    RETRY_JITTER,
    UNAVAILABLE_RETRY_AFTER_S,
    InvalidArgument,
    MeshError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    grpc_errors,
    retry_after_ms,
    status_of,
)
from services.engine.api import (
    EngineCapacityError,
    EngineError,
    InvalidHandoffError,
    InvalidRequestError,
    UnknownRequestError,
)

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (InvalidArgument("sampling.top_p: bad"), (S.INVALID_ARGUMENT, "sampling.top_p: bad")),
        (ResourceExhausted("queue full", retry_after_s=1.0), (S.RESOURCE_EXHAUSTED, "queue full")),
        (Unauthenticated("no key"), (S.UNAUTHENTICATED, "no key")),
        (MeshError("boom"), (S.INTERNAL, "boom")),
        (KvTransferFailed(FailureKind.TIMEOUT, "x"), (S.DEADLINE_EXCEEDED, "timeout: x")),
        (KvTransferFailed(FailureKind.TRUNCATED, "x"), (S.DATA_LOSS, "truncated: x")),
        (StaleHandle("h1"), (S.NOT_FOUND, "stale_handle: h1")),
        (NotOwner("h1"), (S.PERMISSION_DENIED, "not_owner: h1")),
        (InvalidRequestError("top_k", "too big"), (S.INVALID_ARGUMENT, "top_k: too big")),
        (LayoutMismatch("head_dim 64 != 32"), (S.FAILED_PRECONDITION, "head_dim 64 != 32")),
        (EngineCapacityError("no blocks"), (S.RESOURCE_EXHAUSTED, "no blocks")),
        # a KeyError's str() quotes its argument; the client gets the plain text
        (UnknownRequestError("no held KV 'r1'"), (S.NOT_FOUND, "no held KV 'r1'")),
        (UnknownRequestError(), (S.NOT_FOUND, "")),
    ],
)
def test_domain_errors_map_to_their_status(exc, expected):
    assert status_of(exc) == expected


class _HttpishError(Exception):
    status_code = 404  # an int, as HTTP libraries have: not a gRPC status


@pytest.mark.parametrize(
    "exc",
    [ValueError("x"), KeyError("x"), EngineError("loop failed"), InvalidHandoffError("x"), _HttpishError()],
)
def test_anything_else_is_unknown_and_becomes_internal_at_the_edge(exc):
    assert status_of(exc) is None


class _Probe:
    @grpc_errors
    async def Boom(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise RuntimeError("a bug with a secret in it")

    @grpc_errors
    async def Refused(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise UnknownRequestError("no held KV 'r1'")


async def test_the_edge_turns_errors_into_statuses_and_logs_the_method_of_a_bug():
    probe = _Probe()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(getattr(probe, name)) for name in ("Boom", "Refused")
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Probe", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with structlog.testing.capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as boom:
                await channel.unary_unary("/test.Probe/Boom")(b"", timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary("/test.Probe/Refused")(b"", timeout=10)
    finally:
        await server.stop(None)
    assert boom.value.code() == S.INTERNAL and boom.value.details() == "internal error (RuntimeError)"
    assert [(e["event"], e["method"]) for e in logs] == [("internal_error", "_Probe.Boom")]
    assert (refused.value.code(), refused.value.details()) == (S.NOT_FOUND, "no held KV 'r1'")


# ---- retry hints at the edge (issue 18 item 4) ------------------------------------


def test_retry_hints_are_jittered_upwards_within_the_bound():
    shed = ResourceExhausted("queue full", retry_after_s=2.0)
    assert retry_after_ms(shed, S.RESOURCE_EXHAUSTED, rand=lambda: 0.0) == 2000  # never sooner
    top = retry_after_ms(shed, S.RESOURCE_EXHAUSTED, rand=lambda: 0.999)
    assert 2000 < top <= 2000 * (1 + RETRY_JITTER)
    # With the real draw, clients shed together are told different waits.
    hints = {retry_after_ms(shed, S.RESOURCE_EXHAUSTED) for _ in range(50)}
    assert len(hints) > 10 and all(2000 <= h <= 2500 for h in hints)


def test_unavailable_always_carries_a_hint_and_other_errors_none():
    assert retry_after_ms(Unavailable("no worker"), S.UNAVAILABLE, rand=lambda: 0.0) == int(
        UNAVAILABLE_RETRY_AFTER_S * 1000
    )
    assert retry_after_ms(None, S.UNAVAILABLE, rand=lambda: 0.0) == int(UNAVAILABLE_RETRY_AFTER_S * 1000)
    assert retry_after_ms(Unavailable("x", retry_after_s=0.2), S.UNAVAILABLE, rand=lambda: 0.0) == 200
    assert retry_after_ms(InvalidArgument("bad"), S.INVALID_ARGUMENT) is None
    assert retry_after_ms(ResourceExhausted("no hint"), S.RESOURCE_EXHAUSTED) is None


class _Shedder:
    """Refuses every call the way the router's admission does: a domain error raised deep in
    the handler, from another one, with the handler's own state in its frames."""

    def __init__(self) -> None:
        self.flows: list[object] = []

    def _admit(self, flow: dict) -> None:
        try:
            raise LookupError("no slot")
        except LookupError as e:
            flow["error"] = e  # the flow keeps its error: a cycle through the frames
            raise ResourceExhausted("queue full", retry_after_s=0.5) from e

    @grpc_errors
    async def Unary(self, request, context):
        self._admit({"request": request})

    @grpc_errors
    async def Stream(self, request, context):
        self._admit({"request": request})
        yield b""


async def test_a_refused_call_leaves_nothing_for_the_garbage_collector():
    """The edge sets the status and returns instead of `context.abort` (whose AbortError
    grpc.aio keeps in a cycle with the handler's frames) and drops the error's tracebacks:
    in a shed storm the collections of those cycles were the router's longest pauses
    (bench/shed.py's rejection p99, issue 18). The status and retry hint still arrive."""
    import gc

    shedder = _Shedder()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(shedder.Unary),
        "Stream": grpc.unary_stream_rpc_method_handler(shedder.Stream),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Shed", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(20):
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await channel.unary_unary("/test.Shed/Unary")(b"", timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as stream:
                    async for _ in channel.unary_stream("/test.Shed/Stream")(b"", timeout=10):
                        pass
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, (ResourceExhausted, grpc.aio.AbortError))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        await server.stop(None)
    for err in (unary.value, stream.value):
        assert (err.code(), err.details()) == (S.RESOURCE_EXHAUSTED, "queue full")
        assert int(dict(err.trailing_metadata())["retry-after-ms"]) >= 500
    assert left == []
