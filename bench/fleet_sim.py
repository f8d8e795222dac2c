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
  worker-seconds count from start to stop.

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
    # prefill
    queue: deque = field(default_factory=deque)
    queued_tokens: int = 0
    busy: bool = False
    # decode: Outcome -> tokens left; waiting for a slot
    running: dict = field(default_factory=dict)
    waiting: deque = field(default_factory=deque)
    context: dict = field(default_factory=dict)
    last_s: float = 0.0
    version: int = 0

    @property
    def load(self) -> int:
        return self.queued_tokens if self.role == "prefill" else len(self.running) + len(self.waiting)

    @property
    def idle(self) -> bool:
        return not (self.queue or self.busy or self.running or self.waiting)


@dataclass
class SimResult:
    outcomes: list[Outcome]
    worker_s: float
    timeline: list[tuple[float, int, int, float]]  # (t, prefill, decode, arrivals/s in the last interval)
    failed_scaling: int = 0

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
    ):
        self.profile = profile
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
        return SimResult(done, worker_s, timeline, failed_scaling=len(outcomes) - len(done))

    def _on_arrive(self, o: Outcome) -> None:
        self._window_arrivals.append(o.req)
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
        w.busy = True
        self._at(self.now + self.profile.prefill_ms(tokens) / 1000.0, "prefill_done", w, batch)

    # ---- decode ----

    def _step_s(self, w: Worker) -> float:
        return self.profile.decode_ms(len(w.running), sum(w.context.values())) / 1000.0

    def _advance(self, w: Worker) -> None:
        """Move every running sequence forward to now; finished ones leave."""
        if w.running:
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
        w.last_s = self.now

    def _admit(self, w: Worker) -> None:
        p = self.profile
        while w.waiting and len(w.running) < p.max_num_seqs:
            o = w.waiting[0]
            if sum(w.context.values()) + o.req.isl + o.req.osl > p.capacity_tokens and w.running:
                break
            w.waiting.popleft()
            w.running[o] = float(o.req.osl - 1)
            w.context[o] = float(o.req.isl)

    def _schedule_decode(self, w: Worker) -> None:
        w.version += 1
        if w.running:
            self._at(self.now + min(w.running.values()) * self._step_s(w), "decode_next", w, w.version)

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
            for w in sorted(live, key=lambda w: (w.state != STARTING, w.load))[: len(live) - target]:
                w.state = DRAINING
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
