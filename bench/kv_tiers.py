"""KV tiers study (issue 22): does a host KV tier behind a too-small pool pay?

The Mooncake conversation trace replayed through one kv_aware router over 4
`sim` decode workers (real processes: bench/routing_quality.py's machinery and
its docstring's method), whose KV pool holds only a fraction of the working set
(`--device-blocks` per worker against the replay's unique prompt blocks
printed below). Three runs on fresh workers each, same arrivals, lengths and
sharing structure:

- none: no host tier (what pdmesh did before this issue);
- host, not credited: each worker has a host tier (`--host-blocks`, of the
  profile's model: bytes = blocks x block_size x kv_bytes_per_token) that
  catches evicted blocks and restores them on a hit when the profile's
  restore time (bytes at its host bandwidth, 25 GB/s) beats its prefill time;
  the router ignores host-tier blocks (`--tier-credit false`);
- host, credited: the same, and kv_aware credits host-tier blocks with
  tier_weight(measured restore, measured prefill) per worker.

Reported in model time (wall x speedup): hit rate (cached or restored over
prompt tokens), the share restored from the host tier, TTFT mean/p50/p99,
throughput. Last line: `kv_tiers hit_device=.. hit_with_host=..
ttft_host_vs_none=.. ttft_notier_vs_none=.. host_share=..` (hit_device: the
run without a host tier; hit_with_host and ttft_host_vs_none: the credited
run; goal ttft_host_vs_none <= 0.6).

Run: `python bench/kv_tiers.py --quick` (500 requests, simulated GPUs 6x slower
than the routing study's: ~3 x 2 min) or without --quick (2,000 requests, the
routing study's speed: needs idle cores). Why slower: the workers' Python work
per offloaded block and per KV event counts against the simulated pass (a
pass lasts max(modeled, Python)); at the routing study's speedup on 2 shared
cores it stretched every pass of the host-tier runs (TPOT x1.9) and turned
the comparison upside down (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_model
from bench.routing_quality import FULL, QUICK, PolicyResult, Study, describe, run_study, table, workload
from services.model.hashing import block_hashes
from services.model.timing import load_profile


def working_set_blocks(study: Study) -> int:
    seen: set[int] = set()
    for it in workload(study, 0):
        seen.update(block_hashes(it.prompt_ids, study.block_size))
    return len(seen)


def restored_share(r: PolicyResult) -> float:
    restored = sum(d.get("prompt_tokens_restored", 0) for d in r.worker_delta.values())
    prompt = sum(rec.prompt_tokens for rec in r.records if rec.ok)
    return restored / max(prompt, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="500 requests, GPUs simulated 6x slower (make bench, ~7 min)"
    )
    ap.add_argument("--device-blocks", type=int, default=8192, help="KV pool per worker, blocks of 16 tokens")
    ap.add_argument(
        "--host-blocks", type=int, default=65536, help="host tier per worker, blocks of 16 tokens"
    )
    ap.add_argument("--requests", type=int, default=None, help="default: 500 with --quick, else 2,000")
    ap.add_argument(
        "--slowdown",
        type=float,
        default=None,
        help="default 6 with --quick, else 1: on 2 shared cores the workers' Python per block (offload, "
        "events) stretches the simulated passes at the routing study's speedups; slower GPUs leave it room.",
    )
    args = ap.parse_args(argv)

    base = QUICK if args.quick else FULL
    requests = args.requests or (500 if args.quick else base.requests)
    slowdown = args.slowdown or (6.0 if args.quick else 1.0)
    base = replace(
        base,
        name="kv_tiers",
        num_blocks=args.device_blocks,
        block_size=16,
        requests=requests,
        speedup=base.speedup / slowdown,
    )
    profile = load_profile(base.profile)
    ws = working_set_blocks(base)
    print(f"CPU: {cpu_model()}")
    print(describe(base))
    print(
        f"  working set: {ws:,} unique prompt blocks over the replay; pool {args.device_blocks:,} blocks "
        f"per worker ({4 * args.device_blocks / ws:.2f}x the working set over 4 workers); host tier "
        f"{args.host_blocks:,} blocks per worker ({args.host_blocks * 16 * profile.kv_bytes_per_token / 2**30:.0f} "
        f"GiB of the profile's model); restore {profile.restore_s(16) * 1e3:.3f} ms per block at "
        f"{profile.host_bandwidth_gbps:g} GB/s vs prefill ~{profile.prefill_ms(4096, 0) - profile.prefill_ms(4080, 0):.3f} "
        "ms per block at 4k tokens (marginal)"
    )
    runs: dict[str, PolicyResult] = {}
    for name, study in (
        ("none", replace(base, host_tier_blocks=0, policies=("kv_aware",))),
        ("host_notier", replace(base, host_tier_blocks=args.host_blocks, policies=("kv_aware@notier",))),
        ("host", replace(base, host_tier_blocks=args.host_blocks, policies=("kv_aware",))),
    ):
        print(f"run {name}:")
        results, _ = run_study(study)
        runs[name] = results[0]
    print("  model-time figures; hit = cached or restored / prompt tokens (usage)")
    lines = table(list(runs.values()))
    print(lines[0] + f"{'restored':>10}")
    for (name, r), line in zip(runs.items(), lines[1:], strict=True):
        print(line.replace(f"  {r.policy:<16}", f"  {name:<16}", 1) + f"{restored_share(r):>10.3f}")
    for name, r in runs.items():
        tot = {
            k: sum(d.get(k, 0) for d in r.worker_delta.values())
            for k in ("host_evicted", "host_restores_declined", "host_rejected")
        }
        print(
            f"  {name:<16} host tier: {tot['host_evicted']:,} blocks evicted (LRU), {tot['host_rejected']:,} refused by "
            f"the frequency filter, {tot['host_restores_declined']:,} restores declined (slower than recompute)"
        )
    none, notier, host = runs["none"], runs["host_notier"], runs["host"]
    ratio = host.ttft_ms["mean"] / none.ttft_ms["mean"]
    ratio_notier = notier.ttft_ms["mean"] / none.ttft_ms["mean"]
    print(
        f"  host tier, credited vs none: mean TTFT x{ratio:.2f} (goal <= 0.6), p99 "
        f"x{host.ttft_ms['p99'] / none.ttft_ms['p99']:.2f}, hit {host.hit:.3f} vs {none.hit:.3f}; "
        f"not credited: mean TTFT x{ratio_notier:.2f}, hit {notier.hit:.3f}"
    )
    print(
        f"kv_tiers hit_device={none.hit:.3f} hit_with_host={host.hit:.3f} ttft_host_vs_none={ratio:.2f} "
        f"ttft_notier_vs_none={ratio_notier:.2f} host_share={restored_share(host):.3f} "
        f"hit_notier={notier.hit:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
