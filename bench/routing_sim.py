"""Routing policies on a model of the sim workers, in one process, in seconds (issue 17).

Why: the real-process study (bench/routing_quality.py) takes minutes per policy
on two shared cores and moves ±0.1 in kv/rr between runs, too slow and noisy to
find *why* a cost formula loses. This models what the `sim` engine does per
worker, in model time, with no processes and no wall clock:

- the scheduler of services/engine/scheduler.py: running sequences first (a
  decode token each, the rest of a chunked prompt), then waiting ones FCFS up
  to max_num_batched_tokens, the prefix matched at admission (the last prompt
  token always computed); full blocks join the prefix cache as computed;
- the block pool: num_blocks, free cached blocks evicted LRU; admission waits
  while the pool is full (no preemption: the recorded runs had none);
- pass time = prefill_ms(T) + decode_ms(B, K) of the timing profile (timing.py),
  the first token at the end of the pass that computes the last prompt token.

The router sees, per policy variant: the workers' caches exactly (KV events
are fast against pass times), or through KV events that arrive `lag` seconds
after the pass that stored or evicted the blocks, optionally with optimistic
entries (`ttl`: a routed prompt's blocks count as held until then or until an
event says otherwise); and load either as heartbeats (tokens_waiting of
waiting sequences and active_decode_blocks of running ones, every
`report_interval_s`, plus the registry's pending blocks until the next report:
the router before issue 17) or from its own account (services/router/load_view.py).
Policies are the router's own classes (services/router/policy.py), so what wins
here is what the router runs.

`--memo-chunks 8192,32768,0` also models the router's memo of prompt block hashes
(services/router/hash_memo.py): a decision hashes its prompt chunk by chunk (16 blocks)
as deep as the walk goes (the deepest worker's cached prefix plus the block that ends
it), each chunk a memo hit or a miss that computes and keeps it, LRU-bounded at each
given number of chunks (0: unbounded). A decision is warm when every chunk it hashed
was a hit (session 26 measured 0.15 ms warm against 0.25-0.29 ms cold). With
optimistic prefixes (`ttl=`) the router hashes the whole prompt after each decision,
which fills the memo; those chunks are counted apart.

`--speeds 1,1,2.5/1.6` makes the fleet heterogeneous (issue 21 item 3): worker i's
prefill and decode times are multiplied by entry i mod len (one number: both;
"p/d": prefill by p, decode by d; e.g. an older generation with a third of the
compute and 60% of the memory bandwidth is "3/1.6"). Variant options `prof=1`
(the router's WorkerProfiles learn each worker's speed from what it sees: each
request's TTFT over the queue routed ahead of it plus its prompt, and its time per
token after the first, services/router/worker_profile.py) and `label=1` (the
fleet's true factors, as static labels would give them) pass speeds to the policy.
Each row then prints the mean end-to-end latency and the p99 time per output token.

`pull=1` (issue 17 item 3): the router's own `PrefixPullPlanner` (services/router/prefix_pull.py,
through `plan_for_ranking`, as generate.py calls it) may move a request off a loaded holder, or
give the chosen worker the holder's longer prefix; the pull takes the planner's own
`pull_s` (3 ms + the blocks' bytes over the profile's KV link, 64 GB/s for the dynamo-mocker
profile), after which the blocks are cached on the target (a stored event) and the request
queues for the rest (`pwait=S`: S seconds more per pull that the router does not price, e.g. the
puller's reservation waiting for its engine step). Pulled blocks count as cached at admission, so they are in `hit`; the
pull line says how much of it they are. Every prefill rate is the profile's (the model's
reports carry no predicted wait). Not modeled: the holder's lease and the copy's CPU.

Run: `python bench/routing_sim.py --workers 4 8 16 32 --requests 800 --variants
rr,kv@hb,kv@lv,kv@lv:dw=0.1+lag=1+ttl=10` (options after ":" joined by "+": pw, dw,
t (temperature), qw, lag, ttl, oracle=1, pull=1). Not a substitute for the real study: no
gRPC, no CPU contention. The "floor" line is every prompt alone on an idle worker
with one unbounded cache's hits: no policy's mean TTFT can go below it.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import re
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import build_workload
from bench.machine import cpu_model
from bench.traces import VocabRange
from services.model.hashing import block_hashes
from services.model.timing import TimingProfile, load_profile
from services.router.config import RouterConfig
from services.router.hash_memo import CHUNK
from services.router.load_view import LoadView
from services.router.policy import Candidate, PolicyConfig, WorkerLoad, make_policy
from services.router.prefix_pull import PrefixPullConfig, PrefixPullPlanner, plan_for_ranking
from services.router.worker_profile import WorkerProfileConfig, WorkerProfiles


@dataclass(eq=False)
class Req:
    rid: int
    arrival: float
    hashes: list[int]
    prompt: int
    out: int
    worker: int = -1
    cached: int = 0
    computed: int = 0  # tokens computed (prompt then decode)
    produced: int = 0
    first_token: float = math.nan
    done: float = math.nan
    key: int = -1  # load view key
    ahead: int = 0  # prompt tokens queued at its worker when routed (the router's view)
    to_prefill: int = 0  # prompt tokens the router expected it to compute
    blocks: list[int] = field(default_factory=list)  # hashes held (full prompt blocks)
    extra_blocks: int = 0  # non-cacheable blocks held (partial + decode)
    pulled: int = 0  # prompt blocks pulled from another worker before admission (issue 17 item 3)


class Worker:
    def __init__(self, wid: int, prof: TimingProfile, num_blocks: int, bs: int, mbt: int, max_seqs: int):
        self.wid, self.prof, self.bs, self.mbt, self.max_seqs = wid, prof, bs, mbt, max_seqs
        self.capacity = num_blocks
        self.cache: OrderedDict[int, None] = OrderedDict()  # computed full blocks, LRU order
        self.refs: dict[int, int] = {}  # block -> running sequences using it
        self.used_extra = 0
        self.uncomputed = 0  # prompt blocks admitted, not computed yet
        self.log: list[tuple[bool, int]] = []  # (stored?, block) since the last KV event batch
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.busy = False
        self.cached_tokens = 0
        self.prefill_x = self.decode_x = 1.0  # heterogeneous fleets: pass time multipliers

    def occupancy(self) -> int:
        """Blocks taken: the cache (free or in use), blocks being computed, decode/partial blocks."""
        return len(self.cache) + self.uncomputed + self.used_extra

    def match(self, hashes: list[int], prompt: int) -> int:
        usable = (prompt - 1) // self.bs
        n = 0
        cache = self.cache
        while n < usable and n < len(hashes) and hashes[n] in cache:
            n += 1
        return n

    def _room(self, need: int) -> bool:
        """Evict free cached blocks (LRU) until `need` more blocks fit."""
        while self.occupancy() + need > self.capacity:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        for h in self.cache:
            if h not in self.refs:
                del self.cache[h]
                self.log.append((False, h))
                return True
        return False

    def schedule(self) -> tuple[list[tuple[Req, int]], int, int, int]:
        budget = self.mbt
        sched: list[tuple[Req, int]] = []
        new = batch = dctx = 0
        for r in self.running:
            if budget <= 0:
                break
            if r.computed < r.prompt:
                n = min(r.prompt - r.computed, budget)
                new += n
            else:
                n = 1
                batch += 1
                dctx += r.computed + 1
            sched.append((r, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            m = self.match(r.hashes, r.prompt)
            total_blocks = -(-(r.prompt + r.out) // self.bs)
            need = total_blocks - m
            for h in r.hashes[:m]:  # touched first: the eviction below must not take them
                self.cache.move_to_end(h)
            if not self._room(need):
                break
            self.waiting.popleft()
            r.cached = m * self.bs
            self.cached_tokens += r.cached
            r.computed = r.cached
            r.blocks = list(r.hashes)
            for h in r.blocks:
                self.refs[h] = self.refs.get(h, 0) + 1
            r.extra_blocks = total_blocks - len(r.blocks)
            self.used_extra += r.extra_blocks
            self.uncomputed += len(r.blocks) - m
            n = min(r.prompt - r.computed, budget)
            new += n
            sched.append((r, n))
            self.running.append(r)
            budget -= n
        return sched, new, batch, dctx


@dataclass
class Variant:
    name: str
    policy: str
    own_view: bool  # the router's own load view (else heartbeats + pending blocks)
    prefill_weight: float = 1.0
    decode_weight: float = RouterConfig().decode_weight  # the router's default (":dw=1" for Dynamo's)
    temperature: float = 0.0
    queue_weight: float = 1.0  # exploration: weight of queued prefill against the request's own
    lag: float = -1.0  # KV events reach the router this long after the pass (s); < 0: it sees caches exactly
    ttl: float = 0.0  # optimistic prefixes: a routed prompt's blocks count as cached this long (s)
    oracle: bool = False  # exploration: the workers' true remaining prefill tokens as load
    busy_blocks: float = RouterConfig().busy_blocks  # the router's default ("busy=0": none)
    sync: bool = True  # the load view learns of each report (LoadView.reported); "sync=0": max(own, reported)
    prof: bool = False  # speeds learned online (WorkerProfiles), "prof=1"
    label: bool = False  # the fleet's true speed factors, "label=1"
    pull: bool = False  # prefixes pulled instead of recomputed (the router's PrefixPullPlanner), "pull=1"
    pull_wait: float = 0.0  # seconds a pull takes beyond what the router prices, "pwait=S"


class Cluster:
    def __init__(self, args, variant: Variant, reqs: list[Req], prof: TimingProfile, seed: int):
        self.args, self.v, self.prof = args, variant, prof
        self.workers = [
            Worker(i, prof, args.num_blocks, args.block_size, args.mbt, 256) for i in range(args.workers)
        ]
        self.reqs = reqs
        cfg = PolicyConfig(
            block_size=args.block_size,
            prefill_weight=variant.prefill_weight,
            temperature=variant.temperature,
            busy_blocks=variant.busy_blocks,
            **({"decode_weight": variant.decode_weight} if _has_decode_weight() else {}),
        )
        self.policy = make_policy(variant.policy, cfg, random.Random(seed))
        speeds = getattr(args, "speeds", None) or [(1.0, 1.0)]
        for w in self.workers:
            w.prefill_x, w.decode_x = speeds[w.wid % len(speeds)]
        self.profiles = WorkerProfiles(WorkerProfileConfig()) if variant.prof else None
        self.labels: dict[str, tuple[float, float]] | None = None
        if variant.label:
            mid_p = statistics.median(w.prefill_x for w in self.workers)
            mid_d = statistics.median(w.decode_x for w in self.workers)
            self.labels = {str(w.wid): (w.prefill_x / mid_p, w.decode_x / mid_d) for w in self.workers}
        self.view = LoadView()
        self.reports = [WorkerLoad() for _ in self.workers]
        self.pending = [0] * len(self.workers)
        self.events: list[tuple[float, int, int, object]] = []
        # The router's index when events lag: confirmed blocks and provisional ones (expiry) per worker.
        self.seen: list[set[int]] = [set() for _ in self.workers]
        self.prov: list[dict[int, float]] = [{} for _ in self.workers]
        self._seq = 0
        # The hash memo per bound (chunks; 0 = none): chunk key -> None in LRU order, and counts.
        self.memos = {b: OrderedDict() for b in getattr(args, "memo_chunks", [])}
        # Per bound: warm, cold decisions; chunks hit, missed in decisions; missed after them.
        self.memo_counts = {b: [0, 0, 0, 0, 0] for b in self.memos}
        # Pulls: the router's own planner (services/router/prefix_pull.py) on the profile's KV
        # bytes and link, its prefill rate as every worker's (the model's reports carry no
        # predicted wait), and 3 ms of RPCs per pull, as bench/routing_quality.py configures it.
        self.puller = None
        if variant.pull:
            self.puller = PrefixPullPlanner(
                PrefixPullConfig(
                    enabled=True,
                    link_bytes_per_s=prof.kv_bandwidth_gbps * 1e9,
                    kv_bytes_per_token=float(prof.kv_bytes_per_token),
                    latency_s=0.003,
                    prior_tokens_per_s=4096 / (prof.prefill_ms(4096) / 1000),
                ),
                args.block_size,
            )
        self.pulls_failed = 0

    def push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, kind, self._seq, obj))

    def report(self) -> None:
        for i, w in enumerate(self.workers):
            self.reports[i] = WorkerLoad(
                running=len(w.running),
                waiting=len(w.waiting),
                tokens_waiting=sum(r.prompt for r in w.waiting),
                active_decode_blocks=sum(len(r.blocks) + r.extra_blocks for r in w.running),
            )
            self.pending[i] = 0
            if self.v.sync:
                self.view.reported(str(i))

    def route(self, r: Req, now: float) -> None:
        bs = self.args.block_size
        overlaps = {}
        for w in self.workers:
            m = w.match(r.hashes, r.prompt) if self.v.lag < 0 else self.indexed(w.wid, r, now)
            if m:
                overlaps[str(w.wid)] = m
        if self.memos:
            self.memo_walk(r.hashes, max(overlaps.values(), default=0))
        cands = []
        for i in range(len(self.workers)):
            load = self.reports[i]
            if not self.v.own_view and self.pending[i]:
                load = WorkerLoad(
                    tokens_waiting=load.tokens_waiting,
                    active_decode_blocks=load.active_decode_blocks + self.pending[i],
                )
            cands.append(Candidate(str(i), load))
        if self.v.own_view:
            cands = self.view.blend(cands)
        if self.v.oracle:
            cands = [
                Candidate(
                    c.worker_id,
                    WorkerLoad(
                        tokens_waiting=sum(q.prompt - q.computed for q in w.running if q.computed < q.prompt)
                        + sum(q.prompt - w.match(q.hashes, q.prompt) * bs for q in w.waiting),
                        active_decode_blocks=c.load.active_decode_blocks,
                    ),
                )
                for c, w in zip(cands, self.workers, strict=True)
            ]
        if self.v.queue_weight != 1.0:
            qw = self.v.queue_weight
            cands = [
                Candidate(
                    c.worker_id,
                    WorkerLoad(
                        tokens_waiting=int(c.load.tokens_waiting * qw),
                        active_decode_blocks=c.load.active_decode_blocks,
                    ),
                )
                for c in cands
            ]
        speeds = self.labels if self.labels is not None else None
        if self.profiles is not None:
            speeds = self.profiles.ranking_factors() or None
        if speeds:
            ranked = self.policy.rank(cands, len(r.hashes), overlaps, speeds=speeds)
        else:
            ranked = self.policy.rank(cands, len(r.hashes), overlaps)
        plan = None
        if self.puller is not None:  # as generate.py: the plan's target first, maybe a pull
            ranked, plan = plan_for_ranking(self.puller, ranked, cands, overlaps, len(r.hashes))
        choice = ranked[0]
        wi = int(choice.worker_id)
        r.worker = wi
        have = plan.pull_blocks if plan is not None else choice.overlap_blocks  # blocks it will not compute
        r.ahead = next(c.load.tokens_waiting for c in cands if c.worker_id == choice.worker_id)
        r.to_prefill = max(r.prompt - have * bs, 0)
        total_blocks = -(-(r.prompt + r.out) // bs)
        new_blocks = total_blocks - have
        if self.v.own_view:
            r.key = self.view.begin(choice.worker_id, r.prompt - have * bs, new_blocks, r.prompt, bs)
        else:
            self.pending[wi] += new_blocks
        if self.v.ttl > 0:
            if self.memos:  # the optimistic insertion hashes the whole prompt after the decision
                self.memo_walk(r.hashes, len(r.hashes), decision=False)
            seen, prov = self.seen[wi], self.prov[wi]
            for h in r.hashes:
                if h not in seen:
                    prov[h] = now + self.v.ttl
        if plan is not None:  # the target pulls the holder's blocks, then queues the rest
            delta = plan.pull_blocks - overlaps.get(choice.worker_id, 0)
            self.push(now + self.puller.pull_s(delta) + self.v.pull_wait, 4, (r, plan.pull_blocks))
            return
        self.queue(self.workers[wi], r, now)

    def queue(self, w: Worker, r: Req, now: float) -> None:
        w.waiting.append(r)
        if not w.busy:
            self.start_pass(w, now)

    def pulled(self, r: Req, blocks: int, now: float) -> None:
        """A pull of `r`'s first `blocks` prompt blocks landed on its worker: they are cached
        there (a stored event, as the engine emits for imported blocks) and the request queues.
        No room for them: the pull fails and the request recomputes (the product's fallback)."""
        w = self.workers[r.worker]
        new = [h for h in r.hashes[:blocks] if h not in w.cache]
        for h in r.hashes[:blocks]:  # the target's own part of the prefix: touched, not evicted below
            if h in w.cache:
                w.cache.move_to_end(h)
        if w._room(len(new)):
            for h in r.hashes[:blocks]:
                if h not in w.cache:
                    w.log.append((True, h))
                w.cache[h] = None
                w.cache.move_to_end(h)
            r.pulled = len(new)
        else:
            self.pulls_failed += 1
        self.queue(w, r, now)

    def memo_walk(self, hashes: list[int], depth: int, decision: bool = True) -> None:
        """The chunks one decision hashes (MemoHashChain under PrefixIndex.match: the walk
        reads block `depth` to find it held nowhere), through each bound's memo. A chunk's
        key stands for the real one (parent digest + the chunk's tokens) by the hash of its
        last block, which the chain makes unique to the whole prefix and the chunk's length.
        `decision=False`: the hashing after the choice (the optimistic insertion's, the
        whole prompt), which fills the memo but is not the decision's cost (counted apart)."""
        n = len(hashes)
        walked = min(depth + 1, n)
        chunks = -(-walked // CHUNK)
        keys = [hashes[min(c * CHUNK + CHUNK - 1, n - 1)] for c in range(chunks)]
        for bound, memo in self.memos.items():
            counts = self.memo_counts[bound]
            missed = 0
            for k in keys:
                if k in memo:
                    memo.move_to_end(k)
                else:
                    missed += 1
                    memo[k] = None
                    if bound and len(memo) > bound:
                        memo.popitem(last=False)
            if decision:
                counts[0 if missed == 0 else 1] += 1
                counts[2] += len(keys) - missed
                counts[3] += missed
            else:
                counts[4] += missed

    def indexed(self, wi: int, r: Req, now: float) -> int:
        """Leading blocks of `r` the router's (lagging, maybe optimistic) index says `wi` holds."""
        seen, prov = self.seen[wi], self.prov[wi]
        usable = (r.prompt - 1) // self.args.block_size
        n = 0
        while n < usable:
            h = r.hashes[n]
            if h not in seen and prov.get(h, -1.0) < now:
                break
            n += 1
        return n

    def flush(self, w: Worker, now: float) -> None:
        if w.log and self.v.lag >= 0:
            self.push(now + self.v.lag, 3, (w.wid, w.log))
            w.log = []
        else:
            w.log.clear()

    def apply_events(self, wi: int, log: list[tuple[bool, int]]) -> None:
        seen, prov = self.seen[wi], self.prov[wi]
        for stored, h in log:
            prov.pop(h, None)
            if stored:
                seen.add(h)
            else:
                seen.discard(h)

    def start_pass(self, w: Worker, now: float) -> None:
        sched, new, batch, dctx = w.schedule()
        self.flush(w, now)
        if not sched:
            w.busy = False
            return
        w.busy = True
        ms = self.prof.prefill_ms(new, 0) * w.prefill_x + self.prof.decode_ms(batch, dctx) * w.decode_x
        self.push(now + ms / 1000.0, 1, (w, sched))

    def end_pass(self, w: Worker, sched: list[tuple[Req, int]], now: float) -> None:
        bs = w.bs
        for r, n in sched:
            before = r.computed
            r.computed += n
            if before < r.prompt:
                for b in range(before // bs, min(r.computed, r.prompt) // bs):
                    h = r.hashes[b]
                    if h not in w.cache:
                        w.log.append((True, h))
                    w.cache[h] = None
                    w.cache.move_to_end(h)
                    w.uncomputed -= 1
            if r.computed >= r.prompt:
                r.produced += 1
                if r.produced == 1:
                    r.first_token = now
                    if r.key >= 0:
                        self.view.first_token(r.key)
                    if self.profiles is not None:  # as generate.py's _on_first
                        work = r.ahead + (-(-r.to_prefill // bs) + 1) * bs
                        self.profiles.observe_prefill(str(w.wid), work, now - r.arrival)
                if r.produced >= r.out:
                    r.done = now
                    if self.profiles is not None and r.out > 1:  # as generate.py's _report_latency
                        self.profiles.observe_decode(str(w.wid), r.out - 1, now - r.first_token)
                    w.running.remove(r)
                    for h in r.blocks:
                        c = w.refs[h] - 1
                        if c:
                            w.refs[h] = c
                        else:
                            del w.refs[h]
                    w.used_extra -= r.extra_blocks
                    if r.key >= 0:
                        self.view.end(r.key)
        self.flush(w, now)
        self.start_pass(w, now)

    def run(self) -> None:
        for r in self.reqs:
            self.push(r.arrival, 2, r)
        t = 0.0
        while t < self.reqs[-1].arrival + 1:
            self.push(t, 0, None)
            t += self.args.report_interval_s
        self.drain()

    def drain(self) -> None:
        """Process events until none are left."""
        while self.events:
            now, kind, _, obj = heapq.heappop(self.events)
            if kind == 0:
                self.report()
            elif kind == 1:
                w, sched = obj  # type: ignore[misc]
                self.end_pass(w, sched, now)
            elif kind == 3:
                wi, log = obj  # type: ignore[misc]
                self.apply_events(wi, log)
            elif kind == 4:
                r, blocks = obj  # type: ignore[misc]
                self.pulled(r, blocks, now)
            else:
                self.route(obj, now)  # type: ignore[arg-type]


def _has_decode_weight() -> bool:
    return "decode_weight" in PolicyConfig.__dataclass_fields__


VARIANTS = {
    "rr": Variant("rr", "round_robin", False),
    "kv@hb": Variant("kv@hb", "kv_aware", False),
    "kv@lv": Variant("kv@lv", "kv_aware", True),
    "ll@lv": Variant("ll@lv", "least_loaded", True),
}


def parse_variant(spec: str) -> Variant:
    """'rr', 'kv@hb', 'kv@lv', 'll@lv', optionally with options: 'kv@lv:dw=0.05+t=0.1'."""
    base, _, opts = spec.partition(":")
    v = VARIANTS[base]
    v = Variant(spec, v.policy, v.own_view, v.prefill_weight, v.decode_weight, v.temperature)  # fresh copy
    for kv in filter(None, opts.split("+")):
        k, _, val = kv.partition("=")
        name = {
            "pw": "prefill_weight",
            "dw": "decode_weight",
            "t": "temperature",
            "qw": "queue_weight",
            "busy": "busy_blocks",
            "pwait": "pull_wait",
        }.get(k, k)
        if name not in Variant.__dataclass_fields__ or name in ("name", "policy", "own_view"):
            raise ValueError(f"unknown variant option {k!r} in {spec!r}")
        setattr(
            v, name, bool(int(val)) if name in ("oracle", "sync", "prof", "label", "pull") else float(val)
        )
    return v


def parse_speeds(spec: str) -> list[tuple[float, float]]:
    """'1,1,3/1.6' -> [(1, 1), (1, 1), (3, 1.6)]: (prefill, decode) pass-time multipliers."""
    out = []
    for part in filter(None, (x.strip() for x in spec.split(","))):
        pre, _, dec = part.partition("/")
        pair = (float(pre), float(dec or pre))
        if not all(math.isfinite(x) and x > 0 for x in pair):
            raise ValueError(f"speeds must be positive numbers, got {part!r}")
        out.append(pair)
    return out


def make_reqs(args, time_factor: float) -> list[Req]:
    items = build_workload(
        "mooncake",
        num_requests=args.requests,
        max_duration_s=1e9,
        length_factor=getattr(args, "length_factor", 1.0),  # callers before --length-factor pass none
        time_factor=time_factor,
        seed=args.seed,
        vocab=VocabRange(0, 256),
    )
    out = []
    for i, it in enumerate(items):
        hashes = block_hashes(it.prompt_ids, args.block_size)
        out.append(
            Req(
                i,
                it.arrival_s,
                hashes,
                len(it.prompt_ids),
                max(1, math.ceil(it.max_tokens / args.output_factor)),
            )
        )
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def unloaded_ttft_ms(prof: TimingProfile, tokens: int, mbt: int) -> float:
    """TTFT of a prompt alone on a worker: its chunks of at most `mbt` tokens, one pass each."""
    full, rest = divmod(max(tokens, 1), mbt)
    return full * prof.prefill_ms(mbt) + (prof.prefill_ms(rest) if rest else 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--output-factor", type=float, default=16)
    p.add_argument(
        "--time-factor", type=float, default=0.6, help="model time factor at 4 workers (/ workers/4)"
    )
    p.add_argument(
        "--length-factor", type=float, default=1.0, help="trace lengths / this (bench/peers/dynamo/run.py: 8)"
    )
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="arrivals x this at every size (time factor 1/rate); 0: --time-factor",
    )
    p.add_argument("--num-blocks", type=int, default=65536)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mbt", type=int, default=8192)
    p.add_argument("--report-interval-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="rr,kv@hb,kv@lv")
    p.add_argument(
        "--speeds",
        default="",
        help="heterogeneous fleet: pass-time multipliers per worker, cycled (x or prefill/decode)",
    )
    p.add_argument(
        "--memo-chunks",
        default="",
        help="model the router's hash memo at these bounds, comma-separated chunks (0: unbounded)",
    )
    args = p.parse_args(argv)
    args.memo_chunks = [int(b) for b in args.memo_chunks.split(",") if b.strip()]
    args.speeds = parse_speeds(args.speeds)
    prof = load_profile("dynamo-mocker").scaled_to(args.num_blocks, args.block_size)
    print(f"routing model (model time; the CPU sets only how long it takes): {cpu_model()} x{os.cpu_count()}")
    summary: list[str] = []
    for n in args.workers:
        args.workers_n = n
        tf = 1.0 / args.rate if args.rate > 0 else args.time_factor * 4 / n
        base = make_reqs(args, tf)
        print(f"{n} workers, {len(base)} requests, model time_factor {tf:g}")
        seen: set[int] = set()
        alone, alone_ideal = [], []
        ideal_cached = 0
        for r in base:
            usable = (r.prompt - 1) // args.block_size
            k = 0
            while k < usable and r.hashes[k] in seen:
                k += 1
            seen.update(r.hashes)
            ideal_cached += k * args.block_size
            alone.append(unloaded_ttft_ms(prof, r.prompt, args.mbt))
            alone_ideal.append(unloaded_ttft_ms(prof, r.prompt - k * args.block_size, args.mbt))
        print(
            f"  floor: each prompt alone on an idle worker, mean TTFT {statistics.mean(alone):.0f} ms uncached, "
            f"{statistics.mean(alone_ideal):.0f} ms with the ideal cache (p99 {pct(alone_ideal, 0.99):.0f}); "
            f"ideal hit {ideal_cached / sum(r.prompt for r in base):.3f} (one unbounded cache)"
        )
        ideal = ideal_cached / sum(r.prompt for r in base)
        rows = {}
        ran: dict[str, list[Req]] = {}  # each variant's requests, in trace order
        e2es: dict[str, float] = {}
        for spec in args.variants.split(","):
            v = parse_variant(spec)
            reqs = [Req(r.rid, r.arrival, r.hashes, r.prompt, r.out) for r in base]
            a = argparse.Namespace(**vars(args))
            a.workers = n
            cluster = Cluster(a, v, reqs, prof, args.seed)
            cluster.run()
            ran[spec] = reqs
            ttft = [(r.first_token - r.arrival) * 1000 for r in reqs]
            hit = sum(r.cached for r in reqs) / sum(r.prompt for r in reqs)
            span = max(r.done for r in reqs) - reqs[0].arrival
            counts = [sum(1 for r in reqs if r.worker == i) for i in range(n)]
            rows[spec] = (statistics.mean(ttft), pct(ttft, 0.5), pct(ttft, 0.99), hit, len(reqs) / span)
            m, p50, p99, h, rps = rows[spec]
            rr = rows.get("rr")
            rel = f"  vs rr mean x{m / rr[0]:.2f} p99 x{p99 / rr[2]:.2f}" if rr and spec != "rr" else ""
            if spec == "rr":  # the best ratio any policy could reach
                rel = f"  (floor = x{statistics.mean(alone_ideal) / m:.2f} of this mean)"
            print(
                f"  {spec:28s} ttft mean {m:7.0f} p50 {p50:6.0f} p99 {p99:7.0f} ms  hit {h:.3f}  "
                f"req/s {rps:5.2f} spread {max(counts) / statistics.mean(counts):.2f}{rel}"
            )
            tag = re.sub(r"\W+", "_", spec) + f"_w{n}"
            summary.append(f"hit_vs_ideal_{tag}={h / ideal:.2f}" if ideal else f"hit_vs_ideal_{tag}=nan")
            if v.pull:  # pulled blocks are cached at admission: in `hit`, and counted apart here
                pulled = sum(r.pulled for r in reqs) * args.block_size / sum(r.prompt for r in reqs)
                share = sum(1 for r in reqs if r.pulled) / len(reqs)
                print(
                    f"    pulls: {share:.3f} of requests, {pulled:.3f} of prompt tokens pulled (hit without "
                    f"them {h - pulled:.3f}), {cluster.pulls_failed} failed for room; hit / ideal {h / ideal:.2f}"
                )
                summary.append(f"pull_share_{tag}={share:.3f}")
                base_spec = next((x for x in ran if x not in ("rr", spec)), None)
                if base_spec is not None:  # as bench/routing_quality.py's paired_by_request
                    gained, rest = [], []
                    for r0, r1 in zip(ran[base_spec], reqs, strict=True):
                        d = (r1.first_token - r1.arrival - (r0.first_token - r0.arrival)) * 1000
                        (gained if r1.cached > r0.cached else rest).append(d)
                    print(
                        f"    per request, {spec} - {base_spec}: "
                        + "; ".join(
                            f"{name} {len(d)}: TTFT change mean {statistics.mean(d):+.0f} ms, "
                            f"median {statistics.median(d):+.0f}"
                            if d
                            else f"{name} 0"
                            for name, d in (("more cached", gained), ("the rest", rest))
                        )
                    )
            if args.speeds:  # heterogeneous: the whole request, and decode speed
                e2e = statistics.mean((r.done - r.arrival) * 1000 for r in reqs)
                tpot = [(r.done - r.first_token) * 1000 / (r.out - 1) for r in reqs if r.out > 1]
                share = [counts[i] / len(reqs) for i in range(n)]
                # requests are not work: the prompt tokens each worker computed (not cached)
                computed = [sum(r.prompt - r.cached for r in reqs if r.worker == i) for i in range(n)]
                work = [c / (sum(computed) or 1) for c in computed]
                # bench/routing_quality.py's SLOs, model time: TTFT <= 2 s, time per output token <= 100 ms
                within = sum(
                    1
                    for r in reqs
                    if r.first_token - r.arrival <= 2.0
                    and (r.out <= 1 or (r.done - r.first_token) / (r.out - 1) <= 0.1)
                ) / len(reqs)
                print(
                    f"    e2e mean {e2e:7.0f} ms  tpot p50 {pct(tpot, 0.5):5.1f} p99 {pct(tpot, 0.99):6.1f} ms  "
                    f"within SLO {within:.3f}  share per worker {' '.join(f'{x:.2f}' for x in share)}"
                )
                print(f"    computed prompt tokens per worker {' '.join(f'{x:.2f}' for x in work)}")
                tag = re.sub(r"\W+", "_", spec) + f"_w{n}"
                summary += [
                    f"ttft_mean_{tag}={m:.0f}",
                    f"ttft_p99_{tag}={p99:.0f}",
                    f"e2e_mean_{tag}={e2e:.0f}",
                ]
                first = next(iter(e2es), None)
                e2es[spec] = e2e
                summary.append(f"slo_{tag}={within:.3f}")
                if first is not None:  # against the first variant of this run (same trace, same fleet)
                    m0, _, p99_0, _, _ = rows[first]
                    print(
                        f"    vs {first}: ttft mean x{m / m0:.2f} p99 x{p99 / p99_0:.2f} e2e mean x{e2e / e2es[first]:.2f}"
                    )
                    summary.append(f"ttft_vs_first_{tag}={m / m0:.3f}")
                    summary.append(f"e2e_vs_first_{tag}={e2e / e2es[first]:.3f}")
                if cluster.profiles is not None:
                    learned = cluster.profiles.speeds()
                    print(
                        "    learned (prefill, decode) factors: "
                        + " ".join(
                            f"{w}:{p:.2f}/{d:.2f}"
                            for w, (p, d) in sorted(learned.items(), key=lambda x: int(x[0]))
                        )
                    )
            for bound, (warm, cold, hit, missed, after) in cluster.memo_counts.items():
                tag = re.sub(r"\W+", "_", spec) + f"_w{n}_{bound or 'unbounded'}"
                summary.append(f"memo_hits_{tag}={hit / max(hit + missed, 1):.3f}")
                summary.append(f"memo_warm_{tag}={warm / max(warm + cold, 1):.3f}")
                print(
                    f"    hash memo {'unbounded' if not bound else f'{bound} chunks'}: warm decisions "
                    f"{warm / max(warm + cold, 1):.3f}, chunks per decision {hit / max(warm + cold, 1):.2f} "
                    f"hit + {missed / max(warm + cold, 1):.2f} missed (hits {hit / max(hit + missed, 1):.3f}), "
                    f"chunks kept {len(cluster.memos[bound])}"
                    + (f", hashed after the decisions {after / max(warm + cold, 1):.2f}" if after else "")
                )
    if summary:
        print("routing_sim " + " ".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
