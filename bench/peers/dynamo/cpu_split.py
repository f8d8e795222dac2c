"""Where each system's CPU goes in the side by side: per second idle, per request, per output token.

    .venv/bin/python bench/peers/dynamo/cpu_split.py [--requests 300] [--rounds 2] [--idle-s 20]

`run.py` reports one CPU figure per run (the front's and the workers' CPU-seconds over the
load), which cannot say whether a system spends more per request (parse, route, admission,
prefill bookkeeping, KV events), per relayed token, or in the background (timers, health and
Stats polls, runtime threads) whatever the load. This starts each system exactly as `run.py`
does (4 workers, kv routing, the same model folder and engine flags), measures its processes'
CPU while idle for `--idle-s`, then sends the side by side's x4 load (the Mooncake trace's first
`--requests`, prompts / 8) twice per round: once with every request's output cut to 1 token, once
with the trace's lengths. With n requests, T output tokens and D seconds of load per run:

    cpu(run) = idle_rate * D + n * per_request + T * per_token

The two runs give per_token = (cpu_full - cpu_one - idle_rate * (D_full - D_one)) / (T_full - n)
and per_request = (cpu_one - idle_rate * D_one) / n - per_token, for the front (Dynamo's frontend,
pdmesh's router) and the workers (summed), averaged over `--rounds` (the systems alternate
within a round, so a drifting machine load hits both). The background term assumes a timer's
wake-up costs the same under load as idle; under load a loop that is awake anyway pays less for
it, so the background figure is an upper bound of what it adds to a run.

Prints the CPU model and load; last line
`cpu_split front_per_request_ratio=.. front_per_token_ratio=.. workers_per_request_ratio=..
workers_per_token_ratio=.. idle_front_ratio=.. idle_workers_ratio=..` (pdmesh / Dynamo; the
other figures in ms and us on the lines above).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.loadgen import WorkItem, run_load
from bench.machine import cpu_model
from bench.peers.dynamo import run as D
from bench.profile_front_dynamo import side_by_side_load

SYSTEMS = ("dynamo", "pdmesh")


@dataclasses.dataclass(frozen=True)
class Sample:
    """The CPU-seconds of one run's front and workers, and what the run was."""

    front_s: float
    workers_s: float
    requests: int
    tokens: int
    duration_s: float


@dataclasses.dataclass(frozen=True)
class Split:
    """One part (front or workers) of one system: ms per idle second, per request, us per token."""

    idle_ms_per_s: float
    per_request_ms: float
    per_token_us: float


