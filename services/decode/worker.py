"""DecodeWorker: one decode request from the disaggregation decision to its usage, no gRPC.

Owns, per request: the disaggregation decision (this worker's cached prefix ->
a fresh load probe of the prefill candidates when the request may go remote ->
`DisaggregationPolicy`), the remote path (`RemotePrefill`) with its single local
fallback, the request's deadline, and its accounting (tokens, cached and
computed tokens, KV bytes, metrics). It yields typed events, `Tokens` for each
delta and one `Finished` last (or hands the tokens to a sink: the link's path); the
servicer turns a message into a `DecodeJob` and the events into messages, and nothing else.

Cleanup ordering, which the unit tests drive through every failure point:
- remote path: `RemotePrefill` frees this worker's reservation and asks the
  prefill worker to release its lease *before* it raises `RemotePrefillFailed`;
  only then does the local fallback allocate, so a fallback never holds two
  reservations, and a fallback with no deadline left is refused
  (`DeadlineExceeded`) instead of started;
- cancellation (the consumer goes away, or its task is cancelled) at any await:
  an in-flight Prefill call or pull is cancelled and `RemotePrefill` cleans up
  as above; an engine stream is closed (`aclosing`), which aborts the request
  and frees its blocks;
- the deadline: the remote path is bounded by it (and by `prefill_timeout_s`);
  a stream that passes it is closed like a cancelled one and the request ends
  with `DeadlineExceeded`.

A request whose client set no deadline gets `max_request_s`, the configured
longest a request may run; a client deadline is capped by it too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import structlog

from services.common import tracing
from services.common.errors import DeadlineExceeded
from services.common.wait_estimator import PathRates
from services.decode.disagg_policy import (
    Candidate,
    Decision,
    DisaggregationPolicy,
    Mode,
    Path,
    Reason,
    RunningDecode,
)
from services.decode.metrics import DecodeMetrics
from services.decode.prefill_load import OwnDispatches, PrefillLoadProbe
from services.decode.prefix_pull import PrefixPuller, PullHint
from services.decode.remote_prefill import RemotePrefill, RemotePrefillFailed, RemoteResult
from services.engine.api import Engine, EngineRequest, EngineStats, FinishReason, RequestOutput

log = structlog.get_logger()

# A fallback needs at least this much of the deadline left to be worth trying.
MIN_FALLBACK_S = 0.05


@dataclass(frozen=True)
class DecodeJob:
    """One Generate call, converted from its message (validated already)."""

    request: EngineRequest  # request_id unique on this worker
    client_request_id: str  # the id the caller knows the request by (logs, traces)
    mode: Mode | None = None  # None: the policy's default mode
    candidates: Sequence[Candidate] | None = None  # ranked by the router; None: the static ones
    timeout_s: float | None = None  # the client's remaining deadline; None: max_request_s
    pull: PullHint | None = None  # the router's prefix-pull hint (issue 17); the local path follows it


@dataclass(frozen=True)
class Tokens:
    """New output tokens, in order."""

    token_ids: list[int]


@dataclass(frozen=True)
class Finished:
    """The request ended normally; what it cost and where it was prefilled."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    # Prefill work (here or on the prefill worker) plus one forward pass per
    # generated token after the first.
    computed_tokens: int
    path: Path
    reason: Reason
    prefill_worker_id: str
    kv_bytes_transferred: int
    pulled_prefix_tokens: int = 0  # prompt tokens pulled from a peer's prefix cache


Event = Tokens | Finished
TokenSink = Callable[[list[int]], None]  # a request's new tokens, in order


