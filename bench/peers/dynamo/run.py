"""pdmesh side by side with NVIDIA Dynamo: same trace, same rates, same client.

    .venv/bin/python bench/peers/dynamo/run.py            (default: ~8 minutes)
    .venv/bin/python bench/peers/dynamo/run.py --quick    (~1-2 minutes: x4, KV only, 120 requests)

Needs bench/peers/dynamo/setup.sh once (Dynamo 1.6.1 in its own venv, and the
model folder). Runs with the project's .venv; Dynamo's processes run with the
Dynamo venv's python. For each (policy, rate) and each system, in turn:

- Dynamo: `dynamo.frontend --router-mode kv|round-robin` plus N
  `dynamo.mocker --num-workers 1` processes (simulated vLLM-style engines with
  Dynamo's own perf model; one process each, like pdmesh's workers, so each
  has its own metrics page), no etcd/NATS (file discovery, TCP request plane,
  ZMQ events; ../shared/peers/dynamo.md);
- pdmesh: router (`kv_aware` | `round_robin`) + N decode workers on the `sim`
  backend with the `dynamo-mocker` timing profile (the mocker's formulas,
  services/model/profiles.json); the router process is pdmesh's whole front (gRPC
  and the OpenAI HTTP API it serves itself, --http-port), as Dynamo's frontend is.

Both get the same block size, KV blocks per worker, speedup, max_num_seqs and
token budget per pass, and load the same tokenizer folder. Every run starts
cold (fresh processes, empty caches) and is stopped by PID afterwards. The
load is the Mooncake conversation trace (bench/traces), lengths / L and
arrivals compressed by each rate factor, prompts synthesised from hash_ids
(shared ids = shared prefixes) over the folder's word ids, sent open-loop by
bench.loadgen's streaming /v1/completions client to each system's HTTP front.

Measured per run: TTFT and ITL p50/p99, TPOT, output tokens/s, prefix reuse
(cached prompt tokens / prompt tokens from each response's final usage,
`prompt_tokens_details.cached_tokens`: both systems report the engine's own
prefix-cache hit there; each system's own counters are printed next to it),
CPU seconds of each system's processes (Dynamo: frontend, mockers; pdmesh:
router, workers), the request balance over workers, and the mean
TTFT at each hop from the systems' own metrics (Dynamo: engines, frontend;
pdmesh: router flow, HTTP door, and of the door's the wait from a request's
parsed head to its handler running, with the share of requests waiting at most
1 / 5 / 25 ms: the trace's arrivals come in bursts of 3-16 at one instant, whose
set-ups run one after another on the router's one loop) next to the client's. Counters are read before and
after the load, so probes do not count. Before each load, a near-zero-load
probe (sequential requests with fresh 64-token prompts, 2 output tokens)
gives the TTFT beyond the modeled prefill time: each system's own overhead
(HTTP front, router, transport, worker loop). For pdmesh the same probe also
goes straight to a decode worker and to the router over gRPC, splitting that
overhead by hop; Dynamo's workers have no client API, so its router's own
share is read from its /metrics (`dynamo_router_overhead_total_ms`).

The machine's load average and the client's send lag are printed per run: on
a small shared machine they move the figures as much as the systems do.
Ends with the comparison table and one line `dynamo_vs_pdmesh key=value ...`
(Dynamo / pdmesh ratios: below 1 means Dynamo is lower), with
`cpu_front_ratio=` (pdmesh front CPU / Dynamo frontend CPU over all runs, goal
<= 1) and `overhead_ratio=` (pdmesh / Dynamo near-zero-load overhead, goal <= 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # `python bench/peers/dynamo/run.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np

from bench.loadgen import GrpcClient, OpenAIHttpClient, StreamClient, WorkItem, build_workload, run_load
from bench.machine import pin_threads
from bench.peers.dynamo.compare import (
    Row,
    balance,
    format_table,
    ideal_prefix_reuse,
    make_row,
    metric,
    parse_prometheus,
    summary_line,
)
from bench.peers.dynamo.make_model_folder import DEFAULT_VOCAB, FIRST_WORD_ID, write_folder
from bench.stats import RequestRecord, write_records
from bench.traces import VocabRange
from pdmesh.launcher import Launcher, ServiceSpec, flags
from services.model.timing import load_profile

HERE = Path(__file__).resolve().parent
MODEL_NAME = "dm"
PROFILE = "dynamo-mocker"
POLICIES = {"kv": ("kv", "kv_aware"), "round_robin": ("round-robin", "round_robin")}  # ours: (dynamo, pdmesh)


@dataclass(frozen=True)
class Setup:
    """What both systems are given, identically."""

    workers: int
    block_size: int
    num_blocks: int  # KV blocks per worker
    speedup: float
    max_num_seqs: int
    max_num_batched_tokens: int
    model_folder: Path
    dynamo_python: Path
    pdmesh_router_flags: tuple[str, ...] = ()  # extra router flags (experiments; none by default)
    pdmesh_routers: int = 1  # router processes on the same ports (SO_REUSEPORT), as `pdmesh up --routers N`


# ---- processes ------------------------------------------------------------------------------


def free_port(below: int | None = None) -> int:
    """A port nothing listens on now (the usual small race: it is bound again right after)."""
    if below is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = np.random.default_rng()
    for _ in range(200):
        port = int(rng.integers(20000, below))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {below}")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a live process; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name})"


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except OSError as e:
        return 0, str(e)


@dataclass
class Deployment:
    """A running system: its HTTP front, and the PIDs of its front and worker processes."""

    system: str
    url: str
    front_pids: dict[str, int]  # name -> PID of the processes in front of the workers
    worker_pids: list[int]
    workers: int
    stop: object  # () -> None, stops everything it started, by PID
    direct: str = ""  # grpc address of one worker (pdmesh only)
    router: str = ""  # grpc address of the router (pdmesh only)
    metrics_url: str = ""  # the front's /metrics (Dynamo)
    metrics_urls: list[str] = field(default_factory=list)  # pdmesh: each router process's page
    worker_metrics_urls: list[str] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each front process by name, and of all workers as "workers"."""
        return {
            **{k: cpu_s(p) for k, p in self.front_pids.items()},
            "workers": sum(map(cpu_s, self.worker_pids)),
        }