def split(idle_per_s: float, one: Sample, full: Sample, part: str) -> Split:
    """Solve cpu = idle * D + n * per_request + T * per_token from a 1-token and a full run."""
    c1, cf = getattr(one, part), getattr(full, part)
    if full.tokens <= one.tokens:
        raise ValueError("the full run must have more output tokens than the 1-token run")
    per_token = (cf - c1 - idle_per_s * (full.duration_s - one.duration_s)) / (full.tokens - one.tokens)
    per_request = (c1 - idle_per_s * one.duration_s - per_token * one.tokens) / one.requests
    return Split(idle_per_s * 1e3, per_request * 1e3, per_token * 1e6)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def one_token(items: list[WorkItem]) -> list[WorkItem]:
    return [dataclasses.replace(it, max_tokens=1) for it in items]


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(front, workers) CPU-seconds between two `Deployment.cpu()` readings."""
    front = sum(after[k] - before[k] for k in after if k != "workers")
    return front, after["workers"] - before["workers"]


def measure(dep: D.Deployment, items: list[WorkItem], timeout_s: float) -> Sample:
    span = items[-1].arrival_s
    before, t0 = dep.cpu(), time.monotonic()
    recs = asyncio.run(
        run_load(
            items,
            D.HttpClient(dep.url, D.MODEL_NAME),
            max_requests=len(items),
            max_duration_s=span + 1.0,
            timeout_s=timeout_s,
        )
    )
    duration, after = time.monotonic() - t0, dep.cpu()
    failed = sum(not r.ok for r in recs)
    if failed:
        raise RuntimeError(f"{dep.system}: {failed} of {len(items)} requests failed")
    front, workers = cpu_delta(before, after)
    return Sample(
        front_s=front,
        workers_s=workers,
        requests=len(items),
        tokens=sum(it.max_tokens for it in items),
        duration_s=duration,
    )


def idle_rates(dep: D.Deployment, seconds: float) -> tuple[float, float]:
    """CPU-seconds per second of the front and of the workers with nothing sent."""
    before, t0 = dep.cpu(), time.monotonic()
    time.sleep(seconds)  # a bench measuring an idle interval, not a synchronisation
    after, dt = dep.cpu(), time.monotonic() - t0
    front, workers = cpu_delta(before, after)
    return front / dt, workers / dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300, help="first N requests of the x4 load")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds of idle CPU per system and round")
    p.add_argument("--settle-s", type=float, default=5.0, help="seconds after start-up before measuring")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--dynamo-venv", type=Path, default=D.HERE / ".venv")
    a = p.parse_args(argv)
    dyn_python = a.dynamo_venv / "bin" / "python"
    if not dyn_python.exists():
        print(f"no Dynamo venv at {a.dynamo_venv}: run bench/peers/dynamo/setup.sh first", file=sys.stderr)
        return 2
    full = side_by_side_load(a.requests)
    one = one_token(full)
    print(f"cpu: {cpu_model()}; load avg {os.getloadavg()[0]:.1f}")
    print(
        f"{len(full)} requests over {full[-1].arrival_s:.1f} s (the side by side's x4 load), "
        f"{sum(i.max_tokens for i in full)} output tokens; the same with 1 token each; "
        f"{a.rounds} rounds, idle {a.idle_s:g} s"
    )
    parts = ("front_s", "workers_s")
    splits: dict[tuple[str, str], list[Split]] = {}
    with tempfile.TemporaryDirectory(prefix="cpu-split-") as tmp:
        folder = Path(tmp) / "model"
        D.write_folder(folder, D.DEFAULT_VOCAB)
        setup = D.Setup(4, 16, 16384, 1.0, 256, 8192, folder, dyn_python)
        for rnd in range(a.rounds):
            for system in SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]:
                workdir = Path(tmp) / f"{rnd}-{system}"
                workdir.mkdir()
                dep = (D.start_dynamo if system == "dynamo" else D.start_pdmesh)(setup, "kv", workdir)
                try:
                    # Start-up's own work (first polls, caches) stays out of the idle figure.
                    time.sleep(a.settle_s)
                    idle = dict(zip(parts, idle_rates(dep, a.idle_s), strict=True))
                    s_one = measure(dep, one, a.timeout_s)
                    s_full = measure(dep, full, a.timeout_s)
                finally:
                    dep.stop()
                for part in parts:
                    sp = split(idle[part], s_one, s_full, part)
                    splits.setdefault((system, part), []).append(sp)
                    print(
                        f"  round {rnd + 1} {system:6s} {part[:-2]:7s}: idle {sp.idle_ms_per_s:5.1f} ms/s, "
                        f"per request {sp.per_request_ms:5.2f} ms, per token {sp.per_token_us:6.1f} us "
                        f"(CPU {getattr(s_one, part):.2f} s with 1 token, {getattr(s_full, part):.2f} s full; "
                        f"load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )

    def mean(system: str, part: str, field: str) -> float:
        return statistics.fmean(getattr(s, field) for s in splits[(system, part)])

    print("\nmeans over rounds (front = Dynamo's frontend / pdmesh's router; workers summed)")
    print(f"{'':16s}{'idle ms/s':>10s}{'ms/request':>12s}{'us/token':>10s}")
    for part in parts:
        for system in SYSTEMS:
            print(
                f"{system:7s}{part[:-2]:9s}{mean(system, part, 'idle_ms_per_s'):10.1f}"
                f"{mean(system, part, 'per_request_ms'):12.2f}{mean(system, part, 'per_token_us'):10.1f}"
            )
    summary = {}
    for part, name in (("front_s", "front"), ("workers_s", "workers")):
        for field, key in (("per_request_ms", "per_request"), ("per_token_us", "per_token")):
            summary[f"{name}_{key}_ratio"] = ratio(mean("pdmesh", part, field), mean("dynamo", part, field))
    for part, name in (("front_s", "front"), ("workers_s", "workers")):
        summary[f"idle_{name}_ratio"] = ratio(
            mean("pdmesh", part, "idle_ms_per_s"), mean("dynamo", part, "idle_ms_per_s")
        )
    print("cpu_split " + " ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
