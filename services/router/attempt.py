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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from pdmesh.v1 import decode_pb2
from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

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
    # The router's own verdict on the client (e.g. it stopped reading): the error
    # class the client gets, with `details` as its message, instead of the mapping below.
    client_error: type[MeshError] | None = None
    # The router moved the request itself (its worker went unhealthy before the first
    # token, issue 18): nothing was delivered, so the retry needs no retry budget.
    reroute: bool = False

    @classmethod
    def from_status(cls, code: grpc.StatusCode, details: str) -> AttemptError:
        if code in _CLIENT_FAULT:
            return cls(code, details, retryable=False, worker_fault=False)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:  # the request's own budget ran out
            return cls(code, details, retryable=False, worker_fault=False)
        return cls(code, details, retryable=True, worker_fault=code not in _NOT_WORKER_FAULT)

    def to_mesh_error(self, worker_id: str, why: str = "") -> MeshError:
        """The status the client gets when the request ends on this error."""
        if self.client_error is not None:
            return self.client_error(self.details)
        if self.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return InvalidArgument(self.details)
        if self.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            return PermissionDenied(self.details)
        if self.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"deadline exceeded on decode worker {worker_id}")
        suffix = f"; {why}" if why else ""
        return Unavailable(f"decode worker {worker_id} failed: {self.code.name}: {self.details}{suffix}")


# A watchdog that fires later than this (s) was held up by the router's own loop; it looks
# again before it blames the worker (`DecodeAttempt._check`).
LATE_TIMER_S = 0.01


class Wake:
    """The flow's wake-up: `asyncio.Event` for its one waiter, set once per token by an
    attempt and awaited once per token by the flow, without the Event's waiter deque,
    loop lookup and Python `set`/`wait` frames (issue 16: ~15 us of the router's
    profiled CPU per streamed token). The waiter calls `arm()`: None if set since the
    last wake-up (the flag is consumed, as Event's wait then clear), else a future that
    the next `set()` completes; it awaits that future itself (no coroutine frame to
    resume per token). A waiter cancelled meanwhile leaves a cancelled future: the next
    `set()` raises the flag instead."""

    __slots__ = ("_fut", "_set")

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None
        self._set = False

    def set(self) -> None:
        fut = self._fut
        if fut is None or fut.done():
            self._set = True
        else:
            fut.set_result(None)

    def is_set(self) -> bool:
        return self._set

    def arm(self) -> asyncio.Future[None] | None:
        if self._set:
            self._set = False
            return None
        fut = self._fut = asyncio.get_running_loop().create_future()
        return fut

    async def wait(self) -> None:
        fut = self.arm()
        if fut is not None:
            await fut


