"""Faults study (issue 18, item 5): what pdmesh's defences save when workers get slow, hang or flap.

Real processes: one router and N (4) `sim` decode workers (services/engine/sim:
the real scheduler and block manager, pass times from the dynamo-mocker
profile, run `SPEEDUP` times real speed; no prefix cache, so every request's
useful work is prompt + output tokens). Workers join the router at run time
(membership, short leases), so a restarted one registers again. One open-loop
Poisson trace (same arrivals, lengths and prompts in every run) is sent by
this process's clients (bench/faults_client.py) three times, each on a fresh
mesh:

  clean    pdmesh's router, no fault (the baseline);
  pdmesh   pdmesh's router, everything on, clients retrying as the OpenAI SDK
           does (2 retries, exponential backoff + jitter, retry-after hints);
  naive    the same router with the breaker, retry budget, migration (and,
           once they exist, outlier ejection and hedging) off, and clients
           that retry any error at once until their deadline: a plain proxy
           with default retries.

Router flags for each live in ROUTERS, in one place.

The schedule (bench process drives it, by PID), faults on distinct workers in turn:
  slow     worker 0 is 5x slower for `slow_s` (60 s; --quick 20 s): every
           engine pass takes 5x its modeled time (the sim engine's
           --engine-sim-slowdown-file, written by the driver: a degraded GPU;
           the process keeps answering probes and Stats). Until session 10 this
           was a SIGSTOP/SIGCONT duty cycle (80 of every 100 ms stopped), which
           the sim engine made up for after each SIGCONT (a pass that overran
           its modeled time while stopped counts as done): the worker's TTFT
           and ITL rose 1.3-1.5x, not 5x.
  stop     worker 1 SIGSTOPped for 10 s, then SIGCONT.
  kill     worker 2 SIGKILLed, then restarted at once (same worker id).
  flap     worker 3 up 5 s, down 5 s (SIGSTOP) for `flap_s` (60 s; --quick 20 s).

Reported per run: goodput (requests/s that succeed within the SLOs: TTFT <=
SLO_TTFT_S and TPOT <= SLO_TPOT_S, inside the deadline), TTFT p99 of
successes, tokens computed per successful request (the router's computed
tokens / successes), wasted tokens (computed - useful, useful = prompt +
output of successes) and their causes, the peak queue of the workers not
under a fault at that moment (waiting + running from their Stats, polled every
0.25 s; faulted workers are excluded from their fault's start to 3 s after it
heals), requests still unfinished 1 s after their deadline (hung), and the
slow worker's share of new requests over time (worker Stats' requests_total,
2 s bins; plot in bench/results/faults_share.png).

Waste by cause: "migrated" and "router-retried" are successes' computed
tokens beyond their useful ones (by whether the stream migrated); "client
retries" and "failed" are the clients' estimates of attempts that failed
(prompt + tokens received, whether the client then retried it or gave up);
"other" is what the router counted beyond those (its own estimates of lost
attempts; hedges until the router reports them apart).

Last line: `faults goodput_vs_clean=.. waste_vs_naive=.. queue_peak_vs_clean=..
naive_queue_peak_vs_clean=.. hung=.. slow_share_10s=..` (pdmesh's figures;
waste per successful request; slow_share_10s = the slow worker's share of new
requests from 10 s after its slowdown to its end). Targets: >= 0.9, <= 0.3,
<= 2, (shown), 0, < 1/(2N).

    python bench/faults.py            ~12 min
    python bench/faults.py --quick    ~5 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # `python bench/faults.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import numpy as np

from bench.faults_client import NAIVE, SDK, Logical, RetryingClient, RetryPolicy
from bench.machine import cpu_model
from pdmesh.launcher import Launcher, LaunchError, RunningService, ServiceSpec, flags
from pdmesh.v1 import decode_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2

RESULTS = Path(__file__).resolve().parent / "results"
N_WORKERS = 4
SPEEDUP = 0.2  # sim GPUs 5x slower than the profile: ~30 ms per decode pass, ~1 s per request
MAX_NUM_SEQS = 4  # per worker: a backlog shows as waiting requests, not as a bigger batch
SLOWDOWN = 5.0  # the slow fault: every pass of worker 0 takes this many times its modeled time
RATE = 8.0  # requests/s offered: about 55% of the 4 workers' capacity, ~75% of 3 (a cascade needs little headroom)
DEADLINE_S = 10.0  # per request, from its arrival, all attempts included
SLO_TTFT_S = 1.0
SLO_TPOT_S = 0.1
HUNG_SLACK_S = 1.0
READ_TIMEOUT_S = 4.0  # both clients abandon an attempt with no message for this long (4x the SLO TTFT)
POLL_S = 0.25
HEAL_GRACE_S = 3.0

# Intervals both routers share: a plain proxy probes its upstreams too.
COMMON = dict(
    preset="tiny",
    block_size=16,
    health_interval_s=0.25,
    health_timeout_s=0.5,
    stats_interval_s=0.25,
    housekeeping_interval_s=0.25,
    resubscribe_max_s=1.0,
    log_level="warning",
)
# The one place that says what each router runs with. Switches that only exist once issue 18's
# mechanisms are on main (outlier ejection, hedging, re-route of unstarted requests, retried
# arrivals, the breaker's and budget's own off switches) are in SWITCHES and used only when the
# router's --help lists them; LEGACY says how the naive router turns a mechanism off without one.
ROUTERS: dict[str, tuple[dict, RetryPolicy]] = {
    "pdmesh": (
        dict(
            stall_timeout_s=2.0,  # mid-stream stall -> migrate
            first_token_timeout_s=3.0,  # no first token -> fail over (3x SLO TTFT; a cap once predicted)
        ),
        SDK,
    ),
    "naive": (
        dict(
            max_migrations=0,  # no migration ...
            stall_timeout_s=0,  # ... nor stall detection
            first_token_timeout_s=0,  # no per-try timeout (a plain proxy's default)
        ),
        NAIVE,
    ),
}
SWITCHES: dict[str, dict] = {
    "pdmesh": dict(
        outlier_enabled="true",
        hedge_enabled="true",  # off by default; "everything on"
        reroute_unstarted="true",
        retry_attach_enabled="true",
        first_token_timeout_floor_s=1.0,  # the predicted-TTFT timeout may go down to 1 s (cap 3 s)
    ),
    "naive": dict(
        breaker_enabled="false",
        retry_budget_enabled="false",
        outlier_enabled="false",
        hedge_enabled="false",
        reroute_unstarted="false",
        retry_attach_enabled="false",
        first_token_timeout_multiple=0,
    ),
}
LEGACY: dict[str, dict] = {  # used where the router has no breaker_enabled / retry_budget_enabled
    "breaker_enabled": dict(
        breaker_consecutive_failures=1_000_000, breaker_failure_rate=1.0, breaker_min_requests=1_000_000
    ),
    "retry_budget_enabled": dict(retry_budget_retry_ratio=1.0, retry_budget_min_retries_per_second=1e6),
}


def router_flags(kind: str, known: set[str]) -> dict:
    """COMMON + ROUTERS[kind] + the SWITCHES this router knows (+ LEGACY for those it does not)."""
    out = {**COMMON, **ROUTERS[kind][0]}
    for name, value in SWITCHES[kind].items():
        if name in known:
            out[name] = value
        elif kind == "naive":
            out.update(LEGACY.get(name, {}))
    if kind == "pdmesh" and "first_token_timeout_multiple" in known:
        # The first-token timeout follows the worker's predicted TTFT (x multiple, >= floor);
        # first_token_timeout_s is then only its cap, below the clients' 10 s deadline.
        out["first_token_timeout_s"] = 8.0
    return out


def known_router_flags() -> set[str]:
    """Flag names (snake_case) of the router on this checkout, from its --help."""
    text = subprocess.run(
        [sys.executable, "-m", "services.router.main", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    return {m.replace("-", "_") for m in re.findall(r"--([a-z0-9-]+)", text)}


@dataclass(frozen=True)
class Schedule:
    warmup_s: float = 15.0
    slow_s: float = 60.0
    stop_s: float = 10.0
    flap_s: float = 60.0
    flap_period_s: float = 5.0
    gap_s: float = 8.0
    tail_s: float = 10.0

    @property
    def slow_at(self) -> float:
        return self.warmup_s

    @property
    def stop_at(self) -> float:
        return self.slow_at + self.slow_s + self.gap_s

    @property
    def kill_at(self) -> float:
        return self.stop_at + self.stop_s + self.gap_s

    @property
    def flap_at(self) -> float:
        return self.kill_at + 2 * self.gap_s  # a restart takes seconds

    @property
    def span_s(self) -> float:
        return self.flap_at + self.flap_s + self.tail_s


QUICK = Schedule(warmup_s=8.0, slow_s=20.0, flap_s=20.0, gap_s=5.0, tail_s=6.0)


# ---- trace -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int


def trace(span_s: float, seed: int) -> list[Item]:
    rng = np.random.default_rng(seed)
    n = int(span_s * RATE * 1.5) + 10
    t = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / RATE, n - 1))])
    out = []
    for a in t[t < span_s]:
        length = int(rng.choice([48, 96, 160, 256, 384]))
        out.append(
            Item(float(a), tuple(int(x) for x in rng.integers(1, 250, length)), int(rng.choice([16, 32, 48])))
        )
    return out


# ---- the mesh --------------------------------------------------------------------------


@dataclass
class Mesh:
    launcher: Launcher
    router_kind: str
    router_args: dict
    worker_args: dict = field(default_factory=dict)  # extra decode worker flags (--late-after-s)
    router: RunningService | None = None
    workers: dict[int, RunningService] = field(default_factory=dict)
    incarnation: dict[int, int] = field(default_factory=dict)

    def start(self) -> None:
        args = flags(**self.router_args, metrics_port=0)
        self.router = self.launcher.start(
            ServiceSpec(
                f"router-{self.router_kind}",
                "services.router.main",
                args,
                ready_service="pdmesh.v1.RouterService",
            )
        )
        deadline = time.monotonic() + 120
        while not self.router.port_file.exists():  # polling a child's port file, with a deadline
            if self.router.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router did not start:\n{self.router.log_tail()}")
            time.sleep(0.05)
        ports = json.loads(self.router.port_file.read_text())
        self.router.port, self.router.internal_port = ports["port"], ports["internal_port"]
        self.router.metrics_port = ports.get("metrics_port")
        for i in range(N_WORKERS):
            self.start_worker(i, wait=False)
        for w in self.workers.values():
            self.launcher.wait_ready(w, 300)
        self.launcher.wait_ready(self.router, 120)
        wait_serving(self, N_WORKERS)

    def start_worker(self, i: int, wait: bool = True) -> RunningService:
        n = self.incarnation.get(i, 0)
        self.incarnation[i] = n + 1
        assert self.router is not None
        args = flags(
            worker_id=f"decode-{i}",
            router_address=self.router.internal_address,
            router_lease_ms=2000,
            engine_backend="sim",
            engine_preset="tiny",
            engine_sim_profile="dynamo-mocker",
            engine_sim_speedup=SPEEDUP,
            engine_num_blocks=4096,
            engine_block_size=16,
            engine_max_num_seqs=MAX_NUM_SEQS,
            engine_enable_prefix_caching=0,
            engine_sim_slowdown_file=str(self.slowdown_file(i)),
            log_level="warning",
            **self.worker_args,
        )
        name = f"{self.router_kind}-decode-{i}" + (f".{n}" if n else "")
        svc = self.launcher.start(
            ServiceSpec(name, "services.decode.main", args, ready_service="pdmesh.v1.DecodeService")
        )
        self.workers[i] = svc
        if wait:
            self.launcher.wait_ready(svc, 300)
        return svc

    def slowdown_file(self, i: int) -> Path:
        """Worker i's sim slowdown factor (services/engine/sim/runner.py's SlowdownFile)."""
        return self.launcher.workdir / f"decode-{i}.slowdown"

    def slow_down(self, i: int, factor: float) -> None:
        path = self.slowdown_file(i)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{factor:g}\n")
        tmp.replace(path)  # atomic: the worker never reads half a number

    def signal(self, i: int, sig: int) -> None:
        proc = self.workers[i].proc
        if proc.poll() is None:
            proc.send_signal(sig)

    def close(self) -> None:
        for w in self.workers.values():  # a stopped process cannot take SIGTERM
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
        self.launcher.close(grace_s=10)


def router_stub(mesh: Mesh, internal: bool = True):
    assert mesh.router is not None
    addr = mesh.router.internal_address if internal else mesh.router.address
    ch = grpc.insecure_channel(addr)
    return ch, router_pb2_grpc.RouterServiceStub(ch)


def wait_serving(mesh: Mesh, n: int, timeout_s: float = 120.0) -> None:
    ch, stub = router_stub(mesh)
    with ch:
        deadline = time.monotonic() + timeout_s
        while True:
            resp = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
            if sum(w.health == router_pb2.WORKER_HEALTH_SERVING for w in resp.workers) >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"router sees {len(resp.workers)} workers, not {n} serving")
            time.sleep(0.1)  # polling the router's view, with a deadline


def router_stats(mesh: Mesh) -> router_pb2.RouterServiceStatsResponse:
    ch, stub = router_stub(mesh)
    with ch:
        return stub.Stats(router_pb2.RouterServiceStatsRequest(), timeout=10)


# Router metrics read at the start and end of a run (those that exist on this checkout).
METRICS = (
    "pdmesh_router_wasted_tokens_by_cause",
    "pdmesh_router_hedges",
    "pdmesh_router_reroutes",
    "pdmesh_router_outlier_transitions",
    "pdmesh_router_retried_arrivals",
    "pdmesh_router_breaker_transitions",
    "pdmesh_router_reroute_first_token_seconds",  # a histogram: its buckets, count and sum
)


def scrape(mesh: Mesh) -> dict[str, float]:
    """{'name{labels}': value} of the METRICS counters on the router's /metrics."""
    assert mesh.router is not None
    if not mesh.router.metrics_port:
        return {}
    url = f"http://127.0.0.1:{mesh.router.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(METRICS):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{")[0]
        if name.endswith("_total"):
            out[key.replace("_total", "", 1)] = float(value)
        elif name.endswith(("_bucket", "_count")):  # histograms
            out[key] = float(value)
    return out


