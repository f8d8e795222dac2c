"""Where the front's CPU goes: py-spy profiles of the router (gRPC and HTTP doors) and a decode worker at 8 streams (--streams).

Issue 16 asks for a profile before any change to the token path. This script
starts the processes the way `bench/routing.py` part 2 does (real processes on
loopback), drives 8 concurrent endless streams through them, and samples each
process with py-spy (`record --format raw`, so no flame graph viewer is
needed). It prints, per process, the functions with the most *self* samples
(where the CPU is spent), the inclusive share of a few families the issue
names (protobuf, grpc.aio, structlog, prometheus, detokenization, the request
flow), and the CPU microseconds each process spent per relayed message.

Three scenarios, each profiled separately:
- `grpc`: client -> router (gRPC) -> zero-cost fake decode worker (one token
  per message; the fake is bench/routing.py's), profiling the router;
- `http`: client -> the router's HTTP door (OpenAI SSE, --http-port, the
  gateway's app in the router process) -> the same fake, profiling the router;
- `gateway` (with `--gateway`, the front as it was before issue 16): client ->
  a separate gateway process -> router (gRPC) -> the fake, profiling both;
- `decode`: client -> router -> a real decode worker on the `sim` engine
  (tiny preset, time-compressed), profiling the decode worker.

Everything shares this machine's cores (client, fake, services, py-spy at
`--rate` Hz with --nonblocking): absolute rates are lower than without the
profiler; the shares are what this script is for.

Run: `python bench/profile_front.py [--seconds 8] [--rate 250] [--out DIR]`.
Raw profiles go to DIR (default bench/results/profiles/); the last line is
`profile_front router_us_per_msg=.. top_router=.. http_us_per_msg=.. top_http=.. [gateway_us_per_msg=..
top_gateway=..] decode_us_per_msg=.. top_decode=..` (us of CPU per relayed message or SSE event; with
--gateway, gateway_us_per_msg is the gateway and router processes together).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.machine import cpu_model
from bench.routing import HUGE, LONG, channel, router_request
from bench.routing import run_cpu_s as proc_cpu_s  # the scheduler's account, not clock ticks
from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import router_pb2_grpc

STREAMS = 8
TOKENS = 0  # tokens the last grpc_streams run received (a message may carry several)

# Families the issue names, matched on the frame's file path or function name (inclusive share).
FAMILIES = {
    "protobuf": ("google/protobuf", "_pb2"),
    "grpc": ("grpc/aio", "grpc/_cython", "cygrpc", "grpc/_"),
    "structlog/logging": ("structlog", "logging/__init__"),
    "prometheus": ("prometheus_client",),
    "detokenize": ("detokenizer", "tokenizer", "stop_text"),
    "tracing": ("opentelemetry", "tracing.py"),
    "asyncio/uvloop": ("asyncio/", "uvloop"),
    "starlette/uvicorn": ("starlette", "uvicorn", "httptools"),
    "sse/json": ("json/", "responses.py"),
}


def py_spy() -> str:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    return exe


NATIVE = True  # set from --python-only


def start_profile(pid: int, seconds: float, rate: int, out: Path) -> subprocess.Popen:
    cmd = [py_spy(), "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(rate)]
    # --native shows time inside uvloop, grpc's Cython/C-core and protobuf's upb (it needs to pause the process)
    cmd += ["-f", "raw", "-o", str(out)] + (["--native"] if NATIVE else ["--nonblocking"])
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


# Leaves that mean "this thread is waiting", which --native reports as samples too.
IDLE = (
    "epoll_wait",
    "epoll_pwait",
    "poll (",
    "select (",
    "pthread_cond",
    "sem_wait",
    "sem_timedwait",
    "futex",
    "nanosleep",
    "accept (",
    "recv (",
)


def idle(frame: str) -> bool:
    # unresolved libc addresses at the leaf are, in these services, futex waits of
    # gRPC's and the engine's worker threads (every such stack sits under a wait call)
    return frame.startswith(IDLE) or (frame.startswith("0x") and "libc.so" in frame)


def summarize(raw: Path, top: int = 15) -> dict:
    """Self and family shares of the busy samples in py-spy's collapsed stacks ('f1;f2 count' lines)."""
    self_counts: collections.Counter[str] = collections.Counter()
    fam_counts: collections.Counter[str] = collections.Counter()
    total = idle_n = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        if idle(frames[-1]):
            idle_n += count
            continue
        total += count
        self_counts[_no_line(frames[-1])] += count
        seen = set()
        for frame in frames:
            for fam, keys in FAMILIES.items():
                if fam not in seen and any(k in frame for k in keys):
                    seen.add(fam)
        for fam in seen:
            fam_counts[fam] += count
    total = max(total, 1)
    return {
        "samples": total,
        "idle": idle_n / max(total + idle_n, 1),
        "self": [(f, c / total) for f, c in self_counts.most_common(top)],
        "families": {f: fam_counts[f] / total for f in FAMILIES},
    }