@dataclass
class _Account:
    """What one request has used so far."""

    decision: Decision
    prompt_tokens: int
    cached_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    prefill_worker_id: str = ""
    kv_bytes: int = 0
    finish: FinishReason | None = None
    decided_at: float = 0.0  # time.monotonic() of the decision
    predicted_wait: float = 0.0  # the local wait predicted then
    pull: PullHint | None = None
    pulled_tokens: int = 0

    def local_output(self, out: RequestOutput) -> None:
        self.completion_tokens += len(out.token_ids)
        if self.decision.path is Path.LOCAL and out.num_computed_prompt_tokens:
            self.computed_tokens = max(self.computed_tokens, out.num_computed_prompt_tokens)

    def remote_result(self, result: RemoteResult) -> None:
        self.prefill_worker_id = result.prefill_worker_id
        self.kv_bytes = result.bytes_transferred
        self.cached_tokens = max(result.cached_prefix_tokens, result.local_cached_tokens)
        self.computed_tokens += result.prefill_computed_tokens

    def finished(self) -> Finished:
        # Decode work: every generated token after the first needed a forward pass,
        # and the first one too on the local path (it came out of the prefill pass).
        assert self.finish is not None, "the engine stream ended without a finished output"
        return Finished(
            finish_reason=self.finish,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_tokens,
            computed_tokens=self.computed_tokens + max(self.completion_tokens - 1, 0),
            path=self.decision.path,
            reason=self.decision.reason,
            prefill_worker_id=self.prefill_worker_id,
            kv_bytes_transferred=self.kv_bytes,
            pulled_prefix_tokens=self.pulled_tokens,
        )


