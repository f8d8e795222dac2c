"""One attempt of a request on one decode worker: read the stream, watch for stalls.

`DecodeAttempt` owns a reader task that drains the decode worker's Generate
stream into a token buffer and wakes the request flow (services/router/
generate.py), which sends everything buffered as one client message. So tokens
that arrive while the previous message is being written go out together, and
no token ever waits for company. A watchdog timer fails the attempt when the
first message takes longer than `first_timeout_s`, or when no message arrives
for `stall_timeout_s` after the first (the worker died without closing the
connection, or hangs): the reader is cancelled, which cancels the call.

`AttemptError` classifies how an attempt failed: may the request be retried
or migrated, and does it count against the worker's circuit breaker. Errors
that are the client's fault (INVALID_ARGUMENT, ...) are neither.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from pdmesh.v1 import decode_pb2
from services.common.errors import DeadlineExceeded, InvalidArgument, MeshError, PermissionDenied, Unavailable

_CLIENT_FAULT = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
# Not the worker's fault, and another worker may well succeed.
_NOT_WORKER_FAULT = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}


class DecodeCall(Protocol):
    """What `call_decode` returns: a grpc.aio UnaryStreamCall or a test fake."""

    def __aiter__(self) -> AsyncIterator[decode_pb2.DecodeServiceGenerateResponse]: ...

    def cancel(self) -> bool: ...


@dataclass(frozen=True)
class AttemptError:
    code: grpc.StatusCode
    details: str
    retryable: bool  # another attempt may succeed
    worker_fault: bool  # counts as a failure of the worker (circuit breaker)

    @classmethod
    def from_status(cls, code: grpc.StatusCode, details: str) -> AttemptError:
        if code in _CLIENT_FAULT:
            return cls(code, details, retryable=False, worker_fault=False)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:  # the request's own budget ran out
            return cls(code, details, retryable=False, worker_fault=False)
        return cls(code, details, retryable=True, worker_fault=code not in _NOT_WORKER_FAULT)

    def to_mesh_error(self, worker_id: str, why: str = "") -> MeshError:
        """The status the client gets when the request ends on this error."""
        if self.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return InvalidArgument(self.details)
        if self.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            return PermissionDenied(self.details)
        if self.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"deadline exceeded on decode worker {worker_id}")
        suffix = f"; {why}" if why else ""
        return Unavailable(f"decode worker {worker_id} failed: {self.code.name}: {self.details}{suffix}")


class DecodeAttempt:
    """Reads one Generate call; the flow takes tokens with `take` when woken."""

    def __init__(
        self,
        worker_id: str,
        call: DecodeCall,
        wake: asyncio.Event,
        first_timeout_s: float = 0.0,
        stall_timeout_s: float = 0.0,
    ):
        self.worker_id = worker_id
        self.call = call
        self.final: decode_pb2.DecodeFinal | None = None
        self.error: AttemptError | None = None
        self.done = False
        self.messages = 0
        self._tokens: list[int] = []
        self._wake = wake
        self._first_timeout = first_timeout_s
        self._stall_timeout = stall_timeout_s
        self._stalled = False
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._last = loop.time()
        self._reader = loop.create_task(self._read())
        self._watchdog: asyncio.TimerHandle | None = None
        self._arm()

    def take(self) -> list[int]:
        """Tokens received since the last take (in order)."""
        out = self._tokens
        if out:
            self._tokens = []
        return out

    @property
    def pending(self) -> bool:
        return bool(self._tokens)

    def cancel(self) -> None:
        """Stop reading and cancel the call (idempotent)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if not self._reader.done():
            self._reader.cancel()
        self.call.cancel()

    async def wait_closed(self) -> None:
        """Wait until the reader has finished (after `cancel`, for tests and shutdown)."""
        try:
            await self._reader
        except asyncio.CancelledError:
            pass

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                self._last = self._loop.time()
                self.messages += 1
                if self.messages == 1:  # from the first-message limit to the stall limit
                    self._rearm()
                kind = msg.WhichOneof("chunk")
                if kind == "tokens":
                    self._tokens.extend(msg.tokens.token_ids)  # `take` swaps the list
                    self._wake.set()
                elif kind == "final":
                    self.final = msg.final
                    break
            if self.final is None:
                self.error = AttemptError.from_status(
                    grpc.StatusCode.UNKNOWN, "the decode stream ended without a final message"
                )
        except grpc.aio.AioRpcError as e:
            self.error = AttemptError.from_status(e.code(), e.details() or "")
        except asyncio.CancelledError:
            if not self._stalled:
                raise
            got = "its first message" if self.messages == 0 else "a token"
            self.error = AttemptError(
                grpc.StatusCode.UNAVAILABLE, f"stalled: no {got} in time", retryable=True, worker_fault=True
            )
            self.call.cancel()
        finally:
            self.done = True
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
            self._wake.set()

    # ---- stall watchdog -----------------------------------------------------

    def _limit(self) -> float:
        return self._first_timeout if self.messages == 0 else self._stall_timeout

    def _arm(self) -> None:
        limit = self._limit()
        if limit > 0 and not self.done:
            self._watchdog = self._loop.call_at(self._last + limit, self._check)
        else:
            self._watchdog = None

    def _rearm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._arm()

    def _check(self) -> None:
        self._watchdog = None
        if self.done:
            return
        limit = self._limit()
        if limit > 0 and self._loop.time() - self._last >= limit:
            self._stalled = True
            self._reader.cancel()
        else:
            self._arm()