# ---- fault driver and Stats poller (threads; times on the run clock) ---------------------


@dataclass
class Windows:
    """When each worker was under a fault (run-clock seconds), filled in by the driver."""

    faults: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    restart_s: float = float("nan")
    log: list[str] = field(default_factory=list)

    def add(self, i: int, start: float, end: float) -> None:
        self.faults.setdefault(i, []).append((start, end))

    def faulted(self, i: int, t: float) -> bool:
        return any(a <= t <= b + HEAL_GRACE_S for a, b in self.faults.get(i, ()))


def drive(
    mesh: Mesh, sched: Schedule, clock, stop: threading.Event, win: Windows, closed: threading.Event
) -> None:
    """The fault schedule. Returns only once the mesh is closed (`closed`): a worker it restarted
    dies with the thread that started it (services/common/server.py's die_with_parent uses
    PR_SET_PDEATHSIG, which fires when the creating *thread* exits)."""
    try:
        _schedule(mesh, sched, clock, stop, win)
    finally:
        closed.wait(600)


def _schedule(mesh: Mesh, sched: Schedule, clock, stop: threading.Event, win: Windows) -> None:
    def until(t: float) -> bool:
        """Wait until run time t; False if the run was stopped."""
        return not stop.wait(max(0.0, t - clock()))

    if not until(sched.slow_at):
        return
    t0 = clock()
    mesh.slow_down(0, SLOWDOWN)
    stop.wait(max(0.0, sched.slow_at + sched.slow_s - clock()))
    mesh.slow_down(0, 1.0)
    win.add(0, t0, clock())
    win.log.append(f"slow decode-0 {t0:.1f}-{clock():.1f} s, every pass {SLOWDOWN:g}x its modeled time")
    if not until(sched.stop_at):
        return
    t0 = clock()
    mesh.signal(1, signal.SIGSTOP)
    stop.wait(sched.stop_s)
    mesh.signal(1, signal.SIGCONT)
    win.add(1, t0, clock())
    win.log.append(f"stop decode-1 {t0:.1f}-{clock():.1f} s")
    if not until(sched.kill_at):
        return
    t_kill = clock()
    mesh.signal(2, signal.SIGKILL)
    mesh.workers[2].proc.wait()
    # Started here (this thread outlives the mesh), waited for beside: the flap must not wait on it.
    svc = mesh.start_worker(2, wait=False)

    def restarted() -> None:
        try:
            mesh.launcher.wait_ready(svc, 300)
            what = "ready"
        except LaunchError as e:
            what = f"not ready ({str(e).splitlines()[0]})"
        win.restart_s = clock() - t_kill
        win.add(2, t_kill, clock())
        win.log.append(f"kill decode-2 at {t_kill:.1f} s, restarted ({what}) in {win.restart_s:.1f} s")

    threading.Thread(target=restarted, daemon=True).start()
    if not until(sched.flap_at):
        return
    t0 = clock()
    while clock() < sched.flap_at + sched.flap_s and not stop.is_set():  # up 5 s, down 5 s
        c = clock()
        if not until(c + sched.flap_period_s):
            break
        mesh.signal(3, signal.SIGSTOP)
        stop.wait(sched.flap_period_s)
        mesh.signal(3, signal.SIGCONT)
        win.add(3, c + sched.flap_period_s, clock())
    mesh.signal(3, signal.SIGCONT)
    win.log.append(f"flap decode-3 {t0:.1f}-{clock():.1f} s")