class DecodeWorker:
    def __init__(
        self,
        engine: Engine,
        policy: DisaggregationPolicy,
        remote: RemotePrefill | None,
        metrics: DecodeMetrics,
        *,
        static_candidates: Sequence[Candidate] = (),
        prefill_timeout_s: float = 30.0,
        max_request_s: float = 3600.0,
        probe: PrefillLoadProbe | None = None,
        puller: PrefixPuller | None = None,
    ):
        if prefill_timeout_s <= 0 or max_request_s <= 0:
            raise ValueError("prefill_timeout_s and max_request_s must be > 0")
        self.engine = engine
        self.policy = policy
        self.remote = remote
        self.metrics = metrics
        self.static_candidates = list(static_candidates)
        self.prefill_timeout_s = prefill_timeout_s
        self.max_request_s = max_request_s
        self.probe = probe
        self.puller = puller  # follows prefix-pull hints (None: ignored)
        self.own_dispatches = OwnDispatches()
        # The time rule's inputs, fed at every first token, decode interval,
        # remote prefill and KV pull (not only at decisions).
        self.rates = PathRates()
        self.waits = self.rates.local
        self._live: dict[str, _Live] = {}  # requests past their first token here
        self._incoming: dict[str, int] = {}  # remote prefills in flight -> their max_tokens

    def local_wait_s(self, stats: EngineStats | None = None) -> float:
        """Estimated wait before a new local prefill would start (the measured rate
        updated from `stats`, the engine's now when None)."""
        s = self.engine.stats() if stats is None else stats
        self.rates.observe_local(s.prompt_tokens_computed, s.tokens_waiting)
        return self.waits.wait_s(s.tokens_waiting)

    def running_decodes(self, now: float | None = None) -> list[RunningDecode]:
        """The decodes a local prefill would stall, as the policy prices them."""
        now = time.monotonic() if now is None else now
        live = [
            RunningDecode(lv.decoded, max(lv.max_tokens - 1 - lv.decoded, 0), now - lv.first_at)
            for lv in self._live.values()
        ]
        return live + [RunningDecode(0, max(n - 1, 0), 0.0) for n in self._incoming.values()]

    async def generate(
        self, job: DecodeJob, sink: TokenSink | None = None, on_started: Callable[[], None] | None = None
    ) -> AsyncIterator[Event]:
        """`Tokens` events, then one `Finished`; raises a MeshError (DeadlineExceeded)
        or an engine error. Close the iterator (aclosing) to abort early.

        With a `sink`, the tokens go to it instead and only `Finished` is yielded: after
        the first token the engine calls it from its delivery callback (`Engine.divert`),
        so a decoding request costs no task wake-up per engine step (the link's path).

        `on_started()`: called once when this worker's engine begins the request's prefill
        (EngineRequest.on_started), on the local path without a prefix pull only; a
        remote prefill or a pull never reports it (the router's hedge then races on the
        first token, as without it)."""
        self.metrics.requests.inc()
        started = time.monotonic()
        limit = self.max_request_s if job.timeout_s is None else min(job.timeout_s, self.max_request_s)
        deadline = started + limit
        req = job.request
        context_len = len(req.prompt_token_ids) + len(req.resume_token_ids)
        cached = self.engine.prefix_lookup([*req.prompt_token_ids, *req.resume_token_ids])
        decision, wait = await self._decide(job, context_len, cached)
        account = _Account(decision, prompt_tokens=len(req.prompt_token_ids), cached_tokens=cached)
        account.decided_at, account.predicted_wait = time.monotonic(), wait
        account.pull = job.pull
        self._record_decision(job, decision, context_len, cached)
        outcome = "cancelled"
        try:
            async for event in self._run(req, account, deadline, started, sink, on_started):
                yield event
            outcome = "ok"
            yield account.finished()
        except _StreamDeadline as e:
            # Counted as before the core kept the deadline itself: the gRPC edge
            # cancelled such a call, and cancelled is what it was counted as.
            raise DeadlineExceeded(f"the deadline passed {e.where}") from None
        except Exception:
            outcome = "failed"
            raise
        finally:
            self.metrics.finished(outcome)

    # ---- the decision --------------------------------------------------------

    async def _decide(self, job: DecodeJob, context_len: int, cached: int) -> tuple[Decision, float]:
        """The decision and the local wait predicted for it."""
        mode = job.mode or Mode(self.policy.config.default_mode)
        self.rates.arrived(job.request.sampling.max_tokens - len(job.request.resume_token_ids))
        candidates = self._candidates(job)
        if not candidates:
            # Local whatever the wait: skip the engine stats walk the wait estimate needs
            # (a per-request cost at near-zero load, issue 16 item 4).
            decision = self.policy.decide(context_len, cached, (), 0.0, mode, self.waits.tokens_per_s)
            self.waits.started()
            return decision, 0.0
        if self.probe is not None and self.policy.may_go_remote(context_len - cached, mode):
            candidates = await self.probe.refresh(candidates)
        candidates = self.own_dispatches.apply(candidates, self.rates.remote_tokens_per_s)
        s = self.engine.stats()
        wait = self.local_wait_s(s)  # the token rule's (engine counters)
        if not self.policy.config.token_rule:
            wait = self.rates.local_wait_s(s.tokens_waiting)  # per-prefill measured rate
        decision = self.policy.decide(
            context_len,
            cached,
            candidates,
            wait,
            mode,
            self.waits.tokens_per_s,
            rates=self.rates.snapshot(),
            running=self.running_decodes(),
        )
        if decision.path is Path.LOCAL:
            self.waits.started()  # measure this prefill (the backlog was sampled before it)
        return decision, wait

    def _candidates(self, job: DecodeJob) -> list[Candidate]:
        if self.remote is None:
            return []
        return list(job.candidates) if job.candidates else list(self.static_candidates)

    def _record_decision(self, job: DecodeJob, decision: Decision, context_len: int, cached: int) -> None:
        self.metrics.decided(decision)
        prefill_worker = decision.candidate.worker_id if decision.candidate else None
        log.info(
            "disagg_decision",
            request_id=job.client_request_id,
            path=decision.path.value,
            reason=decision.reason.value,
            prompt_tokens=context_len,
            cached_tokens=cached,
            prefill_worker=prefill_worker,
        )
        tracing.annotate(
            request_id=job.client_request_id,
            path=decision.path.value,
            reason=decision.reason.value,
            prefill_worker=prefill_worker,
        )

    # ---- running it ------------------------------------------------------------

    async def _run(
        self,
        req: EngineRequest,
        account: _Account,
        deadline: float,
        started: float,
        sink: TokenSink | None,
        on_started: Callable[[], None] | None = None,
    ) -> AsyncIterator[Tokens]:
        outputs = None
        if account.decision.path is Path.REMOTE:
            result = await self._try_remote(req, account, deadline)
            if result is not None and result.outputs is None:  # the first token finished it
                account.completion_tokens, account.finish = 1, result.finish_reason
                self.metrics.ttft.observe(time.monotonic() - started)
                if sink is None:
                    yield Tokens([result.first_token_id])
                else:
                    sink([result.first_token_id])
                return
            outputs = result.outputs if result is not None else None
        if outputs is None:
            if on_started is not None and account.pull is None:
                req = dataclasses.replace(req, on_started=on_started)
            outputs = await self._local_outputs(req, account, deadline)
        decoding = _Decoding(self, req, account, started, sink)
        diverted = sink is None  # nothing to divert to
        timer = _StreamTimer(deadline, account.decision.path)
        # Closing the stream (finished, cancelled, deadline) aborts the engine request.
        try:
            async with aclosing(outputs) as stream:
                while True:
                    out = await timer.next(stream)
                    if out is None:
                        return
                    tokens = decoding.output(out)
                    if tokens is not None:
                        if sink is None:
                            yield Tokens(tokens)
                        else:
                            sink(tokens)
                    if out.finished:
                        account.finish = out.finish_reason
                        return
                    if not diverted and not decoding.first:
                        # Past the first token: the rest of the stream's outputs, but its
                        # last, go through decoding.diverted in the engine's callback.
                        diverted = self.engine.divert(req.request_id, decoding.diverted)
        finally:
            timer.cancel()
            self._live.pop(req.request_id, None)

    async def _local_outputs(
        self, req: EngineRequest, account: _Account, deadline: float
    ) -> AsyncIterator[RequestOutput]:
        """The local path's engine stream; with a prefix-pull hint, after pulling the
        hinted prefix (services/decode/prefix_pull.py; a failed pull falls back to this)."""
        if account.pull is None or self.puller is None:
            return self.engine.generate(req)
        outputs, account.pulled_tokens = await self.puller.generate(req, account.pull, deadline, self.rates)
        tracing.annotate(pulled_prefix_tokens=account.pulled_tokens)
        return outputs

    async def _try_remote(
        self, req: EngineRequest, account: _Account, deadline: float
    ) -> RemoteResult | None:
        """The remote path; None after a failure (counted) means: prefill locally."""
        candidate = account.decision.candidate
        assert candidate is not None and self.remote is not None
        sent = max(len(req.prompt_token_ids) + len(req.resume_token_ids) - account.cached_tokens, 0)
        self.own_dispatches.begin(candidate.address, sent)
        sent_at = time.monotonic()
        self._incoming[req.request_id] = req.sampling.max_tokens - len(req.resume_token_ids)
        try:
            result = await self.remote.run(
                req, candidate, min(deadline, time.monotonic() + self.prefill_timeout_s)
            )
        except RemotePrefillFailed as e:
            # RemotePrefill has freed our reservation and asked for the lease back.
            self.metrics.fallback(e.stage, e.reason)
            log.warning(
                "remote_prefill_failed",
                request_id=req.request_id,
                stage=e.stage,
                reason=e.reason,
                prefill_worker=candidate.worker_id,
                error=str(e),
            )
            if deadline - time.monotonic() < MIN_FALLBACK_S:
                raise DeadlineExceeded("deadline passed during a failed remote prefill") from e
            account.decision = Decision(Path.LOCAL, Reason.FALLBACK)
            self.metrics.decided(account.decision)
            tracing.annotate(path="local", reason=Reason.FALLBACK.value, fallback=f"{e.stage}: {e.reason}")
            return None
        finally:
            self.own_dispatches.end(candidate.address, sent)
            self._incoming.pop(req.request_id, None)
        account.remote_result(result)
        elapsed = time.monotonic() - sent_at
        self.rates.remote_done(
            result.prefill_computed_tokens, elapsed - result.transfer_seconds, candidate.estimated_wait_s
        )
        self.rates.pulled(result.bytes_transferred, result.transfer_seconds, sent)
        if result.bytes_transferred:
            self.metrics.transferred(result.bytes_transferred, result.transfer_seconds)
        tracing.annotate(kv_bytes=result.bytes_transferred)
        return result