class DecodeAttempt:
    """One attempt; the flow takes tokens with `take` when woken.

    Fed in one of two ways: a per-request Generate call, drained by a reader
    task, or a link (services/router/link.py), whose `LinkCall` pushes into
    `push_tokens` / `push_final` / `push_error` from the link's reader, with no
    task per request. Either way the tokens wait in a buffer of at most
    `max_buffered_tokens` (0 = unbounded): when the flow's consumer stops
    taking them (a client that stopped reading) and the buffer is full, the
    attempt cancels its call (the worker frees the request's KV at once) and
    ends with RESOURCE_EXHAUSTED, a client fault, so nothing else on the
    worker or its link waits for that client.
    """

    def __init__(
        self,
        worker_id: str,
        call: DecodeCall,
        wake: Wake | asyncio.Event,
        first_timeout_s: float = 0.0,
        stall_timeout_s: float = 0.0,
        max_buffered_tokens: int = 0,
        on_first: Callable[[DecodeAttempt], None] | None = None,
    ):
        """`on_first(attempt)`: called once, when the first message (tokens or final) arrives
        (the outlier detector's TTFT sample; nothing runs per token)."""
        self.worker_id = worker_id
        self.call = call
        self.final: decode_pb2.DecodeFinal | None = None
        self.error: AttemptError | None = None
        self.done = False
        self.ended = False  # settled or cancelled: not in flight (the outlier detector's live view)
        self.messages = 0
        self._tokens: list[int] = []
        self._wake = wake
        self._first_timeout = first_timeout_s
        self._stall_timeout = stall_timeout_s
        self._max_buffered = max_buffered_tokens
        self._stalled = False
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._last = loop.time()
        self.started = self._last
        self.first_at: float | None = None  # when the first message arrived
        # When the worker reported the request's prefill begun (a link opened with
        # notify_started, before any message; None: not reported, or never asked).
        self.computing_at: float | None = None
        # The ITL sample: tokens received, and how many came with the first message.
        self.tokens_received = 0
        self._first_tokens = 0
        self.prefill_blocks = 0  # blocks the worker must prefill (set by the flow: TTFT samples)
        self.ahead_tokens = -1  # prompt tokens queued there when routed (set by the flow; -1: unknown)
        self._on_first = on_first
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._due = 0.0  # when the watchdog was due to run
        attach = getattr(call, "attach", None)
        if attach is not None:
            attach(self)
        else:
            self._reader = loop.create_task(self._read())
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
        self.ended = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        self.call.cancel()
        self._release()

    async def wait_closed(self) -> None:
        """Wait until the reader has finished (after `cancel`, for tests and shutdown)."""
        if self._reader is None:
            return
        try:
            await self._reader
        except asyncio.CancelledError:
            pass

    # ---- what the call delivers (the reader task or a link) ---------------------

    def push_tokens(self, token_ids) -> None:
        if self.done:
            return
        self._last = self._loop.time()
        self.messages += 1
        self.tokens_received += len(token_ids)
        if self.messages == 1:  # from the first-message limit to the stall limit
            self._first_tokens = self.tokens_received
            self._first()
            self._rearm()
        self._tokens.extend(token_ids)  # `take` swaps the list
        if self._max_buffered and len(self._tokens) > self._max_buffered:
            self._overflow()
            return
        self._wake.set()

    def push_started(self) -> None:
        """The worker began this request's prefill (a tied hedge races on it, hedge_race.py)."""
        if not self.done and not self.messages and self.computing_at is None:
            self.computing_at = self._loop.time()
            self._wake.set()

    def push_final(self, final: decode_pb2.DecodeFinal) -> None:
        if not self.done:
            self.messages += 1
            self.final = final
            if self.messages == 1:
                self._last = self._loop.time()
                self._first()
            self._settle()

    def push_error(self, error: AttemptError) -> None:
        if not self.done:
            self.error = error
            self._settle()

    def _first(self) -> None:
        self.first_at = self._last
        if self._on_first is not None:
            self._on_first(self)

    @property
    def mean_gap_s(self) -> float | None:
        """Mean time per token after the first message (None: no tokens after it). Per token,
        not per message: a link frame may carry several of one request's tokens."""
        later = self.tokens_received - self._first_tokens
        if self.first_at is None or later < 1:
            return None
        return (self._last - self.first_at) / later

    @property
    def last_at(self) -> float:
        """When the last message arrived (the start while none has)."""
        return self._last

    @property
    def later_tokens(self) -> int:
        """Tokens received after the first message's."""
        return self.tokens_received - self._first_tokens

    @property
    def stalled(self) -> bool:
        """The watchdog failed it: no first message, or no token, in time."""
        return self._stalled

    def fail_unstarted(self, why: str) -> bool:
        """Fail the attempt now if nothing came back yet (its worker went unhealthy): a
        retryable error that spends no retry budget (`AttemptError.reroute`). True if it did."""
        if self.done or self.messages:
            return False
        self.push_error(
            AttemptError(grpc.StatusCode.UNAVAILABLE, why, retryable=True, worker_fault=False, reroute=True)
        )
        self.cancel()
        return True

    def _settle(self) -> None:
        self.done = self.ended = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._release()
        self._wake.set()

    def _release(self) -> None:
        """Settled or cancelled: drop the references that make this attempt, its call and its
        flow a cycle (the call's sink is this attempt; `on_first` is the flow's). Reference
        counting then frees a finished request at once; as cycles, each one waited for the
        garbage collector, whose collections of a few thousand of them paused the router's
        loop for ~15 ms (issue 16's TTFT and ITL tails). Whatever arrives later is ignored."""
        self._on_first = None
        detach = getattr(self.call, "detach", None)
        if detach is not None:
            detach()

    def _overflow(self) -> None:
        n = len(self._tokens)
        self._tokens = []  # the client will not get them: it is failed instead
        self.push_error(
            AttemptError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the client stopped reading: {n} tokens buffered in the router "
                f"(limit {self._max_buffered}); the request was cancelled",
                retryable=False,
                worker_fault=False,
                client_error=ResourceExhausted,
            )
        )
        self.cancel()

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                kind = msg.WhichOneof("chunk")
                if kind == "tokens":
                    self.push_tokens(msg.tokens.token_ids)
                elif kind == "final":
                    self.push_final(msg.final)
                    break
                if self.done:
                    break
            if not self.done:
                self.push_error(
                    AttemptError.from_status(
                        grpc.StatusCode.UNKNOWN, "the decode stream ended without a final message"
                    )
                )
        except grpc.aio.AioRpcError as e:
            self.push_error(AttemptError.from_status(e.code(), e.details() or ""))
        except asyncio.CancelledError:
            if not self._stalled:
                raise
        finally:
            if not self.done:
                self._settle()

    # ---- stall watchdog -----------------------------------------------------

    def _limit(self) -> float:
        return self._first_timeout if self.messages == 0 else self._stall_timeout

    def _arm(self) -> None:
        limit = self._limit()
        if limit > 0 and not self.done:
            self._due = self._last + limit
            self._watchdog = self._loop.call_at(self._due, self._check)
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
        now = self._loop.time()
        late = now - self._due  # how far behind the router's own loop ran this timer
        if limit > 0 and late > LATE_TIMER_S:
            # A loop that was busy in an I/O callback (a batch of frames, a burst of requests)
            # runs its due timers *before* it polls the sockets again (libuv's order, so uvloop's;
            # asyncio's own loop polls first): the message this timer gives up on may have been
            # waiting in the socket for as long as the loop was behind. The router's lateness is
            # not the worker's: look again after the next poll, given as long again to catch up.
            self._due = now + min(late, limit)
            self._watchdog = self._loop.call_at(self._due, self._check)
            return
        if limit > 0 and now - self._last >= limit:
            self._stalled = True
            got = "its first message" if self.messages == 0 else "a token"
            self.push_error(
                AttemptError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"stalled: no {got} in time",
                    retryable=True,
                    worker_fault=True,
                )
            )
            self.cancel()
        else:
            self._arm()