class DynamoProcs:
    """Dynamo's frontend and mocker as child processes of ours; stopped by PID only."""

    def __init__(self, setup: Setup, workdir: Path):
        self.setup, self.workdir = setup, workdir
        self.procs: list[subprocess.Popen] = []
        kv = workdir / "dyn-kv"  # DYN_FILE_KV: must be the same folder for every process
        kv.mkdir(parents=True, exist_ok=True)
        (workdir / "home").mkdir(exist_ok=True)
        self.env = {
            **os.environ,
            "DYN_FILE_KV": str(kv),
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "DYN_LOG": "warn",
            "HOME": str(workdir / "home"),  # its model-card cache goes under $HOME/.cache
            "VIRTUAL_ENV": str(setup.dynamo_python.parent.parent),
        }

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                [str(self.setup.dynamo_python), *args],
                env={**self.env, **(env or {})},
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):  # workers first, then the frontend
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_dynamo(setup: Setup, policy: str, workdir: Path, timeout_s: float = 120.0) -> Deployment:
    """The frontend, then one mocker process per worker (`--num-workers 1` each, like
    pdmesh's one process per worker, and so each has its own metrics page: with
    several engines in one process, 1.6.1's system page shows only one of them)."""
    procs = DynamoProcs(setup, workdir)
    port = free_port()
    try:
        front = procs.start(
            "frontend",
            [
                "-m", "dynamo.frontend",
                "--http-host", "127.0.0.1",
                "--http-port", str(port),
                "--router-mode", POLICIES[policy][0],
                "--discovery-backend", "file",
            ],
        )  # fmt: skip
        mockers, metrics_urls = [], []
        for i in range(setup.workers):
            # DYN_SYSTEM_PORT is parsed as an i16 by Dynamo 1.6.1: it must be below 32768.
            system_port = free_port(below=32768)
            mockers.append(
                procs.start(
                    f"mocker-{i}",
                    [
                        "-m", "dynamo.mocker",
                        "--model-path", str(setup.model_folder),
                        "--model-name", MODEL_NAME,
                        "--num-workers", "1",
                        "--block-size", str(setup.block_size),
                        "--num-gpu-blocks-override", str(setup.num_blocks),
                        "--max-num-seqs", str(setup.max_num_seqs),
                        "--max-num-batched-tokens", str(setup.max_num_batched_tokens),
                        "--speedup-ratio", f"{setup.speedup:g}",
                        "--discovery-backend", "file",
                    ],
                    env={"DYN_SYSTEM_PORT": str(system_port)},  # the engine's vllm:* metrics
                )
            )  # fmt: skip
            metrics_urls.append(f"http://127.0.0.1:{system_port}/metrics")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        delay = 0.1
        named = [(front, "frontend")] + [(m, f"mocker-{i}") for i, m in enumerate(mockers)]
        while True:
            for proc, name in named:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"dynamo {name} exited with {proc.returncode}:\n{log_tail(workdir / f'{name}.log')}"
                    )
            status, body = http_get(url + "/v1/models")
            if status == 200 and MODEL_NAME in body and dynamo_workers(url) >= setup.workers:
                break
            if time.monotonic() > deadline:
                tails = "\n".join(log_tail(workdir / f"{name}.log") for _, name in named)
                raise RuntimeError(f"dynamo not ready after {timeout_s:.0f}s:\n{tails}")
            time.sleep(delay)  # polling a child's readiness with backoff
            delay = min(delay * 1.5, 0.5)
    except BaseException:
        procs.stop()
        raise
    return Deployment(
        "dynamo",
        url,
        {"frontend": front.pid},
        [m.pid for m in mockers],
        setup.workers,
        procs.stop,
        metrics_url=url + "/metrics",
        worker_metrics_urls=metrics_urls,
        logs=[workdir / f"{name}.log" for _, name in named],
    )


