"""The GPU-regime disaggregation study (issue 19): `python bench/disagg.py --engine sim [--quick]`.

Method: the event model of bench/disagg_sim.py (NOT the sim engine's worker
processes, which cannot run 8 workers x 15 deployments x a rate sweep on 2
shared cores; see its docstring for what is shared with the product: the
timing profiles, the scheduler's policy, and the conditional rule itself,
`DisaggregationPolicy(DisaggConfig())` on `PathRates`, run unchanged).

Fleet: 8 simulated GPU instances of a profile (services/model/profiles.json;
`splitwise-h100-llama70b` is one Llama-2-70B TP4 *instance* of 4 H100s, as
Splitwise measured it; `llmd-h100-llama3-8b` is one H100). Deployments at
equal instance count: aggregated (8 workers, every prefill local),
disaggregated at every P:D split 1:7..7:1 (every prefill remote), conditional
at the same splits (the product's default rule). KV links: NVLink 450 GB/s a
direction (H100 NVLink 4, 900 GB/s bidirectional) and RDMA 50 GB/s (one 400
Gb/s ConnectX-7 NIC per GPU, as in DGX H100).

Workloads (lengths in tokens, Poisson arrivals at each rate):
  mix       the long-prompt mix at GPU scale: 90% prompts U[128,512], 10% U[4096,8192], 128 out
  azure     the Azure LLM conversation trace's lengths (bench/traces/azure_conv_2023.csv), unscaled
  mooncake  the Mooncake conversation trace's lengths and prefix hash_ids (512-token units)
  agent     16 agent sessions over a 4,096-token shared system+tools context, each with its own
            4,096-token task context growing 512 tokens a turn; outputs U[16,64]

SLOs (bench/disagg.py's, Splitwise's relative definition): TTFT <= 3x unloaded, TPOT <= 1.5x
unloaded; goodput = the highest rate up to which >= 90% of requests meet both (bisected).
Outputs: bench/results/disagg_gpu.txt (this run's table), disagg_gpu_splits.json (the best
P:D split per profile, link and workload, for the planner), disagg_gpu_<profile>_<link>_<workload>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.disagg_sim import UNIT, Spec, goodput, unloaded_ttft_s
from bench.machine import cpu_model
from bench.traces import default_trace_path, load_azure, load_mooncake
from services.model.timing import TimingProfile, load_profile
from services.planner.split_table import TABLE_PATH, SplitTable

RESULTS = Path(__file__).resolve().parent / "results"
GPUS = 8
LINKS = {"nvlink": 450.0, "rdma": 50.0}  # GB/s a direction
PROFILES = ("splitwise-h100-llama70b", "llmd-h100-llama3-8b")
WORKLOADS = ("mix", "azure", "mooncake", "agent")
METHOD = (
    "method: event model (bench/disagg_sim.py) on the sim engine's timing profiles, the scheduler's "
    "policy and the product's DisaggregationPolicy(DisaggConfig()) + PathRates; not engine processes"
)


def mix_specs(n: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    return [
        Spec(rng.randint(4096, 8192) if rng.random() < 0.10 else rng.randint(128, 512), 128) for _ in range(n)
    ]


def azure_specs(n: int, seed: int) -> list[Spec]:
    reqs = load_azure(default_trace_path("azure"))
    start = random.Random(seed).randrange(0, max(1, len(reqs) - n))
    return [Spec(max(1, r.input_len), max(2, r.output_len)) for r in reqs[start : start + n]]


def mooncake_specs(n: int, seed: int) -> list[Spec]:
    reqs = load_mooncake(default_trace_path("mooncake"))
    start = random.Random(seed).randrange(0, max(1, len(reqs) - n))
    return [Spec(r.input_len, max(2, r.output_len), tuple(r.hash_ids)) for r in reqs[start : start + n]]


def agent_specs(n: int, seed: int, sessions: int = 16) -> list[Spec]:
    rng = random.Random(seed)
    shared = tuple(range(4096 // UNIT))  # one system + tools context for every agent
    ids = iter(range(10_000, 10**9))
    hist = {s: [next(ids) for _ in range(4096 // UNIT)] for s in range(sessions)}
    out = []
    for _ in range(n):
        s = rng.randrange(sessions)
        units = (*shared, *hist[s])
        out.append(Spec(len(units) * UNIT + rng.randint(0, UNIT - 1), rng.randint(16, 64), units))
        hist[s].append(next(ids))  # the turn's tool output joins the session's context
        if len(hist[s]) > 48:  # a session that grew past ~28k tokens starts over
            hist[s] = [next(ids) for _ in range(4096 // UNIT)]
    return out


SPECS = {"mix": mix_specs, "azure": azure_specs, "mooncake": mooncake_specs, "agent": agent_specs}


def capacity_guess(prof: TimingProfile, specs: list[Spec], gpus: int = GPUS) -> float:
    """Requests/s the fleet could roughly serve: GPU-seconds per request at batch 32."""
    per = [
        unloaded_ttft_s(prof, s.prompt) + s.output * prof.decode_ms(32, 32 * s.prompt) / 32 / 1000
        for s in specs
    ]
    return gpus / (sum(per) / len(per))


def study(
    prof: TimingProfile, specs: list[Spec], rates: list[float], seed: int, refine: int, gpus: int = GPUS
) -> dict[str, object]:
    agg, agg_curve, _ = goodput(prof, 0, gpus, "agg", specs, rates, seed, refine=refine)
    out: dict[str, object] = {"agg": agg, "curves": {"agg": agg_curve}, "splits": {}}
    best = {"disagg": (0.0, None, None), "cond": (0.0, None, None)}
    for p in range(1, gpus):
        for mode in ("disagg", "cond"):
            g, curve, dec = goodput(prof, p, gpus - p, mode, specs, rates, seed, refine=refine)
            out["splits"][f"{mode} {p}:{gpus - p}"] = {"goodput": g, "decisions": dec}
            if g > best[mode][0] or best[mode][1] is None:
                best[mode] = (g, f"{p}:{gpus - p}", curve)
    for mode, (g, split, curve) in best.items():
        out[mode], out[f"{mode}_split"] = g, split
        out["curves"][f"{mode} {split}"] = curve
    return out


def plot(name: str, title: str, curves: dict[str, list[tuple[float, float]]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        ax.plot([r / GPUS for r, _ in curve], [a * 100 for _, a in curve], marker="o", label=label)
    ax.axhline(90, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("request rate per GPU instance (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title, fontsize=8)
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"disagg_gpu_{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cpu_mix_specs(n: int, seed: int) -> list[Spec]:
    """bench/disagg.py's CPU long-prompt mix: 90% 64-256 tokens, 10% 2,048-2,304, 32 out."""
    rng = random.Random(seed)
    return [
        Spec(rng.randint(2048, 2304) if rng.random() < 0.10 else rng.randint(64, 256), 32) for _ in range(n)
    ]


