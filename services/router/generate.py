"""The life of one Generate request inside the router, across attempts.

`RequestFlow.run()` is an async generator of token-id lists (one per client
message) and, last, a `FlowFinal`. It drives the cores and talks to decode
workers only through the injected `call_decode(worker_id, request, timeout)`,
so it runs in unit tests against fake calls:

    admission (AdmissionGate: slot now, queue, or shed)
    -> attempt: rank decode workers (policy over the registry's eligible
       workers, prefix overlaps from the index; a latency outlier's cost
       inflated, services/router/outlier.py), take the first whose breaker and
       outlier state let it through, rank prefill candidates, call the worker
       with the remaining deadline and a first-token timeout from its predicted
       TTFT, relay its tokens (DecodeAttempt); with hedging on, a late first
       token sends a copy to the next worker (hedge_race.py); a worker that goes
       unhealthy before the first token has the attempt failed at once
       (`reroute_unstarted`), which retries it without spending retry budget
    -> on failure: the journey decides (migration.decide_recovery: retry before
       the first token, if the retry budget grants one; migrate with resume
       tokens after it; give up), and the flow applies the decision
    -> the cost of the request goes to the CostLedger, exactly once.

Cancellation (client gone, or `cancel()` from Router.Cancel) cancels the
running downstream call at once; cleanup is in `finally`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
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
from services.router.attempt import AttemptError, DecodeAttempt, DecodeCall, Wake
from services.router.circuit_breaker import BreakerRegistry
from services.router.config import RouterConfig
from services.router.cost import CostLedger, RequestCost
from services.router.hash_memo import HashMemo, prompt_chain
from services.router.hedge import HedgeConfig
from services.router.hedge_race import HedgeRace, expected_first_token_s
from services.router.load_view import LoadView, blended
from services.router.migration import Cause, JourneyConfig, Recovery, RequestJourney
from services.router.outlier import OutlierDetector
from services.router.policy import Candidate, Choice, Policy
from services.router.prefix_index import PrefixIndex
from services.router.prefix_pull import PrefixPullPlanner, PullPlan, plan_for_ranking
from services.router.registry import WorkerRegistry, WorkerRole
from services.router.retry_budget import RetryBudget
from services.router.worker_profile import WorkerProfiles, ranking_speeds
from services.router.workflow_routing import WorkflowRouting
from services.router.workflow_sched import NO_WORKFLOW

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
    outliers: OutlierDetector | None = None  # latency outlier detection (issue 18); None: off
    hedge: HedgeConfig = field(default_factory=HedgeConfig)  # hedging before the first token (off by default)
    # A worker looks hung (a stream on it stalled mid-way): move its unstarted requests
    # (Router.reroute_unstarted, with a cause).
    reroute: Callable[[str, str], int] = lambda worker_id, cause: 0
    pull_planner: PrefixPullPlanner | None = None  # prefixes pulled instead of recomputed; None: off
    hash_memo: HashMemo | None = None  # prompt block hashes computed before; None: hash every time
    # The request's WorkflowContext in admission, recovery, routing and cost (issue 21); None: ignored.
    workflows: WorkflowRouting | None = None
    # Each worker's own prefill and decode speed, learned from its attempts (issue 21 item 3);
    # with its config's `route` (ranking_speeds), kv_aware ranks on predicted time. None: not measured.
    profiles: WorkerProfiles | None = None


def _worker_of(ch: Choice) -> str:
    return ch.worker_id


def _cost_of(ch: Choice) -> float:
    return ch.cost


def _tokens_ahead(cands: list[Candidate], own, worker_id: str) -> int:
    """Prompt tokens queued at `worker_id` when a request was routed there, as the policy
    saw them (its report blended with the router's own account); -1 if not a candidate."""
    for c in cands:
        if c.worker_id == worker_id:
            t = own.get(worker_id) if own else None
            if t is None:
                return c.load.tokens_waiting
            return blended(c.load.tokens_waiting, c.load.active_decode_blocks, t)[0]
    return -1


def _speed_of(speeds: dict[str, tuple[float, float]]) -> Callable[[str], float]:
    """How much of a worker's slowness its cost already carries, for the outlier detector's
    rerank: the smaller of its two factors (each multiplies only its own term, so the cost grew
    at least that much; with the larger, a degraded worker whose decode factor ran ahead of its
    prefill factor kept more traffic in the faults study: slow share 0.034-0.036 against 0.024)."""
    same = (1.0, 1.0)
    return lambda worker_id: min(speeds.get(worker_id, same))


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
        wf = ctx.workflows
        self._wf_info = wf.info(req.workflow) if wf is not None else NO_WORKFLOW
        self._hashes: BlockHashChain | None = None  # the last attempt's prompt chain (workflow hint)
        self.journey = RequestJourney(
            req.request_id,
            req.prompt_token_ids,
            req.max_tokens,
            ctx.journey_config,
            sunk_tokens=self._wf_info.tokens_spent,
        )
        self._wake = Wake()
        self._attempt: DecodeAttempt | None = None
        self._waiter: Waiter | None = None
        self._cancel_error: Cancelled | None = None
        self._cost: RequestCost | None = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._started = loop.time()
        self._last_sent = self._started  # when the last tokens left (inter-token latency)
        self._rerouted_at: float | None = None  # first moved off an unhealthy worker (before a token)
        self._deadline = None if req.timeout_s is None else self._started + req.timeout_s
        self.worker_id = ""
        self._routed: int | None = None  # this attempt's LoadView key
        self._last_error: tuple[str, AttemptError] | None = None
        # Hedging before the first token (hedge_race.py), when on.
        self._race = (
            HedgeRace(ctx, self.journey, self._pick, self._new_attempt, self._report_latency, saturated)
            if ctx.hedge.enabled and ctx.outliers is not None
            else None
        )
        self._sent: tuple[decode_pb2.DecodeServiceGenerateRequest, int, int] | None = None

    def cancel(self, why: str = "cancelled by Router.Cancel") -> None:
        """Stop the request now: cancel the downstream call, end the stream with CANCELLED."""
        if self._cancel_error is None:
            self._cancel_error = Cancelled(why)
        if self._waiter is not None:
            self.ctx.gate.abort(self._waiter, self._cancel_error)
        if self._attempt is not None:
            self._attempt.cancel()
        if self._race is not None:
            self._race.cancel()
        self._wake.set()

    def _waited_s(self, plan) -> float:
        """What this attempt tells its worker the request has waited for a first token (the
        worker's on-time-first admission, EngineConfig.queue_late_after_s): the time since it
        began, so a retry after a first-token timeout is not fresh at the next worker. 0 for
        a resumed stream (it had its first token) and for a request moved off a worker that
        went unhealthy: the wait was the mesh's fault, and such a request is owed a first
        token soon (issue 18: within 2 s of the router noticing), not a place behind every
        on-time request there."""
        if plan.resume_token_ids or self._rerouted_at is not None:
            return 0.0
        return max(self._loop.time() - self._started, 0.0)

    def reroute_unstarted(self, worker_id: str, why: str) -> bool:
        """`worker_id` went unhealthy: if this request's attempt (or hedge) there has had
        nothing back yet, fail it now so the request moves to another worker (nothing is
        lost before the first token). True if one was moved."""
        moved = False
        for attempt in (self._attempt, self._race.hedge if self._race is not None else None):
            if attempt is not None and attempt.worker_id == worker_id:
                moved |= attempt.fail_unstarted(f"worker {worker_id} {why} before the first token")
        return moved

    async def run(self) -> AsyncIterator[list[int] | FlowFinal]:
        """Token-id lists (one per client message), then a FlowFinal; raises a
        MeshError for the status the client gets. The attempts' loop is written out here,
        not in a generator of its own: every generator layer costs two Python calls per
        streamed token (BENCHMARKS.md, session 14)."""
        ticket = await self._admit()
        try:
            self.ctx.budget.record_request()
            ctx, journey = self.ctx, self.journey
            remaining = self.req.max_tokens
            first = True
            while True:
                attempt = self._launch()
                worker = attempt.worker_id
                settled = False
                prefilled = None  # the LoadView key whose first token was reported
                race = self._race
                try:
                    if race is not None and not journey.delivered_token_ids and self._sent is not None:
                        race.arm(attempt, *self._sent, self._deadline)
                    while True:
                        if self._cancel_error is not None:
                            raise self._cancel_error
                        if race is not None and race.hedge is not None:  # racing: settle it?
                            attempt, self._routed = race.settle(attempt, self._routed)
                            self._attempt, worker = attempt, attempt.worker_id
                            self.worker_id = worker
                        ids = attempt.take()
                        if ids:
                            if len(ids) > remaining:  # a worker that overruns max_tokens: cut it off
                                ids = ids[:remaining]
                            remaining -= len(ids)
                            journey.record_tokens(ids)
                            routed = self._routed
                            if routed is not None and routed != prefilled:  # the attempt's prefill is done
                                ctx.load_view.first_token(routed)  # type: ignore[union-attr]
                                prefilled = routed
                            now = self._loop.time()
                            if ctx.metrics is not None:
                                if first:
                                    ctx.metrics.ttft(now - self._started)
                                    if self._rerouted_at is not None:  # moved off an unhealthy worker
                                        ctx.metrics.reroute_first_token(now - self._rerouted_at)
                                else:
                                    ctx.metrics.itl(now - self._last_sent, len(ids))
                            first = False
                            self._last_sent = now
                            yield ids
                            continue
                        if attempt.done:
                            settled = True
                            break
                        woken = self._wake.arm()  # None: woken already (consumed)
                        if woken is not None:
                            await woken
                finally:
                    if race is not None:
                        race.end()
                    self._report_latency(attempt)
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
                if err.reroute and first and self._rerouted_at is None:
                    self._rerouted_at = self._loop.time()
                if err.worker_fault:
                    ctx.breakers.record_failure(worker)
                    if attempt.stalled and attempt.messages:  # hung mid-stream: the others there too
                        ctx.reroute(worker, "stalled")
                else:
                    ctx.breakers.record_ignored(worker)
                final = self._recover(worker, err)
                if final is not None:
                    yield final
                    return
        except BaseException:
            if self._cost is None:  # cancelled (client or Router.Cancel), deadline, or gave up
                self._cost = self._end_unfinished()
            raise
        finally:
            if self._attempt is not None:
                self._attempt.cancel()
            if self._cost is not None:
                if self._race is not None and self._race.waste:  # losing copies: not in the journey
                    self._cost = dataclasses.replace(
                        self._cost,
                        computed_tokens=self._cost.computed_tokens + self._race.waste,
                        wasted_tokens=self._cost.wasted_tokens + self._race.waste,
                    )
                self.ctx.ledger.record(self._cost)
                self._count_waste()
                if self.ctx.workflows is not None:
                    self.ctx.workflows.finished(
                        self.req.tenant,
                        self.req.workflow,
                        self._cost,
                        self.worker_id,
                        self._hashes,
                        self.ctx.clock(),
                    )
            served = self._cost.computed_tokens if self._cost is not None else 0
            self.ctx.gate.release(ticket, served)  # charged to the workflow's attained service

    def _count_waste(self) -> None:
        """`pdmesh_router_wasted_tokens_by_cause_total{cause}`, once per request (the copies
        of hedged requests that lost are not in the journey: counted when they are dropped)."""
        metrics = self.ctx.metrics
        if metrics is None or not self.journey.done:
            return
        for cause, tokens in self.journey.waste_by_cause().items():
            metrics.wasted(cause, tokens)

    async def _admit(self) -> Ticket:
        ctx, req = self.ctx, self.req
        deadline = None if req.timeout_s is None else ctx.clock() + req.timeout_s
        cost = len(req.prompt_token_ids) + req.max_tokens
        try:
            return await ctx.gate.acquire(
                req.tenant, req.priority, cost, deadline, self._on_queued, self._wf_info
            )
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
        if self.ctx.workflows is not None:
            self.ctx.workflows.shed(self.req.tenant, self.req.workflow, self.ctx.clock())
        if self.ctx.metrics is not None:
            self.ctx.metrics.shed(reason)

    def _end_unfinished(self) -> RequestCost:
        if self._cancel_error is not None or self.journey.current is not None:
            return self.journey.cancel()
        return self.journey.give_up()

    # ---- attempts -----------------------------------------------------------

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
            err.retryable,
            another_worker=self._another_worker(),
            retry_budget=err.reroute or ctx.budget.can_retry(self._wf_info.tokens_spent),
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
        if decision.action is Recovery.RETRY and not err.reroute:
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
        # Hashed as far as the match reads; through the memo, a prefix routed before costs a lookup.
        hashes = prompt_chain(input_ids, cfg.block_size, ctx.hash_memo)
        now = ctx.clock()
        ctx.index.expire(now)  # optimistic entries nobody confirmed in time
        overlaps = ctx.index.match(hashes) if hashes else {}
        cands = [
            c
            for c in ctx.registry.eligible(WorkerRole.DECODE)
            if c.worker_id not in plan.exclude_workers and not saturated(c, cfg)
        ]
        if ctx.workflows is not None and self._wf_info.workflow_id:  # the workflow's last worker
            overlaps = ctx.workflows.credit(
                self.req.workflow, hashes, overlaps, now, {c.worker_id for c in cands}
            )
        self._hashes = hashes
        own = ctx.load_view.totals() if ctx.load_view is not None else None
        credits = None  # host-tier hits: credited by what each worker measured (tier_index)
        tier_credits = getattr(ctx.index, "tier_credits", None)
        if (
            tier_credits is not None
            and cfg.tier_credit
            and ctx.decode_policy.name == "kv_aware"
            and ctx.index.tiers.has_tiers()
        ):
            credits = tier_credits(hashes, overlaps, {c.worker_id: c.load for c in cands}) or None
        speeds = ranking_speeds(ctx.profiles, ctx.registry)
        ranked = (
            ctx.decode_policy.rank(cands, len(hashes), overlaps, credits=credits, own=own, speeds=speeds)
            if credits
            else ctx.decode_policy.rank(cands, len(hashes), overlaps, own=own, speeds=speeds)
        )
        if ctx.workflows is not None and self._wf_info.workflow_id:  # keep the step home unless backed up
            ranked = ctx.workflows.steer(
                self.req.workflow, hashes, ranked, {c.worker_id: c.load.waiting for c in cands}, now
            )
        pull = None
        if ctx.pull_planner is not None:  # issue 17: the plan's target first, maybe with a pull
            ranked, pull = plan_for_ranking(ctx.pull_planner, ranked, cands, overlaps, len(hashes))
        choice = self._pick(ranked)
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
            prefix_pull=self._pull_hint(pull, choice.worker_id),
            waited_s=self._waited_s(plan),
            # A stream moved off another worker goes ahead in the next one's queue (issue 18).
            front=bool(plan.resume_token_ids) or self._rerouted_at is not None,
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
        pulled = pull.pull_blocks if pull is not None and pull.target == choice.worker_id else 0
        to_prefill = len(input_ids) - max(choice.overlap_blocks, pulled) * cfg.block_size
        # The queue there before this request joins it (`own` is the load view's live totals).
        ahead = _tokens_ahead(cands, own, choice.worker_id)
        if ctx.load_view is not None:  # ended in _attempts' finally, like end_request
            self._routed = ctx.load_view.begin(
                choice.worker_id, to_prefill, new_blocks, len(input_ids), cfg.block_size
            )
        self._sent = (request, to_prefill, new_blocks)  # what a hedge of this attempt sends
        self._attempt = self._new_attempt(choice.worker_id, call, to_prefill)
        self._attempt.ahead_tokens = ahead
        return self._attempt

    def _new_attempt(self, worker_id: str, call: DecodeCall, to_prefill: int) -> DecodeAttempt:
        cfg = self.ctx.config
        on_first = self._on_first if self.ctx.outliers is not None or self.ctx.profiles is not None else None
        blocks = -(-max(to_prefill, 0) // cfg.block_size)
        attempt = DecodeAttempt(
            worker_id,
            call,
            self._wake,
            self._first_token_timeout(worker_id, blocks),
            cfg.stall_timeout_s,
            cfg.max_buffered_tokens,
            on_first,
        )
        attempt.prefill_blocks = blocks
        if self.ctx.outliers is not None:  # judged while in flight too (outlier.py's live view)
            self.ctx.outliers.track(attempt)
        return attempt

    def _pick(self, ranked: list[Choice]) -> Choice | None:
        """The first ranked worker that the outlier detector and its breaker let through."""
        ctx, outliers = self.ctx, self.ctx.outliers
        if outliers is not None:
            speeds = ranking_speeds(ctx.profiles, ctx.registry)
            ranked = outliers.rerank(ranked, _worker_of, _cost_of, _speed_of(speeds) if speeds else None)
        for ch in ranked:
            wid = ch.worker_id
            if outliers is not None and not outliers.is_available(wid):
                continue
            if ctx.breakers.allow_request(wid):
                if outliers is not None:
                    outliers.allow_request(wid)  # takes a probe slot while it is PROBING
                return ch
        return None

    def _first_token_timeout(self, worker_id: str, prefill_blocks: int) -> float:
        """A multiple of when its first message is expected (`expected_first_token_s`: the
        predicted TTFT plus the worker's reported queue wait), within [floor,
        first_token_timeout_s]; the fixed cap without a prediction (or with the multiple 0)."""
        cfg, outliers = self.ctx.config, self.ctx.outliers
        cap = cfg.first_token_timeout_s
        if cap <= 0 or cfg.first_token_timeout_multiple <= 0 or outliers is None:
            return cap
        predicted = expected_first_token_s(self.ctx, worker_id, prefill_blocks)
        if predicted is None:
            return cap
        return min(max(cfg.first_token_timeout_multiple * predicted, cfg.first_token_timeout_floor_s), cap)

    # ---- latency samples (outlier detection), once per attempt ---------------

    def _on_first(self, attempt: DecodeAttempt) -> None:
        assert attempt.first_at is not None
        ttft = attempt.first_at - attempt.started
        if self.ctx.outliers is not None:
            self.ctx.outliers.record_ttft(attempt.worker_id, ttft, attempt.prefill_blocks)
        if self.ctx.profiles is not None and attempt.ahead_tokens >= 0:
            # Seconds per token of the prefill work before its first token (worker_profile.py).
            bs = self.ctx.config.block_size
            work = attempt.ahead_tokens + (attempt.prefill_blocks + 1) * bs
            self.ctx.profiles.observe_prefill(attempt.worker_id, work, ttft)

    def _report_latency(self, attempt: DecodeAttempt) -> None:
        profiles = self.ctx.profiles
        if profiles is not None and attempt.first_at is not None and attempt.later_tokens:
            profiles.observe_decode(
                attempt.worker_id, attempt.later_tokens, attempt.last_at - attempt.first_at
            )
        outliers = self.ctx.outliers
        if outliers is None:
            return
        if attempt.first_at is None:
            err = attempt.error
            if err is not None and err.worker_fault:  # it stalled or broke before a first message
                outliers.record_ttft(
                    attempt.worker_id, self._loop.time() - attempt.started, attempt.prefill_blocks
                )
            else:
                outliers.release(attempt.worker_id)  # no verdict: a probe slot back
            return
        gap = attempt.mean_gap_s
        if gap is not None:
            outliers.record_itl(attempt.worker_id, gap)

    def _pull_hint(self, pull: PullPlan | None, target: str) -> decode_pb2.PrefixPullHint | None:
        """The hint for the chosen worker when the plan pulls to it (None: no pull)."""
        if pull is None or pull.target != target:
            return None
        rec = self.ctx.registry.get(pull.source)
        if rec is None:
            return None
        if self.ctx.metrics is not None:
            self.ctx.metrics.prefix_pull_hinted()
        return decode_pb2.PrefixPullHint(
            worker_id=pull.source,
            address=rec.info.address,
            kv_agent_name=rec.info.kv_agent_name,
            blocks=pull.pull_blocks,
        )

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
