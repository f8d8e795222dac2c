"""Soak: steady load with periodic worker churn, watched for drift and leaks (issue 10, item 6).

A mesh of router + kvtransfer + 1 prefill + 2 decode workers (tiny built-in
model, one torch thread each; workers join the router at run time, so a
restarted one simply registers again) takes open-loop Poisson load through
`bench.loadgen.run_load` for `--minutes`. Every `--churn-every-s` one worker
(decode-0, prefill-0, decode-1 in turn) is stopped, alternately with SIGTERM
(drain) and SIGKILL, and a new process takes its place. Every 5 s the RSS of
every process is read from /proc/<pid>/status. At the end the load stops, the
mesh is given time to go idle, and every worker must hold no block: free ==
total, no lease held.

Reported:
  - p99 end-to-end latency of successful requests per window (`--window-s`),
    and its drift: last window / first window;
  - RSS per process from its first sample after the first window (its own
    start for later incarnations) to its last, in MiB; `rss_drift_mb_max` is
    the largest growth among processes that lived at least half the run;
  - leaked blocks once idle (must be 0), leases still held, router in-flight;
  - the error rate and errors by gRPC code (churn makes some: a request that
    was on a killed worker with nowhere to go, a refused stream while a
    drained worker leaves).

    python bench/soak.py                 10 minutes
    python bench/soak.py --quick         1 minute, churn every 20 s
Last line: `soak minutes=.. requests=.. ok=.. err_rate=.. errors=.. p99_first_ms=..
p99_last_ms=.. p99_drift=.. rss_drift_mb_max=.. leaked_blocks=.. leases_held=.. churns=..`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import numpy as np

from bench.loadgen import WorkItem, poisson_arrivals, run_load
from bench.stats import RequestRecord
from pdmesh.launcher import Launcher, RunningService, ServiceSpec, flags
from pdmesh.v1 import decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2

READY = {
    "router": "pdmesh.v1.RouterService",
    "kvtransfer": "pdmesh.v1.KvTransferService",
    "prefill": "pdmesh.v1.PrefillService",
    "decode": "pdmesh.v1.DecodeService",
}
ENGINE = flags(engine_preset="tiny", engine_num_threads=1)
CHURN_ORDER = (("decode", 0), ("prefill", 0), ("decode", 1))


@dataclass
class SoakMesh:
    workdir: str
    kv_transport: str = "nixl"
    launcher: Launcher = field(init=False)
    current: dict[tuple[str, int], RunningService] = field(default_factory=dict)
    incarnations: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.launcher = Launcher(self.workdir)

    def start(self) -> None:
        self._start("kvtransfer", 0, flags(expiry_interval_s=0.5))
        router = flags(
            health_interval_s=0.5, stats_interval_s=0.5, resubscribe_max_s=1.0, stall_timeout_s=3.0
        )
        self._start("router", 0, router)
        for role, i in (("prefill", 0), ("decode", 0), ("decode", 1)):
            self._start(role, i, self._worker_flags(role, i))
        self.launcher.wait_ready(self.current[("router", 0)])

    def _worker_flags(self, role: str, i: int) -> tuple[str, ...]:
        return (
            flags(
                worker_id=f"{role}-{i}",
                kvtransfer_address=self.current[("kvtransfer", 0)].address,
                kv_transport=self.kv_transport,
                router_address=self.current[("router", 0)].internal_address,
                router_lease_ms=3000,
            )
            + ENGINE
            + (
                flags(kv_lease_ms=5000, max_local_prefill_tokens=64)
                if role == "decode"
                else flags(lease_ttl_s=5)
            )
        )

    def _start(self, role: str, i: int, args: tuple[str, ...]) -> RunningService:
        n = self.incarnations[(role, i)]
        self.incarnations[(role, i)] += 1
        name = f"{role}-{i}" + (f".{n}" if n else "")
        svc = self.launcher.start(ServiceSpec(name, f"services.{role}.main", args, ready_service=READY[role]))
        if role == "router":  # not ready before a decode worker joins: its port is enough for now
            deadline = time.monotonic() + 120
            while not svc.port_file.exists():
                if svc.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"router did not start:\n{svc.log_tail()}")
                time.sleep(0.05)  # polling a child's port file
            ports = json.loads(svc.port_file.read_text())
            svc.port, svc.internal_port = ports["port"], ports["internal_port"]
        else:
            self.launcher.wait_ready(svc)
        self.current[(role, i)] = svc
        return svc

    def churn(self, role: str, i: int, sig: int) -> None:
        """Stop one worker (SIGTERM drains, SIGKILL does not) and start its replacement."""
        old = self.current[(role, i)]
        if sig == signal.SIGTERM:
            self.launcher.stop(old, grace_s=30)
        else:
            self.launcher.kill(old.spec.name, sig)
        self._start(role, i, self._worker_flags(role, i))

    def pids(self) -> dict[str, int]:
        return {s.spec.name: s.proc.pid for s in self.current.values() if s.proc.poll() is None}

    def workers(self) -> list[tuple[str, RunningService]]:
        return [(r, s) for (r, _), s in self.current.items() if r in ("prefill", "decode")]

    def close(self) -> None:
        self.launcher.close(grace_s=10)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def worker_stats(role: str, svc: RunningService) -> worker_pb2.StatsResponse:
    with grpc.insecure_channel(svc.address) as ch:
        stub = (
            decode_pb2_grpc.DecodeServiceStub(ch)
            if role == "decode"
            else prefill_pb2_grpc.PrefillServiceStub(ch)
        )
        return stub.Stats(worker_pb2.StatsRequest(), timeout=10)


def leaks(mesh: SoakMesh, timeout_s: float = 60.0) -> tuple[int, int, int]:
    """(blocks not free, leases held, router in flight) once idle, or when `timeout_s` ran out."""
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = held = 0
        for role, svc in mesh.workers():
            s = worker_stats(role, svc)
            blocks += s.info.kv_capacity_blocks - s.load.free_blocks
            held += s.leases.held
        with grpc.insecure_channel(mesh.current[("router", 0)].internal_address) as ch:
            r = router_pb2_grpc.RouterServiceStub(ch).Stats(
                router_pb2.RouterServiceStatsRequest(), timeout=10
            )
        if (blocks == held == r.inflight == 0) or time.monotonic() > deadline:
            return blocks, held, r.inflight
        time.sleep(0.5)  # polling the workers until idle, with a deadline


def workload(minutes: float, rate: float, seed: int) -> list[WorkItem]:
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rate, int(minutes * 60 * rate * 1.2) + 10, seed)
    items = []
    for t in arrivals:
        length = int(rng.choice([16, 48, 96, 200, 400]))
        items.append(
            WorkItem(t, tuple(int(x) for x in rng.integers(0, 256, length)), int(rng.choice([16, 32, 64])))
        )
    return items


async def sample_rss(mesh: SoakMesh, out: list[tuple[float, str, float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.monotonic()
        for name, pid in mesh.pids().items():
            if (mb := rss_mb(pid)) is not None:
                out.append((now, name, mb))
        try:
            await asyncio.wait_for(stop.wait(), 5.0)
        except TimeoutError:
            pass


async def churn_loop(mesh: SoakMesh, every_s: float, log: list[str], stop: asyncio.Event) -> None:
    n = 0
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            pass
        role, i = CHURN_ORDER[n % len(CHURN_ORDER)]
        sig = signal.SIGTERM if n % 2 == 0 else signal.SIGKILL
        t0 = time.monotonic()
        await asyncio.to_thread(mesh.churn, role, i, sig)
        log.append(
            f"churn {n}: {role}-{i} {signal.Signals(sig).name}, replaced in {time.monotonic() - t0:.1f} s"
        )
        print(log[-1], flush=True)
        n += 1


def p99_ms(records: list[RequestRecord]) -> float:
    e2e = [r.e2e_s for r in records if r.ok and r.e2e_s is not None]
    return float(np.percentile(e2e, 99) * 1000) if e2e else float("nan")


def rss_report(
    samples: list[tuple[float, str, float]], t0: float, warm_s: float, run_s: float
) -> tuple[list[str], float]:
    """Lines per process and the largest growth among processes that lived >= half the run."""
    by_name: dict[str, list[tuple[float, float]]] = {}
    for t, name, mb in samples:
        by_name.setdefault(name, []).append((t, mb))
    lines, worst = [], 0.0
    for name, series in sorted(by_name.items()):
        start = next(((t, mb) for t, mb in series if t - t0 >= warm_s), series[0])
        end = series[-1]
        lived = end[0] - series[0][0]
        growth = end[1] - start[1]
        lines.append(
            f"  {name:14s} rss {start[1]:7.1f} -> {end[1]:7.1f} MiB ({growth:+6.1f}) over {lived / 60:4.1f} min"
        )
        if lived >= run_s / 2:
            worst = max(worst, growth)
    return lines, worst


def windows(records: list[RequestRecord], window_s: float) -> list[tuple[int, int, float]]:
    """(requests, errors, p99 e2e ms) per window of send time."""
    out = []
    n = int(max((r.send_s for r in records), default=0) // window_s) + 1
    for w in range(n):
        inside = [r for r in records if w * window_s <= r.send_s < (w + 1) * window_s]
        out.append((len(inside), sum(not r.ok for r in inside), p99_ms(inside)))
    return out


async def soak(args: argparse.Namespace) -> int:
    mesh = SoakMesh(tempfile.mkdtemp(prefix="pdmesh-soak-"), args.kv_transport)
    print(f"starting the mesh in {mesh.workdir}", flush=True)
    mesh.start()
    samples: list[tuple[float, str, float]] = []
    churns: list[str] = []
    stop = asyncio.Event()
    try:
        t0 = time.monotonic()
        sampler = asyncio.create_task(sample_rss(mesh, samples, stop))
        churner = asyncio.create_task(churn_loop(mesh, args.churn_every_s, churns, stop))
        run_s = args.minutes * 60
        records = await run_load(
            workload(args.minutes, args.rate, args.seed),
            f"grpc://{mesh.current[('router', 0)].address}",
            max_requests=1_000_000,
            max_duration_s=run_s,
            timeout_s=args.timeout_s,
        )
        stop.set()
        await churner
        await sampler
        blocks, held, inflight = await asyncio.to_thread(leaks, mesh)
    finally:
        mesh.close()
    ok = [r for r in records if r.ok]
    errors = Counter(r.error_code for r in records if not r.ok)
    per_window = windows(records, args.window_s)
    print(f"\n{'window':>8} {'requests':>9} {'errors':>7} {'p99 e2e ms':>11}")
    for i, (n, e, p) in enumerate(per_window):
        print(f"{i * args.window_s:7.0f}s {n:9d} {e:7d} {p:11.1f}")
    rss_lines, rss_worst = rss_report(samples, t0, args.window_s, run_s)
    print("\n".join(rss_lines))
    full = [p for n, _, p in per_window if n and not np.isnan(p)]
    first, last = (full[0], full[-1]) if full else (float("nan"), float("nan"))
    err_text = ",".join(f"{k}:{v}" for k, v in sorted(errors.items())) or "none"
    print(
        f"soak minutes={args.minutes:g} requests={len(records)} ok={len(ok)} "
        f"err_rate={1 - len(ok) / max(len(records), 1):.4f} errors={err_text} "
        f"p99_first_ms={first:.1f} p99_last_ms={last:.1f} p99_drift={last / first:.2f} "
        f"rss_drift_mb_max={rss_worst:.1f} leaked_blocks={blocks} leases_held={held} "
        f"router_inflight={inflight} churns={len(churns)}"
    )
    return 0 if blocks == held == inflight == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="1 minute, churn every 20 s, 15 s windows")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--churn-every-s", type=float, default=60.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="deadline of each request")
    ap.add_argument("--kv-transport", default="nixl", choices=("nixl", "grpc"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes, args.churn_every_s, args.window_s = 1.0, 20.0, 15.0
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