def cpu_azure_specs(n: int, seed: int) -> list[Spec]:
    """bench/disagg.py's CPU azure workload: the trace's lengths / 4."""
    return [Spec(max(1, round(s.prompt / 4)), max(2, round(s.output / 4))) for s in azure_specs(n, seed)]


def cpu_check(n: int, seed: int) -> list[str]:
    """The same rule on the CPU profile (`cpu-small-bfloat16`, measured from the torch engine) at the
    CPU study's 2 workers: agg 2, disagg and cond 1:1. Same event model, same defaults."""
    prof = load_profile("cpu-small-bfloat16")
    rows = []
    for w, make in (("mix", cpu_mix_specs), ("azure", cpu_azure_specs)):
        specs = make(n, seed)
        cap = capacity_guess(prof, specs, gpus=2)
        rates = [round(cap * x, 4) for x in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5)]
        res = study(prof, specs, rates, seed + 1, refine=4, gpus=2)
        best = max(res["agg"], res["disagg"])
        rows.append(
            f"cpu-small-bfloat16 (2 workers) {w:<6} agg={res['agg']:.3f} disagg={res['disagg']:.3f} "
            f"cond={res['cond']:.3f} req/s cond/best={res['cond'] / best if best else float('inf'):.2f} "
            f"cond/agg={res['cond'] / res['agg'] if res['agg'] else float('inf'):.2f}"
        )
        print(rows[-1], flush=True)
    return rows


