"""An event model of aggregated, disaggregated and conditional serving on N simulated GPUs.

For the GPU-regime study (`bench/disagg.py --engine sim`, issue 19). Real
sim-engine worker processes (services/engine/sim) cannot run 8 workers x 15
deployments x many rates on the 2 shared cores of this machine, so this is an
*event model* in simulated time, not the sim engine itself. What it shares
with the product and what it models:

- pass times: the sim engine's own timing profiles (services/model/timing.py,
  profiles.json): a pass costs `prefill_ms(T, C) + decode_ms(B, K)`, as
  SimRunner prices it;
- scheduling: the engine Scheduler's policy re-stated (services/engine/
  scheduler.py): every pass serves the running batch first (each decoding
  request one token, an unfinished prompt its next chunk), then admits waiting
  prompts in arrival order while the `max_num_batched_tokens` budget,
  `max_num_seqs` and the KV pool allow; every token of a pass is emitted at its
  end. Not modeled: preemption (admission waits for KV room instead);
- prefix cache: per GPU, an LRU of 512-token prefix units (the Mooncake trace's
  `hash_ids` granularity; an id stands for its block and all before it), half
  the KV pool; a hit skips those tokens' prefill and their transfer;
- KV transfer: `profile.transfer_s(tokens)` at the configured bandwidth, the
  transfers into one decode GPU serialised (its link), the first token
  delivered when the pull ends (the decode worker's remote path);
- routing (all deployments alike): a request goes to the decode-capable GPU
  with the least `uncached prompt + queued prompt + active KV` tokens (Dynamo's
  KV router cost, prefill blocks + decode blocks, weight 1); prefill
  candidates are ranked by estimated wait (queued tokens at the profile's
  prefill rate) plus their own uncached compute;
- the conditional decision: the product's `DisaggregationPolicy` (the default
  `DisaggConfig()`, the time rule) on the product's `PathRates`, fed as
  services/decode/worker.py feeds them (every local first token, decode
  interval, remote prefill and KV pull) on the simulated clock.

SLOs are bench/disagg.py's (Splitwise's relative definition): TTFT <= 3x the
request's unloaded TTFT (its prompt alone on an idle GPU), TPOT <= 1.5x its
unloaded TPOT. Goodput: the highest rate up to which attainment stays >= 90%.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.wait_estimator import PathRates
from services.decode.disagg_policy import (
    Candidate,
    DisaggConfig,
    DisaggregationPolicy,
    Mode,
    Path,
    RunningDecode,
)
from services.model.timing import TimingProfile

UNIT = 512  # tokens per prefix unit (Mooncake's hash_ids block)
TTFT_SLO_X, TPOT_SLO_X = 3.0, 1.5


@dataclass(frozen=True)
class Spec:
    """One request of a workload: lengths and prefix units (ids; () = nothing shared)."""

    prompt: int
    output: int
    units: tuple[int, ...] = ()


@dataclass(eq=False)  # identity: kept in sets
class Req:
    id: int
    arrival: float
    spec: Spec
    ttft_slo: float
    tpot_slo: float
    first_at: float | None = None
    done_at: float | None = None
    decoded: int = 0  # tokens after the first
    last_at: float = 0.0
    path: str = ""
    predicted_wait: float = 0.0  # the local wait predicted at its decision

    @property
    def ok(self) -> bool:
        if self.first_at is None or self.done_at is None:
            return False
        ttft = self.first_at - self.arrival
        tpot = (self.done_at - self.first_at) / (self.spec.output - 1) if self.spec.output > 1 else 0.0
        return ttft <= self.ttft_slo and tpot <= self.tpot_slo


@dataclass
class Job:
    """A prompt to prefill on one GPU."""

    req: Req
    todo: int  # tokens left to compute
    done: int  # context already there (cached or computed)
    remote_to: Gpu | None = None  # prefill role: where the KV goes
    dispatched: float = 0.0
    predicted_wait: float = 0.0
    sent_tokens: int = 0  # tokens the KV pull moves
    computed: int = 0  # tokens this GPU computes for it

    @property
    def kv(self) -> int:
        """KV tokens it holds on this GPU once admitted (a prefill GPU keeps no output)."""
        return self.req.spec.prompt + (0 if self.remote_to is not None else self.req.spec.output)


@dataclass
class Gpu:
    name: str
    prof: TimingProfile
    cache_units: int
    waiting: deque = field(default_factory=deque)
    prefilling: list = field(default_factory=list)
    decoding: list = field(default_factory=list)  # Req
    incoming: set = field(default_factory=set)  # Req whose remote prefill is in flight here
    busy: bool = False
    kv_used: int = 0
    cache: OrderedDict = field(default_factory=OrderedDict)
    link_free: float = 0.0
    prompt_computed: int = 0
    rates: PathRates | None = None  # conditional decode GPUs only

    def queued_tokens(self) -> int:
        return sum(j.todo for j in self.waiting) + sum(j.todo for j in self.prefilling)

    def active_tokens(self) -> int:
        return self.kv_used

    def cached(self, spec: Spec) -> int:
        n = 0
        for u in spec.units:
            if u not in self.cache:
                break
            n += 1
        return min(n * UNIT, spec.prompt - 1)

    def remember(self, spec: Spec) -> None:
        for u in spec.units[: spec.prompt // UNIT]:
            self.cache[u] = None
            self.cache.move_to_end(u)
        while len(self.cache) > self.cache_units:
            self.cache.popitem(last=False)


def unloaded_ttft_s(prof: TimingProfile, prompt: int) -> float:
    """A prompt alone on an idle GPU: its chunks, one pass each (the first token leaves with the last)."""
    t, done = 0.0, 0
    while done < prompt:
        n = min(prof.max_num_batched_tokens, prompt - done)
        t += prof.prefill_ms(n, done) / 1000.0
        done += n
    return t


def unloaded_tpot_s(prof: TimingProfile, spec: Spec) -> float:
    return prof.decode_ms(1, spec.prompt + spec.output // 2) / 1000.0


def prefill_rate(prof: TimingProfile) -> float:
    """Prompt tokens/s of a full-budget pass: what the router divides queued tokens by."""
    n = prof.max_num_batched_tokens
    return n / (prof.prefill_ms(n, 0) / 1000.0)


class Sim:
    def __init__(self, prof: TimingProfile, n_prefill: int, n_decode: int, mode: str, seed: int = 0):
        """`mode`: agg (n_prefill must be 0, every prefill local), disagg (every prefill remote)
        or cond (the product's rule)."""
        self.prof, self.mode = prof, mode
        units = max(1, prof.capacity_tokens // 2 // UNIT)
        self.prefill = [Gpu(f"p{i}", prof, units) for i in range(n_prefill)]
        self.decode = [Gpu(f"d{i}", prof, units) for i in range(n_decode)]
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.policy = DisaggregationPolicy(DisaggConfig())
        self.rate = prefill_rate(prof)
        if mode == "cond":
            for g in self.decode:
                g.rates = PathRates(prior_tokens_per_s=1000.0, clock=lambda: self.now)
        self.decisions = {"local": 0, "remote": 0}

    # ---- events -----------------------------------------------------------

    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, reqs: Sequence[Req]) -> list[Req]:
        for r in reqs:
            self._at(r.arrival, self._arrive, r)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
        return list(reqs)

    # ---- routing and the decision ---------------------------------------------

    def _arrive(self, r: Req) -> None:
        spec = r.spec
        d = min(
            self.decode, key=lambda g: (spec.prompt - g.cached(spec)) + g.queued_tokens() + g.active_tokens()
        )
        cached = d.cached(spec)
        uncached = spec.prompt - cached
        path = Path.LOCAL
        cands: list[tuple[Candidate, Gpu]] = []
        if self.prefill and self.mode != "agg":
            ranked = sorted(
                self.prefill,
                key=lambda p: (p.queued_tokens() + spec.prompt - p.cached(spec)) / self.rate,
            )
            cands = [(Candidate(p.name, p.name, p.queued_tokens() / self.rate), p) for p in ranked]
        if self.mode == "disagg" and cands:
            path = Path.REMOTE
        elif self.mode == "cond" and cands:
            rates = d.rates
            assert rates is not None
            waiting = d.queued_tokens()
            rates.arrived(spec.output)
            rates.observe_local(d.prompt_computed, waiting)
            decision = self.policy.decide(
                spec.prompt,
                cached,
                [c for c, _ in cands],
                rates.local_wait_s(waiting),
                Mode.AUTO,
                rates.local.tokens_per_s,
                rates=rates.snapshot(),
                running=[
                    RunningDecode(
                        q.decoded, q.spec.output - 1 - q.decoded, self.now - (q.first_at or self.now)
                    )
                    for q in d.decoding
                ]
                + [RunningDecode(0, q.spec.output - 1, 0.0) for q in d.incoming],
            )
            path = decision.path
            r.predicted_wait = rates.local_wait_s(waiting)
        self.decisions[path.value] += 1
        r.path = path.value
        if path is Path.LOCAL:
            d.waiting.append(Job(r, uncached, cached, computed=uncached))
            self._kick(d)
        else:
            c, p = cands[0]
            pc = p.cached(spec)
            job = Job(
                r, spec.prompt - pc, pc, remote_to=d, dispatched=self.now, predicted_wait=c.estimated_wait_s
            )
            job.sent_tokens, job.computed = uncached, spec.prompt - pc
            # The decode GPU reserves the KV before the remote prefill starts (reserve_external).
            d.kv_used += spec.prompt + spec.output
            d.incoming.add(r)
            p.waiting.append(job)
            self._kick(p)

    # ---- a GPU's passes --------------------------------------------------------

    def _kick(self, g: Gpu) -> None:
        if not g.busy and (g.waiting or g.prefilling or g.decoding):
            self._pass(g)

    def _pass(self, g: Gpu) -> None:
        prof = self.prof
        budget = prof.max_num_batched_tokens
        dec = g.decoding[: prof.max_num_seqs]
        budget -= len(dec)
        chunks: list[tuple[Job, int]] = []
        for j in g.prefilling:
            if budget <= 0:
                break
            n = min(j.todo, budget)
            chunks.append((j, n))
            budget -= n
        while (
            g.waiting
            and budget > 0
            and len(dec) + len(g.prefilling) < prof.max_num_seqs
            and (g.kv_used + g.waiting[0].kv <= prof.capacity_tokens or not (dec or g.prefilling))
        ):
            j = g.waiting.popleft()
            g.kv_used += j.kv
            g.prefilling.append(j)
            n = min(j.todo, budget)
            chunks.append((j, n))
            budget -= n
        if not dec and not chunks:
            g.busy = False
            return
        t_new = sum(n for _, n in chunks)
        ctx = sum(n * j.done for j, n in chunks) / t_new if t_new else 0.0
        k = sum(q.spec.prompt + 1 + q.decoded for q in dec)
        ms = prof.prefill_ms(t_new, ctx) + prof.decode_ms(len(dec), k)
        g.busy = True
        self._at(self.now + ms / 1000.0, self._pass_end, g, dec, chunks)

    def _pass_end(self, g: Gpu, dec: list[Req], chunks: list[tuple[Job, int]]) -> None:
        now = self.now
        for q in dec:
            q.decoded += 1
            if g.rates is not None:
                g.rates.decode_interval(now - q.last_at, 1)
            q.last_at = now
            if q.decoded >= q.spec.output - 1:
                q.done_at = now
                g.decoding.remove(q)
                g.kv_used -= q.spec.prompt + q.spec.output
        for j, n in chunks:
            j.todo -= n
            j.done += n
            g.prompt_computed += n
            if j.todo > 0:
                continue
            g.prefilling.remove(j)
            g.remember(j.req.spec)
            if j.remote_to is None:
                self._first_token(g, j.req)
                if g.rates is not None:
                    g.rates.local_done(j.computed, now - j.req.arrival, j.req.predicted_wait)
            else:
                g.kv_used -= j.req.spec.prompt
                self._transfer(j, now)
        self._pass(g)

    def _first_token(self, g: Gpu, r: Req) -> None:
        r.first_at = r.last_at = self.now
        if r.spec.output <= 1:
            r.done_at = self.now
            g.kv_used -= r.spec.prompt + r.spec.output
        else:
            g.decoding.append(r)

    def _transfer(self, j: Job, prefill_done: float) -> None:
        d = j.remote_to
        assert d is not None
        start = max(prefill_done, d.link_free)
        dur = self.prof.transfer_s(j.sent_tokens)
        d.link_free = start + dur
        self._at(start + dur, self._pulled, j, dur)

    def _pulled(self, j: Job, dur: float) -> None:
        d = j.remote_to
        assert d is not None
        if d.rates is not None:
            elapsed = self.now - j.dispatched
            d.rates.remote_done(j.computed, elapsed - dur, j.predicted_wait)
            d.rates.pulled(j.sent_tokens * self.prof.kv_bytes_per_token, dur, j.sent_tokens)
        d.remember(j.req.spec)
        d.incoming.discard(j.req)
        self._first_token(d, j.req)
        self._kick(d)


# ---- workloads ---------------------------------------------------------------


def make_requests(prof: TimingProfile, specs: Sequence[Spec], rate: float, seed: int) -> list[Req]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, s in enumerate(specs):
        t += rng.expovariate(rate)
        ttft = TTFT_SLO_X * unloaded_ttft_s(prof, s.prompt)
        out.append(Req(i, t, s, ttft, TPOT_SLO_X * unloaded_tpot_s(prof, s)))
    return out


def attainment(reqs: Sequence[Req]) -> float:
    return sum(r.ok for r in reqs) / len(reqs) if reqs else 0.0


def simulate(
    prof: TimingProfile,
    n_prefill: int,
    n_decode: int,
    mode: str,
    specs: Sequence[Spec],
    rate: float,
    seed: int,
) -> tuple[float, dict[str, int]]:
    sim = Sim(prof, n_prefill, n_decode, mode, seed)
    reqs = sim.run(make_requests(prof, specs, rate, seed))
    return attainment(reqs), sim.decisions


_simulate = simulate


def goodput(
    prof: TimingProfile,
    n_prefill: int,
    n_decode: int,
    mode: str,
    specs: Sequence[Spec],
    rates: Sequence[float],
    seed: int,
    target: float = 0.9,
    refine: int = 3,
    repeats: int = 1,
) -> tuple[float, list[tuple[float, float]], dict[str, int]]:
    """(goodput, the curve over `rates`, decisions at the goodput rate): the highest rate up to
    which attainment stays >= target, refined by bisection between the last good and first bad.
    `repeats` > 1: attainment pooled over that many arrival seeds (seed, seed + 1, ...)."""

    def simulate(prof, n_prefill, n_decode, mode, specs, rate, seed):
        runs = [_simulate(prof, n_prefill, n_decode, mode, specs, rate, seed + k) for k in range(repeats)]
        dec = {k: sum(r[1][k] for r in runs) for k in runs[0][1]}
        return sum(r[0] for r in runs) / repeats, dec

    curve, last_good, first_bad, decisions = [], 0.0, math.inf, {}
    for rate in sorted(rates):
        att, dec = simulate(prof, n_prefill, n_decode, mode, specs, rate, seed)
        curve.append((rate, att))
        if math.isinf(first_bad):
            if att >= target:
                last_good, decisions = rate, dec
            else:
                first_bad = rate
    if math.isfinite(first_bad):
        lo, hi = last_good, first_bad
        for _ in range(refine):
            mid = (lo + hi) / 2 if lo else hi / 2
            att, dec = simulate(prof, n_prefill, n_decode, mode, specs, mid, seed)
            if att >= target:
                lo, decisions = mid, dec
            else:
                hi = mid
        last_good = lo
    return last_good, curve, decisions
