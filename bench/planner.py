"""The planner study: SLO attainment and worker-seconds of four ways to size a P/D fleet.

Fleet: simulated GPU workers of the `splitwise-h100-llama70b` profile
(Llama-2-70B on H100 TP4, Splitwise ISCA'24; services/model/profiles.json), in
bench/fleet_sim.py's event-driven model (its docstring has the method), with
a worker start-up time of `--startup-s` and the planner's interval
`--interval-s`: 60 s and 30 s for the full study's 3,600-s day, scaled with
the day otherwise (--quick's 1,200-s day: 20 s and 10 s), so that the quick
run is the same experiment compressed, not one with a 3x slower start-up
relative to the load (what tracking can save is set by how far ahead capacity
must be decided against how fast the load moves; a real day at 24x
compression makes the full study's 60 s stand for a 24-minute start-up). Request lengths are the Azure conversation trace's
(bench/traces/azure_conv_2023.csv, in order, cycled); arrivals are a Poisson
process whose rate follows one of two shapes:

- `diurnal`: a day compressed into `--day-s` seconds (default 3,600; 1,200 with
  --quick): rate = peak x (trough share + (1 - trough share) x (1 - cos(2 pi t / day)) / 2),
  a 5x swing between night and the afternoon peak. (The Azure trace itself
  covers one hour, not a day: its lengths are real, the day's shape is
  synthesised and said so.)
- `bursty`: a base rate with bursts of 5x for 30 s every 300 s.

Every policy runs on the same fleet mechanisms: a draining decode worker migrates its sequences to
the others (`--no-migrate`: it finishes them), and with `--local-prefill` decode workers prefill
locally by services/decode/disagg_policy.py's time rule (conditional disaggregation; off by default:
it collapsed decode on the full day, BENCHMARKS.md); with it the static peak is searched both with
and without the mode (the fewer workers kept) and a `planner_split` row runs the planner without it.

Policies, each on the same arrivals:
- `planner`: services/planner (Holt forecast over the start-up horizon, both
  pools sized from a measured capacity table, lengths fast-up, measured-SLO
  correction, hysteresis with a down band and a shorter streak while the forecast
  falls); the table (services/planner/capacity_table.py) is
  each role's highest stationary load per pool size with `--table-goal` of the
  requests within its SLO, measured here on the fleet simulation (bisection,
  `--table-s` runs, lengths drawn at random from the trace, the other role
  ample) and cached in bench/results/planner_capacity.json with its settings;
  `planner_formulas`: the same planner sized by the pooled queueing formulas
  (services/planner/sizing.py) instead;
- `dynamo_formula`: NVIDIA Dynamo's throughput-mode formula (docs,
  design-docs/planner-design.md: prefill = ceil(requests x ISL / interval /
  prefill throughput per GPU), decode = ceil(requests x OSL / interval /
  decode throughput per GPU at the ITL target)), with its constant predictor
  (next interval = this one), applied every interval with no hysteresis;
  `dynamo_matched`: the same formula with its per-worker throughputs scaled
  by a factor searched (0.1..1, to 0.01) until it attains what the planner
  attains: its worker-seconds at equal attainment (the formula sizes every
  worker to full utilisation, so unscaled it is cheap and misses the SLO);
- `static_peak`: the smallest fixed (prefill, decode) pools that attain 0.95 on
  the same arrivals, found with hindsight by searching (what an operator who
  provisions for the peak, and knew it exactly, would run);
  `static_mean`: pdmesh's sizing at the run's mean rate, fixed;
- `oracle` (a reference, not a policy anyone can run): the static_peak pools
  scaled by the workload's true rate, read ahead over the next interval and a
  start-up (a reference, not a bound);
- the stationary bound (computed, not a run): the table's pools for the true
  rate at every second, read ahead over an interval plus a start-up;
- `first_burst` (bursty only, a reference): the run's first pools until the
  first interval that shows a burst, then the whole budget: the most a policy
  that sizes for the load it has seen can attain there.

After the diurnal table: where the planner's worker-seconds go (`breakdown`), stage by stage from
the fractional stationary pools to the run's worker-seconds, per role, from its decision log.

Reported per policy: worker-seconds, SLO attainment (TTFT <= --ttft-slo and
mean ITL <= --itl-slo), worker-seconds per successful request (the cost per
successful request, in GPU-worker-seconds), requests failed by scaling (0 in
this model by construction: draining workers finish their work; the real drain
is tested end to end), and a plot of replicas per role against load
(bench/results/planner_<workload>.png).

Run: `python bench/planner.py [--quick]`. Last line:
`planner attainment=.. worker_s_vs_peak=.. worker_s_vs_dynamo_formula=.. attainment_dynamo_formula=.. failed_scaling=..`
(diurnal workload; `_dynamo_formula` = dynamo_matched, `_dynamo_raw` = the
unscaled formula), then the bursty workload's figures with a `_bursty` suffix.
Targets: attainment >= 0.95 with <= 0.7x static peak's worker-seconds; <= the
Dynamo formula's worker-seconds at equal or better attainment; 0 failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.fleet_sim import FleetSim, SimRequest, SimResult
from bench.machine import cpu_model
from bench.traces import default_trace_path, load_azure
from services.model.timing import load_profile
from services.planner.capacity import ProfileModel, decode_batch
from services.planner.capacity_table import CapacityTable
from services.planner.hysteresis import HysteresisConfig
from services.planner.planner import Observation, Planner, PlannerConfig
from services.planner.sizing import Budget, Load, Slo, dynamo_throughput_sizing, prefill_shape, size_pools

PROFILE = "splitwise-h100-llama70b"
# The full study's control-loop time constants, for its 3,600-s day; a shorter day (--quick: 1,200 s)
# scales them with it, so that the quick run is the same experiment, faster (see `main`).
FULL_DAY_S, FULL_INTERVAL_S, FULL_STARTUP_S = 3600.0, 30.0, 60.0
RESULTS = Path(__file__).parent / "results"


# ---- workloads -----------------------------------------------------------------


def poisson(rate_at, duration_s: float, peak: float, rng: np.random.Generator) -> list[float]:
    """Arrival times of a Poisson process with rate rate_at(t) <= peak (thinning)."""
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / peak)
        if t >= duration_s:
            return out
        if rng.random() * peak <= rate_at(t):
            out.append(t)


def rate_function(kind: str, duration_s: float, peak: float):
    """The arrival rate (requests/s) at time t of a workload shape."""
    if kind == "diurnal":
        trough = 0.2

        def rate_at(t: float) -> float:
            return peak * (trough + (1 - trough) * (1 - math.cos(2 * math.pi * t / duration_s)) / 2)

    elif kind == "bursty":
        base = peak / 5

        def rate_at(t: float) -> float:
            return peak if (t % 300.0) >= 270.0 else base

    else:
        raise ValueError(kind)
    return rate_at


def workload(kind: str, duration_s: float, peak: float, seed: int) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    lengths = [(r.input_len, r.output_len) for r in load_azure(default_trace_path("azure"))]
    rate_at = rate_function(kind, duration_s, peak)
    times = poisson(rate_at, duration_s, peak, rng)
    return [SimRequest(t, *lengths[i % len(lengths)]) for i, t in enumerate(times)]


def peak_rate(reqs: list[SimRequest], window_s: float = 60.0) -> float:
    times = [r.arrival_s for r in reqs]
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - window_s:
            j += 1
        best = max(best, i - j + 1)
    return best / window_s


# ---- policies -------------------------------------------------------------------


def run_policy(
    name: str,
    reqs: list[SimRequest],
    a: argparse.Namespace,
    learned: dict,
    local: bool | None = None,
    **planner_kw,
) -> SimResult:
    """Run one policy on `reqs`. `planner_kw` overrides PlannerConfig fields (the planner only);
    `dynamo_util` (in `learned`) scales the Dynamo formula's throughput assumption; `local` overrides
    the fleet's decode-local prefill (`--no-local-prefill`) for this run."""
    iv = a.interval_s
    model = ProfileModel(load_profile(PROFILE))
    slo = Slo(a.ttft_slo, a.itl_slo)
    budget = Budget(a.max_workers)
    isl = float(np.mean([r.isl for r in reqs]))
    osl = float(np.mean([r.osl for r in reqs]))
    mean_rate = len(reqs) / reqs[-1].arrival_s
    cfg = PlannerConfig(
        interval_s=iv,
        ttft_slo_s=a.ttft_slo,
        itl_slo_s=a.itl_slo,
        max_workers=a.max_workers,
        startup_s=a.startup_s,
        **{
            "hysteresis": HysteresisConfig(up_cooldown_s=iv, down_cooldown_s=2 * iv, down_after=3),
            # the planner knows its fleet: decode workers that prefill locally absorb a share of the
            # prefill demand (--local-share); a fleet whose decode workers never prefill, none
            "local_prefill_share": a.local_share if (a.local_prefill if local is None else local) else 0.0,
            # the noise discounts (--rate-floor-z, --length-last-z), where given; else PlannerConfig's
            **{
                k: getattr(a, k) for k in ("rate_floor_z", "length_last_z") if getattr(a, k, None) is not None
            },
            **planner_kw,
        },
    )
    target = Slo(a.ttft_slo * cfg.headroom, a.itl_slo * cfg.headroom)

    def static(rate: float) -> tuple[int, int]:
        s = size_pools(Load(rate, isl, osl), model, target, budget)
        return s.prefill, s.decode

    if name in ("planner", "planner_formulas", "planner_split"):
        # planner: sized from the measured capacity table; planner_formulas: the same loop sized
        # from the queueing formulas alone (no table), the planner as it was before the table
        table = learned.get("capacity") if name != "planner_formulas" else None
        planner = Planner(cfg, model, capacity=table)
        learned[name] = planner

        def policy(obs: Observation, now: float) -> tuple[int, int]:
            d = planner.tick(obs, now)
            return d.prefill, d.decode

        initial = static(len([r for r in reqs if r.arrival_s < iv]) / iv)
    elif name in ("dynamo_formula", "dynamo_matched"):
        # dynamo_matched: the same formula with its per-worker throughputs scaled by `util` (< 1 =
        # workers sized to run below full utilisation), `util` searched until it attains what
        # the planner attains (`matched_dynamo`): the formula's worker-seconds at equal attainment.
        util = learned.get("dynamo_util", 1.0) if name == "dynamo_matched" else 1.0

        def policy(obs: Observation, now: float) -> tuple[int, int]:
            load = Load(obs.requests / iv / util, obs.mean_isl, obs.mean_osl)
            s = dynamo_throughput_sizing(load, model, slo, budget)
            return s.prefill, s.decode

        initial = static(len([r for r in reqs if r.arrival_s < iv]) / iv)
    elif name == "oracle":
        # Not a policy anyone can run: it reads the workload's true rate function ahead. The
        # hindsight-smallest static pools, scaled by the busiest rate until the next decision's
        # new workers are ready: a bound on what tracking the load can save here.
        rate_at = rate_function(a.kind, a.day_s, a.peak_rate)
        top = max(rate_at(t) for t in np.arange(0.0, a.day_s, 1.0))
        p0, d0 = learned["static_peak"]
        ahead = iv + a.startup_s

        def policy(obs: Observation, now: float) -> tuple[int, int]:
            r = max(rate_at(now + k) for k in np.arange(0.0, ahead + 1e-9, 5.0))
            return max(1, math.ceil(p0 * r / top - 1e-9)), max(1, math.ceil(d0 * r / top - 1e-9))

        initial = policy(None, 0.0)  # type: ignore[arg-type]
    elif name == "first_burst_reactive":
        # Not a policy: the best a policy can do that has not seen a burst yet. It runs the
        # planner's first pools until the first interval whose rate is over `burst_ratio` x the
        # first interval's, then the whole budget (split as static peak's pools are) for good:
        # the most capacity, as early as anything that reacts to the burst can have it. (The
        # static-peak pools themselves drain the first burst's backlog slower than the planner's
        # bigger reaction: 0.896 against its 0.910.)
        start = static(len([r for r in reqs if r.arrival_s < iv]) / iv)
        base = max(len([r for r in reqs if r.arrival_s < iv]) / iv, 1e-9)
        seen = {"burst": False}
        p0, d0 = learned["static_peak"]
        p_all = max(1, min(a.max_workers - 1, round(a.max_workers * p0 / (p0 + d0))))
        everything = (p_all, a.max_workers - p_all)

        def policy(obs: Observation, now: float) -> tuple[int, int]:
            if obs.requests / iv > cfg.burst_ratio * base:
                seen["burst"] = True
            return everything if seen["burst"] else start

        initial = start
    elif name in ("static_peak", "static_mean"):
        fixed = learned["static_peak"] if name == "static_peak" else static(mean_rate)

        def policy(obs: Observation, now: float) -> tuple[int, int]:
            return fixed

        initial = fixed
    else:
        raise ValueError(name)
    sim = FleetSim(model.profile, initial=initial, **_fleet_options(a, local=local))
    return sim.run(reqs, policy)