def robustness(rows: list[tuple[str, str, str, str]], n: int, seed: int, repeats: int) -> list[str]:
    """The rows where cond lost at the best split, again with attainment pooled over `repeats`
    arrival seeds (goodput from one seed's curve turns on single noisy points), at that split."""
    out = []
    for pname, link, w, split in rows:
        prof = replace(load_profile(pname), kv_bandwidth_gbps=LINKS[link])
        specs = SPECS[w](n, seed)
        rates = [round(capacity_guess(prof, specs) * x, 4) for x in (0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5)]
        p, d = (int(x) for x in split.split(":"))
        g = {
            m: goodput(prof, pp, dd, m, specs, rates, seed + 1, refine=4, repeats=repeats)[0]
            for m, pp, dd in (("agg", 0, GPUS), ("disagg", p, d), ("cond", p, d))
        }
        out.append(
            f"{pname:<24} {link:<6} {w:<9} split {split} x{repeats} seeds: agg={g['agg'] / GPUS:.3f} "
            f"disagg={g['disagg'] / GPUS:.3f} cond={g['cond'] / GPUS:.3f} "
            f"cond/disagg={g['cond'] / g['disagg'] if g['disagg'] else float('inf'):.2f}"
        )
        print(out[-1], flush=True)
    return out


def write_planner_table(splits: dict) -> None:
    """The planner's copy of the best splits: the winners only (services/planner/split_table.py)."""
    keep = ("best_disagg_split", "best_cond_split", "goodput_per_instance")
    compact = {
        p: {ln: {w: {k: row[k] for k in keep} for w, row in ws.items()} for ln, ws in links.items()}
        for p, links in splits.items()
    }
    doc = {"_doc": f"written by `bench/disagg.py --engine sim`; {METHOD}", "instances": GPUS, "best": compact}
    TABLE_PATH.write_text(json.dumps(doc, indent=2) + "\n")


