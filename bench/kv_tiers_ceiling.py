"""How far can a host KV tier take bench/kv_tiers.py's TTFT? Its ceiling, in process, in model time.

bench/kv_tiers.py (real processes) measured mean TTFT with the host tier at 0.74x of
without; the issue's goal is <= 0.6x. This replays the same requests (the Mooncake
conversation trace, first 500, outputs / 16, model time_factor 0.6, 4 workers of 8,192
blocks x 16 tokens, the dynamo-mocker profile) through bench/routing_sim.py's model of the
sim workers and the router's own kv_aware policy, and adds a host tier to each worker:
evicted device blocks go there (LRU, bounded in blocks or unbounded), a prompt's device
prefix continued by host blocks restores them (into device blocks) when the profile says
restoring beats recomputing, and the restore is charged to the pass that admits the
prompt at the profile's host bandwidth (as services/engine/sim/runner.py does). The
router sees every worker's tiers exactly (no event lag) and credits host blocks with the
modeled tier_weight (restore vs recompute), or not at all.

Rows, each against `none` (no host tier, the same model):
- host / host@credit: the real run's host tier (65,536 blocks per worker), router blind / crediting;
- unbounded@credit: a host tier that never evicts (capacity is not the limit);
- unbounded@free: the same with restores costing nothing (bandwidth is not the limit);
- device-unbounded: device pools that never evict (neither capacity nor restores limit; the
  routing's partition of the trace still does);
- floor: each prompt alone on an idle worker with one unbounded cache's hits (no queueing,
  no partition: no policy can go below it).
Last line: `kv_tiers_ceiling hit_none=.. ttft_host_vs_none=.. ttft_unbounded_vs_none=..
ttft_free_vs_none=.. ttft_device_unbounded_vs_none=.. floor_vs_none=..`.
Run: `python bench/kv_tiers_ceiling.py [--requests 500]` (seconds; no processes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import OrderedDict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_model
from bench.routing_sim import Cluster, Req, Worker, make_reqs, parse_variant, pct, unloaded_ttft_ms
from services.model.timing import TimingProfile, load_profile
from services.router.policy import TierOverlap, overlap_credit, tier_weight


class TierWorker(Worker):
    """routing_sim's Worker with a host tier behind its pool (`host_blocks`: None = unbounded;
    0 = none). `free_restore`: restores cost no time."""

    def __init__(self, *a, host_blocks: int | None, free_restore: bool, **kw):
        super().__init__(*a, **kw)
        self.host_blocks = host_blocks
        self.free_restore = free_restore
        self.host: OrderedDict[int, None] = OrderedDict()
        self.pending_restore_ms = 0.0
        self.restored_tokens = 0
        self.host_evicted = 0
        self.declined = 0

    def _evict_one(self) -> bool:
        for h in self.cache:
            if h not in self.refs:
                del self.cache[h]
                self.log.append((False, h))
                if self.host_blocks != 0:
                    self.host[h] = None
                    self.host.move_to_end(h)
                    if self.host_blocks is not None and len(self.host) > self.host_blocks:
                        self.host.popitem(last=False)
                        self.host_evicted += 1
                return True
        return False

    def host_match(self, hashes: list[int], prompt: int, device: int) -> int:
        """Host-tier blocks continuing a device prefix of `device` blocks."""
        usable = (prompt - 1) // self.bs
        n = device
        while n < usable and n < len(hashes) and hashes[n] not in self.cache and hashes[n] in self.host:
            n += 1
        return n - device

    def restore_ms(self, blocks: int) -> float:
        return 0.0 if self.free_restore else self.prof.restore_s(blocks * self.bs) * 1000.0

    def worth(self, blocks: int, rest_tokens: int) -> bool:
        """ModeledTierCost.worth_restoring: restore time < the prompt pass's time saved."""
        k = blocks * self.bs
        saved = self.prof.prefill_ms(max(rest_tokens, 1) + k) - self.prof.prefill_ms(max(rest_tokens, 1))
        return self.restore_ms(blocks) < saved

    def schedule(self):
        """routing_sim's Worker.schedule with the restore at admission: the host blocks that
        continue a waiting prompt's device prefix become device cache blocks (the sim engine
        restores them into fresh pool blocks) when that beats recomputing them."""
        budget = self.mbt
        sched = []
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
            d = self.match(r.hashes, r.prompt)
            k = self.host_match(r.hashes, r.prompt, d) if self.host_blocks != 0 else 0
            if k and not self.worth(k, r.prompt - (d + k) * self.bs):
                self.declined += 1
                k = 0
            total_blocks = -(-(r.prompt + r.out) // self.bs)
            for h in r.hashes[:d]:  # touched first: the eviction below must not take them
                self.cache.move_to_end(h)
            if not self._room(total_blocks - d):
                break
            for h in r.hashes[d : d + k]:  # restored: device cache blocks from now on
                self.cache[h] = None
                self.host.move_to_end(h)
            if k:
                self.pending_restore_ms += self.restore_ms(k)
                self.restored_tokens += k * self.bs
            m = d + k
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


class TierCluster(Cluster):
    def __init__(self, args, variant, reqs, prof, seed, *, host_blocks, free_restore, credit):
        super().__init__(args, variant, reqs, prof, seed)
        self.workers = [
            TierWorker(
                i,
                prof,
                args.num_blocks,
                args.block_size,
                args.mbt,
                256,
                host_blocks=host_blocks,
                free_restore=free_restore,
            )
            for i in range(args.workers)
        ]
        self.credit = credit

    def route(self, r: Req, now: float) -> None:
        if not self.credit:
            return super().route(r, now)
        # The router's kv_aware with per-worker tier credits (generate.py -> tier_index.credits).
        w0 = self.workers[0]
        weight = tier_weight(
            w0.restore_ms(1) / 1000.0, (self.prof.prefill_ms(4096) - self.prof.prefill_ms(4080)) / 1000.0
        )
        self._credits = {}
        for w in self.workers:
            d = w.match(r.hashes, r.prompt)
            k = w.host_match(r.hashes, r.prompt, d)
            if k:
                self._credits[str(w.wid)] = overlap_credit([TierOverlap(d, 1.0), TierOverlap(k, weight)])
        rank = self.policy.rank

        def rank_with_credit(cands, prompt_blocks, overlaps, **kw):
            # credits only where a worker holds host blocks; elsewhere its device overlap
            credits = {**{k: float(v) for k, v in (overlaps or {}).items()}, **self._credits}
            return rank(cands, prompt_blocks, overlaps, credits=credits or None, **kw)

        self.policy.rank = rank_with_credit  # type: ignore[method-assign]
        try:
            super().route(r, now)
        finally:
            self.policy.rank = rank  # type: ignore[method-assign]

    def start_pass(self, w, now: float) -> None:
        sched, new, batch, dctx = w.schedule()
        self.flush(w, now)
        if not sched:
            w.busy = False
            return
        w.busy = True
        ms = self.prof.prefill_ms(new, 0) + self.prof.decode_ms(batch, dctx) + w.pending_restore_ms
        w.pending_restore_ms = 0.0
        self.push(now + ms / 1000.0, 1, (w, sched))


def run(
    args,
    base: list[Req],
    prof: TimingProfile,
    *,
    host_blocks=0,
    free_restore=False,
    credit=False,
    device_unbounded=False,
):
    reqs = [Req(r.rid, r.arrival, r.hashes, r.prompt, r.out) for r in base]
    c = TierCluster(
        args,
        parse_variant("kv@lv"),
        reqs,
        prof,
        args.seed,
        host_blocks=host_blocks,
        free_restore=free_restore,
        credit=credit,
    )
    if device_unbounded:  # the pools never evict; the profile's decode still sees its own pool size
        for w in c.workers:
            w.capacity = 1 << 40
    c.run()
    ttft = [(r.first_token - r.arrival) * 1000 for r in reqs]
    tpot = [(r.done - r.first_token) * 1000 / (r.out - 1) for r in reqs if r.out > 1]
    restored = sum(getattr(w, "restored_tokens", 0) for w in c.workers)
    prompt = sum(r.prompt for r in reqs)
    hit = sum(r.cached for r in reqs) / prompt  # restored blocks were in the cache at admission
    return {
        "ttft": statistics.mean(ttft),
        "p50": pct(ttft, 0.5),
        "p99": pct(ttft, 0.99),
        "tpot": pct(tpot, 0.5),
        "hit": hit,
        "restored": restored / prompt,
        "host_evicted": sum(getattr(w, "host_evicted", 0) for w in c.workers),
        "declined": sum(getattr(w, "declined", 0) for w in c.workers),
        "spread": max(sum(1 for r in reqs if r.worker == i) for i in range(args.workers))
        / (len(reqs) / args.workers),
    }


def add_study_args(p: argparse.ArgumentParser) -> None:
    """kv_tiers --quick's experiment, shared with bench/kv_tiers_replay.py (same trace, pools, tiers)."""
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=8192, help="device pool per worker (kv_tiers --quick)")
    p.add_argument("--host-blocks", type=int, default=65536)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mbt", type=int, default=8192)
    p.add_argument("--output-factor", type=float, default=16)
    p.add_argument("--time-factor", type=float, default=0.6)
    p.add_argument("--report-interval-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_args(p)
    args = p.parse_args(argv)
    args.length_factor = 1.0
    prof = load_profile("dynamo-mocker").scaled_to(args.num_blocks, args.block_size)
    base = make_reqs(args, args.time_factor)
    print(
        f"kv_tiers ceiling (in process, model time): {args.workers} workers x {args.num_blocks:,} blocks x "
        f"{args.block_size} tokens, {len(base)} Mooncake requests, outputs / {args.output_factor:g}, time_factor "
        f"{args.time_factor}; restore {prof.restore_s(args.block_size) * 1e3:.3f} ms/block at "
        f"{prof.host_bandwidth_gbps:g} GB/s; {cpu_model()} x{os.cpu_count()}, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    seen: set[int] = set()
    alone_ideal, ideal_cached = [], 0
    for r in base:
        usable = (r.prompt - 1) // args.block_size
        k = 0
        while k < usable and r.hashes[k] in seen:
            k += 1
        seen.update(r.hashes)
        ideal_cached += k * args.block_size
        alone_ideal.append(unloaded_ttft_ms(prof, r.prompt - k * args.block_size, args.mbt))
    ideal_hit = ideal_cached / sum(r.prompt for r in base)
    print(
        f"  working set {len(seen):,} unique prompt blocks ({args.workers * args.num_blocks / len(seen):.2f}x in the pools)"
    )
    rows = {
        "none": run(args, base, prof),
        "host": run(args, base, prof, host_blocks=args.host_blocks),
        "host@credit": run(args, base, prof, host_blocks=args.host_blocks, credit=True),
        "unbounded@credit": run(args, base, prof, host_blocks=None, credit=True),
        "unbounded@free": run(args, base, prof, host_blocks=None, credit=True, free_restore=True),
        "device-unbounded": run(args, base, prof, device_unbounded=True),
    }
    none = rows["none"]["ttft"]
    print(
        f"  {'run':18s} {'hit':>6} {'restored':>9} {'ttft mean':>10} {'p50':>7} {'p99':>7} {'tpot p50':>9} {'vs none':>8} {'host evicted':>13} {'declined':>9} {'spread':>7}"
    )
    for name, r in rows.items():
        print(
            f"  {name:18s} {r['hit']:6.3f} {r['restored']:9.3f} {r['ttft']:10.0f} {r['p50']:7.0f} {r['p99']:7.0f} "
            f"{r['tpot']:9.1f} {r['ttft'] / none:8.2f} {r['host_evicted']:13,} {r['declined']:9,} {r['spread']:7.2f}"
        )
    floor = statistics.mean(alone_ideal)
    print(
        f"  {'floor':18s} {ideal_hit:6.3f} {'':9s} {floor:10.0f} {'':7s} {'':7s} {'':9s} {floor / none:8.2f}   (each prompt alone, one unbounded cache)"
    )
    print(
        f"kv_tiers_ceiling hit_none={rows['none']['hit']:.3f} hit_host={rows['host@credit']['hit']:.3f} "
        f"hit_unbounded={rows['unbounded@credit']['hit']:.3f} hit_ideal={ideal_hit:.3f} "
        f"ttft_host_vs_none={rows['host@credit']['ttft'] / none:.2f} "
        f"ttft_unbounded_vs_none={rows['unbounded@credit']['ttft'] / none:.2f} "
        f"ttft_free_vs_none={rows['unbounded@free']['ttft'] / none:.2f} "
        f"ttft_device_unbounded_vs_none={rows['device-unbounded']['ttft'] / none:.2f} floor_vs_none={floor / none:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