def matched_dynamo(reqs: list[SimRequest], a: argparse.Namespace, goal: float) -> tuple[float, SimResult]:
    """The Dynamo formula's throughput scale `util` (searched in 0.1..1, to 0.01) whose run attains
    `goal` with the fewest worker-seconds: the formula given whatever margin it needs to match."""
    lo, hi = 0.1, 1.0
    best: tuple[float, SimResult] | None = None
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        r = run_policy("dynamo_matched", reqs, a, {"dynamo_util": mid})
        if r.attainment(a.ttft_slo, a.itl_slo) >= goal:
            lo, best = mid, (mid, r)
        else:
            hi = mid
    if best is None:  # even 10% of its throughput assumption does not attain `goal`
        best = (lo, run_policy("dynamo_matched", reqs, a, {"dynamo_util": lo}))
    return best


def smallest_static(reqs: list[SimRequest], a: argparse.Namespace, goal: float = 0.95) -> tuple[int, int]:
    """The fewest fixed (prefill, decode) workers that attain `goal` on this run, found with hindsight:
    binary search of the prefill count at a generous decode count, then of the decode count. With
    decode-local prefill on, searched both with it and without it (an operator can switch it off), and
    the fewer workers kept: the mode never makes the baseline worse than the pure split."""
    model = ProfileModel(load_profile(PROFILE))

    def search(lo: int, hi: int, ok) -> int:
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
        return lo

    def smallest(local: bool) -> tuple[int, int]:
        def attains(p: int, d: int) -> float:
            sim = FleetSim(model.profile, initial=(p, d), **_fleet_options(a, local=local))
            return sim.run(reqs, lambda obs, now: (p, d)).attainment(a.ttft_slo, a.itl_slo)

        cap = a.max_workers
        d_hi = min(cap // 2, cap - 1)
        p = search(1, cap - d_hi, lambda n: attains(n, d_hi) >= goal)
        d = search(1, cap - p, lambda n: attains(p, n) >= goal)
        return p, d

    found = [smallest(False)]
    if a.local_prefill:
        found.append(smallest(True))
    return min(found, key=lambda pd: (pd[0] + pd[1], found.index(pd)))


def _fleet_options(a: argparse.Namespace, *, local: bool | None = None) -> dict:
    """The fleet's mechanisms, the same for every policy: decode-local prefill and migration on drain."""
    return {
        "startup_s": a.startup_s,
        "interval_s": a.interval_s,
        "local_prefill": a.local_prefill if local is None else local,
        "migrate_on_drain": a.migrate_on_drain,
        "ttft_slo_s": a.ttft_slo,
        "itl_slo_s": a.itl_slo,
    }


# ---- the measured capacity table and the stationary bound -------------------------------


def stationary_ok(
    prof, lengths: list[tuple[int, int]], rate: float, p: int, d: int, a: argparse.Namespace, seed: int
) -> tuple[float, float]:
    """(share within the TTFT SLO, share within the ITL SLO) of fixed pools (p, d) at a constant Poisson
    `rate`: lengths drawn at random from the trace, `--table-s` seconds, the first 20% cut (warm-up)."""
    rng = np.random.default_rng(seed)
    dur = a.table_s
    times = poisson(lambda t: rate, dur, rate, rng)
    picks = rng.integers(0, len(lengths), len(times))
    reqs = [SimRequest(t, *lengths[k]) for t, k in zip(times, picks, strict=True)]
    r = FleetSim(prof, initial=(p, d), startup_s=a.startup_s, interval_s=a.interval_s).run(
        reqs, lambda obs, now: (p, d)
    )
    outs = [o for o in r.outcomes if o.req.arrival_s >= 0.2 * dur]
    n = max(len(outs), 1)
    return (
        sum(o.ttft_s <= a.ttft_slo for o in outs) / n,
        sum(o.itl_s <= a.itl_slo for o in outs) / n,
    )


def measure_capacity(a: argparse.Namespace, goal: float) -> CapacityTable:
    """Each role's capacity per pool size on the fleet simulation: the highest constant rate (bisection,
    6 steps between the size below's rate and the pool's fluid limit) at which c workers of the role,
    the other role ample, keep `goal` of the requests within its SLO; as demand (tokens/s)."""
    model = ProfileModel(load_profile(PROFILE))
    lengths = [(r.input_len, r.output_len) for r in load_azure(default_trace_path("azure"))]
    isl = float(np.mean([x[0] for x in lengths]))
    osl = float(np.mean([x[1] for x in lengths]))
    ample = a.max_workers
    # the fluid limits: one prefill worker's tokens/s at full passes; one decode worker's output
    # tokens/s at the ITL SLO's batch
    _, _, p_tps = prefill_shape(model, isl)
    batch = decode_batch(model, isl + osl / 2, a.itl_slo)
    d_tps = batch / model.decode_step_s(batch, int(batch * (isl + osl / 2)))
    top = 1.5 * a.peak_rate
    out: dict[str, list[float]] = {}
    for role, per_len, fluid in (("prefill", isl, p_tps), ("decode", osl, d_tps)):
        caps: list[float] = []
        lo = 0.0
        c = 0
        while not caps or caps[-1] < top * per_len:
            c += 1
            hi = c * fluid / per_len  # requests/s: the pool's fluid limit
            lo_c = lo
            for _ in range(6):
                mid = (lo_c + hi) / 2
                p, d = (c, ample) if role == "prefill" else (ample, c)
                ok = stationary_ok(model.profile, lengths, mid, p, d, a, a.table_seed)[role == "decode"]
                lo_c, hi = (mid, hi) if ok >= goal else (lo_c, mid)
            lo = max(lo_c, lo)
            caps.append(max(lo, 1e-3) * per_len)
        out[role] = caps
    return CapacityTable(
        tuple(out["prefill"]),
        tuple(out["decode"]),
        goal,
        f"bench/planner.py: {PROFILE}, Azure conversation lengths drawn at random, constant Poisson "
        f"rates, {a.table_s:.0f} s each, TTFT <= {a.ttft_slo} s / mean ITL <= {a.itl_slo} s",
    )


def capacity_table(a: argparse.Namespace) -> tuple[CapacityTable, str]:
    """The measured capacity table: bench/results/planner_capacity.json when it was measured with
    these settings, else measured now (minutes) and written there."""
    key = {
        "profile": PROFILE,
        "ttft_slo": a.ttft_slo,
        "itl_slo": a.itl_slo,
        "table_s": a.table_s,
        "goal": a.table_goal,
        "seed": a.table_seed,
        "ample": a.max_workers,
        "top_rate": 1.5 * a.peak_rate,
    }
    path = RESULTS / "planner_capacity.json"
    if path.exists() and not a.remeasure_table:
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return CapacityTable.from_doc(doc), f"{path} (measured earlier with these settings)"
    t0 = time.perf_counter()
    table = measure_capacity(a, a.table_goal)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps({**table.to_doc(), "key": key}, indent=1) + "\n")
    return table, f"measured now in {time.perf_counter() - t0:.0f} s, written to {path}"


