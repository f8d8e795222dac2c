"""Aggregated vs disaggregated vs conditional prefill, with real compute.

Three deployments of the `small` built-in model (one torch thread per worker
process, so each uses about one of this machine's 2 cores), behind one router:

  agg     two decode workers, every prefill local (no prefill worker)
  disagg  one prefill + one decode worker, every prefill remote (KV over NIXL)
  cond    one prefill + one decode worker, the conditional rule decides

Workloads: `mix` (90% short prompts of 64-256 tokens, 10% long of 2,048-2,304)
and `azure` (the Azure LLM conversation trace's prompt and output lengths,
scaled down), Poisson arrivals at each rate of a sweep.

SLOs are relative to unloaded latency, as Splitwise defines them: each request
must reach TTFT <= 3x the unloaded TTFT of a prompt of its length (a linear fit
over lengths, measured on the aggregated deployment one request at a time) and
TPOT <= 1.5x the unloaded TPOT p50. Attainment = share of all requests meeting
both (failures are misses).

    python bench/disagg.py --fixed-rate 1.0      issue 5's comparison at one rate;
                                                 last line `disagg tpot_p99_agg=.. ...`
    python bench/disagg.py [--quick]             the sweep; a PNG per workload in
                                                 bench/results/; last line
                                                 `goodput agg=.. disagg=.. cond=.. cond_vs_agg=..`
                                                 (highest rate with >= 90% attainment, long-prompt mix)
    python bench/disagg.py --workloads mix --relative-rates --rates 0.5 --repeats 3 --patient
                                                 issue 19 item 4: repetitions (the three modes back
                                                 to back in each), means with 95% t-intervals, per-point
                                                 Wilson intervals; rates in units of each repetition's
                                                 measured capacity (a shared machine's speed drifts);
                                                 `--pin` puts each engine worker on its own CPU
    python bench/disagg.py --engine sim [--quick]  the GPU-regime study (issue 19), bench/disagg_gpu.py:
                                                 8 simulated GPUs, an event model on the sim timing
                                                 profiles with the product's rule; last line
                                                 `disagg_gpu goodput_agg=.. ... best_split=..`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import numpy as np

from bench import topology
from bench.loadgen import WorkItem, poisson_arrivals, run_load
from bench.machine import cpu_model, pin_threads
from bench.stats import RequestRecord
from bench.traces import default_trace_path, load_azure
from pdmesh.v1 import router_pb2, router_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {
    "agg": topology.Topology("agg", prefill=0, decode=2, decode_flags=("--default-mode", "local")),
    "disagg": topology.Topology("disagg", prefill=1, decode=1, decode_flags=("--default-mode", "remote")),
    "cond": topology.Topology("cond", prefill=1, decode=1, decode_flags=("--default-mode", "auto")),
}
VOCAB = 256  # byte tokens of the built-in tokenizer (specials excluded)
TTFT_SLO_X, TPOT_SLO_X = 3.0, 1.5


@dataclass(frozen=True)
class Workload:
    name: str
    lengths: list[tuple[int, int]]  # (prompt, output) pool to draw from, in order


def mix_workload(n: int, seed: int, output: int) -> Workload:
    rng = random.Random(seed)
    lengths = []
    for _ in range(n):
        long = rng.random() < 0.10
        lengths.append((rng.randint(2048, 2304) if long else rng.randint(64, 256), output))
    return Workload("mix", lengths)


def azure_workload(n: int, seed: int, length_factor: float) -> Workload:
    reqs = load_azure(default_trace_path("azure"))
    rng = random.Random(seed)
    picked = rng.sample(reqs, n)
    return Workload(
        "azure",
        [
            (max(1, round(r.input_len / length_factor)), max(2, round(r.output_len / length_factor)))
            for r in picked
        ],
    )


def items(w: Workload, rate: float, seed: int) -> list[WorkItem]:
    rng = random.Random(seed)
    times = poisson_arrivals(rate, len(w.lengths), seed)
    # Unique prompts: prefix caching must not blur the comparison.
    return [
        WorkItem(t, tuple(rng.randrange(VOCAB) for _ in range(p)), o)
        for t, (p, o) in zip(times, w.lengths, strict=True)
    ]


def wait_workers(address: str, want: int, timeout_s: float = 60.0) -> None:
    """The router sees every worker SERVING before load starts."""
    stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(address))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ws = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers
        if sum(w.health == router_pb2.WORKER_HEALTH_SERVING for w in ws) >= want:
            return
        time.sleep(0.2)
    raise RuntimeError(f"router at {address} never saw {want} healthy workers")


def run(address: str, work: list[WorkItem], timeout_s: float) -> list[RequestRecord]:
    duration = (work[-1].arrival_s if work else 0) + 1.0
    return asyncio.run(
        run_load(
            work, f"grpc://{address}", max_requests=len(work), max_duration_s=duration, timeout_s=timeout_s
        )
    )


@dataclass(frozen=True)
class Baseline:
    ttft_a: float  # unloaded TTFT = a + b * prompt tokens (seconds)
    ttft_b: float
    tpot: float  # unloaded TPOT p50 (seconds)

    def ttft_slo(self, prompt_tokens: int) -> float:
        return TTFT_SLO_X * (self.ttft_a + self.ttft_b * prompt_tokens)

    @property
    def tpot_slo(self) -> float:
        return TPOT_SLO_X * self.tpot


def measure_baseline(address: str, lengths: list[int], output: int, seed: int) -> Baseline:
    """One request at a time on the aggregated deployment."""
    rng = random.Random(seed)
    xs, ttfts, tpots = [], [], []
    for length in lengths:
        work = [WorkItem(0.0, tuple(rng.randrange(VOCAB) for _ in range(length)), output)]
        (rec,) = run(address, work, timeout_s=120)
        if rec.ok and rec.ttft_s is not None:
            xs.append(length)
            ttfts.append(rec.ttft_s)
            if rec.tpot_s is not None:
                tpots.append(rec.tpot_s)
    b, a = np.polyfit(np.array(xs, float), np.array(ttfts), 1)
    return Baseline(float(max(a, 1e-3)), float(max(b, 0.0)), float(np.median(tpots)))


def attainment(records: list[RequestRecord], base: Baseline) -> float:
    return misses(records, base)[0]


def misses(records: list[RequestRecord], base: Baseline) -> tuple[float, int, int]:
    """(attainment, requests missing the TTFT SLO, requests missing the TPOT SLO); a failed request
    counts as missing both."""
    met = ttft_miss = tpot_miss = 0
    for r in records:
        if not r.ok or r.ttft_s is None:
            ttft_miss, tpot_miss = ttft_miss + 1, tpot_miss + 1
            continue
        ttft_ok = r.ttft_s <= base.ttft_slo(r.prompt_tokens)
        tpot_ok = r.tpot_s is None or r.tpot_s <= base.tpot_slo
        ttft_miss += not ttft_ok
        tpot_miss += not tpot_ok
        met += ttft_ok and tpot_ok
    return (met / len(records) if records else 0.0), ttft_miss, tpot_miss


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values else float("nan")


def describe(records: list[RequestRecord]) -> dict[str, float]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return {
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p99": pct(tpot, 99),
        "ok": len(ok),
        "n": len(records),
        "remote": sum(r.prefill_path == "remote" for r in ok),
    }


def best_rate(curve: list[tuple[float, float]], target: float = 0.9) -> float:
    """Highest swept rate up to which every rate attains >= target (0 when the lowest does not).
    Not merely the highest rate that does: with 40-60 requests a point the curves are not
    monotonic, and a lucky point past a failing one is not a rate the deployment sustains."""
    best = 0.0
    for rate, att in sorted(curve):
        if att < target:
            break
        best = rate
    return best


def plot(workload: str, curves: dict[str, list[tuple[float, float]]], scaling: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return None
    RESULTS.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, curve in curves.items():
        ax.plot([r for r, _ in curve], [a * 100 for _, a in curve], marker="o", label=mode)
    ax.axhline(90, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(f"{workload}: TTFT<=3x, TPOT<=1.5x unloaded ({scaling})", fontsize=9)
    ax.set_ylim(0, 105)
    ax.legend()
    path = RESULTS / f"disagg_{workload}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_average() -> str:
    try:
        return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "load average unknown"


def mode_topology(args, mode: str) -> topology.Topology:
    topo = topology.Topology(**{**MODES[mode].__dict__, "preset": args.preset})
    if args.patient:
        # A contended machine runs a 2,048-token prefill for 20 s: the router's stall timeout
        # (10 s) would migrate every decode it stalls and the remote prefill timeout (30 s)
        # fail queued prompts over to local, failures of the deployment's absolute timeouts
        # rather than of the modes being compared.
        topo = topology.Topology(
            **{
                **topo.__dict__,
                "router_flags": (*topo.router_flags, "--stall-timeout-s", "0"),
                "decode_flags": (*topo.decode_flags, "--prefill-timeout-s", "600"),
            }
        )
    if mode == "cond" and args.cond_max_local is not None:
        flags = (*topo.decode_flags, "--max-local-prefill-tokens", str(args.cond_max_local))
        topo = topology.Topology(**{**topo.__dict__, "decode_flags": flags})
    return topo


def pin_workers(dep: topology.Deployment) -> None:
    """`--pin`: a deployment's engine workers one to a CPU (prefill workers first, then decode:
    agg's two decode workers on CPUs 0 and 1, disagg's and cond's prefill worker on 0 and decode
    worker on 1); the router, kvtransfer and this process (the client) float. Disaggregation's
    premise is that decode does not share its processor with prefill; unpinned, the scheduler
    can run both workers' engine threads on one core of two for a while (issue 19)."""
    cpus = sorted(os.sched_getaffinity(0))
    workers = [*dep.prefills, *dep.decodes]
    if len(cpus) < len(workers):
        raise SystemExit(f"--pin needs a CPU per worker ({len(workers)}), this process has {len(cpus)}")
    for cpu, svc in zip(cpus, workers, strict=False):
        pin_threads(svc.proc.pid, {cpu})


