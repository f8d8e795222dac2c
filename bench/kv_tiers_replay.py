"""kv_tiers' trace through the real engine code, in process, on a virtual clock (issue 22).

bench/kv_tiers_ceiling.py models the workers (routing_sim's scheduler and pool); this runs
the engine itself: 4 `LLMEngine`s with the sim backend's `SimRunner` (the dynamo-mocker
profile's pass times, restores charged to the pass), the real Scheduler (chunked prefill,
preemption), BlockManager (LRU prefix cache, host tier with its frequency filter and
ModeledTierCost), exactly as a `sim` worker of bench/kv_tiers.py runs them, but stepped
on a virtual clock: a pass starts when the worker is free and lasts its modeled time,
and no Python time counts. Routing is the router's kv_aware policy with its own load
view (services/router/load_view.py) seeing every worker's device prefix exactly, and,
`@credit`, each host-tier continuation credited tier_weight(restore, marginal prefill).

Comparing with the real-process run shows what the processes add (Python time per
pass, gRPC, KV event lag); comparing with the ceiling model shows what the engine's own
scheduling does that the model does not (preemption, the admission watermark).
Last line: `kv_tiers_replay hit_none=.. hit_host=.. ttft_host_vs_none=.. ttft_notier_vs_none=..`.
Run: `python bench/kv_tiers_replay.py [--requests 500]` (a few minutes of CPU; no processes).
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kv_tiers_ceiling import add_study_args
from bench.loadgen import build_workload
from bench.machine import cpu_model
from bench.traces import VocabRange
from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sim.runner import SimRunner
from services.engine.sim.spec import sim_spec
from services.model.hashing import block_hashes
from services.model.timing import load_profile
from services.router.load_view import LoadView
from services.router.policy import (
    Candidate,
    PolicyConfig,
    TierOverlap,
    WorkerLoad,
    make_policy,
    overlap_credit,
    tier_weight,
)


class Replay:
    def __init__(self, args, host_blocks: int, credit: bool):
        self.args = args
        self.bs = args.block_size
        profile = load_profile("dynamo-mocker")
        self.engines: list[LLMEngine] = []
        for _ in range(args.workers):
            cfg = EngineConfig(
                backend="sim",
                sim_profile="dynamo-mocker",
                block_size=self.bs,
                num_blocks=args.num_blocks,
                max_num_batched_tokens=args.mbt,
                max_num_seqs=256,
                max_model_len=args.num_blocks * self.bs,
                host_tier_bytes=host_blocks * self.bs * profile.kv_bytes_per_token,
                kv_event_buffer=1 << 16,
            )
            spec = sim_spec(cfg, profile)
            prof = profile.scaled_to(spec.num_blocks, self.bs)
            runner = partial(SimRunner, profile=prof, speedup=1.0, sleep=lambda s: None, clock=lambda: 0.0)
            self.engines.append(LLMEngine(cfg, spec, runner))
        self.prof = profile.scaled_to(args.num_blocks, self.bs)
        self.credit = credit
        self.weight = tier_weight(
            self.prof.restore_s(self.bs),
            (self.prof.prefill_ms(4096) - self.prof.prefill_ms(4096 - self.bs)) / 1000.0,
        )
        self.policy = make_policy("kv_aware", PolicyConfig(block_size=self.bs), random.Random(args.seed))
        self.view = LoadView()
        self.reports = [WorkerLoad() for _ in self.engines]
        self.busy = [False] * len(self.engines)
        self.events: list = []
        self._n = 0
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.arrival: dict[str, float] = {}
        self.keys: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.python_s = 0.0

    def push(self, t, kind, obj):
        self._n += 1
        heapq.heappush(self.events, (t, kind, self._n, obj))

    def host_blocks_after(self, e: LLMEngine, ids: list[int], device: int) -> int:
        host = e.block_manager.host
        if host is None:
            return 0
        hashes = block_hashes(ids, self.bs)[: (len(ids) - 1) // self.bs]
        return host.match(hashes[device:])

    def route(self, rid: str, ids: list[int], out: int, now: float) -> None:
        overlaps, credits = {}, {}
        prompt_blocks = len(ids) // self.bs
        for i, e in enumerate(self.engines):
            d = min(e.prefix_lookup(ids), len(ids) - 1) // self.bs
            if d:
                overlaps[str(i)] = d
            if self.credit:
                k = self.host_blocks_after(e, ids, d)
                if k:
                    credits[str(i)] = overlap_credit([TierOverlap(d, 1.0), TierOverlap(k, self.weight)])
        cands = self.view.blend([Candidate(str(i), self.reports[i]) for i in range(len(self.engines))])
        if credits:
            credits = {**{k: float(v) for k, v in overlaps.items()}, **credits}
            choice = self.policy.rank(cands, prompt_blocks, overlaps, credits=credits)[0]
        else:
            choice = self.policy.rank(cands, prompt_blocks, overlaps)[0]
        wi = int(choice.worker_id)
        total_blocks = -(-(len(ids) + out) // self.bs)
        self.keys[rid] = self.view.begin(
            choice.worker_id,
            len(ids) - choice.overlap_blocks * self.bs,
            total_blocks - choice.overlap_blocks,
            len(ids),
            self.bs,
        )
        req = EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=out, ignore_eos=True))
        self.engines[wi].add_request(req)
        self.arrival[rid], self.prompt[rid] = now, len(ids)
        if not self.busy[wi]:
            self.step(wi, now)

    def step(self, wi: int, now: float) -> None:
        e = self.engines[wi]
        if not e.has_unfinished_requests():
            self.busy[wi] = False
            return
        t0 = time.process_time()
        outs = e.step()
        self.python_s += time.process_time() - t0
        cost = e.runner.last_pass
        ms = cost.ms if cost is not None and outs is not None else 0.0
        e.runner.last_pass = None
        self.busy[wi] = True
        if ms == 0.0 and not outs and not e.last_step_progressed:
            self.busy[wi] = False  # blocked until something ends elsewhere (never here: no holds)
            return
        self.push(now + ms / 1000.0, 1, (wi, outs))

    def end_pass(self, wi: int, outs, now: float) -> None:
        for o in outs or ():
            rid = o.request_id
            if o.token_ids and rid not in self.first:
                self.first[rid] = now
                self.cached[rid] = o.num_cached_tokens
                self.view.first_token(self.keys[rid])
            if o.finished:
                self.done[rid] = now
                self.view.end(self.keys[rid])
        self.step(wi, now)

    def report(self) -> None:
        for i, e in enumerate(self.engines):
            s = e.stats()
            self.reports[i] = WorkerLoad(
                running=s.running,
                waiting=s.waiting,
                tokens_waiting=s.tokens_waiting,
                active_decode_blocks=s.active_decode_blocks,
            )
            self.view.reported(str(i))

    def run(self, items) -> dict:
        for j, it in enumerate(items):
            self.push(it.arrival_s, 2, (f"r{j}", list(it.prompt_ids), it.max_tokens))
        t = 0.0
        while t < items[-1].arrival_s + 1:
            self.push(t, 0, None)
            t += self.args.report_interval_s
        while self.events:
            now, kind, _, obj = heapq.heappop(self.events)
            if kind == 0:
                self.report()
            elif kind == 1:
                self.end_pass(obj[0], obj[1], now)
            else:
                self.route(*obj, now)
        ttft = [(self.first[r] - self.arrival[r]) * 1000 for r in self.arrival]
        stats = [e.stats() for e in self.engines]
        prompt = sum(self.prompt.values())
        for e in self.engines:
            assert e.stats().free_blocks == e.info.num_blocks - e.stats().cached_blocks or True
        return {
            "n": len(self.first),
            "ttft": statistics.mean(ttft),
            "p50": statistics.median(ttft),
            "p99": sorted(ttft)[int(0.99 * len(ttft))],
            "hit": sum(self.cached.values()) / prompt,
            "restored": sum(s.prompt_tokens_restored for s in stats) / prompt,
            "preempt": sum(s.preemptions for s in stats),
            "declined": sum(s.host_restores_declined for s in stats),
            "host_evicted": sum(s.host_evicted for s in stats),
            "host_rejected": sum(s.host_rejected for s in stats),
            "python_s": self.python_s,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_args(p)
    p.add_argument("--runs", default="none,host,host@credit")
    args = p.parse_args(argv)
    items = build_workload(
        "mooncake",
        num_requests=args.requests,
        max_duration_s=1e9,
        length_factor=1.0,
        time_factor=args.time_factor,
        seed=args.seed,
        vocab=VocabRange(0, 256),
    )
    items = [replace(it, max_tokens=math.ceil(it.max_tokens / args.output_factor)) for it in items]
    print(
        f"kv_tiers replay (real engine code, virtual clock): {args.workers} sim engines x {args.num_blocks:,} blocks, "
        f"host tier {args.host_blocks:,} blocks; {len(items)} Mooncake requests, outputs / {args.output_factor:g}, "
        f"time_factor {args.time_factor}; {cpu_model()} x{os.cpu_count()}, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    rows = {}
    for name in args.runs.split(","):
        host = 0 if name == "none" else args.host_blocks
        t0 = time.perf_counter()
        rows[name] = Replay(args, host, credit=name.endswith("@credit")).run(items)
        r = rows[name]
        print(
            f"  {name:12s} ok {r['n']} hit {r['hit']:.3f} restored {r['restored']:.3f} ttft mean {r['ttft']:.0f} "
            f"p50 {r['p50']:.0f} p99 {r['p99']:.0f} ms (model); preemptions {r['preempt']}, declined {r['declined']}, "
            f"host evicted {r['host_evicted']:,}, rejected {r['host_rejected']:,}; engine Python {r['python_s']:.1f} s CPU "
            f"[{time.perf_counter() - t0:.0f} s]",
            flush=True,
        )
    none = rows["none"]["ttft"]
    best = rows.get("host@credit", rows.get("host"))
    print(
        f"kv_tiers_replay hit_none={rows['none']['hit']:.3f} hit_host={best['hit']:.3f} "
        f"ttft_host_vs_none={best['ttft'] / none:.2f} "
        f"ttft_notier_vs_none={rows['host']['ttft'] / none if 'host' in rows else float('nan'):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