def stationary_bound(
    table: CapacityTable, a: argparse.Namespace, isl: float, osl: float, lead_s: float
) -> float:
    """Worker-seconds of running, at every second, exactly the table's pools for the busiest true rate
    of the next `lead_s` seconds (a policy that knows the future and whose pools are always
    stationary-sized): what the 'perfect-foresight bound' of the study is."""
    rate_at = rate_function(a.kind, a.day_s, a.peak_rate)
    rates = np.array([rate_at(t + 0.5) for t in np.arange(0.0, a.day_s, 1.0)])
    ws = 0.0
    k = round(lead_s)
    for i in range(len(rates)):
        r = float(rates[i : i + k + 1].max())
        ws += max(table.workers("prefill", r * isl), 1) + max(table.workers("decode", r * osl), 1)
    return ws


def _frac_workers(table: CapacityTable, role: str, demand: float) -> float:
    """The table's pool for `demand` as a fractional worker count (linear between measured sizes)."""
    caps = getattr(table, role)
    prev = 0.0
    for c, cap in enumerate(caps, start=1):
        if cap >= demand:
            return c - 1 + (demand - prev) / (cap - prev)
        prev = cap
    return len(caps) + (demand - caps[-1]) / (caps[-1] / len(caps))


BREAKDOWN = (
    ("fractional", "the table's pools at the true rate, as fractions of a worker (no rounding, no lead)"),
    ("integer", "the same, whole workers"),
    ("bound", "+ the lead: for the busiest true rate over an interval + a start-up (the stationary bound)"),
    ("true_lengths", "per decision, the true rate over the lead x the true mean lengths of its arrivals"),
    ("lengths", "x the lengths the planner sized for instead"),
    ("forecast", "x its forecast rate instead of the true one"),
    ("margin", "/ the table margin (and less what decode-local prefill absorbs)"),
    ("corrected", "+ the down band and the measured-SLO corrections (a role over its SLO gets one more)"),
    ("hysteresis", "the decision applied: cooldowns and the scale-down streak"),
    ("pools", "the pools the run had (starting and active workers)"),
    ("total", "+ draining workers (told to stop, finishing their work): the run's worker-seconds"),
)