@dataclass(frozen=True)
class Sample:
    t: float
    worker: int
    incarnation: str  # address: requests_total restarts with a new process
    waiting: int
    running: int
    requests_total: int
    computed: int = 0  # the engine's own count: prompt + decode positions computed since start


def _sample(clock, i: int, w: RunningService, s) -> Sample:
    computed = s.counters.prompt_tokens_computed + s.counters.decode_tokens_computed
    return Sample(clock(), i, w.address, s.load.waiting, s.load.running, s.requests_total, computed)


def poll(mesh: Mesh, clock, stop: threading.Event, out: list[Sample]) -> None:
    channels: dict[str, grpc.Channel] = {}
    try:
        while not stop.is_set():
            tick = clock()
            for i, w in list(mesh.workers.items()):
                if not w.port or w.proc.poll() is not None:
                    continue
                ch = channels.get(w.address) or channels.setdefault(
                    w.address, grpc.insecure_channel(w.address)
                )
                try:
                    s = decode_pb2_grpc.DecodeServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=POLL_S)
                except grpc.RpcError:
                    continue  # stopped or gone: no sample
                out.append(_sample(clock, i, w, s))
            stop.wait(max(0.0, tick + POLL_S - clock()))
    finally:
        for ch in channels.values():
            ch.close()