class _Decoding:
    """One request's per-output accounting (TTFT, inter-token intervals, the time
    rule's rates, the live decode), whether its outputs are pulled from the stream
    or handed to `diverted` by the engine."""

    __slots__ = ("_account", "_last", "_live", "_req", "_sink", "_worker", "first")

    def __init__(
        self,
        worker: DecodeWorker,
        req: EngineRequest,
        account: _Account,
        started: float,
        sink: TokenSink | None,
    ):
        self._worker, self._req, self._account, self._sink = worker, req, account, sink
        self._last = started
        self._live = _Live(first_at=started, max_tokens=req.sampling.max_tokens - len(req.resume_token_ids))
        self.first = True  # no token yet

    def output(self, out: RequestOutput) -> list[int] | None:
        """Account for one output; its new tokens, None when it has none."""
        w, account = self._worker, self._account
        if self.first and account.decision.path is Path.LOCAL:
            account.cached_tokens = out.num_cached_tokens or account.cached_tokens
        account.local_output(out)
        n = len(out.token_ids)
        if not n:
            return None
        now = time.monotonic()
        live = self._live
        if self.first:
            w.metrics.ttft.observe(now - live.first_at)
            self.first = False
            live.first_at = now
            live.decoded = n - 1
            w._live[self._req.request_id] = live
            w.local_wait_s()  # a prefill ended: measure the rate
            if account.decision.path is Path.LOCAL:
                w.rates.local_done(account.computed_tokens, now - account.decided_at, account.predicted_wait)
        else:
            w.metrics.itl(now - self._last, n)
            w.rates.decode_interval(now - self._last, n)
            live.decoded += n
        self._last = now
        return list(out.token_ids)

    def diverted(self, out: RequestOutput) -> None:
        """An unfinished output the engine handed over in its delivery callback."""
        tokens = self.output(out)
        if tokens is not None:
            assert self._sink is not None
            self._sink(tokens)


