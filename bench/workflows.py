"""Workflow-aware scheduling study (issue 21 item 5): an in-process event model.

Synthesized agentic workflows go through the router's real admission core
(services/router/admission.py + workflow_sched.py, on the simulation's clock)
to workers whose KV is the engine's real BlockManager (prefix cache, LRU and
workflow pins); a step's service time comes from a sim timing profile
(services/model/profiles.json, as bench/fleet_sim.py). Cost accounting is the
router's real WorkflowLedger (services/router/cost.py).

What is modeled, not run: a worker serves `slots` steps at once and queues the
rest locally (its engine's waiting queue); a step takes
prefill_ms(uncached prompt, cached) + output x decode_ms(pool utilisation);
a step still running at its workflow's deadline is cancelled then (its tokens
are wasted, prorated). Routing is the router's: the kv_aware policy
(services/router/policy.py, at the router's decode weight) over every worker's
exact cached prefix and its queued prefill tokens (the router's LoadView), and
for pdmesh the workflow -> worker hint (services/router/workflow_affinity.py);
a step that reaches a worker restarts its workflow's pin TTL, as the engine's
Scheduler.add does.

Workflows: single-call chat, 10-20-call copilot, 40-60-call research agent;
each call's prompt is the conversation so far plus a new user/tool message;
think/tool gaps between calls; one deadline per workflow (every step carries
it as its gRPC deadline). Deterministic for a seed (token ids from crc32 of the
workflow id, not Python's per-process string hash). Offered load = overload x the fleet's capacity
(slot-seconds of the workload's steps at ideal cache reuse).

Policies (same workload, same fleet):
- fifo: one queue in arrival order, no priorities, no pins;
- priority: per-request priority by class (chat > copilot > research);
- las: Autellix-style program-level least attained service alone (strict levels);
- pdmesh: tenant priority (with the in-flight slots beyond the workers' batch
  slots reserved for priority >= 0) + EDF + bounded attained-service deferral +
  sunk-cost shedding + workflow KV pins + the affinity hint and home steering.

    python bench/workflows.py --quick
"""

from __future__ import annotations

import argparse
import array
import heapq
import itertools
import math
import multiprocessing
import os
import random
import sys
import zlib
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_model
from services.engine.api import EngineRequest
from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence
from services.model.hashing import BlockHashChain
from services.model.timing import TimingProfile, load_profile
from services.router.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRejected,
    Ticket,
    Waiter,
    WaiterState,
)
from services.router.config import RouterConfig
from services.router.cost import RequestCost, RequestOutcome, WorkflowLedger
from services.router.policy import Candidate, KvAwarePolicy, PolicyConfig, WorkerLoad
from services.router.workflow_affinity import WorkflowAffinity
from services.router.workflow_sched import WorkflowInfo, WorkflowSchedConfig

BLOCK = 16
SYSTEM = list(range(1, 257))  # shared system prompt: a cache hit for everyone


@dataclass(frozen=True)
class Kind:
    name: str
    share: float
    steps: tuple[int, int]
    msg_tokens: tuple[int, int]  # new user / tool tokens per step
    out_tokens: tuple[int, int]
    gap_s: tuple[float, float]  # think / tool time between steps
    priority: int  # its per-request priority (priority and pdmesh policies)
    slack: float  # deadline = arrival + slack x (unloaded service + gaps)


KINDS = (
    Kind("chat", 0.6, (1, 1), (50, 400), (50, 250), (0.0, 0.0), 1, 4.0),
    Kind("copilot", 0.3, (10, 20), (100, 400), (30, 150), (1.0, 6.0), 0, 2.0),
    Kind("research", 0.1, (40, 60), (200, 600), (50, 200), (0.5, 4.0), -1, 2.0),
)


@dataclass(eq=False)
class Workflow:
    id: str
    kind: Kind
    arrival: float
    msgs: list[int]
    outs: list[int]
    gaps: list[float]
    deadline: float = 0.0
    step: int = 0
    context: list[int] = field(default_factory=list)  # conversation so far
    spent: int = 0
    home: int | None = None
    done: bool = False
    ok: bool = False
    end: float = 0.0
    tokens_rng: random.Random | None = None