def _no_line(frame: str) -> str:
    # "fn (path/file.py:123)" -> "fn (path/file.py)": one row per function, not per line
    return re.sub(r":\d+\)$", ")", frame)


def short(frame: str) -> str:
    # py-spy frames look like "function (path/to/file.py:123)"
    fn, _, where = frame.partition(" (")
    where = where.rstrip(")")
    parts = where.split("/")
    return f"{fn} ({'/'.join(parts[-2:])})"


def print_summary(name: str, s: dict, per: str) -> None:
    print(
        f"\n== {name}: {s['samples']} busy samples ({s['idle'] * 100:.0f}% of all were waits, left out); {per}"
    )
    print("  self share  function")
    for frame, share in s["self"]:
        print(f"  {share * 100:9.1f}%  {short(frame)}")
    fams = ", ".join(f"{f} {v * 100:.0f}%" for f, v in sorted(s["families"].items(), key=lambda kv: -kv[1]))
    print(f"  inclusive: {fams}")


# ---- load --------------------------------------------------------------------------


async def grpc_streams(address: str, seconds: float, max_tokens: int = LONG) -> int:
    """STREAMS streams through the router's gRPC door; each reopens a request of `max_tokens` until time is up."""
    global TOKENS
    msgs = TOKENS = 0
    stop = time.perf_counter() + seconds

    async def one() -> None:
        nonlocal msgs
        global TOKENS
        async with channel(address) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            while time.perf_counter() < stop:
                call = stub.Generate(router_request(max_tokens), timeout=600)
                async for m in call:
                    msgs += 1
                    TOKENS += len(m.delta.token_ids)
                    if time.perf_counter() >= stop:
                        call.cancel()
                        break

    await asyncio.gather(*(one() for _ in range(STREAMS)))
    return msgs


async def http_streams(base_url: str, seconds: float, model: str) -> int:
    """STREAMS SSE streams through the HTTP door (bench/loadgen.py's client), each cut off after `seconds`."""
    from bench.loadgen import OpenAIHttpClient, WorkItem
    from bench.stats import RequestRecord

    client = OpenAIHttpClient(base_url, model)
    item = WorkItem(0.0, tuple(range(1, 33)), LONG)
    recs = [RequestRecord(f"p{i}", 0.0, 0.0, len(item.prompt_ids), LONG) for i in range(STREAMS)]
    await asyncio.gather(*(client.generate(r, item, time.perf_counter, seconds) for r in recs))
    await client.close()
    return sum(len(r.token_times_s) for r in recs)


# ---- scenarios ---------------------------------------------------------------------------


LINK = True  # --no-link: the router calls Generate per request instead of DecodeService.Link


def router_args(workers: list[str]) -> tuple[str, ...]:
    return flags(
        decode_link=str(LINK).lower(),
        decode_workers=workers,
        policy="round_robin",
        max_model_len=HUGE,
        limits_max_tokens_limit=HUGE,
        limits_max_prompt_tokens=HUGE,
        admission_max_inflight=1024,
        stall_timeout_s=0,
        log_level="warning",
    )


