"""Figures of one faults-study run (bench/faults.py) and the share plot.

Pure functions of what a run recorded: the clients' `Logical` records, the
workers' Stats samples, the fault windows and two router Stats reads.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from bench.faults_client import Logical

BIN_S = 2.0


@dataclass
class RunResult:
    name: str
    records: list[Logical]
    samples: list  # bench.faults.Sample
    windows: object  # bench.faults.Windows
    stats0: object  # router Stats before the load
    stats1: object  # and after
    span_s: float
    leaked_blocks: int = 0
    slow_at: float = 0.0
    slow_end: float = 0.0
    metrics: dict = field(default_factory=dict)  # router counters' deltas over the run (nonzero)

    def delta(self, name: str) -> int:
        return int(getattr(self.stats1, name) - getattr(self.stats0, name))


def meets_slo(r: Logical, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    if not r.ok or r.ttft_s is None or r.e2e_s is None or r.e2e_s > r.deadline_s:
        return False
    return r.ttft_s <= slo_ttft_s and (r.tpot_s is None or r.tpot_s <= slo_tpot_s)


def hung(records: list[Logical], slack_s: float) -> int:
    return sum(r.end_s is None or r.e2e_s > r.deadline_s + slack_s for r in records)


def engine_computed(res: RunResult) -> int | None:
    """Tokens the engines themselves computed over the run (prompt + decode positions, their
    Stats counters), summed over worker incarnations: each incarnation's last count (they
    start at 0 with the mesh or the restart, and no request runs before the trace). What a
    SIGKILLed incarnation computed after its last 0.25 s poll is not seen (both routers alike).
    None when the samples carry no counts."""
    last: dict[str, int] = {}
    for s in res.samples:
        c = getattr(s, "computed", None)
        if c is None:
            return None
        last[s.incarnation] = max(last.get(s.incarnation, 0), c)
    return sum(last.values()) if last else None


def waste(res: RunResult) -> dict[str, float]:
    """Computed, useful and wasted tokens, with the causes (see bench/faults.py's docstring).

    `computed` is the engines' own count when the samples have it (`engine_computed`), else
    the router's `computed_tokens`, which for attempts that ended without a worker's report
    (cancelled, failed, a losing hedge) is the router's estimate, the attempt's whole prefill
    plus what it delivered, whether or not the worker had started it. `router_computed` is
    the router's figure either way."""
    ok = [r for r in res.records if r.ok]
    router_computed = res.delta("computed_tokens")
    measured = engine_computed(res)
    computed = router_computed if measured is None else measured
    # One attempt computes every prompt position and every output token but the last (sampled,
    # never fed back): the router's computed_tokens of an undisturbed request.
    useful = sum(r.prompt_len + r.tokens - 1 for r in ok)
    migrated = sum(max(r.computed - r.prompt_len - r.tokens + 1, 0) for r in ok if r.migrations)
    router_retried = sum(max(r.computed - r.prompt_len - r.tokens + 1, 0) for r in ok if not r.migrations)
    client_retried = failed = 0
    for r in res.records:
        lost = [r.prompt_len + got for got in r.failed_attempt_tokens]
        if r.ok:
            client_retried += sum(lost)
        elif lost:
            client_retried += sum(lost[:-1])
            failed += lost[-1]
    wasted = computed - useful
    return {
        "computed": computed,
        "useful": useful,
        "wasted": wasted,
        "migrated": migrated,
        "router_retried": router_retried,
        "client_retried": client_retried,
        "failed": failed,
        "other": wasted - migrated - router_retried - client_retried - failed,
        "router_wasted": res.delta("wasted_tokens"),
        "router_computed": router_computed,
        "engine_measured": measured is not None,
        "per_success": wasted / max(len(ok), 1),
        "computed_per_success": computed / max(len(ok), 1),
    }


def healthy_peak(res: RunResult) -> tuple[int, int]:
    """(peak waiting + running, peak waiting) over workers not under a fault at the time."""
    both = waiting = 0
    for s in res.samples:
        if not res.windows.faulted(s.worker, s.t):
            both = max(both, s.waiting + s.running)
            waiting = max(waiting, s.waiting)
    return both, waiting


def new_requests(res: RunResult) -> dict[int, np.ndarray]:
    """New requests accepted per worker per BIN_S bin (from requests_total deltas)."""
    nbins = int(res.span_s // BIN_S) + 2
    out = {w: np.zeros(nbins) for w in {s.worker for s in res.samples}}
    last: dict[str, int] = {}
    for s in sorted(res.samples, key=lambda s: s.t):
        prev = last.get(s.incarnation, 0)
        last[s.incarnation] = s.requests_total
        b = min(int(s.t // BIN_S), nbins - 1)
        out[s.worker][b] += max(s.requests_total - prev, 0)
    return out


def slow_share(res: RunResult, start: float, end: float, worker: int = 0) -> float:
    per = new_requests(res)
    lo, hi = int(start // BIN_S), int(end // BIN_S)
    slow = per.get(worker, np.zeros(1))[lo:hi].sum()
    total = sum(v[lo:hi].sum() for v in per.values())
    return float(slow / total) if total else float("nan")


def share_series(res: RunResult, worker: int = 0) -> tuple[np.ndarray, np.ndarray]:
    per = new_requests(res)
    total = sum(per.values())
    slow = per.get(worker, np.zeros_like(total))
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, slow / total, np.nan)
    return np.arange(len(share)) * BIN_S + BIN_S / 2, share


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary_lines(res: RunResult, slo_ttft_s: float, slo_tpot_s: float, slack_s: float) -> list[str]:
    recs = res.records
    ok = [r for r in recs if r.ok]
    good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in recs)
    w = waste(res)
    peak, peak_wait = healthy_peak(res)
    codes = Counter(r.code for r in recs if not r.ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    attempts = sum(r.attempts for r in recs)
    lines = [
        f"  {res.name}: {len(recs)} requests, {len(ok)} ok, failed {dict(codes) or 'none'}; "
        f"{attempts} client attempts ({attempts - len(recs)} client retries)",
        f"    goodput {good / res.span_s:.2f} req/s ({good} within SLO over {res.span_s:.0f} s); "
        f"TTFT p50 {1000 * pct(ttft, 50):.0f} ms p99 {1000 * pct(ttft, 99):.0f} ms; "
        f"hung {hung(recs, slack_s)}",
        f"    router: retries {res.delta('retries')} denied {res.delta('retries_denied')} "
        f"migrations {res.delta('migrations')} shed {res.delta('requests_shed')} "
        f"failed {res.delta('requests_failed')} cancelled {res.delta('requests_cancelled')}",
        f"    tokens computed {w['computed']:,} ({'engines' if w['engine_measured'] else 'router'}' count; "
        f"router's {w['router_computed']:,}), {w['computed_per_success']:.1f} per success, useful "
        f"{w['useful']:,}; wasted {w['wasted']:,} ({w['per_success']:.1f} per success; router's own "
        f"count {w['router_wasted']:,})",
        f"    wasted by cause: failed {w['failed']:,}, client retries {w['client_retried']:,}, "
        f"router retries {w['router_retried']:,}, migrated {w['migrated']:,}, other {w['other']:,}",
        *_metric_lines(res),
        *_error_lines(res),
        f"    healthy workers' peak queue (waiting+running) {peak}, waiting alone {peak_wait}; "
        f"leaked blocks at the end {res.leaked_blocks}",
        *_miss_lines(res, slo_ttft_s, slo_tpot_s),
        *_queue_lines(res, slo_ttft_s, slo_tpot_s),
    ]
    if res.slow_end > res.slow_at:
        lines.append(
            f"    slow worker's share of new requests: first 10 s "
            f"{slow_share(res, res.slow_at, res.slow_at + 10):.3f}, after 10 s "
            f"{slow_share(res, res.slow_at + 10, res.slow_end):.3f}"
        )
    return lines


def _miss_lines(res: RunResult, slo_ttft_s: float, slo_tpot_s: float, bin_s: float = 5.0) -> list[str]:
    """Requests that missed the SLOs (or failed), by arrival time: which fault cost them."""
    misses = Counter(
        int(r.arrival_s // bin_s) for r in res.records if not meets_slo(r, slo_ttft_s, slo_tpot_s)
    )
    if not misses:
        return []
    text = ", ".join(f"{b * bin_s:g}-{(b + 1) * bin_s:g} s: {n}" for b, n in sorted(misses.items()))
    lines = [f"    missed the SLOs, by arrival: {text}"]
    if by_fault := _misses_by_fault(res, slo_ttft_s, slo_tpot_s):
        lines.append(
            f"    missed, arriving during each fault (+{FAULT_TAIL_S:g} s), by where they ended: {by_fault}"
        )
    return lines


FAULT_TAIL_S = 5.0  # arrivals this long after a fault's last window still count as its
FAULT_NAMES = {0: "slow", 1: "stop", 2: "kill", 3: "flap"}  # bench/faults.py's schedule, by worker


def _misses_by_fault(res: RunResult, slo_ttft_s: float, slo_tpot_s: float) -> str:
    """Per fault, the requests arriving from its first window's start to FAULT_TAIL_S after its
    last window's end that missed the SLOs, by where they ended: failed; on the faulted worker;
    moved off a worker mid-stream (migrated); on another worker without a migration (sent there
    first, re-routed before a first token, or retried). Which of those a fault costs says
    whether moving work off it paid."""
    faults = getattr(res.windows, "faults", {})
    parts = []
    for i, spans in sorted(faults.items()):
        if not spans:
            continue
        start, end = min(a for a, _ in spans), max(b for _, b in spans) + FAULT_TAIL_S
        where = Counter()
        for r in res.records:
            if start <= r.arrival_s <= end and not meets_slo(r, slo_ttft_s, slo_tpot_s):
                if not r.ok:
                    where["failed"] += 1
                elif r.worker_id == f"decode-{i}":
                    where["on it"] += 1
                elif r.migrations:
                    where["migrated"] += 1
                else:
                    where["elsewhere"] += 1
        kinds = ("on it", "migrated", "elsewhere", "failed")
        parts.append(
            f"{FAULT_NAMES.get(i, f'decode-{i}')} {start:.0f}-{end:.0f} s: "
            + " / ".join(f"{where[k]} {k}" for k in kinds)
        )
    return "; ".join(parts)


def _queue_lines(res: RunResult, slo_ttft_s: float, slo_tpot_s: float, bin_s: float = 5.0) -> list[str]:
    """Requests waiting in the workers' queues by time (each worker's mean over its polls in a
    bin, summed over workers), and why the bin's arrivals missed the SLOs: where a run's queue
    built up and what it cost, whatever the cause."""
    acc: dict[int, dict[int, list[int]]] = {}
    for s in res.samples:
        acc.setdefault(int(s.t // bin_s), {}).setdefault(s.worker, []).append(s.waiting)
    queued = {b: sum(sum(v) / len(v) for v in per.values()) for b, per in acc.items()}
    lines = []
    if any(q >= 0.05 for q in queued.values()):
        text = ", ".join(f"{b * bin_s:g}: {q:.1f}" for b, q in sorted(queued.items()) if q >= 0.05)
        lines.append(
            f"    waiting in the workers' queues (mean, summed over workers), by {bin_s:g} s bin: {text}"
        )
    why: dict[int, list[int]] = {}
    for r in res.records:
        if meets_slo(r, slo_ttft_s, slo_tpot_s):
            continue
        k = why.setdefault(int(r.arrival_s // bin_s), [0, 0, 0])
        if not r.ok or r.ttft_s is None or r.e2e_s is None or r.e2e_s > r.deadline_s:
            k[2] += 1
        elif r.ttft_s > slo_ttft_s:
            k[0] += 1
        else:
            k[1] += 1
    if why:
        text = ", ".join(f"{b * bin_s:g}: {t}/{p}/{f}" for b, (t, p, f) in sorted(why.items()))
        lines.append(f"    misses by arrival bin, TTFT/TPOT/failed-or-late: {text}")
    per = new_requests(res)  # per worker, BIN_S bins
    if per:
        k = max(1, round(bin_s / BIN_S))
        n = max(len(v) for v in per.values())
        cols = []
        for lo in range(0, n, k):
            got = [int(per[w][lo : lo + k].sum()) if w in per else 0 for w in range(max(per) + 1)]
            cols.append(f"{lo * BIN_S:g}: {'/'.join(map(str, got))}")
        lines.append(f"    new requests per worker (0/1/2/...), by {k * BIN_S:g} s bin: {', '.join(cols)}")
    return lines


def _error_lines(res: RunResult, top: int = 4) -> list[str]:
    """The most frequent failed-attempt errors (code and the start of its details)."""
    c = Counter(d for r in res.records for d in r.details)
    if not c:
        return []
    return ["    failed attempts, most frequent: " + "; ".join(f"{n}x {d}" for d, n in c.most_common(top))]


def _label(key: str) -> str:
    """'name{cause="hedged"}' -> 'hedged'."""
    return key.split("=", 1)[1].strip('"}') if "=" in key else key


REROUTE_FIRST = "pdmesh_router_reroute_first_token_seconds"
REROUTE_BOUND_S = 2.0  # issue 18: their first token elsewhere within 2 s of the router noticing


def rerouted_within(metrics: dict) -> tuple[float, float]:
    """(requests moved before a first token that got one elsewhere, those within the bound),
    from the router's histogram deltas."""
    n = metrics.get(f"{REROUTE_FIRST}_count", 0.0)
    within = metrics.get(f'{REROUTE_FIRST}_bucket{{le="{REROUTE_BOUND_S}"}}', 0.0)
    return n, within


def _metric_lines(res: RunResult) -> list[str]:
    if not res.metrics:
        return []
    by_cause = {k: v for k, v in res.metrics.items() if k.startswith("pdmesh_router_wasted_tokens_by_cause")}
    reroute = {k: v for k, v in res.metrics.items() if k.startswith(REROUTE_FIRST)}
    rest = {k: v for k, v in res.metrics.items() if k not in by_cause and k not in reroute}
    lines = []
    if reroute:
        n, within = rerouted_within(res.metrics)
        lines.append(
            f"    moved off an unhealthy worker before a first token: {n:g}, first token elsewhere "
            f"within {REROUTE_BOUND_S:g} s of the router noticing: {within:g}"
        )
    if by_cause:
        text = ", ".join(f"{_label(k)} {v:,.0f}" for k, v in sorted(by_cause.items()))
        lines.append(f"    router's wasted tokens by cause: {text}")
    if rest:
        text = ", ".join(f"{k.removeprefix('pdmesh_router_')} {v:g}" for k, v in sorted(rest.items()))
        lines.append(f"    router counters: {text}")
    return lines


def plot_share(results: list[RunResult], n_workers: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for res in results:
        x, y = share_series(res)
        ax.plot(x, y, label=res.name, marker=".", linewidth=1)
    slowed = [r for r in results if r.slow_end > r.slow_at]
    if slowed:
        ax.axvspan(
            slowed[0].slow_at, slowed[0].slow_end, color="grey", alpha=0.15, label="decode-0 5x slower"
        )
    ax.axhline(1 / n_workers, color="k", linestyle=":", linewidth=1, label="1/N (even)")
    ax.axhline(1 / (2 * n_workers), color="r", linestyle="--", linewidth=1, label="1/(2N) target")
    ax.set_xlabel("run time (s)")
    ax.set_ylabel(f"decode-0's share of new requests ({BIN_S:g} s bins)")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("Slow worker's share of new requests (bench/faults.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the study's figures (one repetition), their mean and spread over repetitions --------

FIGURES = (
    "goodput_vs_clean",
    "waste_vs_naive",
    "queue_peak_vs_clean",
    "naive_queue_peak_vs_clean",
    "hung",
    "slow_share_10s",
    "rerouted_late",
    "clean_slo",
)
# A repetition whose fault-free run met its SLOs for less than this share of requests ran on
# a machine too busy for the mesh (the 2-vCPU box shared with other work reaches load 35):
# its ratios compare two collapses, so they are flagged and left out of the mean.
VALID_CLEAN_SLO = 0.8


def figures(results: dict[str, RunResult], slo_ttft_s: float, slo_tpot_s: float, slack_s: float) -> dict:
    """The last line's figures of one repetition (pdmesh's, naive's queue beside them; NaN
    where a run is missing). Waste is per successful request, the engines' count."""
    nan = float("nan")

    def goodput(r: RunResult) -> float:
        return sum(meets_slo(x, slo_ttft_s, slo_tpot_s) for x in r.records) / r.span_s

    def ratio(a: float, b: float) -> float:
        return a / b if b else nan

    pd, nv, cl = results.get("pdmesh"), results.get("naive"), results.get("clean")
    clean_peak = healthy_peak(cl)[0] if cl else nan
    return {
        "goodput_vs_clean": ratio(goodput(pd), goodput(cl)) if pd and cl else nan,
        "waste_vs_naive": ratio(waste(pd)["per_success"], waste(nv)["per_success"]) if pd and nv else nan,
        "queue_peak_vs_clean": ratio(healthy_peak(pd)[0], clean_peak) if pd else nan,
        "naive_queue_peak_vs_clean": ratio(healthy_peak(nv)[0], clean_peak) if nv else nan,
        "hung": float(hung(pd.records, slack_s)) if pd else nan,
        "slow_share_10s": slow_share(pd, pd.slow_at + 10, pd.slow_end) if pd else nan,
        # moved off a worker that went unhealthy before their first token, and that first token
        # came later than REROUTE_BOUND_S after (the router's histogram; target 0)
        "rerouted_late": (lambda n, w: n - w)(*rerouted_within(pd.metrics)) if pd else nan,
        "clean_slo": (
            sum(meets_slo(x, slo_ttft_s, slo_tpot_s) for x in cl.records) / max(len(cl.records), 1)
            if cl
            else nan
        ),
    }


def valid(fig: dict) -> bool:
    """Was the machine quiet enough for this repetition (see VALID_CLEAN_SLO)? No clean run: yes."""
    c = fig.get("clean_slo", float("nan"))
    return math.isnan(c) or c >= VALID_CLEAN_SLO


def _fmt(name: str, v: float) -> str:
    if name in ("hung", "rerouted_late"):
        return str(int(v)) if v == v else "nan"
    return f"{v:.3f}" if name in ("slow_share_10s", "clean_slo") else f"{v:.2f}"


def summary_line(fig: dict) -> str:
    return "faults " + " ".join(f"{n}={_fmt(n, fig[n])}" for n in FIGURES)


def mean_figures(reps: list[dict]) -> dict:
    """Mean over the valid repetitions (hung and rerouted_late: the sum, as each is a miss); over
    all of them when none is valid (the line then says so through its clean_slo)."""
    reps = [r for r in reps if valid(r)] or reps
    out = {}
    for n in FIGURES:
        vals = [v for r in reps if (v := r.get(n, float("nan"))) == v]
        summed = n in ("hung", "rerouted_late")  # counts of misses
        out[n] = (sum(vals) if summed else sum(vals) / len(vals)) if vals else float("nan")
    return out


def spread_line(reps: list[dict]) -> str:
    parts = []
    for n in FIGURES:
        vals = [v for r in reps if (v := r.get(n, float("nan"))) == v]
        if vals:
            parts.append(f"{n} {_fmt(n, sum(vals) / len(vals))} [{_fmt(n, min(vals))}, {_fmt(n, max(vals))}]")
    return "; ".join(parts) + f" (n={len(reps)})"
