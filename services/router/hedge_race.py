"""One request's hedge: the timer, the copy racing the running attempt, and its accounts.

The request flow (services/router/generate.py) owns one `HedgeRace` when hedging is
on (hedge.py has the pure decisions: when, and which leg wins). `arm` starts the
timer for the flow's attempt; when it fires and the attempt has had nothing back,
a copy goes to the next-best worker (the retry budget pays for it). The flow calls
`settle` whenever it wakes while a copy races: the leg that started first is kept
(the journey learns of a hedge that won, `RequestJourney.hedge_won`), the other is
cancelled at once and its registry, load-view, breaker and latency accounts are
closed here. What a losing copy computed (estimated as its prefill) is in `waste`,
which the flow adds to the request's cost (the journey does not know the copy).

A copy sent while the primary's worker had not reported its prefill begun is tied
to it (HedgeConfig.tied): the first leg reported computing wins, and the other,
cancelled unreported, is estimated to have computed nothing (it was queued; a leg
on a path that never reports, a remote prefill, may have: the engines' own
counters are the measure, bench/faults.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from pdmesh.v1 import decode_pb2
from services.router.attempt import LATE_TIMER_S, DecodeAttempt, DecodeCall
from services.router.hash_memo import prompt_chain
from services.router.hedge import Leg, Winner, hedge_delay, race_winner, worth_hedging
from services.router.migration import RequestJourney
from services.router.policy import Choice
from services.router.registry import WorkerRole
from services.router.worker_profile import ranking_speeds

log = structlog.get_logger()


def expected_first_token_s(ctx, worker_id: str, prefill_blocks: int) -> float | None:
    """When an attempt sent to `worker_id` now should see its first message: the detector's
    predicted TTFT for its work there plus the queue wait the worker last reported (None
    with no prediction). The first-token timeout and the hedge delay are multiples of it: a
    request waiting its turn behind a queue is not late, and a copy of it (or a failover)
    loses its place in that queue and adds to another."""
    predicted = ctx.outliers.predicted_ttft(worker_id, prefill_blocks)
    if predicted is None:
        return None
    rec = ctx.registry.get(worker_id)
    return predicted + (max(rec.load.estimated_wait_ms, 0.0) / 1000.0 if rec is not None else 0.0)


def leg_of(attempt: DecodeAttempt) -> Leg:
    if attempt.messages:
        return Leg.STARTED
    if attempt.done:
        return Leg.FAILED
    return Leg.WAITING if attempt.computing_at is None else Leg.COMPUTING


class HedgeRace:
    def __init__(
        self,
        ctx,  # RoutingContext
        journey: RequestJourney,
        pick: Callable[[list[Choice]], Choice | None],
        new_attempt: Callable[[str, DecodeCall, int], DecodeAttempt],
        report_latency: Callable[[DecodeAttempt], None],
        saturated: Callable[..., bool],
    ):
        self.ctx = ctx
        self.journey = journey
        self._pick = pick
        self._new_attempt = new_attempt
        self._report_latency = report_latency
        self._saturated = saturated
        self._loop = asyncio.get_running_loop()
        self.hedge: DecodeAttempt | None = None
        self.waste = 0  # tokens of copies that lost (not in the journey)
        self._hedges = 0
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0  # when the timer was due to fire
        self._delay = 0.0
        self._compute_delay = 0.0  # the delay measured from the primary's reported start
        self._primary: DecodeAttempt | None = None
        self._sent: tuple[decode_pb2.DecodeServiceGenerateRequest, int, int, float | None] | None = None
        self._routed: int | None = None  # the copy's LoadView key
        self._cached = 0  # input tokens the copy's worker was expected to have cached
        self._tied = False  # the copy races the primary on starting (HedgeConfig.tied)

    def arm(
        self,
        primary: DecodeAttempt,
        request: decode_pb2.DecodeServiceGenerateRequest,
        to_prefill: int,
        new_blocks: int,
        deadline: float | None,
    ) -> None:
        """Hedge `primary` (just started, nothing delivered yet) if it is late."""
        predicted = expected_first_token_s(self.ctx, primary.worker_id, primary.prefill_blocks)
        delay = hedge_delay(self.ctx.hedge, predicted, self._hedges)
        if delay is None:
            return
        self._primary = primary
        self._sent = (request, to_prefill, new_blocks, deadline)
        self._due, self._delay = primary.started + delay, delay
        # A primary whose worker reports its prefill begun is late only against the time
        # since then: its queue is behind it (tied hedges: the workers report starts).
        own = self.ctx.outliers.predicted_ttft(primary.worker_id, primary.prefill_blocks)
        self._compute_delay = hedge_delay(self.ctx.hedge, own, self._hedges) or delay
        self._timer = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        """The primary is late: send a copy to the next-best worker, if the budget allows."""
        self._timer = None
        ctx, cfg, primary = self.ctx, self.ctx.config, self._primary
        if primary is None or primary.done or primary.messages or self.hedge is not None:
            return
        now = self._loop.time()
        late = now - self._due
        if late > LATE_TIMER_S:
            # The attempt watchdog's rule (services/router/attempt.py `_check`): on uvloop a loop
            # busy in an I/O callback runs its due timers before it polls the sockets again, so
            # the primary's first message may be waiting in the socket. A copy sent now would be
            # waste; look again after the next poll, given as long again to catch up.
            self._due = now + min(late, self._delay)
            self._timer = self._loop.call_at(self._due, self._fire)
            return
        computing = primary.computing_at
        if ctx.hedge.tied and computing is not None and computing + self._compute_delay - now > LATE_TIMER_S:
            # Its prefill began lately: it is late only if it computes for as long again, and a
            # copy starting from nothing now would rarely beat it (BENCHMARKS.md, faults,
            # session 23: with ties alone the fault-free run lost 18 of 19 copies).
            self._due = computing + self._compute_delay
            self._timer = self._loop.call_at(self._due, self._fire)
            return
        assert self._sent is not None
        if not ctx.budget.can_retry():
            self._count("denied")
            return
        request, to_prefill, new_blocks, deadline = self._sent
        exclude = {a.worker_id for a in self.journey.attempts} | {primary.worker_id}
        cands = [
            c
            for c in ctx.registry.eligible(WorkerRole.DECODE)
            if c.worker_id not in exclude and not self._saturated(c, cfg)
        ]
        waited = self._loop.time() - primary.started
        faster = [
            c
            for c in cands
            if not ctx.hedge.require_faster
            or worth_hedging(
                waited,
                ctx.outliers.predicted_ttft(c.worker_id, primary.prefill_blocks),
                c.load.estimated_wait_ms / 1000.0,
            )
        ]
        if cands and not faster:  # a copy would wait as long: it would only double the work
            self._count("not_faster")
            return
        cands = faster
        inputs = tuple(request.prompt_token_ids) + tuple(request.resume_token_ids)
        hashes = prompt_chain(inputs, cfg.block_size, ctx.hash_memo)  # the primary's chunks: memo hits
        overlaps = ctx.index.match(hashes) if hashes and cands else {}
        choice = None
        if cands:
            speeds = ranking_speeds(ctx.profiles, ctx.registry)  # as the flow's own ranking
            ranked = (
                ctx.decode_policy.rank(cands, len(hashes), overlaps, speeds=speeds)
                if speeds
                else ctx.decode_policy.rank(cands, len(hashes), overlaps)
            )
            choice = self._pick(ranked)
        if choice is None:
            self._count("no_worker")
            return
        timeout = None if deadline is None else deadline - self._loop.time()
        if timeout is not None and timeout <= 0:
            ctx.breakers.record_ignored(choice.worker_id)
            return
        ctx.budget.record_retry()
        self._hedges += 1
        wid = choice.worker_id
        if not request.resume_token_ids:  # the copy brings the primary's wait (on-time-first admission)
            copy = decode_pb2.DecodeServiceGenerateRequest()
            copy.CopyFrom(request)
            copy.waited_s = request.waited_s + max(self._loop.time() - primary.started, 0.0)
            request = copy
        ctx.registry.begin_request(wid, 0 if ctx.load_view is not None else new_blocks)
        call = ctx.call_decode(wid, request, timeout)
        if ctx.load_view is not None:
            self._routed = ctx.load_view.begin(wid, to_prefill, new_blocks, len(inputs), cfg.block_size)
        self._cached = choice.overlap_blocks * cfg.block_size
        self.hedge = self._new_attempt(wid, call, len(inputs) - self._cached)
        # Tied only to a primary still queued: one already computing may have hung in its
        # prefill, and a copy that had to wait for it to report would never win.
        self._tied = ctx.hedge.tied and primary.computing_at is None
        self._count("sent")
        log.info("hedged", request_id=request.request_id, worker=primary.worker_id, hedge=wid)

    def settle(self, primary: DecodeAttempt, routed: int | None) -> tuple[DecodeAttempt, int | None]:
        """(the attempt to go on with, its LoadView key): the primary while both wait."""
        hedge = self.hedge
        assert hedge is not None
        winner = race_winner(leg_of(primary), leg_of(hedge), self._tied)
        if winner is Winner.NONE:
            return primary, routed
        self.hedge = None
        if winner is Winner.PRIMARY:
            self._drop(hedge, self._routed, in_journey=False)
            self._routed = None
            self._count("lost")
            return primary, routed
        # A tied primary cancelled before its worker reported it computing was queued there.
        unstarted = self._queued(primary)
        self._drop(primary, routed, in_journey=True)
        self.journey.hedge_won(
            hedge.worker_id, cached_tokens=self._cached, loser_computed=0 if unstarted else None
        )
        kept_routed, self._routed = self._routed, None
        self._count("won")
        return hedge, kept_routed

    def cancel(self) -> None:
        """The request is cancelled: the copy too, at once (`end` settles its accounts)."""
        if self.hedge is not None:
            self.hedge.cancel()

    def end(self) -> None:
        """The attempt is over (or the flow ends): no copy may start or keep running."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._primary = None
        hedge, self.hedge = self.hedge, None
        if hedge is not None:
            self._drop(hedge, self._routed, in_journey=False)
            self._routed = None
            self._count("lost")

    def _drop(self, leg: DecodeAttempt, routed: int | None, in_journey: bool) -> None:
        """Cancel a leg and settle its accounts (registry, load view, breaker, latency, waste).
        `in_journey`: the leg is the journey's running attempt (the primary)."""
        ctx = self.ctx
        leg.cancel()
        if in_journey and leg.first_at is None and ctx.outliers is not None:
            # Beaten by its copy: "no first message after this long" is a (censored) sample.
            ctx.outliers.record_ttft(leg.worker_id, self._loop.time() - leg.started, leg.prefill_blocks)
        else:
            self._report_latency(leg)
        ctx.registry.end_request(leg.worker_id)
        if routed is not None:
            ctx.load_view.end(routed)
        err = leg.error
        if err is not None and err.worker_fault:
            ctx.breakers.record_failure(leg.worker_id)
        else:
            ctx.breakers.record_ignored(leg.worker_id)
        # What the leg computed is lost, estimated as its prefill (it delivered nothing). The
        # primary's is in the journey (hedge_won cancels it, and the flow counts it by cause
        # when the request ends); a copy's is added to the cost and counted here.
        current = self.journey.current
        if current is None or in_journey:
            return
        if self._queued(leg):
            return  # a tied copy cancelled in its queue: nothing computed
        wasted = max(current.input_tokens - self._cached, 0)
        self.waste += wasted
        if ctx.metrics is not None and wasted:
            ctx.metrics.wasted("hedged", wasted)

    def _queued(self, leg: DecodeAttempt) -> bool:
        """A leg of a tied race that its worker never reported computing: it was queued."""
        return self._tied and leg.computing_at is None and not leg.messages

    def _count(self, outcome: str) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.hedge(outcome)