def dynamo_workers(url: str) -> int:
    """Workers the frontend's /health lists as instances of the generate endpoint."""
    status, body = http_get(url + "/health")
    if status != 200:
        return 0
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return 0
    return sum(1 for inst in data.get("instances", []) if inst.get("endpoint") == "generate")


def start_pdmesh(setup: Setup, policy: str, workdir: Path, timeout_s: float = 180.0) -> Deployment:
    launcher = Launcher(workdir)
    folder = str(setup.model_folder)
    no_limit = 1 << 20
    engine = flags(
        engine_backend="sim",
        engine_model_path=folder,
        engine_sim_profile=PROFILE,
        engine_sim_speedup=setup.speedup,
        engine_block_size=setup.block_size,
        engine_num_blocks=setup.num_blocks,
        engine_max_num_seqs=setup.max_num_seqs,
        engine_max_num_batched_tokens=setup.max_num_batched_tokens,
        default_mode="local",  # no prefill workers here; Dynamo's mockers are aggregated too
        metrics_port=0,
        limits_max_prompt_tokens=no_limit,
        log_level="warning",
    )
    try:
        decodes = [
            launcher.start(
                ServiceSpec(
                    f"decode-{i}",
                    "services.decode.main",
                    flags(worker_id=f"decode-{i}") + engine,
                    ready_service="pdmesh.v1.DecodeService",
                )
            )
            for i in range(setup.workers)
        ]
        for d in decodes:
            launcher.wait_ready(d, timeout_s)

        def router_spec(i: int, port: int, http_port: int) -> ServiceSpec:
            return ServiceSpec(
                "router" if i == 0 else f"router-{i}",
                "services.router.main",
                flags(
                    port=port,
                    http_port=http_port,
                    so_reuseport=1 if setup.pdmesh_routers > 1 else None,
                    decode_workers=[d.address for d in decodes],
                    model_path=folder,
                    http_served_model_name=MODEL_NAME,  # what the old gateway served it as  # the OpenAI HTTP API, in the router process (no gateway)
                    block_size=setup.block_size,
                    policy=POLICIES[policy][1],
                    # Dynamo's frontend queues nothing by default: let every engine slot be used.
                    admission_max_inflight=setup.workers * setup.max_num_seqs,
                    limits_max_prompt_tokens=no_limit,
                    metrics_port=0,
                    log_level="warning",
                )
                + setup.pdmesh_router_flags,
                ready_service="pdmesh.v1.RouterService",
            )

        router = launcher.start_ready(router_spec(0, 0, 0), timeout_s)
        # More routers join the first one's ports; the kernel spreads the connections.
        others = [
            launcher.start_ready(router_spec(i, router.port, router.http_port or 0), timeout_s)
            for i in range(1, setup.pdmesh_routers)
        ]
    except BaseException:
        launcher.close()
        raise
    return Deployment(
        "pdmesh",
        f"http://{router.http_address}",
        {"router": router.proc.pid, **{f"router-{i}": r.proc.pid for i, r in enumerate(others, 1)}},
        [d.proc.pid for d in decodes],
        setup.workers,
        launcher.close,
        direct=decodes[0].address,
        router=router.address,
        # Each router's own page (the HTTP door's pdmesh_gateway_* metrics are on its registry
        # too): the counters are summed over them.
        metrics_urls=[
            f"http://127.0.0.1:{r.metrics_port}/metrics" for r in (router, *others) if r.metrics_port
        ],
        worker_metrics_urls=[f"http://127.0.0.1:{d.metrics_port}/metrics" for d in decodes if d.metrics_port],
        logs=[s.log_path for s in launcher.services],
    )


# ---- load --------------------------------------------------------------------------------------