def profiled(pids: dict[str, int], seconds: float, rate: int, out: Path, load) -> dict:
    cpu0 = {n: proc_cpu_s(p) for n, p in pids.items()}
    profs = {n: start_profile(p, seconds + 1, rate, out / f"{n}.raw") for n, p in pids.items()}
    t0 = time.perf_counter()
    msgs = asyncio.run(load(seconds))
    wall = time.perf_counter() - t0
    cpu = {n: proc_cpu_s(p) - cpu0[n] for n, p in pids.items()}
    for n, prof in profs.items():
        _, err = prof.communicate(timeout=60)
        if prof.returncode != 0:
            raise SystemExit(f"py-spy on {n} failed: {err.strip()[-400:]}")
    return {"msgs": msgs, "wall": wall, "cpu": cpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "profiles"))
    p.add_argument("--python-only", action="store_true", help="no --native frames (then --nonblocking)")
    p.add_argument(
        "--part", choices=("all", "router", "decode", "overhead"), default="all", help="scenarios to run"
    )
    p.add_argument("--requests", type=int, default=400, help="overhead: sequential 1-token requests")
    p.add_argument("--no-link", action="store_true", help="the router calls Generate per request")
    p.add_argument(
        "--gateway", action="store_true", help="also profile a separate gateway process (the old front)"
    )
    p.add_argument("--no-decode", action="store_true", help="skip the decode-worker scenario")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams of the router scenarios")
    a = p.parse_args(argv)
    global NATIVE, LINK, STREAMS
    STREAMS = a.streams
    NATIVE = not a.python_only
    LINK = not a.no_link
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"cpu: {cpu_model()} x{os.cpu_count()}; load avg {os.getloadavg()[0]:.1f}; streams {STREAMS}; "
        f"token path: {'Link' if LINK else 'Generate per request'}"
    )
    mode = "--native" if NATIVE else "--nonblocking"
    print(f"py-spy at {a.rate} Hz ({mode}), {a.seconds:.0f} s per scenario; raw profiles in {out}")
    results: dict[str, str] = {}
    with Launcher(tempfile.mkdtemp(prefix="bench-profile-")) as launcher:
        if a.part in ("all", "router"):
            front(a, launcher, out, results)
        if a.part in ("all", "decode") and not a.no_decode:
            decode_part(a, launcher, out, results)
        if a.part in ("all", "overhead"):
            overhead_part(a, launcher, out, results)
    print("profile_front " + " ".join(f"{k}={v}" for k, v in results.items()))
    return 0