@dataclass
class _Live:
    """A request past its first token here: what its TPOT slack is made of."""

    first_at: float
    max_tokens: int
    decoded: int = 0


class _StreamDeadline(Exception):
    def __init__(self, where: str):
        self.where = where


class _StreamTimer:
    """A stream's deadline as one loop timer for the whole stream: it cancels the
    consumer's task only while that task waits for the stream's next output, and
    a wait that starts after it fired ends at once. A timer per output
    (`asyncio.timeout_at` around each `anext`) cost a timer handle, a task lookup
    and a cancel per token per request, ~15% of a loaded worker's loop CPU
    (issue 16 item 4)."""

    __slots__ = ("_handle", "_waiter", "_where", "expired")

    def __init__(self, deadline: float, path: Path):
        """`deadline` on time.monotonic's clock."""
        loop = asyncio.get_running_loop()
        self.expired = False
        self._waiter: asyncio.Task | None = None
        self._where = "during the local prefill or decode" if path is Path.LOCAL else "while decoding"
        self._handle = loop.call_at(loop.time() + (deadline - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self.expired = True
        if self._waiter is not None:
            self._waiter.cancel()

    async def next(self, stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        """The stream's next output, None at its end; `_StreamDeadline` once the deadline passed."""
        if self.expired:
            raise _StreamDeadline(self._where)
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        self._waiter = task
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            # Ours only when nobody else cancelled the task too (asyncio.timeout's rule).
            if self.expired and task.uncancel() <= cancelling:
                raise _StreamDeadline(self._where) from None
            raise
        finally:
            self._waiter = None

    def cancel(self) -> None:
        self._handle.cancel()