# ---- one run ---------------------------------------------------------------------------


async def send(items: list[Item], address: str, policy: RetryPolicy, clock, seed: int) -> list[Logical]:
    client = RetryingClient(address, policy, seed, READ_TIMEOUT_S)
    run_id = uuid.uuid4().hex[:8]
    records: list[Logical] = []
    tasks: list[asyncio.Task] = []
    try:
        for i, it in enumerate(items):
            while (delay := it.arrival_s - clock()) > 0:  # pacing the open-loop arrivals
                await asyncio.sleep(delay)
            rec = Logical(i, it.arrival_s, len(it.prompt), it.max_tokens, DEADLINE_S)
            records.append(rec)
            tasks.append(asyncio.create_task(client.run(rec, it.prompt, clock, run_id)))
        if tasks:  # every request ends by its deadline; the rest are hung (cancelled here, counted)
            await asyncio.wait(tasks, timeout=DEADLINE_S + HUNG_SLACK_S + 5)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    return records


def leaked_blocks(mesh: Mesh, clock, samples: list[Sample], timeout_s: float = 60.0) -> int:
    """Blocks not free once idle (no prefix cache: an idle worker holds none). The last
    Stats of each worker go into `samples`: the engines' final computed-token counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        held, last = 0, []
        for i, w in mesh.workers.items():
            if not w.port or w.proc.poll() is not None:
                continue
            with grpc.insecure_channel(w.address) as ch:
                s = decode_pb2_grpc.DecodeServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)
            held += s.info.kv_capacity_blocks - s.load.free_blocks + s.load.running + s.load.waiting
            last.append(_sample(clock, i, w, s))
        if held == 0 or time.monotonic() > deadline:
            samples.extend(last)
            return held
        time.sleep(0.25)  # polling until idle, with a deadline


def run_one(
    name: str,
    router_kind: str,
    router_args: dict,
    faulted: bool,
    sched: Schedule,
    items: list[Item],
    workdir: str,
    seed: int = 0,
    worker_args: dict | None = None,
):
    from bench.faults_report import RunResult

    launcher = Launcher(Path(workdir) / name)
    mesh = Mesh(launcher, router_kind, router_args, dict(worker_args or {}))
    stop, closed = threading.Event(), threading.Event()
    win = Windows()
    samples: list[Sample] = []
    try:
        t_start = time.perf_counter()
        mesh.start()
        print(
            f"  {name}: mesh up in {time.perf_counter() - t_start:.0f} s (logs {launcher.workdir})",
            flush=True,
        )
        stats0, metrics0 = router_stats(mesh), scrape(mesh)
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        threads = [threading.Thread(target=poll, args=(mesh, clock, stop, samples), daemon=True)]
        if faulted:
            threads.append(
                threading.Thread(target=drive, args=(mesh, sched, clock, stop, win, closed), daemon=True)
            )
        for t in threads:
            t.start()
        assert mesh.router is not None
        records = asyncio.run(send(items, mesh.router.address, ROUTERS[router_kind][1], clock, seed=seed + 1))
        stop.set()
        threads[0].join(60)
        for i in mesh.workers:
            mesh.signal(i, signal.SIGCONT)
        leaked = leaked_blocks(mesh, clock, samples)  # idle first: every request's cost is in the ledger
        stats1, metrics1 = router_stats(mesh), scrape(mesh)
    finally:
        stop.set()
        mesh.close()
        closed.set()
    for line in win.log:
        print(f"    {line}")
    slow = win.faults.get(0, [(0.0, 0.0)])[0]
    res = RunResult(name, records, samples, win, stats0, stats1, sched.span_s, leaked, slow[0], slow[1])
    res.metrics = {k: v - metrics0.get(k, 0.0) for k, v in metrics1.items() if v - metrics0.get(k, 0.0)}
    return res


# ---- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from bench import faults_report as rep

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="compressed schedule (~5 min in all)")
    ap.add_argument("--runs", default="clean,pdmesh,naive", help="subset of clean,pdmesh,naive")
    ap.add_argument("--seed", type=int, default=0, help="trace and client seed of the first repetition")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="repetitions (seeds seed, seed+1, ...); the last line is their mean",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SIDE.FLAG=VALUE",
        help="override a router flag of one side, e.g. pdmesh.hedge_enabled=false (repeatable)",
    )
    ap.add_argument(
        "--late-after-s",
        type=float,
        default=SLO_TTFT_S,
        help="every run's workers: --engine-queue-late-after-s (on time first; 0 = first come, first served)",
    )
    ap.add_argument(
        "--late-max-s",
        type=float,
        default=0.0,
        help="every run's workers: --engine-queue-late-max-s (a late request overdue after this "
        "takes its place again; 0 = no bound)",
    )
    ap.add_argument("--out", default="", help="results file name under bench/results/")
    args = ap.parse_args(argv)
    worker_args = {"engine_queue_late_after_s": args.late_after_s} if args.late_after_s else {}
    if args.late_max_s:
        worker_args["engine_queue_late_max_s"] = args.late_max_s
    sched = QUICK if args.quick else Schedule()
    items = trace(sched.span_s, args.seed)
    lines: list[str] = []

    def out(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    out(f"faults study ({'quick' if args.quick else 'full'}); CPU: {cpu_model()} x{os.cpu_count()}")
    out(
        f"  {N_WORKERS} sim decode workers (dynamo-mocker, speedup {SPEEDUP:g}, max_num_seqs {MAX_NUM_SEQS}, "
        f"no prefix cache); Poisson {RATE:g} req/s for {sched.span_s:.0f} s = {len(items)} requests (seed {args.seed}), "
        f"prompts 48-384, outputs 16-48 tokens; deadline {DEADLINE_S:g} s, client read timeout "
        f"{READ_TIMEOUT_S:g} s; SLO TTFT <= {SLO_TTFT_S:g} s, "
        f"TPOT <= {1000 * SLO_TPOT_S:g} ms; workers' queue: "
        + (
            f"on time first after {args.late_after_s:g} s"
            + (f", overdue after {args.late_max_s:g} s" if args.late_max_s else "")
            if args.late_after_s
            else "first come, first served"
        )
    )
    out(
        f"  schedule: decode-0 5x slower {sched.slow_at:g}-{sched.slow_at + sched.slow_s:g} s; decode-1 "
        f"SIGSTOP {sched.stop_at:g}-{sched.stop_at + sched.stop_s:g} s; decode-2 SIGKILL at {sched.kill_at:g} s "
        f"+ restart; decode-3 flapping {sched.flap_period_s:g} s up / {sched.flap_period_s:g} s down "
        f"{sched.flap_at:g}-{sched.flap_at + sched.flap_s:g} s"
    )
    known = known_router_flags()
    args_of = {kind: router_flags(kind, known) for kind in ROUTERS}
    for item in args.set:
        side_flag, _, value = item.partition("=")
        side, _, flag = side_flag.partition(".")
        if side not in args_of or not flag or flag not in known:
            ap.error(f"--set {item!r}: need SIDE.FLAG=VALUE with SIDE in {sorted(args_of)} and a router flag")
        args_of[side][flag] = value
    head = subprocess.run(
        ["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True
    ).stdout.strip()
    out(f"  checkout: {head[:100]}")
    for kind, (_, policy) in ROUTERS.items():
        out(f"  {kind} router flags: {' '.join(flags(**args_of[kind]))}; clients: {policy}")
    missing = sorted({n for sw in SWITCHES.values() for n in sw} - known)
    if missing:
        out(f"  not on this checkout (so not used): {', '.join('--' + m.replace('_', '-') for m in missing)}")
    workdir = tempfile.mkdtemp(prefix="bench-faults-")
    plan = {"clean": ("pdmesh", False), "pdmesh": ("pdmesh", True), "naive": ("naive", True)}
    names = args.runs.split(",")
    per_rep: list[dict[str, float]] = []
    results: dict[str, rep.RunResult] = {}
    for k in range(args.repeat):
        seed = args.seed + k
        items = trace(sched.span_s, seed)
        # Repetition k runs pdmesh and naive in alternating order, so that a machine getting
        # busier (or quieter) through the study does not favour one side.
        order = (
            names
            if k % 2 == 0
            else [n for n in names if n == "clean"] + [n for n in reversed(names) if n != "clean"]
        )
        if args.repeat > 1:
            out(f"  repetition {k + 1}/{args.repeat}: seed {seed}, order {','.join(order)}")
        results = {}
        for name in order:
            kind, faulted = plan[name]
            out(f"  {name}: load average before {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
            results[name] = res = run_one(
                name, kind, args_of[kind], faulted, sched, items, workdir, seed, worker_args
            )
            for line in rep.summary_lines(res, SLO_TTFT_S, SLO_TPOT_S, HUNG_SLACK_S):
                out(line)
        fig = rep.figures(results, SLO_TTFT_S, SLO_TPOT_S, HUNG_SLACK_S)
        per_rep.append(fig)
        if args.repeat > 1:
            out("  " + rep.summary_line(fig) + f" (repetition {k + 1}, seed {seed})")
        if not rep.valid(fig):
            out(
                f"  INVALID repetition: the fault-free run met its SLOs for {fig['clean_slo']:.2f} of requests "
                f"(< {rep.VALID_CLEAN_SLO}): the machine was too busy; left out of the mean"
            )
    RESULTS.mkdir(exist_ok=True)
    rep.plot_share(list(results.values()), N_WORKERS, RESULTS / "faults_share.png")
    out(f"  plot: {RESULTS / 'faults_share.png'} (last repetition)")
    if args.repeat > 1:
        out("  over repetitions, mean [min, max]: " + rep.spread_line(per_rep))
    out(rep.summary_line(rep.mean_figures(per_rep)))
    name = args.out or ("faults_quick.txt" if args.quick else "faults.txt")
    (RESULTS / name).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