def repetition(args, rates: list[float], workloads: list[str], loads: dict[str, Workload], seed: int):
    """The three modes interleaved point by point: all three deployments run side by side (an
    idle one costs next to nothing), and at each rate the modes take turns, in an order rotated
    from rate to rate, so that a shared machine's speed drifting over minutes lands on all three
    alike instead of on whichever mode ran during the slow minutes (session 5: modes run back to
    back saw TPOT differ 15x within one repetition). The unloaded baseline, which this
    repetition's SLOs are relative to, is measured on agg. Returns (curves, stats)."""
    curves: dict[str, dict[str, list[tuple[float, float]]]] = {w: {} for w in workloads}
    stats: dict[tuple[str, str, float], dict[str, float]] = {}
    caps: dict[str, float] = {}
    deps: dict[str, topology.Deployment] = {}
    try:
        for mode in MODES:
            topo = mode_topology(args, mode)
            deps[mode] = topology.start(topo)
            wait_workers(deps[mode].internal_address, topo.prefill + topo.decode)
            if args.pin:
                pin_workers(deps[mode])
        print(
            f"[{time.strftime('%H:%M:%S', time.gmtime())} UTC] deployments up: {load_average()}", flush=True
        )
        # Each length twice: the TPOT SLO is 1.5x this median, so a noisy baseline moves every
        # attainment figure (4 samples gave 20.1-24.9 ms across runs on this machine).
        lengths = [64, 128, 256, 512, 1024, 2048] * 2
        base = measure_baseline(deps["agg"].address, lengths, args.output_tokens, seed + 7)
        print(
            f"unloaded: TTFT = {base.ttft_a * 1000:.0f} ms + {base.ttft_b * 1e6:.0f} us/token; "
            f"TPOT p50 {base.tpot * 1000:.1f} ms -> SLO TPOT <= {base.tpot_slo * 1000:.1f} ms",
            flush=True,
        )
        if args.relative_rates:
            caps = {w: capacity(base, loads[w]) for w in workloads}
            print(
                "relative rates: unbatched capacity "
                + " ".join(f"{w}={c:.3f} req/s" for w, c in caps.items())
                + "; absolute rates "
                + " ".join(f"{w}={[round(x * c, 3) for x in rates]}" for w, c in caps.items()),
                flush=True,
            )
        names = list(MODES)
        for w in workloads:
            for i, rate in enumerate(rates):
                r_abs = rate * caps[w] if args.relative_rates else rate
                for mode in names[i % len(names) :] + names[: i % len(names)]:
                    recs = run(
                        deps[mode].address, items(loads[w], r_abs, seed + int(rate * 100)), timeout_s=300
                    )
                    att, ttft_miss, tpot_miss = misses(recs, base)
                    curves[w].setdefault(mode, []).append((rate, att))
                    d = describe(recs)
                    stats[(mode, w, rate)] = d
                    print(
                        f"[{time.strftime('%H:%M:%S', time.gmtime())}] {w:>5} {mode:>6} rate={rate:<5}"
                        f"{f' ({r_abs:.3f} req/s)' if args.relative_rates else ''} ok={d['ok']}/{d['n']} "
                        f"remote={d['remote']} ttft p50/p99={d['ttft_p50']:.0f}/{d['ttft_p99']:.0f} ms "
                        f"tpot p50/p99={d['tpot_p50']:.1f}/{d['tpot_p99']:.1f} ms attain={att:.0%} "
                        f"(missed ttft {ttft_miss}, tpot {tpot_miss}) {load_average()}",
                        flush=True,
                    )
    finally:
        for dep in deps.values():
            dep.close()
    return curves, stats