def front(a, launcher: Launcher, out: Path, results: dict[str, str]) -> None:
    from services.gateway.launch import gateway_spec
    from services.gateway.launch import start_ready as gateway_start_ready

    fake = launcher.start_ready(
        ServiceSpec(
            "fake-decode", "bench.routing", ("--serve-fake",), ready_service="pdmesh.v1.DecodeService"
        )
    )
    router = launcher.start_ready(
        ServiceSpec(
            "router",
            "services.router.main",
            router_args([fake.address]),
            ready_service="pdmesh.v1.RouterService",
        )
    )
    r = profiled(
        {"router": router.proc.pid}, a.seconds, a.rate, out, lambda s: grpc_streams(router.address, s)
    )
    us = r["cpu"]["router"] / max(r["msgs"], 1) * 1e6
    s = summarize(out / "router.raw")
    print_summary(
        "router (gRPC door, zero-cost worker)",
        s,
        f"{r['msgs'] / r['wall']:.0f} msgs/s, {us:.0f} us CPU/msg",
    )
    results["router_us_per_msg"] = f"{us:.0f}"
    results["top_router"] = short(s["self"][0][0]).split(" ")[0] if s["self"] else "-"

    model = "builtin-tiny"
    door = launcher.start_ready(
        ServiceSpec(
            "router-http",
            "services.router.main",
            router_args([fake.address]) + flags(http_port=0),
            ready_service="pdmesh.v1.RouterService",
        )
    )
    r = profiled(
        {"router_door": door.proc.pid},
        a.seconds,
        a.rate,
        out,
        lambda s: http_streams(f"http://{door.http_address}", s, model),
    )
    hus = r["cpu"]["router_door"] / max(r["msgs"], 1) * 1e6
    sh = summarize(out / "router_door.raw")
    print_summary(
        "router's HTTP door (one process, zero-cost worker)",
        sh,
        f"{r['msgs'] / r['wall']:.0f} SSE events/s, {hus:.0f} us CPU/event",
    )
    results["http_us_per_msg"] = f"{hus:.0f}"
    results["top_http"] = short(sh["self"][0][0]).split(" ")[0] if sh["self"] else "-"
    launcher.stop(door)

    if a.gateway:
        gateway = gateway_start_ready(
            launcher, gateway_spec(router.address, extra=flags(log_level="warning"))
        )
        base = f"http://{gateway.address}"
        r = profiled(
            {"gateway": gateway.proc.pid, "router_http": router.proc.pid},
            a.seconds,
            a.rate,
            out,
            lambda s: http_streams(base, s, model),
        )
        gus = r["cpu"]["gateway"] / max(r["msgs"], 1) * 1e6
        rus = r["cpu"]["router_http"] / max(r["msgs"], 1) * 1e6
        per = f"{r['msgs'] / r['wall']:.0f} SSE events/s, gateway {gus:.0f} + router {rus:.0f} us CPU/event"
        sg = summarize(out / "gateway.raw")
        print_summary("gateway process in front of the router (before issue 16)", sg, per)
        print_summary("router behind the gateway", summarize(out / "router_http.raw"), per)
        results["gateway_us_per_msg"] = f"{gus + rus:.0f}"
        results["top_gateway"] = short(sg["self"][0][0]).split(" ")[0] if sg["self"] else "-"
        launcher.stop(gateway)


async def paired(base: str, other: str, n: int, direct: bool) -> tuple[list[float], list[float]]:
    """Whole-request times (ms) of n sequential 1-token requests to `base` and to `other`,
    alternating one each (so the machine's drifting load hits both alike), after 20 warm-up pairs."""
    from bench.routing import decode_request
    from pdmesh.v1 import decode_pb2_grpc

    times: tuple[list[float], list[float]] = ([], [])
    async with channel(base) as c0, channel(other) as c1:
        make = decode_pb2_grpc.DecodeServiceStub if direct else router_pb2_grpc.RouterServiceStub
        stubs = (make(c0), make(c1))
        for i in range(n + 20):
            for k, stub in enumerate(stubs):
                req = decode_request(1, i) if direct else router_request(1)
                t0 = time.perf_counter()
                async for _ in stub.Generate(req, timeout=30):
                    pass
                if i >= 20:
                    times[k].append((time.perf_counter() - t0) * 1000)
    return times


