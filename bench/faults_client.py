"""Clients of the faults study (bench/faults.py): open-loop requests that retry the way real clients do.

Owns one `Logical` record per request the application makes (all its attempts
inside) and the retry loop around `RouterService.Generate`. Two policies:

- `SDK`: what the OpenAI Python SDK does by default (openai/_base_client.py):
  2 retries on connection errors, 408/409/429 and 5xx (here UNAVAILABLE,
  RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNKNOWN), waiting
  min(0.5 * 2**n, 8) s x (1 - 0.25 * random()) unless the server sent a
  retry-after hint of at most 60 s (here the router's `retry-after-ms`
  trailer), which it waits instead. A stream that broke after its first token
  is not retried (the SDK retries the request, not a stream it already
  returned). Every attempt of a request carries one idempotency key (gRPC
  metadata `idempotency-key`, the HTTP header's name), as a client with
  idempotent retries sends; the router may join a retry to the running request.
- `NAIVE`: a client behind a plain proxy with default retries: on any error,
  mid-stream too, send the whole request again at once, until its deadline
  (`MAX_NAIVE_ATTEMPTS` only bounds a pathological loop; reported if hit).

Every request has a deadline `deadline_s` from its arrival; an attempt gets
what is left as its gRPC timeout, so nothing can outlive it by more than the
scheduling of this process. Both clients also have a read timeout
(`read_timeout_s`, as an application sets the SDK's `timeout=`, which httpx
applies to every read): an attempt with no message for that long is
abandoned (cancelled) and counts as READ_TIMEOUT, which the SDK retries before
the first token (APITimeoutError) and the naive client always. Tokens an attempt received before failing are
counted per request (`failed_attempt_tokens`): the clients' own count of
work thrown away.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc

from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

RETRYABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL", "UNKNOWN", "READ_TIMEOUT"}
MAX_NAIVE_ATTEMPTS = 50


@dataclass(frozen=True)
class RetryPolicy:
    name: str
    max_retries: int  # retries after the first attempt
    backoff: bool  # exponential backoff with jitter (else: at once)
    honour_hint: bool  # wait the server's retry-after hint when it sends one
    retry_mid_stream: bool  # retry a stream that broke after its first token
    idempotency_key: bool  # every attempt carries one key per request (gRPC metadata idempotency-key)
    any_error: bool = False  # retry every error (else only RETRYABLE codes)


SDK = RetryPolicy("sdk", 2, backoff=True, honour_hint=True, retry_mid_stream=False, idempotency_key=True)
NAIVE = RetryPolicy(
    "naive",
    MAX_NAIVE_ATTEMPTS - 1,
    backoff=False,
    honour_hint=False,
    retry_mid_stream=True,
    idempotency_key=False,
    any_error=True,
)


def sdk_wait_s(retries_so_far: int, hint_s: float | None, rng: random.Random) -> float:
    """openai-python's `_calculate_retry_timeout`: the hint if 0 < hint <= 60, else backoff with jitter."""
    if hint_s is not None and 0 < hint_s <= 60:
        return hint_s
    return min(0.5 * 2.0**retries_so_far, 8.0) * (1 - 0.25 * rng.random())


@dataclass
class Logical:
    """One application request and everything its attempts did. Times: seconds on the run's clock."""

    index: int
    arrival_s: float
    prompt_len: int
    max_tokens: int
    deadline_s: float
    attempts: int = 0
    ok: bool = False
    code: str = ""  # "" when ok, else the last attempt's status name
    first_token_s: float | None = None  # first token of the attempt that completed
    end_s: float | None = None
    tokens: int = 0  # delivered by the completing attempt
    computed: int = 0  # its final usage.computed_tokens (all router-side attempts)
    migrations: int = 0
    worker_id: str = ""
    failed_attempt_tokens: list[int] = field(default_factory=list)
    hints_s: list[float] = field(default_factory=list)  # retry-after hints received
    details: list[str] = field(default_factory=list)  # each failed attempt's "CODE: details"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.end_s is None or self.tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.tokens - 1)