class HttpClient(OpenAIHttpClient):
    """bench.loadgen's client, except that a chunk carrying only a finish_reason (empty
    text, no usage count) is not a token. pdmesh's HTTP door sends one at the end and no
    continuous usage, so the base client would count one token too many per request
    (an extra ~0 ms ITL); Dynamo's continuous usage already avoids it."""

    @staticmethod
    def _on_chunk(rec: RequestRecord, data: dict, t: float, usage_total: int | None) -> int | None:
        choices = data.get("choices") or []
        usage = data.get("usage") or {}
        if (
            choices
            and choices[0].get("finish_reason")
            and not choices[0].get("text")
            and usage.get("completion_tokens") is None
        ):
            rec.finish_reason = choices[0]["finish_reason"]
            data = {**data, "choices": []}
        return OpenAIHttpClient._on_chunk(rec, data, t, usage_total)


async def sequential_ttfts(
    client: StreamClient, items: Sequence[WorkItem], timeout_s: float = 30.0
) -> list[float]:
    """TTFT (s) of each item sent one at a time (near-zero load)."""
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    out = []
    for i, item in enumerate(items):
        rec = RequestRecord(
            f"probe-{os.getpid()}-{time.time_ns()}-{i}",
            clock(),
            clock(),
            len(item.prompt_ids),
            item.max_tokens,
        )
        await client.generate(rec, item, clock, timeout_s)
        if rec.ok and rec.ttft_s is not None:
            out.append(rec.ttft_s)
    return out


def probe_items(n: int, seed: int, prompt_len: int, vocab_size: int) -> list[WorkItem]:
    """n fresh prompts (no shared prefix with anything), 2 output tokens each."""
    rng = np.random.default_rng([seed, 7])
    return [
        WorkItem(0.0, tuple(rng.integers(FIRST_WORD_ID, vocab_size, prompt_len).tolist()), 2)
        for _ in range(n)
    ]


async def probe(dep: Deployment, n: int, seed: int, prompt_len: int, vocab_size: int) -> dict[str, float]:
    """Median near-zero-load TTFT (ms) through the HTTP front, and for pdmesh direct and via the router."""
    out = {}
    paths: list[tuple[str, StreamClient]] = [("http", HttpClient(dep.url, MODEL_NAME))]
    if dep.direct:
        paths += [("direct", GrpcClient(dep.direct, "decode")), ("router", GrpcClient(dep.router, "router"))]
    for k, (name, client) in enumerate(paths):
        items = probe_items(n + 5, seed * 100 + k, prompt_len, vocab_size)
        ttfts = (await sequential_ttfts(client, items))[5:]  # the first 5 warm connections and caches up
        await client.close()
        out[name] = float(np.median(ttfts)) * 1e3 if ttfts else math.nan
    return out


# ---- one run -----------------------------------------------------------------------------------


@dataclass
class RunResult:
    row: Row
    probe: dict[str, float]
    metrics: dict[str, float]


def run_one(
    system: str,
    policy: str,
    rate_label: str,
    setup: Setup,
    items: list[WorkItem],
    args: argparse.Namespace,
    workdir: Path,
) -> RunResult:
    start = start_dynamo if system == "dynamo" else start_pdmesh
    t_start = time.monotonic()
    dep = start(setup, policy, workdir)
    try:
        if args.pin:
            pin_split(dep)
        print(f"   {system} {policy} up in {time.monotonic() - t_start:.1f}s; probing", flush=True)
        pr = asyncio.run(probe(dep, args.probe_requests, args.seed, args.probe_prompt_len, args.vocab_size))
        span = items[-1].arrival_s
        print(f"   load: {len(items)} requests over {span:.1f}s", flush=True)
        cpu0, before, load0 = dep.cpu(), counters(dep), os.getloadavg()[0]
        records = asyncio.run(
            run_load(
                items,
                HttpClient(dep.url, MODEL_NAME),
                max_requests=len(items),
                max_duration_s=span + 1.0,
                timeout_s=args.timeout_s,
            )
        )
        cpu = {k: v - cpu0[k] for k, v in dep.cpu().items()}
        load1 = os.getloadavg()[0]
        mets = load_metrics(before, counters(dep), dep.workers)
    finally:
        dep.stop()
    row = make_row(system, policy, rate_label, records, sum(cpu.values()))
    row.extra.update(
        **{f"cpu_{k}_s": v for k, v in cpu.items()},
        prompt_tokens_sent=float(sum(len(it.prompt_ids) for it in items)),
        load_before=load0,
        load_after=load1,
        client_lag_p99_ms=float(np.percentile([r.send_s - r.scheduled_s for r in records], 99)) * 1e3,
    )
    if args.records_dir:
        Path(args.records_dir).mkdir(parents=True, exist_ok=True)
        out = Path(args.records_dir) / f"{system}-{policy}-{rate_label.split()[0]}.jsonl"
        write_records(out, records, meta={"system": system, "policy": policy, "rate": rate_label})
    errors = sorted({r.error_code for r in records if not r.ok})
    print(
        f"   done: ok {row.ok}/{row.requests}{' errors ' + ','.join(errors) if errors else ''}; "
        f"TTFT p50 {row.ttft_p50:.1f} ms; reuse {row.prefix_reuse:.1%}; "
        "CPU "
        + ", ".join(f"{k} {v:.1f}s" for k, v in cpu.items())
        + f"; machine load {load0:.1f} -> {load1:.1f}",
        flush=True,
    )
    return RunResult(row, pr, mets)


