"""The router's CPU per relayed message, checkout A vs checkout B, alternating on one fake worker.

`bench/routing.py` part 2 reports rates, which on a shared 2-core machine follow
the other jobs' load more than the router's code (the same code gave 5k and
13k msgs/s within minutes). What a change to the hot path changes is the CPU
the router spends per message, so this measures that: one zero-cost fake
decode worker (bench/routing.py's, over DecodeService.Link) and two router
processes, one per checkout (PYTHONPATH), with the gRPC and HTTP doors; then,
alternating A and B for `--rounds`, `--streams` endless streams through one
router until `--messages` client messages (gRPC) or SSE events (HTTP) arrived
after every stream got its first one, and the router's CPU seconds per token it
relayed in that span (its own count, TTFT + ITL samples from its Stats: with a
client behind, many messages wait in the connection's buffers, so the client's
count is not what the router did), with its CPU seconds
(the scheduler's nanosecond account, /proc/<pid>/task/*/schedstat; clock ticks
are dodged by a process that runs in short bursts) over exactly that span. Start-up and stream opening are
outside the span. Prints per round, the medians and the minima (the least
disturbed round of each side), then
`front_cpu_ab grpc_us_a=.. grpc_us_b=.. grpc_ratio=.. http_us_a=.. http_us_b=.. http_ratio=..
grpc_tok_per_msg_b=.. grpc_min_ratio=.. http_min_ratio=..` (ratio = B / A of the medians, min_ratio
of the minima; below 1 is less CPU per message).

`--dynamo`: the configuration of the Dynamo side by side instead
(bench/peers/dynamo/run.py's `start_pdmesh`: 4 `sim` workers with the
dynamo-mocker profile, its WordLevel model folder, kv_aware, HTTP door,
continuous usage, token-id prompts of the Mooncake trace / 8 at x4): both routers
on the same workers (each subscribes to their KV events, but only the router under
load makes any), alternating A and B on the same `--requests` requests per round
(order swapped every round, as the second one finds the first one's prefixes
cached); the router's CPU per request and per output token over the round, and
`front_cpu_ab_dynamo us_per_token_a=.. us_per_token_b=.. ratio=.. min_ratio=..`.

Run (from a directory with no `services` package, so PYTHONPATH decides):
`cd /tmp && python /path/to/bench/front_cpu_ab.py --a /tmp/base --b /path/to/checkout [--dynamo]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_model
from bench.routing import HUGE, LONG, PROMPT, channel, router_request, run_cpu_s
from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import router_pb2, router_pb2_grpc

MAIN_THREAD = False  # --main-thread: count only the router's event-loop thread


def proc_cpu_s(pid: int) -> float:
    """The router's CPU seconds (the scheduler's account, `run_cpu_s`): the whole process, or
    (--main-thread) its event-loop thread, which runs the flow, the doors and gRPC's inline
    sends."""
    if not MAIN_THREAD:
        return run_cpu_s(pid)
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


async def relayed(internal: str) -> int:
    """Token messages the router has handed to its doors so far: its TTFT and ITL sample
    counts (one per token, counted as the flow yields it, before any client reads it)."""
    async with channel(internal) as ch:
        s = await router_pb2_grpc.RouterServiceStub(ch).Stats(
            router_pb2.RouterServiceStatsRequest(), timeout=30
        )
    return s.ttft.counts[-1] + s.itl.counts[-1]


def router_spec(name: str, root: Path, fake: str) -> ServiceSpec:
    args = flags(
        decode_link="true",
        port=0,
        http_port=0,
        decode_workers=[fake],
        policy="round_robin",
        max_model_len=HUGE,
        limits_max_tokens_limit=HUGE,
        limits_max_prompt_tokens=HUGE,
        admission_max_inflight=1024,
        stall_timeout_s=0,
        log_level="warning",
    )
    return ServiceSpec(
        name,
        "services.router.main",
        args,
        env={"PYTHONPATH": str(root)},
        ready_service="pdmesh.v1.RouterService",
    )


async def grpc_span(
    address: str, internal: str, pid: int, streams: int, messages: int
) -> tuple[float, float]:
    """(router CPU us per client message, tokens per message) over `messages` messages."""
    count = tokens = 0
    started = 0
    all_started = asyncio.Event()
    done = asyncio.Event()
    span: dict[str, float] = {}

    async def one() -> None:
        nonlocal count, tokens, started
        async with channel(address) as ch:
            call = router_pb2_grpc.RouterServiceStub(ch).Generate(router_request(LONG), timeout=600)
            first = True
            async for msg in call:
                if first:
                    first = False
                    started += 1
                    if started == streams:
                        span["cpu0"] = proc_cpu_s(pid)
                        span["n0"] = await relayed(internal)
                        all_started.set()
                    continue
                if all_started.is_set():
                    count += 1
                    tokens += len(msg.delta.token_ids)
                    if count == messages:
                        span["cpu1"] = proc_cpu_s(pid)
                        span["n1"] = await relayed(internal)
                        done.set()
                if done.is_set():
                    call.cancel()
                    break

    await asyncio.gather(*(one() for _ in range(streams)))
    # Per token the router relayed in the span (its own count: with the client behind, many
    # messages sit in the connection's buffers, so the client's count is not the router's).
    return (span["cpu1"] - span["cpu0"]) / max(span["n1"] - span["n0"], 1) * 1e6, tokens / messages


async def http_span(address: str, internal: str, pid: int, streams: int, events: int) -> float:
    """Router CPU us per SSE event over `events` events (a raw HTTP/1.1 client, as routing.py's)."""
    import json

    host, port = address.rsplit(":", 1)
    body = json.dumps({"prompt": PROMPT, "max_tokens": LONG, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    count = started = 0
    all_started = asyncio.Event()
    done = asyncio.Event()
    span: dict[str, float] = {}

    async def one() -> None:
        nonlocal count, started
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body)
        tail = b""
        first = True
        try:
            status = await reader.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"HTTP door answered {status!r}")
            while not done.is_set():
                data = await reader.read(65536)
                if not data:
                    break
                n = (tail + data).count(b"\n\n")
                tail = data[-1:]
                if first and n:
                    first = False
                    started += 1
                    if started == streams:
                        span["cpu0"] = proc_cpu_s(pid)
                        span["n0"] = await relayed(internal)
                        all_started.set()
                    continue
                if all_started.is_set():
                    count += n
                    if count >= events and not done.is_set():
                        done.set()
                        span["cpu1"] = proc_cpu_s(pid)
                        span["n1"] = await relayed(internal)
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(streams)))
    return (span["cpu1"] - span["cpu0"]) / max(span["n1"] - span["n0"], 1) * 1e6  # per token relayed