def _hint_s(err: grpc.aio.AioRpcError) -> float | None:
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                return int(value) / 1000.0
            except ValueError:
                return None
    return None


class RetryingClient:
    def __init__(self, address: str, policy: RetryPolicy, seed: int, read_timeout_s: float):
        self.policy = policy
        self.read_timeout_s = read_timeout_s
        self._rng = random.Random(seed)
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def run(self, rec: Logical, prompt: tuple[int, ...], clock, run_id: str) -> None:
        """All attempts of one request, ending by its deadline."""
        deadline = rec.arrival_s + rec.deadline_s
        while True:
            left = deadline - clock()
            if left <= 0:
                rec.code = rec.code or "DEADLINE_EXCEEDED"
                break
            key = f"{run_id}-{rec.index}"
            rid = f"{key}-a{rec.attempts}"  # a new id per attempt: the last one may still be ending
            meta = (("idempotency-key", key),) if self.policy.idempotency_key else None
            rec.attempts += 1
            got, err = await self._attempt(rec, prompt, rid, meta, left, clock)
            if err is None:
                break
            rec.code = err.code().name
            rec.failed_attempt_tokens.append(got)
            detail = err.details() if isinstance(err, grpc.aio.AioRpcError) else ""
            rec.details.append(f"{rec.code}: {(detail or '')[:80]}")
            hint = _hint_s(err)
            if hint is not None:
                rec.hints_s.append(hint)
            retries = rec.attempts - 1
            # DEADLINE_EXCEEDED: the request's own deadline passed, nothing is left to retry in.
            retryable = rec.code != "DEADLINE_EXCEEDED" if self.policy.any_error else rec.code in RETRYABLE
            if not retryable:
                break
            if retries >= self.policy.max_retries or (got and not self.policy.retry_mid_stream):
                break
            if self.policy.backoff:
                wait = sdk_wait_s(retries, hint if self.policy.honour_hint else None, self._rng)
                if clock() + wait >= deadline:
                    break
                await asyncio.sleep(wait)  # the client's retry backoff, not synchronisation
        rec.end_s = clock()

    async def _attempt(self, rec: Logical, prompt, rid: str, meta, timeout_s: float, clock):
        """(tokens received, None) on success, (tokens received, error) on failure."""
        sampling = common_pb2.SamplingParams(max_tokens=rec.max_tokens, ignore_eos=True)
        req = router_pb2.GenerateRequest(
            request_id=rid, token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling
        )
        got, first, final = 0, None, None
        call = self._stub.Generate(req, timeout=timeout_s, metadata=meta)
        try:
            while True:
                try:  # the client's read timeout: no message for this long abandons the attempt
                    msg = await asyncio.wait_for(call.read(), self.read_timeout_s)
                except TimeoutError:
                    call.cancel()
                    return got, _Failed("READ_TIMEOUT")
                if msg is grpc.aio.EOF:
                    break
                if msg.HasField("delta"):
                    if msg.delta.token_ids and first is None:
                        first = clock()
                    got += len(msg.delta.token_ids)
                elif msg.HasField("final"):
                    final = msg.final
        except grpc.aio.AioRpcError as e:
            return got, e
        if final is None or got == 0:
            return got, _Failed("INCOMPLETE")
        rec.ok, rec.code, rec.first_token_s, rec.tokens = True, "", first, got
        rec.computed, rec.migrations, rec.worker_id = (
            final.usage.computed_tokens,
            final.migrations,
            final.worker_id,
        )
        return got, None


class _Failed:
    """An attempt that ended without a gRPC error: READ_TIMEOUT (the client gave up on it) or
    INCOMPLETE (OK without a final message or tokens: never expected, a bug if seen)."""

    def __init__(self, name: str):
        self.name = name

    def code(self):
        return self

    def trailing_metadata(self):
        return ()
