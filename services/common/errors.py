"""Typed errors inside, gRPC status codes at the edge.

Cores and engines raise domain errors; `status_of` maps any of them to a gRPC
status once (this module imports neither the engine nor the kvtransfer library:
their errors name their own status, see `status_of`), and `grpc_errors` wraps a servicer method so that a domain error
becomes the call's status (code, message) and an unexpected exception becomes
INTERNAL with a generic message (the traceback goes to the log, never to the
client).
"""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Callable
from typing import Any

import grpc
import structlog

log = structlog.get_logger()

# Status details travel in a header (percent-encoded, up to 12 bytes a character);
# clients refuse headers over 16 KiB and then see RESOURCE_EXHAUSTED instead of the status.
MAX_DETAILS_CHARS = 512

# Retry hints ("retry-after-ms") are spread over [h, (1 + RETRY_JITTER) h]: clients
# shed in the same burst are told different waits and come back spread out, not
# as one wave that is shed again (issue 18 item 4). Only upwards: never sooner
# than the estimate.
RETRY_JITTER = 0.25
# The hint of an UNAVAILABLE that names none: half the router's health-probe interval (1 s),
# so a client is back about when the mesh has seen a worker come or go (HTTP: Retry-After 1).
UNAVAILABLE_RETRY_AFTER_S = 0.5


class MeshError(Exception):
    """Base of pdmesh's domain errors; `code` is the gRPC status at the edge."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidArgument(MeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(MeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(MeshError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(MeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(MeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(MeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


def retry_after_ms(
    exc: BaseException | None, code: grpc.StatusCode, rand: Callable[[], float] = random.random
) -> int | None:
    """The jittered "retry-after-ms" hint of an error at the edge, None for none:
    the error's own `retry_after_s`, else UNAVAILABLE_RETRY_AFTER_S for UNAVAILABLE.
    O(1), one float draw: it runs on every shed request."""
    hint = getattr(exc, "retry_after_s", None)
    if hint is None and code == grpc.StatusCode.UNAVAILABLE:
        hint = UNAVAILABLE_RETRY_AFTER_S
    if hint is None:
        return None
    return int(hint * (1.0 + RETRY_JITTER * rand()) * 1000)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The gRPC status for a known domain error, None for anything else.

    Errors of the layers below the services that common cannot import (the
    engine's, the kvtransfer library's) carry their status themselves: a
    `status_code` (class attribute or property) that is a `grpc.StatusCode`,
    and optionally `status_message()` for the details (default `str(exc)`).
    """
    if isinstance(exc, MeshError):
        return exc.code, str(exc)
    code = getattr(exc, "status_code", None)
    if not isinstance(code, grpc.StatusCode):
        return None
    message = getattr(exc, "status_message", None)
    return code, message() if callable(message) else str(exc)


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException, method: str = "?") -> None:
    """End the call with the status of `exc` (INTERNAL for unknown errors): the caller
    returns right after (the `grpc_errors` wrappers do).

    `method` names the servicer method in the log of an unknown error (grpc.aio
    offers no public way to read it from the context, and the private one it once
    had is gone in grpcio 1.85: `grpc_errors` passes the wrapped method's name)."""
    mapped = status_of(exc)
    if mapped is None:
        log.error("internal_error", method=method, exc_info=exc)
        mapped = (grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})")
    code, message = mapped
    if len(message) > MAX_DETAILS_CHARS:  # messages echo client input, and headers have a size limit
        message = message[:MAX_DETAILS_CHARS] + "..."
    retry_ms = retry_after_ms(exc, code)
    if retry_ms is not None:
        context.set_trailing_metadata((("retry-after-ms", str(retry_ms)),))
    drop_tracebacks(exc)
    # The status is set and the handler returns, rather than `context.abort`, which raises
    # an AbortError that grpc.aio keeps in a cycle with the handler's frames (~26 objects per
    # call for the collector, more with ours): under a shed storm the collections of those
    # cycles were the router's longest pauses.
    context.set_code(code)
    context.set_details(message)


def drop_tracebacks(exc: BaseException | None) -> None:
    """Let go of the frames an error (and the errors it was raised from) passed through, once
    its status is known. Each frame keeps its locals after its function returned (the request's
    flow, its task, its closures), and one of them usually refers back to the error: every
    rejected request then left a cycle of ~100 objects for the garbage collector, whose
    collections of them (~20k objects each) stopped the router's loop for 8-37 ms every ~0.7 s
    of a 20x burst (bench/shed.py, issue 18's rejection p99). Without the tracebacks reference
    counting frees them at once."""
    seen = 0
    while exc is not None and seen < 8:  # a chain is short; a cyclic chain must not loop
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
        seen += 1


def grpc_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a servicer method (unary or server-streaming) with `abort_for`."""
    method = fn.__qualname__  # e.g. "DecodeServicer.Generate", for the log of an internal error

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in fn(self, request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as e:  # the edge: every error becomes a status
                await abort_for(context, e, method)  # and the stream ends with that status

        return stream_wrapper

    @functools.wraps(fn)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # the edge: every error becomes a status
            await abort_for(context, e, method)
            return None  # no response: the call ends with the status abort_for set

    return unary_wrapper