def breakdown(r: SimResult, planner: Planner, reqs: list[SimRequest], a: argparse.Namespace) -> dict:
    """Where the planner's worker-seconds go, per role, from its own decision log and the run's workers:
    each stage of BREAKDOWN as worker-seconds (seconds x workers), from the bound to what the run used."""
    table: CapacityTable = a.capacity
    decs = list(planner.decisions)
    lead, day = a.interval_s + a.startup_s, a.day_s
    end = max(w.stopped_s or 0.0 for w in r.workers)
    n = math.ceil(end)
    secs = np.arange(n, dtype=float)
    rate_at = rate_function(a.kind, day, a.peak_rate)
    rates = np.array([rate_at(t + 0.5) if t < day else 0.0 for t in secs])
    k = round(lead)
    ahead = np.array([rates[i : i + k + 1].max() for i in range(n)])
    arrivals = np.array([q.arrival_s for q in reqs])

    def stages_of(role: str, key: str) -> dict[str, float]:
        lengths = np.array([getattr(q, key) for q in reqs], dtype=float)
        mean = float(lengths.mean())

        def held(f) -> float:
            v = np.zeros(n)
            for i, d in enumerate(decs):
                t1 = decs[i + 1].at_s if i + 1 < len(decs) else end
                v[int(d.at_s) : int(min(t1, end))] = f(d)
            v[: int(decs[0].at_s)] = f(decs[0])  # the initial pools: as the first decision's
            return float(v.sum())

        def true_len(t: float) -> float:
            i0, i1 = np.searchsorted(arrivals, t), np.searchsorted(arrivals, t + lead)
            return float(lengths[i0:i1].mean()) if i1 > i0 else mean

        def table_pool(rate: float, length: float) -> int:
            return max(table.workers(role, rate * length), 1)

        stages = {
            "fractional": float(sum(_frac_workers(table, role, x * mean) for x in rates[secs < day])),
            "integer": float(sum(max(table.workers(role, x * mean), 1) for x in rates[secs < day])),
            "bound": float(sum(max(table.workers(role, x * mean), 1) for x in ahead[secs < day])),
            "true_lengths": held(lambda d: table_pool(float(ahead[int(d.at_s)]), true_len(d.at_s))),
            "lengths": held(lambda d: table_pool(float(ahead[int(d.at_s)]), getattr(d.forecast, key))),
            "forecast": held(lambda d: table_pool(d.forecast.rate, getattr(d.forecast, key))),
            "margin": held(lambda d: getattr(d.sizing, role)),
            "corrected": held(lambda d: d.sizing.inputs.get(f"corrected_{role}", getattr(d.sizing, role))),
            "hysteresis": held(lambda d: getattr(d, role)),
        }
        pools = drains = 0.0
        for w in r.workers:
            if w.role != role:
                continue
            start, stop = max(w.started_s, 0.0), w.stopped_s or end
            told = w.drain_s if w.drain_s is not None else stop
            pools += told - start
            drains += stop - told
        stages.update(pools=pools, total=pools + drains)
        return stages

    return {"prefill": stages_of("prefill", "isl"), "decode": stages_of("decode", "osl")}