def merge(tags: list[str], extra: list[str]) -> None:
    """The parts of a sweep run apart (`--tag`) as one: disagg_gpu.txt, disagg_gpu_splits.json
    and the planner's table, rows in the order of `tags`; `extra`: lines to append (cpu_check)."""
    head, rows, rest, best = None, [], [], {}
    for tag in tags:
        lines = (RESULTS / f"disagg_gpu{tag}.txt").read_text().splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith("profile "))
        head = head or lines[: at + 1]
        body = lines[at + 1 :]
        cut = next((i for i, ln in enumerate(body) if not ln.strip()), len(body))
        rows += body[:cut]
        tail = body[cut:]
        # The part's own split table is rebuilt below from the merged JSON.
        stop = next((i for i, ln in enumerate(tail) if ln.startswith("best P:D split")), len(tail))
        rest += [ln for ln in tail[:stop] if ln.strip()]
        doc = json.loads((RESULTS / f"disagg_gpu_splits{tag}.json").read_text())
        for prof, links in doc["best"].items():
            for link, ws in links.items():
                best.setdefault(prof, {}).setdefault(link, {}).update(ws)
    assert head is not None
    split_text = SplitTable.from_doc({"instances": GPUS, "best": best}).render()
    out = [*head, *rows]
    if rest:
        out += ["", *rest]
    if extra:
        out += ["", *extra]
    out += ["", "best P:D split per workload (the planner's table, services/planner/split_table.py):"]
    out += split_text.splitlines()
    (RESULTS / "disagg_gpu.txt").write_text("\n".join(out) + "\n")
    (RESULTS / "disagg_gpu_splits.json").write_text(
        json.dumps({"_doc": METHOD, "instances": GPUS, "best": best}, indent=2) + "\n"
    )
    write_planner_table(best)
    print("\n".join(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="sim")
    ap.add_argument("--quick", action="store_true", help="the long-prompt mix, 70B, RDMA only")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--links", default=",".join(LINKS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-check", action="store_true", help="also the CPU profile at 2 workers")
    ap.add_argument(
        "--tag",
        default="",
        help="write disagg_gpu<TAG>.txt / _splits<TAG>.json and no planner table (a part of the sweep run apart)",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="seeds pooled when re-checking rows where cond lost (0: skip)"
    )
    ap.add_argument(
        "--merge",
        default=None,
        help="comma-separated tags of parts run apart: write the whole sweep's files from them and exit",
    )
    args = ap.parse_args(argv)
    n = args.requests or (300 if args.quick else 600)
    if args.merge:
        merge(args.merge.split(","), cpu_check(n, args.seed) if args.cpu_check else [])
        return 0
    profiles = ["splitwise-h100-llama70b"] if args.quick else args.profiles.split(",")
    links = ["rdma"] if args.quick else args.links.split(",")
    workloads = ["mix"] if args.quick else args.workloads.split(",")
    grid = (
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0]
        if not args.quick
        else [0.2, 0.4, 0.6, 0.8, 1.0, 1.5]
    )
    lines = [
        f"disagg_gpu: {GPUS} instances, requests/point={n}, SLO TTFT<=3x TPOT<=1.5x unloaded, goodput at "
        f">=90% attainment (bisected); {METHOD}",
    ]
    lines.append(
        f"cpu: {cpu_model()} x{os.cpu_count()} (an event model: the CPU sets only how long it takes)"
    )
    print("\n".join(lines), flush=True)
    header = (
        f"{'profile':<24} {'link':<6} {'workload':<9} {'agg':>7} {'disagg':>7} {'split':>5} {'cond':>7} "
        f"{'split':>5} {'cond/best':>9} {'cond/agg':>8}  (goodput req/s per instance)"
    )
    table, splits, quick, lost = [header], {}, None, []
    for pname in profiles:
        base = load_profile(pname)
        for link in links:
            prof = replace(base, kv_bandwidth_gbps=LINKS[link])
            for w in workloads:
                specs = SPECS[w](n, args.seed)
                cap = capacity_guess(prof, specs)
                rates = [round(cap * x, 4) for x in grid]
                res = study(prof, specs, rates, args.seed + 1, refine=3 if args.quick else 4)
                best = max(res["agg"], res["disagg"])
                cb = res["cond"] / best if best else float("inf")
                ca = res["cond"] / res["agg"] if res["agg"] else float("inf")
                row = (
                    f"{pname:<24} {link:<6} {w:<9} {res['agg'] / GPUS:>7.3f} {res['disagg'] / GPUS:>7.3f} "
                    f"{res['disagg_split']:>5} {res['cond'] / GPUS:>7.3f} {res['cond_split']:>5} {cb:>9.2f} {ca:>8.2f}"
                )
                print(row, flush=True)
                table.append(row)
                splits.setdefault(pname, {}).setdefault(link, {})[w] = {
                    "best_disagg_split": res["disagg_split"],
                    "best_cond_split": res["cond_split"],
                    "goodput_per_instance": {
                        "agg": res["agg"] / GPUS,
                        "disagg": res["disagg"] / GPUS,
                        "cond": res["cond"] / GPUS,
                    },
                    "all_splits": {k: v["goodput"] / GPUS for k, v in res["splits"].items()},
                    "cond_decisions_at_goodput": res["splits"][f"cond {res['cond_split']}"]["decisions"],
                }
                plot(
                    f"{pname}_{link}_{w}",
                    f"{pname}, {link} {LINKS[link]:g} GB/s, {w}: TTFT<=3x, TPOT<=1.5x unloaded",
                    res["curves"],
                )
                if cb < 1.0:
                    lost.append((pname, link, w, res["disagg_split"]))
                if w == "mix" and quick is None:
                    quick = (res, cb, ca)
    if lost and args.repeats > 1 and not args.quick:
        table += ["", "rows where cond lost, re-checked at the best disagg split, seeds pooled:"]
        table += robustness(lost, n, args.seed, args.repeats)
    if args.cpu_check:
        table += ["", *cpu_check(n, args.seed)]
    if splits:
        split_text = SplitTable.from_doc({"instances": GPUS, "best": splits}).render()
        table += ["", "best P:D split per workload (the planner's table, services/planner/split_table.py):"]
        table += split_text.splitlines()
        print("\n" + "\n".join(table[-1 - len(split_text.splitlines()) :]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    if not args.quick:
        txt, js = RESULTS / f"disagg_gpu{args.tag}.txt", RESULTS / f"disagg_gpu_splits{args.tag}.json"
        txt.write_text("\n".join(lines + table) + "\n")
        js.write_text(json.dumps({"_doc": METHOD, "instances": GPUS, "best": splits}, indent=2) + "\n")
        if not args.tag:
            write_planner_table(splits)
        print(f"wrote {txt}, {js}" + ("" if args.tag else f" and {TABLE_PATH}"))
    if quick is not None:
        res, cb, ca = quick
        print(
            f"disagg_gpu goodput_agg={res['agg'] / GPUS:.3f} goodput_disagg={res['disagg'] / GPUS:.3f} "
            f"goodput_cond={res['cond'] / GPUS:.3f} cond_vs_best={cb:.2f} cond_vs_agg={ca:.2f} "
            f"best_split={res['cond_split']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