_CPUS = frozenset(os.sched_getaffinity(0))  # this process's CPUs at start


def pin_split(dep: Deployment) -> None:
    """`--pin`: the engines on the first CPU, the front (router / frontend) and this process
    (the load's client) on the second, for both systems alike: a diagnostic of what the
    front adds when the co-located engines' CPU does not compete with it."""
    cpus = sorted(_CPUS)  # before the first call pinned this process
    if len(cpus) < 2:
        raise SystemExit("--pin needs 2 CPUs")
    engines, front = {cpus[0]}, set(cpus[1:])
    for pid in dep.worker_pids:
        pin_threads(pid, engines)
    for pid in dep.front_pids.values():
        pin_threads(pid, front)
    pin_threads(os.getpid(), front)


def counters(dep: Deployment) -> dict[str, float]:
    """Raw counters (sums, counts) of each system's own /metrics pages, read before and
    after the load so that `load_metrics` sees the load alone (not the probes)."""
    front = parse_prometheus(http_get(dep.metrics_url)[1]) if dep.metrics_url else []
    front += [s for u in dep.metrics_urls for s in parse_prometheus(http_get(u)[1])]
    workers = [parse_prometheus(http_get(u)[1]) for u in dep.worker_metrics_urls]
    gateway = front  # pdmesh: the HTTP door's metrics are on each router's registry
    out: dict[str, float] = {}

    def hist(name: str, samples, base: str) -> None:
        out[name + "_sum"] = metric(samples, base + "_sum")
        out[name + "_count"] = metric(samples, base + "_count")

    if dep.system == "dynamo":
        engines = [s for w in workers for s in w]
        hist("router_decision", front, "dynamo_router_overhead_total_ms")
        hist("front_ttft", front, "dynamo_frontend_time_to_first_token_seconds")
        hist("engine_ttft", engines, "vllm:time_to_first_token_seconds")
        out["cached_tokens"] = metric(front, "dynamo_frontend_cached_tokens_sum")
        out["prompt_tokens"] = metric(front, "dynamo_frontend_input_sequence_tokens_sum")
        out["predicted_cached_tokens"] = metric(
            front, "dynamo_component_router_kv_selected_cached_prefix_tokens_total"
        )
        out["preemptions"] = metric(engines, "vllm:num_preemptions_total")
        requests = [metric(w, "vllm:e2e_request_latency_seconds_count") for w in workers]
    else:
        hist("front_ttft", front, "pdmesh_router_ttft_seconds")
        hist("gateway_ttft", gateway, "pdmesh_gateway_ttft_seconds")
        # The door's wait from a request's parsed head to its handler running (the loop's queue).
        hist("gateway_queue", gateway, "pdmesh_gateway_queue_seconds")
        for le in ("0.001", "0.005", "0.025"):
            out[f"gateway_queue_le{le}"] = metric(gateway, "pdmesh_gateway_queue_seconds_bucket", le=le)
        hist("engine_ttft", [s for w in workers for s in w], "pdmesh_decode_ttft_seconds")
        # How late each loop ran its 50 ms timer: the router's, and the workers' together.
        for name, samples, base in (
            ("router_lag", front, "pdmesh_router_event_loop_lag_seconds"),
            ("worker_lag", [s for w in workers for s in w], "pdmesh_decode_event_loop_lag_seconds"),
        ):
            hist(name, samples, base)
            out[name + "_le5ms"] = metric(samples, base + "_bucket", le="0.005")
        out["cached_tokens"] = sum(metric(w, "pdmesh_engine_prompt_tokens_cached_total") for w in workers)
        out["preemptions"] = sum(metric(w, "pdmesh_engine_preemptions_total") for w in workers)
        requests = [metric(w, "pdmesh_decode_requests_total") for w in workers]
    out.update({f"requests_{i}": v for i, v in enumerate(requests)})
    return out


