"""An event-driven simulation of a disaggregated fleet whose pool sizes change at run time.

For the planner study (bench/planner.py): what matters there is hours of
traffic over a fleet whose prefill and decode pools grow and shrink, which real
processes on two cores cannot show. The workers' speeds come from a sim timing
profile (services/model/profiles.json, the same tables the `sim` engine uses);
the queues, routing and lifecycle are modeled here:

- a prefill worker runs one pass at a time over the prompts queued to it (short
  prompts share a pass up to the profile's batch token budget), then each
  prompt's KV moves to a decode worker in `transfer_s(tokens)`; the first token
  comes with the prefill (TTFT = arrival -> prefill done + transfer);
- a decode worker decodes every running sequence one token per step, a step
  taking `decode_ms(batch, context)`; between two events the batch is constant,
  so its tokens advance as a fluid (time / step), and the request's mean ITL is
  (finish - first token) / (output - 1), waits for a free slot included;
- new prompts go to the prefill worker with the fewest queued tokens, prefilled
  requests to the decode worker with the fewest running sequences (only
  workers that are ready and not draining take new work);
- a worker started at t is ready at t + startup_s; a worker told to stop drains
  (takes nothing new, finishes what it has) and stops when empty, so scaling
  never fails a request in this model (the real drain is tested end to end);
  worker-seconds count from start to stop. With `migrate_on_drain` a draining
  decode worker hands its sequences (tokens left, context) to the active ones
  after their KV's transfer, as the router's token-exact migration does;
- with `local_prefill` (conditional disaggregation) a new prompt goes first to the
  decode worker with the fewest sequences, which prefills it itself when
  services/decode/disagg_policy.py's time rule says so (`_prefill_here`, on the
  profile's times); its decodes stall for that pass (no overlap, as the sim
  engine's pass = prefill + decode).

Every `interval_s` the simulation hands the policy an `Observation` of the last
interval and applies the (prefill, decode) counts it returns.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.model.timing import TimingProfile
from services.planner.planner import Observation

STARTING, ACTIVE, DRAINING, STOPPED = "starting", "active", "draining", "stopped"


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    isl: int
    osl: int


@dataclass(slots=True, eq=False)  # identity-hashed: a key of the decode worker's running set
class Outcome:
    req: SimRequest
    first_token_s: float = math.nan
    finish_s: float = math.nan
    resume: tuple[float, float] | None = None  # (tokens left, context) of a migrated decode

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.req.arrival_s

    @property
    def itl_s(self) -> float:
        return (self.finish_s - self.first_token_s) / max(self.req.osl - 1, 1)


@dataclass(eq=False)
class Worker:
    role: str
    started_s: float
    ready_s: float
    state: str = STARTING
    stopped_s: float | None = None
    drain_s: float | None = None  # when it was told to stop (worker-seconds after it: draining)
    # prefill
    queue: deque = field(default_factory=deque)
    queued_tokens: int = 0
    busy: bool = False
    pass_tokens: int = 0  # of the pass in progress (in queued_tokens too)
    pass_done_s: float = 0.0
    # decode: Outcome -> tokens left; waiting for a slot
    running: dict = field(default_factory=dict)
    waiting: deque = field(default_factory=deque)
    context: dict = field(default_factory=dict)
    last_s: float = 0.0  # decode: tokens are counted from here (a local prefill's stall moves it ahead)
    version: int = 0
    # decode with local prefill: prompts this decode worker prefills itself, and its pass in progress
    local_queue: deque = field(default_factory=deque)
    local_tokens: int = 0
    local_busy_until: float | None = None
    local_pass: list = field(default_factory=list)
    incoming: int = 0  # decode: migrated sequences whose KV is on its way here

    @property
    def load(self) -> int:
        if self.role == "prefill":
            return self.queued_tokens
        return len(self.running) + len(self.waiting) + len(self.local_queue)

    @property
    def drain_left(self) -> float:
        """What it would still run if told to stop now: prefill, its queued tokens; decode, its longest
        sequence's tokens left (it stops when the last one finishes)."""
        if self.role == "prefill":
            return float(self.queued_tokens)
        left = [*self.running.values(), *(float(o.req.osl) for o in self.waiting)]
        return max(left, default=0.0) + sum(o.req.osl for o in self.local_queue)

    @property
    def idle(self) -> bool:
        return not (
            self.queue
            or self.busy
            or self.running
            or self.waiting
            or self.local_queue
            or self.local_busy_until is not None
            or self.incoming
        )