@dataclass(eq=False)
class Step:
    wf: Workflow
    index: int
    prompt: list[int]
    out: int
    out_tokens: list[int] = field(default_factory=list)
    ticket: Ticket | None = None
    queued_at: float = 0.0
    ctx: int = 0
    hashes: BlockHashChain | None = None
    routed_prefill: int = 0


@dataclass(frozen=True)
class Policy:
    name: str
    admission: AdmissionConfig
    priorities: bool
    pins: bool
    affinity: bool


def policies(base: AdmissionConfig, worker_slots: int) -> list[Policy]:
    """The four policies. `base` is pdmesh's admission config less its slot reserve;
    `worker_slots`: the fleet's batch slots (base.max_inflight is more: the rest wait
    in the workers' local queues)."""
    off = replace(base, edf=False, attained_service=False, sunk_cost_shedding=False)
    strict_las = replace(base.workflow, level_delay_s=1e6)  # levels dominate arrival
    # pdmesh holds the in-flight slots beyond the workers' batch slots for priority >= 0:
    # lower-priority steps never wait in a worker's local FIFO queue, where a later
    # higher-priority step would have to wait behind them (admission.py, reserved_inflight).
    full = replace(base, reserved_inflight=max(base.max_inflight - worker_slots, 0))
    return [
        Policy("fifo", off, False, False, False),
        Policy("priority", off, True, False, False),
        Policy("las", replace(off, attained_service=True, workflow=strict_las), False, False, False),
        Policy("pdmesh", full, True, True, True),
    ]


def make_workload(rate: float, duration_s: float, seed: int) -> list[Workflow]:
    rng = random.Random(seed)
    t, out, n = 0.0, [], 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        kind = rng.choices(KINDS, [k.share for k in KINDS])[0]
        steps = rng.randint(*kind.steps)
        out.append(
            Workflow(
                id=f"{kind.name}-{n}",
                kind=kind,
                arrival=t,
                msgs=[rng.randint(*kind.msg_tokens) for _ in range(steps)],
                outs=[rng.randint(*kind.out_tokens) for _ in range(steps)],
                gaps=[rng.uniform(*kind.gap_s) for _ in range(steps)],
            )
        )
        n += 1


class Fleet:
    """Workers: slots, a local queue, a real BlockManager each."""

    def __init__(self, workers: int, slots: int, blocks: int, pin_ttl_s: float, clock):
        self.slots = slots
        self.profile = load_profile("dynamo-mocker").scaled_to(blocks, BLOCK)
        self.bms = [
            BlockManager(blocks, BLOCK, True, 64, pin_ttl_s=pin_ttl_s, clock=clock) for _ in range(workers)
        ]
        self.running = [0] * workers
        self.context = [0] * workers  # context tokens of the running steps (the mocker's K)
        self.queues: list[deque[Step]] = [deque() for _ in range(workers)]
        self.queued_prefill = [0] * workers  # prompt tokens routed there, not started (the LoadView's)
        self.seqs: dict[int, Sequence] = {}

    def backlog(self, w: int) -> int:
        return self.running[w] + len(self.queues[w])

    def service_s(self, w: int, new: int, cached: int, out: int) -> float:
        # Decode speed depends on the running batch's context, not on idle (cached or pinned) blocks.
        k = self.context[w]
        return (self.profile.prefill_ms(new, cached) + out * self.profile.decode_ms(self.slots, k)) / 1000.0