def load_metrics(before: dict[str, float], after: dict[str, float], workers: int) -> dict[str, float]:
    """The load's share of the counters: totals, means (ms) and the request balance."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def mean(name: str, scale: float = 1e3) -> float:
        return d[name + "_sum"] / d[name + "_count"] * scale if d.get(name + "_count") else math.nan

    out = {k: v for k, v in d.items() if not k.endswith(("_sum", "_count")) and not k.startswith("requests_")}
    out.update(
        front_ttft_ms=mean("front_ttft"),
        engine_ttft_ms=mean("engine_ttft"),
        gateway_ttft_ms=mean("gateway_ttft"),
        gateway_queue_ms=mean("gateway_queue"),
        gateway_queue_n=d.get("gateway_queue_count", math.nan),
        router_decision_ms=mean("router_decision", 1.0),
        router_lag_ms=mean("router_lag"),
        worker_lag_ms=mean("worker_lag"),
        router_lag_over_5ms=1 - d.get("router_lag_le5ms", 0) / d["router_lag_count"]
        if d.get("router_lag_count")
        else math.nan,
        worker_lag_over_5ms=1 - d.get("worker_lag_le5ms", 0) / d["worker_lag_count"]
        if d.get("worker_lag_count")
        else math.nan,
        **balance([v for k, v in d.items() if k.startswith("requests_")], workers),
    )
    return out


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one rate, KV routing only, fewer requests (~2 min)")
    p.add_argument("--workers", type=int, default=4, help="engines per system")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-blocks", type=int, default=16384, help="KV blocks per worker (the mocker's default)"
    )
    p.add_argument("--speedup", type=float, default=1.0, help="modeled time / wall time, both systems")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--length-factor", type=float, default=8.0, help="trace lengths are divided by this")
    p.add_argument(
        "--rates", help="arrival rate multipliers of the trace (time_factor = 1/x); default 2,4 (quick: 4)"
    )
    p.add_argument("--policies", help="kv and/or round_robin; default kv,round_robin (quick: kv)")
    p.add_argument("--rr-rates", default="last", help="rates for round_robin: all | last")
    p.add_argument("--systems", default="dynamo,pdmesh")
    p.add_argument("--num-requests", type=int, help="first N requests of the trace; default 500 (quick: 120)")
    p.add_argument("--max-duration-s", type=float, default=120.0, help="of scaled trace time per run")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request deadline")
    p.add_argument(
        "--probe-requests", type=int, help="near-zero-load probes per path; default 30 (quick: 20)"
    )
    p.add_argument("--probe-prompt-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dynamo-venv", type=Path, default=HERE / ".venv")
    p.add_argument("--model-folder", type=Path, default=HERE / "model")
    p.add_argument(
        "--pdmesh-routers",
        type=int,
        default=1,
        help="pdmesh router processes sharing the ports (SO_REUSEPORT, as `pdmesh up --routers N`); default 1",
    )
    p.add_argument(
        "--pdmesh-router-flags",
        default="",
        help="extra flags for pdmesh's router, space-separated (experiments, e.g. --stats-interval-s 0.1)",
    )
    p.add_argument("--records-dir", default="", help="write each run's records as JSONL here")
    p.add_argument(
        "--pin",
        action="store_true",
        help="diagnostic: each system's engines on the first CPU, its front and the client on the others",
    )
    a = p.parse_args(argv)
    defaults = (
        {"rates": "4", "policies": "kv", "num_requests": 120, "probe_requests": 20}
        if a.quick
        else {"rates": "2,4", "policies": "kv,round_robin", "num_requests": 500, "probe_requests": 30}
    )
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def bursts(arrivals: Sequence[float]) -> str:
    """How the arrivals bunch: the trace's timestamps are in whole seconds, so requests come
    several at one instant, and a front that sets requests up one at a time queues them."""
    at = Counter(round(t, 6) for t in arrivals)
    per_request = sum(n * n for n in at.values()) / max(len(arrivals), 1)
    return (
        f"arrivals at {len(at)} instants, {min(at.values())}-{max(at.values())} at once "
        f"({per_request:.1f} on average for a request)"
    )


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs ({model or platform.machine()}), {platform.system()} {platform.release()}"


def versions(python: Path) -> str:
    """ai-dynamo / ai-dynamo-runtime versions in Dynamo's venv."""
    code = "import importlib.metadata as m; print(m.version('ai-dynamo'), m.version('ai-dynamo-runtime'))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    return " / runtime ".join(out.stdout.split()) if out.returncode == 0 else "version unknown"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    dyn_python = args.dynamo_venv / "bin" / "python"
    if "dynamo" in args.systems and not dyn_python.exists():
        print(f"no Dynamo venv at {args.dynamo_venv}: run bench/peers/dynamo/setup.sh first", file=sys.stderr)
        return 2
    write_folder(args.model_folder, args.vocab_size)
    setup = Setup(
        args.workers,
        args.block_size,
        args.num_blocks,
        args.speedup,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.model_folder.resolve(),
        dyn_python,
        tuple(args.pdmesh_router_flags.split()),
        args.pdmesh_routers,
    )
    capacity = setup.num_blocks * setup.block_size
    rates = [float(x) for x in args.rates.split(",")]
    policies = [x for x in args.policies.split(",") if x]
    systems = [x for x in args.systems.split(",") if x]
    for pol in policies:
        if pol not in POLICIES:
            raise SystemExit(f"unknown policy {pol!r}; want kv or round_robin")

    workloads: dict[float, list[WorkItem]] = {}
    for rate in rates:
        items = build_workload(
            "mooncake",
            num_requests=args.num_requests,
            max_duration_s=args.max_duration_s,
            length_factor=args.length_factor,
            time_factor=1.0 / rate,
            seed=args.seed,
            vocab=VocabRange(FIRST_WORD_ID, args.vocab_size),
        )
        # A request must fit one worker's cache with room to spare, on both systems alike.
        workloads[rate] = [it for it in items if len(it.prompt_ids) + it.max_tokens <= capacity // 2]
    profile = load_profile(PROFILE)
    started = datetime.datetime.now(datetime.UTC)
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    print(f"machine: {machine()}; dynamo {versions(dyn_python) if 'dynamo' in systems else '-'}")
    print(
        f"dynamo side by side: {setup.workers} workers per system, block {setup.block_size}, "
        f"{setup.num_blocks} blocks/worker ({capacity} tokens), speedup {setup.speedup:g}, "
        f"max_num_seqs {setup.max_num_seqs}, max_num_batched_tokens {setup.max_num_batched_tokens}"
        + (
            f"; pdmesh router extra flags: {' '.join(setup.pdmesh_router_flags)}"
            if setup.pdmesh_router_flags
            else ""
        )
        + (f"; pdmesh router processes: {setup.pdmesh_routers}" if setup.pdmesh_routers > 1 else "")
        + ("; --pin: engines on the first CPU, fronts and the client on the others" if args.pin else "")
    )
    print(
        f"trace mooncake_conversation, length_factor {args.length_factor:g}, first {args.num_requests} "
        f"requests within {args.max_duration_s:g}s; rates x{', x'.join(f'{r:g}' for r in rates)}; "
        f"{started:%Y-%m-%dT%H:%MZ}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"{platform.python_implementation()} {platform.python_version()}"
    )
    rate_labels = {}
    for rate, items in workloads.items():
        span = items[-1].arrival_s
        rate_labels[rate] = f"x{rate:g} ({len(items) / max(span, 1e-9):.1f}/s)"
        print(
            f"  rate {rate_labels[rate]}: {len(items)} requests over {span:.1f}s, prompt mean "
            f"{np.mean([len(i.prompt_ids) for i in items]):.0f} max {max(len(i.prompt_ids) for i in items)} tokens, "
            f"output mean {np.mean([i.max_tokens for i in items]):.0f}; ideal prefix reuse "
            f"{ideal_prefix_reuse([i.prompt_ids for i in items], setup.block_size):.1%}; "
            + bursts([i.arrival_s for i in items])
        )

    plan = []
    for policy in policies:
        for rate in rates if policy == "kv" or args.rr_rates == "all" else rates[-1:]:
            plan += [(policy, rate, system) for system in systems]
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="pdmesh-vs-dynamo-") as tmp:
        for i, (policy, rate, system) in enumerate(plan):
            print(f"== [{i + 1}/{len(plan)}] {system} {policy} {rate_labels[rate]}", flush=True)
            workdir = Path(tmp) / f"{i}-{system}-{policy}"
            workdir.mkdir()
            results.append(run_one(system, policy, rate_labels[rate], setup, workloads[rate], args, workdir))
    report(results, setup, profile, args)
    return 0 if all(r.row.ok == r.row.requests for r in results) else 1