POLICIES = ("planner", "planner_formulas", "dynamo_formula", "static_peak", "static_mean", "oracle")


def plot(kind: str, results: dict[str, SimResult], tag: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for ax, role_i, role in ((axes[0], 1, "prefill"), (axes[1], 2, "decode")):
        for name in ("planner", "dynamo_formula", "static_peak"):
            tl = results[name].timeline
            ax.step([x[0] for x in tl], [x[role_i] for x in tl], where="post", label=name)
        ax.set_ylabel(f"{role} workers")
        load_ax = ax.twinx()
        tl = results["planner"].timeline
        load_ax.plot([x[0] for x in tl], [x[3] for x in tl], color="grey", alpha=0.4, label="arrivals/s")
        load_ax.set_ylabel("arrivals/s")
    axes[0].legend(loc="upper left", fontsize=8)
    axes[1].set_xlabel("simulated seconds")
    fig.suptitle(f"planner study, {kind}: replicas per role against load ({PROFILE})")
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"planner_{kind}{tag}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def study(kind: str, a: argparse.Namespace) -> dict[str, str]:
    a.kind = kind
    reqs = workload(kind, a.day_s, a.peak_rate, a.seed)
    print(
        f"\n== {kind}: {len(reqs)} requests over {a.day_s:.0f} s, peak 60-s rate {peak_rate(reqs):.1f}/s, "
        f"mean {len(reqs) / a.day_s:.1f}/s"
    )
    print(
        f"{'policy':>15} {'worker_s':>9} {'attain':>7} {'ws/ok_req':>9} {'max P':>5} {'max D':>5} {'failed':>6}"
    )
    results: dict[str, SimResult] = {}
    t0 = time.perf_counter()
    learned = {"static_peak": smallest_static(reqs, a), "capacity": a.capacity}
    print(
        f"static_peak = the smallest fixed pools attaining 0.95 here, found with hindsight: "
        f"{learned['static_peak']} ({time.perf_counter() - t0:.0f} s to search)"
    )

    def row(name: str, r: SimResult, took: float) -> None:
        att = r.attainment(a.ttft_slo, a.itl_slo)
        ok = att * len(r.outcomes)
        maxp = max((x[1] for x in r.timeline), default=0)
        maxd = max((x[2] for x in r.timeline), default=0)
        print(
            f"{name:>15} {r.worker_s:9.0f} {att:7.3f} {r.worker_s / max(ok, 1):9.2f} {maxp:5d} {maxd:5d} "
            f"{r.failed_scaling:6d}   ({took:.1f} s)"
        )

    for name in POLICIES:
        t0 = time.perf_counter()
        results[name] = run_policy(name, reqs, a, learned)
        row(name, results[name], time.perf_counter() - t0)
        if name == "planner":  # the Dynamo formula at the planner's attainment, for the comparison
            t0 = time.perf_counter()
            util, results["dynamo_matched"] = matched_dynamo(
                reqs, a, results["planner"].attainment(a.ttft_slo, a.itl_slo)
            )
            row("dynamo_matched", results["dynamo_matched"], time.perf_counter() - t0)
            print(f"{'':>15} (dynamo_matched = the formula with its throughputs x {util:.2f}, searched)")
    if a.local_prefill:  # the other way: the planner in a fleet whose decode workers never prefill
        t0 = time.perf_counter()
        results["planner_split"] = run_policy("planner_split", reqs, a, learned, local=False)
        row("planner_split", results["planner_split"], time.perf_counter() - t0)
        local = results["planner"].local_prefills / max(len(reqs), 1)
        print(
            f"{'':>15} (planner_split = the planner with no decode-local prefill; the planner's fleet "
            f"prefilled {local:.1%} of the prompts on decode workers)"
        )
    print(f"plot: {plot(kind, results, a.plot_tag)}")
    brk = breakdown(results["planner"], learned["planner"], reqs, a)
    peak_ws = results["static_peak"].worker_s
    print(
        "where the planner's worker-seconds go (x static peak's), stage by stage from the bound to the run:"
    )
    print(f"{'':>13} {'prefill':>8} {'decode':>8} {'both':>8}  ")
    for stage, what in BREAKDOWN:
        p_, d_ = brk["prefill"][stage] / peak_ws, brk["decode"][stage] / peak_ws
        print(f"{stage:>13} {p_:8.3f} {d_:8.3f} {p_ + d_:8.3f}  {what}")
    p, dyn, raw, peak, oracle = (
        results["planner"],
        results["dynamo_matched"],
        results["dynamo_formula"],
        results["static_peak"],
        results["oracle"],
    )
    print(
        f"oracle (knows the future rate; not a real policy): {oracle.worker_s / peak.worker_s:.2f}x static "
        f"peak's worker-seconds at attainment {oracle.attainment(a.ttft_slo, a.itl_slo):.3f}"
    )
    # The perfect-foresight bound, computed (session 5 quoted 0.688x from a scratch script: pools
    # searched jointly at a 4/s grid of rates, each rate's need taken at the grid point above).
    isl = float(np.mean([r.isl for r in reqs]))
    osl = float(np.mean([r.osl for r in reqs]))
    lead = a.interval_s + a.startup_s
    b0 = stationary_bound(a.capacity, a, isl, osl, 0.0) / peak.worker_s
    b1 = stationary_bound(a.capacity, a, isl, osl, lead) / peak.worker_s
    print(
        f"stationary bound (the capacity table's pools for the true rate at every second, each role at "
        f"{a.capacity.goal:.0%} within its SLO): {b0:.3f}x static peak with no lead, {b1:.3f}x with the "
        f"{lead:.0f}-s lead (interval + start-up)"
    )
    extra = {"bound_vs_peak": f"{b1:.3f}"}
    if kind == "bursty":
        t0 = time.perf_counter()
        fb = run_policy("first_burst_reactive", reqs, a, learned)
        row("first_burst", fb, time.perf_counter() - t0)
        print(
            f"first burst answered at once (the whole budget from the first interval that shows it, "
            f"kept): attainment {fb.attainment(a.ttft_slo, a.itl_slo):.3f}; the most a policy that has not "
            f"seen a burst before can reach here"
        )
        extra["attainment_first_burst_reactive"] = f"{fb.attainment(a.ttft_slo, a.itl_slo):.3f}"
    pf = results["planner_formulas"]
    if "planner_split" in results:
        ps = results["planner_split"]
        extra["attainment_planner_split"] = f"{ps.attainment(a.ttft_slo, a.itl_slo):.3f}"
        extra["worker_s_vs_peak_planner_split"] = f"{ps.worker_s / peak.worker_s:.2f}"
        extra["local_prefill_share_of_prompts"] = f"{p.local_prefills / max(len(reqs), 1):.3f}"
    return {
        "attainment": f"{p.attainment(a.ttft_slo, a.itl_slo):.3f}",
        "worker_s_vs_peak": f"{p.worker_s / peak.worker_s:.2f}",
        "worker_s_vs_dynamo_formula": f"{p.worker_s / dyn.worker_s:.2f}",
        "attainment_dynamo_formula": f"{dyn.attainment(a.ttft_slo, a.itl_slo):.3f}",
        "dynamo_formula_util": f"{util:.2f}",
        "worker_s_vs_dynamo_raw": f"{p.worker_s / raw.worker_s:.2f}",
        "attainment_dynamo_raw": f"{raw.attainment(a.ttft_slo, a.itl_slo):.3f}",
        "failed_scaling": str(p.failed_scaling),
        "oracle_worker_s_vs_peak": f"{oracle.worker_s / peak.worker_s:.2f}",
        "oracle_attainment": f"{oracle.attainment(a.ttft_slo, a.itl_slo):.3f}",
        "attainment_planner_formulas": f"{pf.attainment(a.ttft_slo, a.itl_slo):.3f}",
        "worker_s_vs_peak_planner_formulas": f"{pf.worker_s / peak.worker_s:.2f}",
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 1,200-s day (make bench)")
    ap.add_argument("--day-s", type=float, default=None)
    ap.add_argument("--peak-rate", type=float, default=40.0, help="requests/s at the peak")
    ap.add_argument("--ttft-slo", type=float, default=1.0)
    ap.add_argument("--itl-slo", type=float, default=0.05)
    ap.add_argument(
        "--startup-s",
        type=float,
        default=None,
        help=f"worker start-up (default {FULL_STARTUP_S:.0f} s x day/3600)",
    )
    ap.add_argument(
        "--interval-s",
        type=float,
        default=None,
        help=f"decision interval (default {FULL_INTERVAL_S:.0f} s x day/3600)",
    )
    ap.add_argument("--max-workers", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table-s", type=float, default=150.0, help="seconds of each capacity-table measurement")
    ap.add_argument(
        "--remeasure-table", action="store_true", help="measure the capacity table even if cached"
    )
    ap.add_argument(
        "--table-goal", type=float, default=0.95, help="per-role SLO share the capacity table is for"
    )
    ap.add_argument(
        "--local-prefill",
        action="store_true",
        help="decode workers prefill locally by disagg_policy's time rule (conditional disaggregation) in "
        "every policy's fleet; off: pure disaggregation (it collapsed decode on the full day: BENCHMARKS.md)",
    )
    ap.add_argument(
        "--local-share",
        type=float,
        default=0.5,
        help="with --local-prefill, the planner's local_prefill_share (prefill sized below the table)",
    )
    ap.add_argument(
        "--no-migrate",
        dest="migrate_on_drain",
        action="store_false",
        help="a draining decode worker finishes its sequences instead of migrating them",
    )
    ap.add_argument(
        "--table-seed",
        type=int,
        default=1000,
        help="seed of the capacity table's stationary runs (an offline profile: the same table for every --seed)",
    )
    ap.add_argument(
        "--rate-floor-z",
        type=float,
        default=None,
        help="the planners' rate_floor_z (default: PlannerConfig's): the rate floor less z Poisson standard errors",
    )
    ap.add_argument(
        "--length-last-z",
        type=float,
        default=None,
        help="the planners' length_last_z (default: PlannerConfig's): the last interval's lengths less z standard errors",
    )
    a = ap.parse_args(argv)
    a.day_s = a.day_s or (1200.0 if a.quick else FULL_DAY_S)
    # The day is compressed; so are the control loop's time constants, by the same factor. What
    # tracking the load can save is set by how far ahead capacity must be decided (an interval
    # plus a start-up) against how fast the load moves: a 1,200-s day with the full run's 60-s
    # start-up was a 3x slower start-up than the full study's, not the same study shorter.
    scale = a.day_s / FULL_DAY_S
    a.startup_s = FULL_STARTUP_S * scale if a.startup_s is None else a.startup_s
    a.interval_s = FULL_INTERVAL_S * scale if a.interval_s is None else a.interval_s
    print(f"cpu: {cpu_model()} x{os.cpu_count()} (a simulation: the CPU sets only how long it takes)")
    print(
        f"profile {PROFILE}; SLO TTFT <= {a.ttft_slo} s and mean ITL <= {a.itl_slo * 1000:.0f} ms; "
        f"start-up {a.startup_s:.0f} s; interval {a.interval_s:.0f} s; budget {a.max_workers} workers; "
        f"every policy's fleet: decode-local prefill {'on' if a.local_prefill else 'off'}, "
        f"migration on drain {'on' if a.migrate_on_drain else 'off'}"
    )
    # the quick default run's plots are planner_<kind>.png; other runs' get a tag, not to overwrite them
    a.plot_tag = ("" if a.quick else f"_day{a.day_s:.0f}") + ("_local" if a.local_prefill else "")
    table, where = capacity_table(a)
    a.capacity = table
    print(f"capacity table (per role, pool size 1..n; tokens/s within the SLO for {table.goal:.0%}): {where}")
    print(f"  prefill uncached tokens/s: {[round(x) for x in table.prefill]}")
    print(f"  decode output tokens/s:    {[round(x) for x in table.decode]}")
    head = study("diurnal", a)
    bursty = study("bursty", a)
    line = " ".join(f"{k}={v}" for k, v in head.items())
    line += " " + " ".join(f"{k}_bursty={v}" for k, v in bursty.items())
    print(f"planner {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