def overhead_part(a, launcher: Launcher, out: Path, results: dict[str, str]) -> None:
    """Issue 16 item 4: the decode worker's own cost per request at near-zero load. The sim
    engine at speedup 1e6 models ~0 ms of engine time (a 32-token prefill is ~ms / 1e6); the
    zero-cost fake (bench/routing.py) is the floor of a gRPC request from this client. Worker
    overhead = sim worker p50 - fake p50, direct and through one router."""
    import statistics

    fake = launcher.start_ready(
        ServiceSpec("fake-ovh", "bench.routing", ("--serve-fake",), ready_service="pdmesh.v1.DecodeService")
    )
    engine = flags(engine_backend="sim", engine_preset="tiny", engine_sim_speedup=1e6, engine_num_blocks=1024)
    sim = launcher.start_ready(
        ServiceSpec(
            "decode-ovh",
            "services.decode.main",
            flags(worker_id="decode-ovh", log_level="warning") + engine,
            ready_service="pdmesh.v1.DecodeService",
        )
    )
    r_fake = launcher.start_ready(
        ServiceSpec(
            "router-ovh-fake",
            "services.router.main",
            router_args([fake.address]),
            ready_service="pdmesh.v1.RouterService",
        )
    )
    r_sim = launcher.start_ready(
        ServiceSpec(
            "router-ovh-sim",
            "services.router.main",
            router_args([sim.address]),
            ready_service="pdmesh.v1.RouterService",
        )
    )
    n = a.requests
    cpu0 = proc_cpu_s(sim.proc.pid)
    t = dict(
        zip(
            ("fake_direct", "sim_direct"),
            asyncio.run(paired(fake.address, sim.address, n, True)),
            strict=True,
        )
    )
    sim_cpu_ms = (proc_cpu_s(sim.proc.pid) - cpu0) / (n + 20) * 1000
    t |= dict(
        zip(
            ("fake_router", "sim_router"),
            asyncio.run(paired(r_fake.address, r_sim.address, n, False)),
            strict=True,
        )
    )
    p50 = {k: statistics.median(v) for k, v in t.items()}
    print(f"\n== decode worker overhead at near-zero load ({n} sequential 1-token requests, sim x1e6)")
    for k, v in p50.items():
        print(f"  {k:12s} p50 {v:.3f} ms")
    # Median of the paired differences: robust to the load drifting during the run.
    direct = statistics.median(s - f for s, f in zip(t["sim_direct"], t["fake_direct"], strict=True))
    routed = statistics.median(s - f for s, f in zip(t["sim_router"], t["fake_router"], strict=True))
    print(
        f"  worker overhead beyond a zero-cost worker: direct {direct:.3f} ms, through the router "
        f"{routed:.3f} ms (target <= 1 ms); worker CPU {sim_cpu_ms:.3f} ms per request"
    )
    results["worker_overhead_ms"] = f"{direct:.3f}"
    results["worker_overhead_routed_ms"] = f"{routed:.3f}"
    results["worker_cpu_ms_per_request"] = f"{sim_cpu_ms:.3f}"


def decode_part(a, launcher: Launcher, out: Path, results: dict[str, str]) -> None:
    engine = flags(
        engine_backend="sim",
        engine_preset="tiny",
        engine_sim_speedup=1000.0,
        engine_num_blocks=8192,
        engine_max_num_seqs=64,
    )
    decode = launcher.start_ready(
        ServiceSpec(
            "decode",
            "services.decode.main",
            flags(worker_id="decode-0") + engine,
            ready_service="pdmesh.v1.DecodeService",
        )
    )
    router2 = launcher.start_ready(
        ServiceSpec(
            "router-sim",
            "services.router.main",
            router_args([decode.address]),
            ready_service="pdmesh.v1.RouterService",
        )
    )
    r = profiled(
        {"decode": decode.proc.pid},
        a.seconds,
        a.rate,
        out,
        lambda s: grpc_streams(router2.address, s, 512),
    )
    dus = r["cpu"]["decode"] / max(r["msgs"], 1) * 1e6
    dut = r["cpu"]["decode"] / max(TOKENS, 1) * 1e6
    sd = summarize(out / "decode.raw")
    print_summary(
        "decode worker (sim engine, x1000)",
        sd,
        f"{r['msgs'] / r['wall']:.0f} router msgs/s, {TOKENS / r['wall']:.0f} tokens/s, "
        f"{dus:.0f} us CPU/msg, {dut:.0f} us CPU/token",
    )
    results["decode_us_per_msg"] = f"{dus:.0f}"
    results["decode_us_per_token"] = f"{dut:.0f}"
    results["top_decode"] = short(sd["self"][0][0]).split(" ")[0] if sd["self"] else "-"


if __name__ == "__main__":
    raise SystemExit(main())