def report(results: list[RunResult], setup: Setup, profile, args: argparse.Namespace) -> None:
    rows = [r.row for r in results]
    print()
    print(
        "times in ms; reuse = cached prompt tokens / prompt tokens (each response's final usage: the "
        "engine's own prefix-cache hits); CPU s = CPU seconds of the system's processes during the load"
    )
    print(format_table(rows))
    print()
    print("each system's own counters over the load (probes excluded):")
    for r in results:
        m, x = r.metrics, r.row.extra
        sent = x["prompt_tokens_sent"]
        cpu = {k[4:-2]: v for k, v in x.items() if k.startswith("cpu_") and k.endswith("_s")}
        parts = [
            f"machine load average {x['load_before']:.1f} -> {x['load_after']:.1f}",
            f"client send lag p99 {x['client_lag_p99_ms']:.1f} ms",
            "CPU " + " ".join(f"{k} {v:.1f}s" for k, v in cpu.items()),
            f"busiest worker {m.get('busiest_over_mean', math.nan):.2f}x the mean request count",
            f"preemptions {m.get('preemptions', math.nan):.0f}",
            f"cached tokens {m.get('cached_tokens', math.nan) / sent:.1%} of the load's prompt tokens",
        ]
        if r.row.system == "dynamo":
            parts[-1] += f" (router predicted {m.get('predicted_cached_tokens', math.nan) / sent:.1%})"
            parts.append(
                f"TTFT mean at the engines {m.get('engine_ttft_ms', math.nan):.1f}, at the frontend "
                f"{m.get('front_ttft_ms', math.nan):.1f}, at the client {r.row.ttft_mean:.1f}"
            )
        else:
            parts.append(
                f"TTFT mean at the decode workers {m.get('engine_ttft_ms', math.nan):.1f}, "
                f"at the router {m.get('front_ttft_ms', math.nan):.1f}, at the HTTP door "
                f"{m.get('gateway_ttft_ms', math.nan):.1f} (of which waiting for the loop "
                f"{m.get('gateway_queue_ms', math.nan):.2f}; "
                + "/".join(
                    f"{m.get(f'gateway_queue_le{le}', math.nan) / m.get('gateway_queue_n', math.nan):.0%}"
                    for le in ("0.001", "0.005", "0.025")
                )
                + f" within 1/5/25 ms), at the client {r.row.ttft_mean:.1f}"
            )
            parts.append(
                f"event-loop lag mean router {m.get('router_lag_ms', math.nan):.2f} ms "
                f"({m.get('router_lag_over_5ms', math.nan):.1%} of ticks > 5 ms), decode workers "
                f"{m.get('worker_lag_ms', math.nan):.2f} ms ({m.get('worker_lag_over_5ms', math.nan):.1%})"
            )
        print(f"  {r.row.system} {r.row.policy} {r.row.rate}: " + "; ".join(parts))

    modeled = profile.prefill_ms(args.probe_prompt_len) / setup.speedup
    print()
    print(
        f"near-zero load: median TTFT of {args.probe_prompt_len}-token fresh prompts, 2 output tokens, sent one "
        f"at a time before each load (modeled prefill {modeled:.1f} ms):"
    )
    over: dict[str, list[float]] = {"dynamo": [], "pdmesh": []}
    hops: dict[str, list[float]] = {"router": [], "gateway": [], "worker": []}
    decisions: list[float] = []
    for r in results:
        p, m = r.probe, r.metrics
        over[r.row.system].append(p["http"] - modeled)
        line = f"  {r.row.system:<7} {r.row.policy:<11} HTTP front {p['http']:.2f}"
        if "direct" in p:
            hops["worker"].append(p["direct"] - modeled)
            hops["router"].append(p["router"] - p["direct"])
            hops["gateway"].append(p["http"] - p["router"])
            line += f"; router over gRPC {p['router']:.2f}; a worker over gRPC directly {p['direct']:.2f}"
        if not math.isnan(m.get("router_decision_ms", math.nan)):
            decisions.append(m["router_decision_ms"])
            line += f"; router decision {m['router_decision_ms']:.3f} (dynamo_router_overhead_total_ms)"
        print(line)
    med = {k: float(np.median(v)) if v else math.nan for k, v in {**over, **hops}.items()}
    print(
        f"  beyond the modeled engine time: dynamo {med['dynamo']:.2f} ms, pdmesh {med['pdmesh']:.2f} ms "
        f"(pdmesh: worker {med['worker']:.2f} + router hop {med['router']:.2f} + HTTP door {med['gateway']:.2f})"
    )
    front = {"dynamo": 0.0, "pdmesh": 0.0}  # CPU s of the processes in front of the workers
    for r in results:
        front[r.row.system] += sum(
            v
            for k, v in r.row.extra.items()
            if k == "cpu_frontend_s" or (k.startswith("cpu_router") and k.endswith("_s"))
        )
    print(
        f"front CPU over all runs: pdmesh router process {front['pdmesh']:.1f} s, "
        f"Dynamo frontend {front['dynamo']:.1f} s"
    )
    print()
    overhead = {
        "overhead_ms_dynamo": med["dynamo"],
        "overhead_ms_pdmesh": med["pdmesh"],
        "router_hop_ms_pdmesh": med["router"],
        "router_decision_ms_dynamo": float(np.median(decisions)) if decisions else math.nan,
        "cpu_front_ratio": front["pdmesh"] / front["dynamo"] if front["dynamo"] > 0 else math.nan,
        "overhead_ratio": med["pdmesh"] / med["dynamo"] if med["dynamo"] > 0 else math.nan,
    }
    print(summary_line(rows, overhead))


if __name__ == "__main__":
    sys.exit(main())