def dynamo_router_spec(
    name: str, root: Path, workers: list[str], folder: Path, max_inflight: int
) -> ServiceSpec:
    """The router as bench/peers/dynamo/run.py's start_pdmesh runs it, from checkout `root`."""
    from bench.peers.dynamo.run import MODEL_NAME

    args = flags(
        decode_workers=workers,
        model_path=str(folder),
        http_port=0,
        http_served_model_name=MODEL_NAME,
        block_size=16,
        policy="kv_aware",
        admission_max_inflight=max_inflight,
        limits_max_prompt_tokens=1 << 20,
        metrics_port=0,
        log_level="warning",
    )
    return ServiceSpec(
        name,
        "services.router.main",
        args,
        env={"PYTHONPATH": str(root)},
        ready_service="pdmesh.v1.RouterService",
    )


def dynamo_ab(a, roots: dict[str, Path]) -> int:
    """--dynamo: the Dynamo side by side's configuration, A and B alternating (module docstring)."""
    from bench.loadgen import build_workload, run_load
    from bench.peers.dynamo import run as D
    from bench.traces import VocabRange

    folder = Path(tempfile.mkdtemp(prefix="bench-cpu-ab-model-"))
    D.write_folder(folder, D.DEFAULT_VOCAB)

    def workload(seed: int) -> list:
        # The same arrivals, lengths and sharing pattern for every seed; other token ids, so
        # no run finds the prefixes of an earlier one cached (fewer KV events: less CPU).
        items = build_workload(
            "mooncake",
            num_requests=a.requests,
            max_duration_s=120.0,
            length_factor=8.0,
            time_factor=1 / 4,
            seed=seed,
            vocab=VocabRange(D.FIRST_WORD_ID, D.DEFAULT_VOCAB),
        )
        return [it for it in items if len(it.prompt_ids) + it.max_tokens <= 16384 * 16 // 2]

    items = workload(0)
    out_tokens = sum(it.max_tokens for it in items)
    span = items[-1].arrival_s
    engine = flags(
        engine_backend="sim",
        engine_model_path=str(folder),
        engine_sim_profile=D.PROFILE,
        engine_sim_speedup=1.0,
        engine_block_size=16,
        engine_num_blocks=16384,
        engine_max_num_seqs=256,
        engine_max_num_batched_tokens=8192,
        default_mode="local",
        metrics_port=0,
        limits_max_prompt_tokens=1 << 20,
        log_level="warning",
    )
    us: dict[str, list[float]] = {"a": [], "b": []}
    with Launcher(tempfile.mkdtemp(prefix="bench-cpu-ab-")) as launcher:
        decodes = [
            launcher.start(
                ServiceSpec(
                    f"decode-{i}",
                    "services.decode.main",
                    flags(worker_id=f"decode-{i}") + engine,
                    env={"PYTHONPATH": str(roots["b"])},
                    ready_service="pdmesh.v1.DecodeService",
                )
            )
            for i in range(4)
        ]
        for d in decodes:
            launcher.wait_ready(d, 180)
        addrs = [d.address for d in decodes]
        routers = {
            k: launcher.start_ready(dynamo_router_spec(f"router-{k}", r, addrs, folder, 4 * 256), 180)
            for k, r in roots.items()
        }
        print(
            f"dynamo config: {len(items)} requests per round over {span:.1f} s, {out_tokens} output tokens, "
            f"{sum(len(it.prompt_ids) for it in items)} prompt tokens; A={roots['a']} B={roots['b']}; "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        seeds = iter(range(1, 1 << 30))
        for i in range(-1, a.rounds):  # round 0: warm-up (connections, links, caches), not counted
            for k in ("a", "b") if i % 2 == 0 else ("b", "a"):
                r = routers[k]
                client = D.HttpClient(f"http://{r.http_address}", D.MODEL_NAME)
                run = workload(next(seeds))
                cpu0 = proc_cpu_s(r.proc.pid)
                recs = asyncio.run(
                    run_load(run, client, max_requests=len(run), max_duration_s=span + 1.0, timeout_s=60)
                )
                cpu = proc_cpu_s(r.proc.pid) - cpu0
                ok = sum(x.ok for x in recs)
                if i < 0:
                    print(f"warm-up {k.upper()}: ok {ok}/{len(run)}", flush=True)
                    continue
                us[k].append(cpu / out_tokens * 1e6)
                print(
                    f"round {i + 1} {k.upper()}: router {cpu:.2f} CPU-s, {cpu / len(items) * 1e3:.2f} ms/request, "
                    f"{us[k][-1]:.1f} us/output token; ok {ok}/{len(items)}; load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    med = {k: statistics.median(v) for k, v in us.items()}
    low = {k: min(v) for k, v in us.items()}
    lower = sum(b < a_ for a_, b in zip(us["a"], us["b"], strict=True))
    print(f"B lower than A in {lower} of {a.rounds} rounds")
    print(
        f"front_cpu_ab_dynamo us_per_token_a={med['a']:.1f} us_per_token_b={med['b']:.1f} "
        f"ratio={med['b'] / med['a']:.2f} min_ratio={low['b'] / low['a']:.2f}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="checkout A (the baseline)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--main-thread", action="store_true", help="CPU of the event-loop thread only")
    p.add_argument("--dynamo", action="store_true", help="the Dynamo side by side's configuration")
    p.add_argument("--requests", type=int, default=200, help="--dynamo: requests per round")
    a = p.parse_args(argv)
    global MAIN_THREAD
    MAIN_THREAD = a.main_thread
    roots = {"a": Path(a.a).resolve(), "b": Path(a.b).resolve()}
    print(f"cpu: {cpu_model()} x{os.cpu_count()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    if a.dynamo:
        return dynamo_ab(a, roots)
    res: dict[str, list[float]] = {k: [] for k in ("grpc_a", "grpc_b", "http_a", "http_b", "tpm_a", "tpm_b")}
    with Launcher(tempfile.mkdtemp(prefix="bench-cpu-ab-")) as launcher:
        fake = launcher.start_ready(
            ServiceSpec(
                "fake-decode",
                "bench.routing",
                ("--serve-fake",),
                env={"PYTHONPATH": str(roots["b"])},
                ready_service="pdmesh.v1.DecodeService",
            )
        )
        routers = {
            k: launcher.start_ready(router_spec(f"router-{k}", r, fake.address)) for k, r in roots.items()
        }
        print(
            f"streams {a.streams}, {a.messages} messages per span; A={roots['a']} B={roots['b']}; "
            f"CPU of {'the event-loop thread' if MAIN_THREAD else 'the whole router process'}; "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        for i in range(a.rounds):
            for k in ("a", "b") if i % 2 == 0 else ("b", "a"):
                r = routers[k]
                t0 = time.perf_counter()
                us, tpm = asyncio.run(
                    grpc_span(r.address, r.internal_address, r.proc.pid, a.streams, a.messages)
                )
                hus = asyncio.run(
                    http_span(r.http_address, r.internal_address, r.proc.pid, a.streams, a.messages)
                )
                res[f"grpc_{k}"].append(us)
                res[f"http_{k}"].append(hus)
                res[f"tpm_{k}"].append(tpm)
                print(
                    f"round {i + 1} {k.upper()}: gRPC {us:.1f} us/msg ({tpm:.2f} tok/msg), "
                    f"HTTP {hus:.1f} us/event; {time.perf_counter() - t0:.1f} s, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    med = {k: statistics.median(v) for k, v in res.items()}
    low = {k: min(v) for k, v in res.items()}  # the least disturbed round of each
    print(
        f"min: gRPC A {low['grpc_a']:.1f} B {low['grpc_b']:.1f} us/msg (B/A {low['grpc_b'] / low['grpc_a']:.2f}); "
        f"HTTP A {low['http_a']:.1f} B {low['http_b']:.1f} us/event (B/A {low['http_b'] / low['http_a']:.2f})"
    )
    print(
        f"median: gRPC A {med['grpc_a']:.1f} B {med['grpc_b']:.1f} us/msg (B/A {med['grpc_b'] / med['grpc_a']:.2f}); "
        f"HTTP A {med['http_a']:.1f} B {med['http_b']:.1f} us/event (B/A {med['http_b'] / med['http_a']:.2f})"
    )
    print(
        f"front_cpu_ab grpc_us_a={med['grpc_a']:.1f} grpc_us_b={med['grpc_b']:.1f} "
        f"grpc_ratio={med['grpc_b'] / med['grpc_a']:.2f} http_us_a={med['http_a']:.1f} "
        f"http_us_b={med['http_b']:.1f} http_ratio={med['http_b'] / med['http_a']:.2f} "
        f"grpc_tok_per_msg_b={med['tpm_b']:.2f} grpc_min_ratio={low['grpc_b'] / low['grpc_a']:.2f} "
        f"http_min_ratio={low['http_b'] / low['http_a']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
