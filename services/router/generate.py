"""The life of one Generate request inside the router, across attempts.

`RequestFlow.run()` is an async generator of token-id lists (one per client
message) and, last, a `FlowFinal`. It drives the cores and talks to decode
workers only through the injected `call_decode(worker_id, request, timeout)`,
so it runs in unit tests against fake calls:

    admission (AdmissionGate: slot now, queue, or shed)
    -> attempt: rank decode workers (policy over the registry's eligible
       workers, prefix overlaps from the index), take the first whose breaker
       lets it through, rank prefill candidates, call the worker with the
       remaining deadline, relay its tokens (DecodeAttempt)
    -> on failure: the journey decides (migration.decide_recovery: retry before
       the first token, if the retry budget grants one; migrate with resume
       tokens after it; give up), and the flow applies the decision
    -> the cost of the request goes to the CostLedger, exactly once.

Cancellation (client gone, or `cancel()` from Router.Cancel) cancels the
running downstream call at once; cleanup is in `finally`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from pdmesh.v1 import common_pb2, decode_pb2
from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    ResourceExhausted,
    Unavailable,
)
from services.model.hashing import BlockHashChain
from services.router.admission import AdmissionRejected, DeadlineUnreachable, InvalidAdmission, Ticket, Waiter
from services.router.admission_gate import AdmissionGate
from services.router.attempt import AttemptError, DecodeAttempt, DecodeCall
from services.router.circuit_breaker import BreakerRegistry
from services.router.config import RouterConfig
from services.router.cost import CostLedger, RequestCost
from services.router.load_view import LoadView
from services.router.migration import Cause, JourneyConfig, Recovery, RequestJourney
from services.router.policy import Candidate, Policy
from services.router.prefix_index import PrefixIndex
from services.router.registry import WorkerRegistry, WorkerRole
from services.router.retry_budget import RetryBudget

log = structlog.get_logger()

CallDecode = Callable[[str, decode_pb2.DecodeServiceGenerateRequest, "float | None"], DecodeCall]


class Cancelled(MeshError):
    code = grpc.StatusCode.CANCELLED


class AlreadyExists(MeshError):
    code = grpc.StatusCode.ALREADY_EXISTS


@dataclass(frozen=True)
class FlowRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams  # validated, seed assigned, max_tokens set
    tenant: str = ""
    priority: int = 0
    workflow: common_pb2.WorkflowContext | None = None
    timeout_s: float | None = None  # the client's remaining deadline at arrival

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens


@dataclass(frozen=True, kw_only=True)
class FlowFinal:
    finish_reason: int  # common_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    computed_tokens: int
    worker_id: str
    migrations: int
    prefill_path: str


@dataclass
class RoutingContext:
    """Everything a flow reads or drives; built once by `Router`."""

    config: RouterConfig
    registry: WorkerRegistry
    index: PrefixIndex
    decode_policy: Policy
    prefill_policy: Policy
    breakers: BreakerRegistry
    budget: RetryBudget
    ledger: CostLedger
    gate: AdmissionGate
    journey_config: JourneyConfig
    call_decode: CallDecode
    clock: Callable[[], float] = time.monotonic
    metrics: Any = None  # RouterMetrics or None
    notify: Callable[[], None] = lambda: None  # state changed (a request queued), for waiters
    load_view: LoadView | None = None  # the router's own load account; None: heartbeats only


def saturated(c: Candidate, config: RouterConfig) -> bool:
    if config.max_waiting_per_worker and c.load.waiting >= config.max_waiting_per_worker:
        return True
    return bool(config.max_inflight_per_worker and c.inflight >= config.max_inflight_per_worker)


def check_capacity(ctx: RoutingContext) -> None:
    """Fail fast before admission: UNAVAILABLE with no decode worker, RESOURCE_EXHAUSTED
    (with a retry hint) when every one is saturated."""
    cands = ctx.registry.eligible(WorkerRole.DECODE)
    if not cands:
        raise Unavailable("no healthy decode worker")
    if all(saturated(c, ctx.config) for c in cands):
        raise ResourceExhausted(
            "every decode worker is saturated", retry_after_s=ctx.config.saturated_retry_after_s
        )


class RequestFlow:
    def __init__(self, ctx: RoutingContext, req: FlowRequest):
        self.ctx = ctx
        self.req = req
        self.journey = RequestJourney(
            req.request_id, req.prompt_token_ids, req.max_tokens, ctx.journey_config
        )
        self._wake = asyncio.Event()
        self._attempt: DecodeAttempt | None = None
        self._waiter: Waiter | None = None
        self._cancel_error: Cancelled | None = None
        self._cost: RequestCost | None = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._started = loop.time()
        self._last_sent = self._started  # when the last tokens left (inter-token latency)
        self._deadline = None if req.timeout_s is None else self._started + req.timeout_s
        self.worker_id = ""
        self._routed: int | None = None  # this attempt's LoadView key
        self._last_error: tuple[str, AttemptError] | None = None

    def cancel(self, why: str = "cancelled by Router.Cancel") -> None:
        """Stop the request now: cancel the downstream call, end the stream with CANCELLED."""
        if self._cancel_error is None:
            self._cancel_error = Cancelled(why)
        if self._waiter is not None:
            self.ctx.gate.abort(self._waiter, self._cancel_error)
        if self._attempt is not None:
            self._attempt.cancel()
        self._wake.set()

    async def run(self) -> AsyncIterator[list[int] | FlowFinal]:
        """Token-id lists (one per client message), then a FlowFinal; raises a
        MeshError for the status the client gets."""
        ticket = await self._admit()
        try:
            self.ctx.budget.record_request()
            async for item in self._attempts():
                yield item
        except BaseException:
            if self._cost is None:  # cancelled (client or Router.Cancel), deadline, or gave up
                self._cost = self._end_unfinished()
            raise
        finally:
            if self._attempt is not None:
                self._attempt.cancel()
            if self._cost is not None:
                self.ctx.ledger.record(self._cost)
            self.ctx.gate.release(ticket)

    async def _admit(self) -> Ticket:
        ctx, req = self.ctx, self.req
        deadline = None if req.timeout_s is None else ctx.clock() + req.timeout_s
        cost = len(req.prompt_token_ids) + req.max_tokens
        try:
            return await ctx.gate.acquire(req.tenant, req.priority, cost, deadline, self._on_queued)
        except DeadlineUnreachable as e:
            self._shed(e.reason)
            raise DeadlineExceeded(str(e)) from e
        except AdmissionRejected as e:
            self._shed(e.reason)
            raise ResourceExhausted(str(e), retry_after_s=e.retry_after_s) from e
        except InvalidAdmission as e:
            raise InvalidArgument(str(e)) from e
        finally:
            self._waiter = None

    def _on_queued(self, waiter: Waiter) -> None:
        self._waiter = waiter
        self.ctx.notify()

    def _shed(self, reason: str) -> None:
        self.ctx.ledger.record_shed()
        if self.ctx.metrics is not None:
            self.ctx.metrics.shed(reason)

    def _end_unfinished(self) -> RequestCost:
        if self._cancel_error is not None or self.journey.current is not None:
            return self.journey.cancel()
        return self.journey.give_up()

    # ---- attempts -----------------------------------------------------------

    async def _attempts(self) -> AsyncIterator[list[int] | FlowFinal]:
        ctx, journey = self.ctx, self.journey
        remaining = self.req.max_tokens
        first = True
        while True:
            attempt = self._launch()
            worker = attempt.worker_id
            settled = False
            try:
                while True:
                    if self._cancel_error is not None:
                        raise self._cancel_error
                    ids = attempt.take()
                    if ids:
                        if len(ids) > remaining:  # a worker that overruns max_tokens: cut it off
                            ids = ids[:remaining]
                        remaining -= len(ids)
                        journey.record_tokens(ids)
                        if self._routed is not None:  # the attempt's prefill is done
                            ctx.load_view.first_token(self._routed)  # type: ignore[union-attr]
                        now = self._loop.time()
                        if ctx.metrics is not None:
                            if first:
                                ctx.metrics.ttft(now - self._started)
                            else:
                                ctx.metrics.itl(now - self._last_sent, len(ids))
                        first = False
                        self._last_sent = now
                        yield ids
                        continue
                    if attempt.done:
                        settled = True
                        break
                    await self._wake.wait()
                    self._wake.clear()
            finally:
                ctx.registry.end_request(worker)
                if self._routed is not None:
                    ctx.load_view.end(self._routed)  # type: ignore[union-attr]
                    self._routed = None
                if not settled:  # cancelled or closed mid-attempt: no verdict on the worker
                    ctx.breakers.record_ignored(worker)
            self._attempt = None
            if attempt.final is not None:
                yield self._succeed(attempt)
                return
            err = attempt.error
            assert err is not None
            if err.worker_fault:
                ctx.breakers.record_failure(worker)
            else:
                ctx.breakers.record_ignored(worker)
            final = self._recover(worker, err)
            if final is not None:
                yield final
                return

    def _succeed(self, attempt: DecodeAttempt) -> FlowFinal:
        final = attempt.final
        assert final is not None
        self.ctx.breakers.record_success(attempt.worker_id)
        computed = final.usage.computed_tokens or None  # 0: the worker did not say; estimate
        self._cost = self.journey.succeed(computed)
        return FlowFinal(
            finish_reason=final.finish_reason,
            prompt_tokens=len(self.req.prompt_token_ids),
            completion_tokens=len(self.journey.delivered_token_ids),
            cached_prompt_tokens=final.usage.cached_prompt_tokens,
            computed_tokens=self._cost.computed_tokens,
            worker_id=attempt.worker_id,
            migrations=self.journey.migrations,
            prefill_path=final.prefill_path,
        )

    def _recover(self, worker: str, err: AttemptError) -> FlowFinal | None:
        """After a failed attempt, apply the journey's decision: return a final
        (COMPLETE), fall through to the next attempt (None), or raise the error
        the client gets."""
        ctx = self.ctx
        decision = self.journey.fail_attempt(
            err.retryable, another_worker=self._another_worker(), retry_budget=ctx.budget.can_retry()
        )
        log.info(
            "attempt_failed",
            request_id=self.req.request_id,
            worker=worker,
            code=err.code.name,
            details=err.details,
            decision=decision.action.value,
            delivered=len(self.journey.delivered_token_ids),
        )
        if decision.action is Recovery.RETRY:
            ctx.budget.record_retry()
        elif decision.cause is Cause.RETRY_BUDGET:
            ctx.budget.record_denied()
            if ctx.metrics is not None:
                ctx.metrics.retry_denied()
        if decision.action is Recovery.COMPLETE:
            self._cost = self.journey.complete()
            return FlowFinal(
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                prompt_tokens=len(self.req.prompt_token_ids),
                completion_tokens=len(self.journey.delivered_token_ids),
                cached_prompt_tokens=0,
                computed_tokens=self._cost.computed_tokens,
                worker_id=worker,
                migrations=self.journey.migrations,
                prefill_path="",
            )
        if decision.action is Recovery.GIVE_UP:
            self._cost = self.journey.give_up()
            raise err.to_mesh_error(worker, decision.reason)
        self._last_error = (worker, err)
        return None

    def _another_worker(self) -> bool:
        """Is there an eligible decode worker this request has not failed on?"""
        failed = {a.worker_id for a in self.journey.attempts}
        return any(c.worker_id not in failed for c in self.ctx.registry.eligible(WorkerRole.DECODE))

    def _launch(self) -> DecodeAttempt:
        """Pick a decode worker for the next attempt and start the call."""
        ctx, cfg, plan = self.ctx, self.ctx.config, self.journey.next_attempt()
        input_ids = plan.prompt_token_ids + plan.resume_token_ids
        hashes = BlockHashChain(input_ids, cfg.block_size)  # hashed as far as the match reads
        now = ctx.clock()
        ctx.index.expire(now)  # optimistic entries nobody confirmed in time
        overlaps = ctx.index.match(hashes) if hashes else {}
        cands = [
            c
            for c in ctx.registry.eligible(WorkerRole.DECODE)
            if c.worker_id not in plan.exclude_workers and not saturated(c, cfg)
        ]
        if ctx.load_view is not None:
            cands = ctx.load_view.blend(cands)
        credits = None  # host-tier hits: credited by what each worker measured (tier_index)
        tier_credits = getattr(ctx.index, "tier_credits", None)
        if (
            tier_credits is not None
            and cfg.tier_credit
            and ctx.decode_policy.name == "kv_aware"
            and ctx.index.tiers.has_tiers()
        ):
            credits = tier_credits(hashes, overlaps, {c.worker_id: c.load for c in cands}) or None
        choice = None
        ranked = (
            ctx.decode_policy.rank(cands, len(hashes), overlaps, credits=credits)
            if credits
            else ctx.decode_policy.rank(cands, len(hashes), overlaps)
        )
        for ch in ranked:
            if ctx.breakers.allow_request(ch.worker_id):
                choice = ch
                break
        if choice is None:
            self._cost = self.journey.give_up()
            last = self._last_error
            if last is not None:
                raise last[1].to_mesh_error(last[0], "no other decode worker to try")
            raise Unavailable("no decode worker available")
        timeout = None
        if self._deadline is not None:
            timeout = self._deadline - self._loop.time()
            if timeout <= 0:
                ctx.breakers.record_ignored(choice.worker_id)
                self._cost = self.journey.cancel()
                raise DeadlineExceeded("the deadline passed before the next attempt could start")
        request = decode_pb2.DecodeServiceGenerateRequest(
            request_id=self.req.request_id,
            prompt_token_ids=plan.prompt_token_ids,
            resume_token_ids=plan.resume_token_ids,
            sampling=self.req.sampling,
            tenant=self.req.tenant,
            priority=self.req.priority,
            workflow=self.req.workflow,
            prefill_candidates=self._prefill_candidates(len(hashes), overlaps),
        )
        self.journey.start_attempt(choice.worker_id, cached_tokens=choice.overlap_blocks * cfg.block_size)
        total_blocks = -(-(len(input_ids) + plan.max_tokens_remaining) // cfg.block_size)
        new_blocks = total_blocks - choice.overlap_blocks
        # With the load view the registry's pending blocks would count the request twice.
        ctx.registry.begin_request(choice.worker_id, 0 if ctx.load_view is not None else new_blocks)
        if cfg.optimistic_prefix_ttl_s > 0:
            ctx.index.apply_provisional(choice.worker_id, hashes, now + cfg.optimistic_prefix_ttl_s)
        self.worker_id = choice.worker_id
        call = ctx.call_decode(choice.worker_id, request, timeout)
        if ctx.load_view is not None:  # ended in _attempts' finally, like end_request
            to_prefill = len(input_ids) - choice.overlap_blocks * cfg.block_size
            self._routed = ctx.load_view.begin(choice.worker_id, to_prefill, new_blocks)
        self._attempt = DecodeAttempt(
            choice.worker_id,
            call,
            self._wake,
            cfg.first_token_timeout_s,
            cfg.stall_timeout_s,
            cfg.max_buffered_tokens,
        )
        return self._attempt

    def _prefill_candidates(self, prompt_blocks: int, overlaps: dict[str, int]) -> list[Any]:
        ctx = self.ctx
        limit = ctx.config.max_prefill_candidates
        if limit == 0:
            return []
        cands = ctx.registry.eligible(WorkerRole.PREFILL)
        if not cands:
            return []
        out = []
        for ch in ctx.prefill_policy.rank(cands, prompt_blocks, overlaps)[:limit]:
            rec = ctx.registry.get(ch.worker_id)
            if rec is None:
                continue
            out.append(
                decode_pb2.PrefillCandidate(
                    worker_id=ch.worker_id,
                    address=rec.info.address,
                    overlap_blocks=ch.overlap_blocks,
                    estimated_wait_ms=rec.load.estimated_wait_ms,
                )
            )
        return out