def capacity(base: Baseline, w: Workload, workers: int = 2) -> float:
    """Requests/s the 2 workers serve one request at a time each at the measured unloaded
    latency: the unit of `--relative-rates`, so that a sweep keeps its load level when this
    shared machine runs 6x slower than it did (issue 19: its baseline TPOT read 144 ms with
    8 helpers on 2 cores, against 23 ms quiet; absolute rates then overload every mode)."""
    per = [base.ttft_a + base.ttft_b * p + max(o - 1, 0) * base.tpot for p, o in w.lengths]
    return workers / (sum(per) / len(per))


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_ci(xs: list[float]) -> str:
    """mean [95% t-interval] over repetitions."""
    m = float(np.mean(xs))
    if len(xs) < 2:
        return f"{m:.3g}"
    h = T975.get(len(xs) - 1, 1.96) * float(np.std(xs, ddof=1)) / len(xs) ** 0.5
    return f"{m:.3g} [{m - h:.3g}, {m + h:.3g}]"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return c - h, c + h


def summarize(reps, workloads: list[str], rates: list[float], done: int) -> None:
    """Per workload: each repetition's goodput per mode and cond / max(agg, disagg); the
    mean with a 95% t-interval over repetitions; attainment per point pooled over
    repetitions with a Wilson 95% interval."""
    print(f"--- summary after {done} repetition(s) ---", flush=True)
    for w in workloads:
        g = {m: [best_rate(c[w][m]) for c, _ in reps] for m in MODES}
        ratio = [
            (c / max(a, d)) if max(a, d) else float("inf")
            for a, d, c in zip(g["agg"], g["disagg"], g["cond"], strict=True)
        ]
        wins = sum(c >= max(a, d) for a, d, c in zip(g["agg"], g["disagg"], g["cond"], strict=True))
        print(
            f"{w}: goodput per repetition "
            + " ".join(f"{m}={','.join(f'{x:g}' for x in g[m])}" for m in MODES)
            + f"; cond/max(agg,disagg) per repetition {','.join(f'{x:.2f}' for x in ratio)}; "
            f"cond >= max(agg, disagg) in {wins} of {len(ratio)}",
            flush=True,
        )
        print(
            f"{w}: goodput mean [95% CI] " + " ".join(f"{m}={mean_ci(g[m])}" for m in MODES),
            flush=True,
        )
        # Goodput on a coarse grid ties at 0 when every mode misses the lowest rate: the
        # attainment at each rate, per repetition, is the comparison that still says something.
        for i, rate in enumerate(rates):
            a = {m: [c[w][m][i][1] for c, _ in reps] for m in MODES}
            att_wins = sum(c >= max(x, y) for x, y, c in zip(a["agg"], a["disagg"], a["cond"], strict=True))
            print(
                f"{w}: attainment at rate {rate:g} per repetition "
                + " ".join(f"{m}={','.join(f'{x:.0%}' for x in a[m])}" for m in MODES)
                + "; mean [95% CI] "
                + " ".join(f"{m}={mean_ci(a[m])}" for m in MODES)
                + f"; cond >= max(agg, disagg) in {att_wins} of {len(reps)}",
                flush=True,
            )
        for m in MODES:
            cells = []
            for i, rate in enumerate(rates):
                atts = [c[w][m][i][1] for c, _ in reps]
                n = sum(s[(m, w, rate)]["n"] for _, s in reps)
                k = round(sum(a * s[(m, w, rate)]["n"] for a, (_, s) in zip(atts, reps, strict=True)))
                lo, hi = wilson(k, n)
                cells.append(f"{rate:g}:{k / n:.0%}[{lo:.0%},{hi:.0%}]" if n else f"{rate:g}:-")
            print(f"{w}: {m:>6} attainment pooled (Wilson 95%) " + " ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if ("--engine" in argv and argv[argv.index("--engine") + 1 :][:1] == ["sim"]) or "--engine=sim" in argv:
        from bench import disagg_gpu  # the GPU-regime study: an event model, see its docstring

        return disagg_gpu.main(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("torch", "sim"), default="torch", help="sim: bench/disagg_gpu.py")
    ap.add_argument("--quick", action="store_true", help="fewer requests and rates (make bench)")
    ap.add_argument("--fixed-rate", type=float, default=None, help="issue 5: one rate, TTFT/TPOT per mode")
    ap.add_argument("--rates", type=str, default=None, help="comma-separated sweep rates (req/s)")
    ap.add_argument("--requests", type=int, default=None, help="requests per (mode, rate)")
    ap.add_argument("--workloads", type=str, default="mix,azure")
    ap.add_argument("--output-tokens", type=int, default=32, help="output tokens of mix requests")
    ap.add_argument("--azure-length-factor", type=float, default=4.0)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cond-max-local",
        type=int,
        default=None,
        help="cond mode's --max-local-prefill-tokens (default: the decode service's default)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="repetitions (each: the three modes interleaved point by point); CIs when > 1",
    )
    ap.add_argument(
        "--relative-rates",
        action="store_true",
        help="--rates are multiples of the unbatched capacity measured by each repetition's baseline",
    )
    ap.add_argument(
        "--first-repetition",
        type=int,
        default=0,
        help="index of the first repetition (its arrival seed is seed + 1000 x index): continue a series",
    )
    ap.add_argument(
        "--patient",
        action="store_true",
        help="router stall timeout off, remote prefill timeout 600 s (a machine too contended for the defaults)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="each engine worker on its own CPU (router, kvtransfer and the client float)",
    )
    ap.add_argument(
        "--stop-at",
        type=float,
        default=None,
        help="Unix time: start no repetition that (timed as the last one) would end after it",
    )
    args = ap.parse_args(argv)
    n = args.requests or (16 if args.quick else 60)
    rates = (
        [float(r) for r in args.rates.split(",")]
        if args.rates
        else ([0.5, 1.0] if args.quick else [0.25, 0.5, 0.75, 1.0, 1.5, 2.0])
    )
    workloads = ["mix"] if args.quick else args.workloads.split(",")
    if args.fixed_rate is not None:
        rates, workloads = [args.fixed_rate], ["mix"]
    print(
        f"disagg bench: preset={args.preset} requests/point={n} rates={rates} workloads={workloads} "
        f"mix=90%x[64,256]+10%x[2048,2304] out={args.output_tokens}; azure length_factor="
        f"{args.azure_length_factor} time: Poisson at each rate; cond max_local_prefill_tokens="
        f"{args.cond_max_local if args.cond_max_local is not None else 'service default'}"
        f"{'; --pin: each engine worker on its own CPU' if args.pin else ''}",
        flush=True,
    )

    loads = {
        "mix": mix_workload(n, args.seed, args.output_tokens),
        "azure": azure_workload(n, args.seed, args.azure_length_factor),
    }
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; {load_average()}", flush=True)
    reps: list[tuple[dict[str, dict[str, list[tuple[float, float]]]], dict]] = []
    rep_s = 0.0
    for rep in range(args.first_repetition, args.first_repetition + args.repeats):
        if args.stop_at is not None and reps and time.time() + rep_s > args.stop_at:
            print(f"stopping before repetition {rep + 1}: it would end after --stop-at", flush=True)
            break
        t0 = time.time()
        # One repetition = the three modes interleaved on one arrival seed, so that the ratios
        # within a repetition share the machine's load of those minutes.
        curves, stats = repetition(args, rates, workloads, loads, args.seed + 1000 * rep)
        rep_s = time.time() - t0
        reps.append((curves, stats))
        if args.repeats > 1:
            summarize(reps, workloads, rates, len(reps))
    stats = reps[-1][1]
    # Curves pooled over repetitions (every point has the same request count).
    curves = {
        w: {
            m: [(r, float(np.mean([c[w][m][i][1] for c, _ in reps]))) for i, r in enumerate(rates)]
            for m in MODES
        }
        for w in workloads
    }
    if args.fixed_rate is not None:
        r = args.fixed_rate
        a, c = stats[("agg", "mix", r)], stats[("cond", "mix", r)]
        print(
            f"disagg tpot_p99_agg={a['tpot_p99']:.1f} tpot_p99_cond={c['tpot_p99']:.1f} "
            f"tpot_p99_disagg={stats[('disagg', 'mix', r)]['tpot_p99']:.1f} ttft_p50_agg={a['ttft_p50']:.0f} "
            f"ttft_p50_cond={c['ttft_p50']:.0f} ttft_p50_disagg={stats[('disagg', 'mix', r)]['ttft_p50']:.0f} "
            f"rate={r}"
        )
        return 0
    for w in workloads:
        path = plot(w, curves[w], f"azure lengths/{args.azure_length_factor:g}" if w == "azure" else "mix")
        goods = {m: best_rate(curves[w][m]) for m in MODES}
        print(
            f"{w}: highest rate with >= 90% SLO attainment "
            + " ".join(f"{m}={g:g}" for m, g in goods.items())
            + (f" (plot {path})" if path else "")
        )
    # The mean over repetitions of each one's goodput (not the goodput of the pooled curve).
    g = {m: float(np.mean([best_rate(c["mix"][m]) for c, _ in reps])) for m in MODES}
    ratio = g["cond"] / g["agg"] if g["agg"] else float("inf")
    print(
        f"goodput agg={g['agg']:.3g} disagg={g['disagg']:.3g} cond={g['cond']:.3g} cond_vs_agg={ratio:.2f}"
        + (f" repetitions={len(reps)}" if len(reps) > 1 else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