@dataclass
class SimResult:
    outcomes: list[Outcome]
    worker_s: float
    timeline: list[tuple[float, int, int, float]]  # (t, prefill, decode, arrivals/s in the last interval)
    failed_scaling: int = 0
    local_prefills: int = 0  # prompts a decode worker prefilled itself (local_prefill on)
    workers: list[Worker] = field(default_factory=list)  # every worker the run had, for accounting

    def attainment(self, ttft_s: float, itl_s: float) -> float:
        ok = sum(1 for o in self.outcomes if o.ttft_s <= ttft_s and o.itl_s <= itl_s)
        return ok / max(len(self.outcomes), 1)


Policy = Callable[[Observation, float], tuple[int, int]]


class FleetSim:
    def __init__(
        self,
        profile: TimingProfile,
        *,
        initial: tuple[int, int],
        startup_s: float,
        interval_s: float,
        quantile: float = 0.9,
        local_prefill: bool = False,
        drain_soonest: bool = False,
        migrate_on_drain: bool = False,
        ttft_slo_s: float = 1.0,
        itl_slo_s: float = 0.05,
    ):
        self.profile = profile
        self.local_prefill = local_prefill
        self.drain_soonest = drain_soonest
        self.migrate_on_drain = migrate_on_drain
        self.ttft_slo_s, self.itl_slo_s = ttft_slo_s, itl_slo_s
        self._local_prefills = 0
        self._arrivals_per_decode_s = 0.0  # last interval's arrivals per ready decode worker
        self._mean_osl = 0.0  # of the arrivals so far
        self._arrived = 0
        self.startup_s, self.interval_s, self.quantile = startup_s, interval_s, quantile
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.workers: list[Worker] = []
        for role, n in zip(("prefill", "decode"), initial, strict=True):
            for _ in range(n):
                w = Worker(role, -startup_s, 0.0, ACTIVE)
                self.workers.append(w)
        self._firsts: list[Outcome] = []  # first tokens of the current interval
        self._finishes: list[Outcome] = []  # and finishes
        self._window_arrivals: list[SimRequest] = []

    # ---- events ----

    def _at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, args))

    def run(self, requests: Sequence[SimRequest], policy: Policy) -> SimResult:
        outcomes = [Outcome(r) for r in requests]
        for o in outcomes:
            self._at(o.req.arrival_s, "arrive", o)
        end = requests[-1].arrival_s if requests else 0.0
        t = self.interval_s
        while t <= end + self.interval_s:
            self._at(t, "tick", policy)
            t += self.interval_s
        timeline: list[tuple[float, int, int, float]] = []
        self._timeline = timeline
        while self._events:
            self.now, _, kind, args = heapq.heappop(self._events)
            getattr(self, f"_on_{kind}")(*args)
        for w in self.workers:
            if w.stopped_s is None:
                w.stopped_s = self.now
        worker_s = sum(w.stopped_s - max(w.started_s, 0.0) for w in self.workers)
        done = [o for o in outcomes if not math.isnan(o.finish_s)]
        return SimResult(
            done,
            worker_s,
            timeline,
            failed_scaling=len(outcomes) - len(done),
            local_prefills=self._local_prefills,
            workers=self.workers,
        )

    def _on_arrive(self, o: Outcome) -> None:
        self._window_arrivals.append(o.req)
        self._arrived += 1
        self._mean_osl += (o.req.osl - self._mean_osl) / self._arrived
        if self.local_prefill:
            d = self._pick("decode")
            if d.state == ACTIVE and self._prefill_here(d, o):
                self._local_prefills += 1
                d.local_queue.append(o)
                d.local_tokens += o.req.isl
                self._start_local(d)
                return
        w = self._pick("prefill")
        w.queue.append(o)
        w.queued_tokens += o.req.isl
        self._start_prefill(w)

    def _on_prefill_done(self, w: Worker, batch: list[Outcome]) -> None:
        w.busy = False
        for o in batch:
            w.queued_tokens -= o.req.isl
            self._at(self.now + self.profile.transfer_s(o.req.isl), "kv_arrived", o)
        self._start_prefill(w)
        self._maybe_stop(w)

    def _on_kv_arrived(self, o: Outcome) -> None:
        o.first_token_s = self.now
        self._firsts.append(o)
        if o.req.osl <= 1:
            o.finish_s = self.now
            self._finishes.append(o)
            return
        w = self._pick("decode")
        self._advance(w)
        w.waiting.append(o)
        self._admit(w)
        self._schedule_decode(w)

    def _on_decode_next(self, w: Worker, version: int) -> None:
        if version != w.version:
            return
        self._advance(w)
        self._admit(w)
        self._schedule_decode(w)
        self._maybe_stop(w)

    def _on_ready(self, w: Worker) -> None:
        if w.state == STARTING:
            w.state = ACTIVE

    def _on_tick(self, policy: Policy) -> None:
        obs = self._observe()
        p, d = policy(obs, self.now)
        self._timeline.append((self.now, p, d, len(self._window_arrivals) / self.interval_s))
        self._arrivals_per_decode_s = (
            len(self._window_arrivals) / self.interval_s / max(obs.ready_decode_workers or 0, 1)
        )
        self._firsts, self._finishes, self._window_arrivals = [], [], []
        self._resize("prefill", max(p, 1))
        self._resize("decode", max(d, 1))

    # ---- prefill ----

    def _start_prefill(self, w: Worker) -> None:
        if w.busy or not w.queue:
            return
        batch = [w.queue.popleft()]
        tokens = batch[0].req.isl
        while w.queue and tokens + w.queue[0].req.isl <= self.profile.max_num_batched_tokens:
            o = w.queue.popleft()
            batch.append(o)
            tokens += o.req.isl
        w.busy, w.pass_tokens = True, tokens
        w.pass_done_s = self.now + self.profile.prefill_ms(tokens) / 1000.0
        self._at(w.pass_done_s, "prefill_done", w, batch)

    def _prefill_wait_s(self, w: Worker) -> float:
        """Until a prompt queued at prefill worker `w` now would start: its pass in progress, then its queue."""
        p = self.profile
        rest = w.queued_tokens - (w.pass_tokens if w.busy else 0)
        passes = math.ceil(rest / p.max_num_batched_tokens)
        ahead = (passes * p.prefill_ms(1) + p.prefill[1] * rest) / 1000.0 if rest else 0.0
        return (max(w.pass_done_s - self.now, 0.0) if w.busy else 0.0) + ahead

    # ---- decode-local prefill (conditional disaggregation) ----

    def _prefill_here(self, d: Worker, o: Outcome) -> bool:
        """services/decode/disagg_policy.py's time rule, on what the sim knows: prefill on decode worker
        `d` when that scores more requests within their SLOs than the best prefill worker does.

        local = [local TTFT <= TTFT SLO] - sum over d's decodes of min(1, (stall / slack)^2), remote =
        [remote TTFT <= TTFT SLO]; a tie goes to the path using less of the SLO budgets. A decode's
        slack is its ITL budget (ITL SLO x its tokens) less its elapsed time, its remaining tokens at
        the current step and the local prefills already queued here; for one already past it, the stall
        is priced against its whole ITL budget instead. (The real rule's measured rates are the
        profile's times here, and its term for decodes that start during the stall is left out.)"""
        p = self.profile
        own = p.prefill_ms(o.req.isl) / 1000.0
        ahead = self._local_ahead_s(d)
        local_ttft = ahead + own
        ready = [w for w in self.workers if w.role == "prefill" and w.state == ACTIVE]
        if ready:
            best = min(ready, key=lambda w: w.queued_tokens)
            remote_ttft = self._prefill_wait_s(best) + own + p.transfer_s(o.req.isl)
        else:
            remote_ttft = math.inf
        batch = len(d.running) + len(d.waiting)
        step = p.decode_ms(max(batch, 1), int(sum(d.context.values()))) / 1000.0
        cost = share = 0.0
        for q, left in itertools.chain(d.running.items(), ((q, q.req.osl - 1) for q in d.waiting)):
            budget = self.itl_slo_s * max(q.req.osl - 1, 1)
            slack = budget - (self.now - q.first_token_s) - left * step - ahead
            x = own / slack if slack > 0 else own / budget
            cost += min(1.0, x * x)
            share += x
        local = float(local_ttft <= self.ttft_slo_s) - cost
        remote = float(remote_ttft <= self.ttft_slo_s)
        if local != remote:
            return local > remote
        if ready and remote_ttft - own - p.transfer_s(o.req.isl) <= 0 and self._mean_osl > 1:
            # the decodes expected to start here during the stall (the tie-break's term in the real rule)
            arriving = self._arrivals_per_decode_s * own
            slack = (self.itl_slo_s - step) * (self._mean_osl - 1)
            share += arriving * (min(1.0, own / 2 / slack) if slack > 0 else 1.0)
        return local_ttft / self.ttft_slo_s + share <= remote_ttft / self.ttft_slo_s

    def _local_ahead_s(self, d: Worker) -> float:
        p = self.profile
        busy = max(d.local_busy_until - self.now, 0.0) if d.local_busy_until is not None else 0.0
        rest = d.local_tokens - sum(q.req.isl for q in d.local_pass)
        passes = math.ceil(rest / p.max_num_batched_tokens)
        return busy + ((passes * p.prefill_ms(1) + p.prefill[1] * rest) / 1000.0 if rest else 0.0)

    def _start_local(self, d: Worker) -> None:
        """A local prefill pass on decode worker `d`: its decodes stall for the pass (no overlap, as
        the sim engine's pass = prefill + decode)."""
        if d.local_busy_until is not None or not d.local_queue:
            return
        batch = [d.local_queue.popleft()]
        tokens = batch[0].req.isl
        while d.local_queue and tokens + d.local_queue[0].req.isl <= self.profile.max_num_batched_tokens:
            q = d.local_queue.popleft()
            batch.append(q)
            tokens += q.req.isl
        stall = self.profile.prefill_ms(tokens) / 1000.0
        self._advance(d)
        d.local_pass = batch
        d.local_busy_until = self.now + stall
        d.last_s = max(d.last_s, self.now) + stall  # no tokens until the pass ends
        self._schedule_decode(d)
        self._at(d.local_busy_until, "local_done", d, batch)

    def _on_local_done(self, d: Worker, batch: list[Outcome]) -> None:
        d.local_busy_until, d.local_pass = None, []
        self._advance(d)
        for o in batch:
            d.local_tokens -= o.req.isl
            o.first_token_s = self.now
            self._firsts.append(o)
            if o.req.osl <= 1:
                o.finish_s = self.now
                self._finishes.append(o)
            else:
                d.waiting.append(o)
        self._admit(d)
        self._start_local(d)
        self._schedule_decode(d)
        self._maybe_stop(d)

    # ---- decode ----

    def _step_s(self, w: Worker) -> float:
        return self.profile.decode_ms(len(w.running), sum(w.context.values())) / 1000.0

    def _advance(self, w: Worker) -> None:
        """Move every running sequence forward to now; finished ones leave."""
        if w.running and self.now > w.last_s:  # (not during a local prefill's stall)
            produced = (self.now - w.last_s) / self._step_s(w)
            for o in list(w.running):
                left = w.running[o] - produced
                w.context[o] += produced
                if left <= 1e-6:
                    o.finish_s = self.now
                    self._finishes.append(o)
                    del w.running[o], w.context[o]
                else:
                    w.running[o] = left
        w.last_s = max(w.last_s, self.now)

    def _admit(self, w: Worker) -> None:
        p = self.profile
        while w.waiting and len(w.running) < p.max_num_seqs:
            o = w.waiting[0]
            if sum(w.context.values()) + o.req.isl + o.req.osl > p.capacity_tokens and w.running:
                break
            w.waiting.popleft()
            left, ctx = o.resume if o.resume is not None else (float(o.req.osl - 1), float(o.req.isl))
            o.resume = None
            w.running[o] = left
            w.context[o] = ctx

    def _schedule_decode(self, w: Worker) -> None:
        w.version += 1
        if w.running:
            start = max(self.now, w.last_s)
            self._at(start + min(w.running.values()) * self._step_s(w), "decode_next", w, w.version)

    # ---- pools ----

    def _pick(self, role: str) -> Worker:
        ready = [w for w in self.workers if w.role == role and w.state == ACTIVE]
        if not ready:  # nothing ready yet: the one that will be ready first
            ready = sorted(
                (w for w in self.workers if w.role == role and w.state == STARTING), key=lambda w: w.ready_s
            )[:1]
        return min(ready, key=lambda w: w.load)

    def _resize(self, role: str, target: int) -> None:
        live = [w for w in self.workers if w.role == role and w.state in (STARTING, ACTIVE)]
        for _ in range(target - len(live)):
            w = Worker(role, self.now, self.now + self.startup_s)
            self.workers.append(w)
            self._at(w.ready_s, "ready", w)
        if target < len(live):
            # stop starting ones first (they hold nothing), then the least loaded
            # (drain_soonest: of the active ones, those whose work ends first, not the fewest sequences)
            key = (lambda w: w.drain_left) if self.drain_soonest else (lambda w: w.load)
            for w in sorted(live, key=lambda w: (w.state != STARTING, key(w)))[: len(live) - target]:
                w.state, w.drain_s = DRAINING, self.now
                if self.migrate_on_drain and role == "decode":
                    self._migrate_all(w)
                self._maybe_stop(w)

    def _migrate_all(self, w: Worker) -> None:
        """A draining decode worker hands its sequences to the active ones (the router's token-exact
        migration): each resumes there after its KV's transfer, with its tokens left and its context."""
        others = [x for x in self.workers if x.role == "decode" and x.state == ACTIVE]
        if not others:
            return
        self._advance(w)
        moving = [(o, w.running[o], w.context[o]) for o in w.running]
        moving += [
            (o, *o.resume) if o.resume else (o, float(o.req.osl - 1), float(o.req.isl)) for o in w.waiting
        ]
        w.running.clear()
        w.context.clear()
        w.waiting.clear()
        w.version += 1
        for o, left, ctx in moving:
            o.resume = (left, ctx)
            to = min(others, key=lambda x: x.load + x.incoming)
            to.incoming += 1
            self._at(self.now + self.profile.transfer_s(int(ctx)), "migrated", to, o)

    def _on_migrated(self, w: Worker, o: Outcome) -> None:
        w.incoming -= 1
        self._advance(w)
        w.waiting.append(o)
        self._admit(w)
        self._schedule_decode(w)
        self._maybe_stop(w)

    def _maybe_stop(self, w: Worker) -> None:
        if w.state == DRAINING and w.idle:
            w.state, w.stopped_s = STOPPED, self.now

    def _observe(self) -> Observation:
        arr = self._window_arrivals
        n = len(arr)
        firsts = sorted(o.ttft_s for o in self._firsts)
        itls = sorted(o.itl_s for o in self._finishes)

        def q(xs: list[float]) -> float | None:
            return xs[min(int(self.quantile * len(xs)), len(xs) - 1)] if xs else None

        live = {
            r: sum(1 for w in self.workers if w.role == r and w.state in (STARTING, ACTIVE))
            for r in ("prefill", "decode")
        }
        return Observation(
            requests=n,
            mean_isl=sum(r.isl for r in arr) / n if n else 0.0,
            mean_osl=sum(r.osl for r in arr) / n if n else 0.0,
            hit_rate=0.0,
            prefill_workers=live["prefill"],
            decode_workers=live["decode"],
            ttft_q_s=q(firsts),
            itl_q_s=q(itls),
            ready_prefill_workers=sum(1 for w in self.workers if w.role == "prefill" and w.state == ACTIVE),
            ready_decode_workers=sum(1 for w in self.workers if w.role == "decode" and w.state == ACTIVE),
        )