class Sim:
    def __init__(self, policy: Policy, workload: list[Workflow], args):
        self.now = 0.0
        self.policy = policy
        self.ctl = AdmissionController(policy.admission, clock=lambda: self.now)
        self.fleet = Fleet(
            args.workers, args.slots, args.blocks, args.pin_ttl_s if policy.pins else 0.0, lambda: self.now
        )
        self.ledger = WorkflowLedger(abandon_after_s=1e9)
        self.batch_context = args.batch_context
        self.events: list = []
        self.ids = itertools.count()
        self.workload = [
            replace(w, context=[], tokens_rng=random.Random(zlib.crc32(w.id.encode()))) for w in workload
        ]
        for w in self.workload:
            w.deadline = w.arrival + w.kind.slack * self.unloaded_s(w)
            self.push(w.arrival, self.step_arrives, w)
        self.armed: float | None = None
        self.waiters: dict[int, Step] = {}
        self.max_wait = {k.name: 0.0 for k in KINDS}
        self.prompt_tokens = self.cached_tokens = 0
        self.followups = self.affinity_hits = self.same_home = 0
        self.miss_moved = self.miss_home = 0  # follow-ups without their context: routed away / at home
        self.failures: dict[str, int] = {}  # "class:cause" -> workflows failed so
        # The router's own routing code: kv_aware at the router's decode weight, and the hint.
        self.router_policy = KvAwarePolicy(
            PolicyConfig(block_size=BLOCK, decode_weight=RouterConfig().decode_weight), random.Random(7)
        )
        self.affinity = WorkflowAffinity() if policy.affinity else None

    def unloaded_s(self, w: Workflow) -> float:
        return demand_slot_s([w], self.fleet.profile, self.batch_context) + sum(w.gaps)

    def push(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.ids), fn, args))

    def run(self) -> None:
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            self.now = t
            fn(*args)
            self.arm()

    # ---- admission -------------------------------------------------------------

    def arm(self) -> None:
        at = self.ctl.next_expiry()
        if at is not None and at != self.armed:
            self.armed = at
            self.push(at, self.expire)

    def expire(self) -> None:
        self.armed = None
        for waiter in self.ctl.expire():
            step = self.waiters.pop(waiter.id)
            self.fail_shed(step, waiter.rejection.reason if waiter.rejection else "expired")

    def step_arrives(self, wf: Workflow) -> None:
        k = wf.step
        if not wf.context:
            wf.context = list(SYSTEM)
        wf.context += rng_toks(wf, wf.msgs[k])
        step = Step(wf, k, list(wf.context), wf.outs[k], rng_toks(wf, wf.outs[k]), queued_at=self.now)
        prio = wf.kind.priority if self.policy.priorities else 0
        info = WorkflowInfo(wf.id, k, wf.spent)
        try:
            got = self.ctl.try_admit(wf.kind.name, prio, len(step.prompt) + step.out, wf.deadline, info)
        except AdmissionRejected as e:
            self.fail_shed(step, e.reason)
            return
        for waiter in self.ctl.expire():  # sunk-cost shedding displaced someone
            self.fail_shed(self.waiters.pop(waiter.id), waiter.rejection.reason if waiter.rejection else "")
        if isinstance(got, Waiter):
            self.waiters[got.id] = step
        else:
            step.ticket = got
            self.dispatch(step)

    def granted(self, waiters: list[Waiter]) -> None:
        for waiter in waiters:
            assert waiter.state is WaiterState.GRANTED
            step = self.waiters.pop(waiter.id)
            step.ticket = waiter.ticket
            self.dispatch(step)

    # ---- workers ---------------------------------------------------------------

    def dispatch(self, step: Step) -> None:
        """Route as the router does (services/router/generate.py _launch): the
        kv_aware policy over the workers, overlaps from their caches (the prefix
        index, exact here), and for pdmesh the workflow -> worker hint's credit."""
        fleet = self.fleet
        hashes = BlockHashChain(step.prompt, BLOCK)
        overlaps = {str(i): bm.cached_prefix_blocks(hashes) for i, bm in enumerate(fleet.bms)}
        if self.affinity is not None:
            overlaps = self.affinity.credit(step.wf.id, hashes, overlaps, self.now)
        cands = [
            Candidate(
                str(i),
                WorkerLoad(
                    running=fleet.running[i],
                    waiting=len(fleet.queues[i]),
                    tokens_waiting=fleet.queued_prefill[i],
                    active_decode_blocks=fleet.context[i] // BLOCK,
                ),
            )
            for i in range(len(fleet.bms))
        ]
        ranked = self.router_policy.rank(cands, len(hashes), overlaps)
        if self.affinity is not None:  # as generate.py: home first unless its queue is the longer
            waiting = {str(i): len(q) for i, q in enumerate(fleet.queues)}
            ranked = self.affinity.steer(step.wf.id, hashes, ranked, waiting, self.now)
        w = int(ranked[0].worker_id)
        step.hashes = hashes
        step.routed_prefill = len(step.prompt) - overlaps[str(w)] * BLOCK
        if step.index > 0 and step.wf.home is not None:
            self.same_home += w == step.wf.home
        if self.policy.pins:
            fleet.bms[w].touch_pin(step.wf.id)  # as the engine's Scheduler.add
        if fleet.running[w] < fleet.slots and not fleet.queues[w]:  # never ahead of the local queue
            self.start(w, step)
        else:
            fleet.queued_prefill[w] += step.routed_prefill
            fleet.queues[w].append(step)

    def start(self, w: int, step: Step) -> None:
        fleet = self.fleet
        name = step.wf.kind.name  # wait = admission queue + the worker's local queue
        self.max_wait[name] = max(self.max_wait[name], self.now - step.queued_at)
        bm = fleet.bms[w]
        bm.expire_pins()  # as the engine's scheduler does each step
        fleet.running[w] += 1
        tokens = step.prompt + step.out_tokens
        seq = Sequence(EngineRequest(f"{step.wf.id}/{step.index}", tokens), BLOCK, None)
        if step.hashes is not None:  # the prompt's chain, hashed once at routing (the same values)
            seq._block_hashes = list(step.hashes)
        hits = bm.match_prefix(seq, len(step.prompt) - 1)
        if bm.allocate_slots(seq, len(tokens), hits):
            seq.num_computed_tokens = len(tokens)
            bm.cache_full_blocks(seq)
            cached = len(hits) * BLOCK
            fleet.seqs[id(step)] = seq
        else:  # pool full of running work: computed, not kept
            cached = 0
        new = len(step.prompt) - cached
        self.prompt_tokens += len(step.prompt)
        self.cached_tokens += cached
        if step.index > 0:
            self.followups += 1
            prior = len(step.prompt) - step.wf.msgs[step.index]
            hit = cached >= (prior // BLOCK) * BLOCK - BLOCK
            self.affinity_hits += hit
            if not hit:
                if w == step.wf.home:
                    self.miss_home += 1
                else:
                    self.miss_moved += 1
        step.wf.home = w
        step.ctx = len(tokens)
        fleet.context[w] += step.ctx
        took = fleet.service_s(w, new, cached, step.out)
        computed = new + step.out
        if self.now + took > step.wf.deadline:  # the deadline cancels it mid-way
            frac = (step.wf.deadline - self.now) / took
            self.push(step.wf.deadline, self.finish, w, step, max(int(computed * frac), 1), False)
        else:
            self.push(self.now + took, self.finish, w, step, computed, True)

    def finish(self, w: int, step: Step, computed: int, ok: bool) -> None:
        fleet, wf = self.fleet, step.wf
        fleet.running[w] -= 1
        fleet.context[w] -= step.ctx
        seq = fleet.seqs.pop(id(step), None)
        final = step.index == len(wf.msgs) - 1
        bm = fleet.bms[w]
        if seq is not None:
            if ok and not final and self.policy.pins:
                bm.pin(wf.id, seq)
            elif final or not ok:
                bm.unpin(wf.id)
            bm.free(seq)
        assert step.ticket is not None
        self.granted(self.ctl.release(step.ticket, served_tokens=computed))
        outcome = RequestOutcome.SUCCEEDED if ok else RequestOutcome.CANCELLED
        cost = RequestCost(outcome=outcome, computed_tokens=computed, wasted_tokens=0 if ok else computed)
        self.ledger.record_step(wf.kind.name, wf.id, cost, final=final, now=self.now)
        wf.spent += computed
        if not ok:
            key = f"{wf.kind.name}:deadline_cancel"
            self.failures[key] = self.failures.get(key, 0) + 1
            self.end(wf, False)
        elif final:
            self.end(wf, True)
        else:
            if self.affinity is not None and step.hashes is not None:
                self.affinity.record(wf.id, str(w), step.hashes, self.now)
            wf.context += step.out_tokens
            wf.step += 1
            self.push(self.now + wf.gaps[step.index], self.step_arrives, wf)
        while fleet.queues[w] and fleet.running[w] < fleet.slots:
            nxt = fleet.queues[w].popleft()
            fleet.queued_prefill[w] -= nxt.routed_prefill
            self.start(w, nxt)

    def fail_shed(self, step: Step, reason: str) -> None:
        key = f"{step.wf.kind.name}:{reason}"
        self.failures[key] = self.failures.get(key, 0) + 1
        self.ledger.record_shed(step.wf.kind.name, step.wf.id, self.now)
        for bm in self.fleet.bms:
            bm.unpin(step.wf.id)
        self.end(step.wf, False)

    def end(self, wf: Workflow, ok: bool) -> None:
        wf.done, wf.ok, wf.end = True, ok, self.now
        if self.affinity is not None:
            self.affinity.forget(wf.id)
        self.ctl.forget_workflow(wf.id)

    # ---- results ---------------------------------------------------------------

    def results(self) -> dict:
        s = self.ledger.stats()
        lat = sorted(w.end - w.arrival for w in self.workload if w.ok)
        by_kind = {
            k.name: sum(w.ok for w in self.workload if w.kind is k)
            / max(sum(w.kind is k for w in self.workload), 1)
            for k in KINDS
        }
        return {
            "done": s.completed,
            "total": len(self.workload),
            "rate": s.completion_rate,
            "cost": s.cost_per_successful_workflow,
            "waste": s.wasted_tokens / s.completed if s.completed else math.inf,
            "p99": lat[min(int(0.99 * len(lat)), len(lat) - 1)] if lat else math.nan,
            "max_wait": max(self.max_wait.values()),
            "waits": dict(self.max_wait),
            "by_kind": by_kind,
            "kv_hit": self.cached_tokens / max(self.prompt_tokens, 1),
            "affinity": self.affinity_hits / max(self.followups, 1),
            "same_home": self.same_home / max(self.followups, 1),
            "pins": self.fleet.bms[0].pin_stats() if self.policy.pins else None,
            "failures": dict(sorted(self.failures.items())),
            "miss_moved": self.miss_moved,
            "miss_home": self.miss_home,
        }


def rng_toks(wf: Workflow, n: int) -> list[int]:
    """`n` token ids in [300, 60300) from the workflow's own generator (16 random
    bits each: a per-token randint was a tenth of the study's time)."""
    assert wf.tokens_rng is not None
    return [300 + x % 60_000 for x in array.array("H", wf.tokens_rng.randbytes(2 * n))]


def mean_context(workload: list[Workflow]) -> float:
    """Output-token-weighted mean context of the workload's steps."""
    num = den = 0
    for w in workload:
        ctx = len(SYSTEM)
        for m, o in zip(w.msgs, w.outs, strict=True):
            ctx += m
            num, den = num + o * ctx, den + o
            ctx += o
    return num / max(den, 1)


def demand_slot_s(workload: list[Workflow], p: TimingProfile, batch_context: float) -> float:
    """Slot-seconds the workload needs at ideal cache reuse, decoding in a full
    batch of mean-sized contexts (`batch_context` tokens; the capacity
    yardstick; deadlines use it too)."""
    per_token_ms = p.decode_ms(1, int(batch_context))
    total = 0.0
    for w in workload:
        ctx = len(SYSTEM)
        for m, o in zip(w.msgs, w.outs, strict=True):
            total += (p.prefill_ms(m, ctx) + o * per_token_ms) / 1000.0
            ctx += m + o
    return total


def _run_one(ov, name, base, capacity, per_wf, duration, args) -> dict:
    pol = next(p for p in policies(base, args.workers * args.slots) if p.name == name)
    sim = Sim(pol, make_workload(ov * capacity / per_wf, duration, args.seed), args)
    sim.run()
    return sim.results()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a shorter arrival window")
    ap.add_argument("--duration-s", type=float, default=1200.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=16384, help="KV blocks (16 tokens) per worker")
    ap.add_argument("--pin-ttl-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--overloads", type=str, default="1.5,3")
    ap.add_argument("--policies", type=str, default="fifo,priority,las,pdmesh", help="a subset, to diagnose")
    ap.add_argument("--jobs", type=int, default=1, help="runs (overload x policy) in parallel processes")
    args = ap.parse_args(argv)
    duration = 400.0 if args.quick else args.duration_s
    base = AdmissionConfig(
        max_inflight=args.workers * args.slots * 2,
        queue_limit_per_priority=args.workers * args.slots,
        queue_timeout_s=60.0,
        workflow=WorkflowSchedConfig(level_base_tokens=4000, level_delay_s=2.0, max_level=4),
    )
    capacity = args.workers * args.slots  # slot-seconds per second
    probe = make_workload(1.0, 2000.0, args.seed + 99)
    profile = load_profile("dynamo-mocker").scaled_to(args.blocks, BLOCK)
    args.batch_context = args.slots * mean_context(probe)
    per_wf = demand_slot_s(probe, profile, args.batch_context) / len(probe)
    print(f"cpu: {cpu_model()}, load average {os.getloadavg()[0]:.1f} (at start)")
    print(
        f"fleet: {args.workers} workers x {args.slots} slots, {args.blocks} KV blocks each; "
        f"{per_wf:.1f} slot-s per workflow; arrivals for {duration:.0f} s"
    )
    overloads = [float(x) for x in args.overloads.split(",")]
    names = [p.name for p in policies(base, capacity) if p.name in args.policies.split(",")]
    jobs = [(ov, name) for ov in overloads for name in names]
    # Each (overload, policy) run is independent and deterministic: --jobs runs them in
    # parallel processes, with the same results as one after another.
    if args.jobs > 1:
        with multiprocessing.get_context("fork").Pool(min(args.jobs, len(jobs))) as pool:
            done = pool.starmap(
                _run_one, [(ov, name, base, capacity, per_wf, duration, args) for ov, name in jobs]
            )
    else:
        done = [_run_one(ov, name, base, capacity, per_wf, duration, args) for ov, name in jobs]
    results = dict(zip(jobs, done, strict=True))
    last: dict[str, dict] = {}
    for ov in overloads:
        rate = ov * capacity / per_wf
        n = len(make_workload(rate, duration, args.seed))
        print(f"\n== overload {ov:g}x: {rate:.2f} workflows/s, {n} workflows")
        print(
            f"{'policy':9} {'done':>5} {'rate':>6} {'cost/ok':>8} {'waste/ok':>9} {'p99_s':>7} "
            f"{'max_wait_s':>10} {'kv_hit':>6} {'affin':>6}  done by class / longest wait by class"
        )
        rows = {}
        for name in names:
            r = rows[name] = results[(ov, name)]
            classes = " ".join(f"{k}={r['by_kind'][k]:.2f}/{r['waits'][k]:.0f}s" for k in r["by_kind"])
            print(
                f"{name:9} {r['done']:5d} {r['rate']:6.2f} {r['cost']:8.0f} {r['waste']:9.0f} "
                f"{r['p99']:7.1f} {r['max_wait']:10.1f} {r['kv_hit']:6.2f} {r['affinity']:6.2f}  {classes}"
            )
            fails = " ".join(f"{k}={v}" for k, v in r["failures"].items())
            print(
                f"{'':9} failed by class:cause {fails or '-'}; follow-ups without their context: "
                f"routed elsewhere {r['miss_moved']}, at their last worker {r['miss_home']}"
            )
            if r["pins"] is not None:
                p = r["pins"]
                print(
                    f"{'':9} worker 0 pins: expired={p.pins_expired} evicted={p.pins_evicted} "
                    f"released={p.pins_released}; next step routed to its last worker {r['same_home']:.2f}"
                )
        last = rows
    if not {"fifo", "las", "pdmesh"} <= last.keys():
        return 0
    f, las, full = last["fifo"], last["las"], last["pdmesh"]
    print(
        f"\nworkflows done_vs_fifo={full['done'] / max(f['done'], 1):.2f} "
        f"waste_vs_fifo={full['waste'] / f['waste'] if f['waste'] else math.nan:.2f} "
        f"done_vs_las={full['done'] / max(las['done'], 1):.2f} "
        f"affinity_hit={full['affinity']:.2f} max_wait_s={full['max_wait']:.1f}"
    )
    print(f"(load average {os.getloadavg()[0]:.1f} at the end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
