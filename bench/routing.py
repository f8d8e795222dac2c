"""Routing benchmarks. Part 1: routing quality on sim workers; part 2: the router's own cost.

Part 1 lives in bench/routing_quality.py (its docstring has the method): the
Mooncake conversation trace replayed through one router per policy
(kv_aware, round_robin, least_loaded) over 4 `sim` decode workers, reporting
prefix-cache hit rate, TTFT and throughput per policy at equal offered load.
`--scale` runs it at 8, 16 and 32 workers instead and plots
bench/results/routing_scale.png (part 2 is then skipped).

Part 2:

The router runs as a real process (`services.router.main`) in front of a
zero-cost fake decode worker (another process, defined here: it answers
Generate with tokens as fast as gRPC lets it, one token per message, and
serves Stats/health/KV events like a worker; over DecodeService.Link it
sends, per "step", one frame with one token for every open request, which is
what the router uses unless `--no-link`). The client is this process
(grpc.aio on uvloop). Measured:

- TTFT of a 1-token request, sequentially: through the router vs calling the
  fake directly; the difference is the router hop (router_overhead_ms_p50);
- messages/s relayed with one token per message over 1 stream (the fake's
  own rate read directly, for comparison) and over 64 streams
  (router_msgs_per_s: client messages/s, issue 16's target);
- tokens/s over 1 and 8 streams with the router coalescing whatever is ready
  into one client message (router_tokens_per_s is the 8-stream figure);
- 1 vs 2 router processes sharing one port with SO_REUSEPORT, 16 streams on
  16 connections (scale_2proc = aggregate tokens/s ratio);
- the HTTP door of the same router process (--http-port): SSE events/s over 64
  concurrent /v1/completions streams, each on its own connection
  (http_msgs_per_s; the tokens per event are printed: the router sends
  whatever tokens are ready as one event, one per event when it keeps up).

Everything shares this machine's cores (client, fake, routers): on a 2-core
machine the fake and the client take CPU the routers would otherwise get, so
the scale ratio is bounded well below 2 there. Each rate is printed with the
client's CPU share.

Part 1 also runs the headline study at 8 workers (`--sizes`, offered load per
worker fixed); `--ablation` adds kv_aware@lv (the router's own load view),
kv_aware@opt (+ optimistic prefixes) and kv_aware@pull (+ prefixes pulled from a
loaded holder instead of recomputed) to every study; plain kv_aware is the
default router (heartbeat load, no optimistic prefixes). On a busy machine, `--slowdown K` runs the simulated GPUs K times
slower (model-time figures stay comparable; the wall-clock request rate and so
the CPU need drop K times) and `--requests N` shortens the trace.

Part 3 (bench/routing_decision.py, also `--decision` alone): the cost of one
routing decision at 32 workers x 10,000 cached prefixes, 4,096-token prompt (the router's
hash memo warm: the prefix was routed before; `routing_decision.py --memo all` compares).

Run: `python bench/routing.py` (full: ~25 min) or `--quick` (< 6 min, make
bench), `--part 1|2|3` for one part, `--scale` for the scale study (~20 min).
The last line is `routing hit_kv=.. hit_rr=.. ttft_kv_vs_rr=..
router_overhead_ms_p50=.. ttft_p50_ms=.. ttft_p99_ms=.. router_msgs_per_s=..
router_tokens_per_s=.. http_msgs_per_s=.. scale_2proc=.. hit_ll=.. ttft_ll_vs_rr=..
ttft_p99_kv_vs_rr=.. hit_kv_8=.. ttft_kv_vs_rr_8=.. ttft_p99_kv_vs_rr_8=..
hit_vs_ideal=.. decision_ms_p50=.. pull_share=0` (hit = cached / prompt
tokens; ttft_*_vs_rr = ratio of mean TTFTs, target kv <= 0.5; the ttft_p50/p99
fields are part 2's router-hop TTFTs; hit_vs_ideal = kv_aware's hit rate over
one unbounded cache's at the largest size run, target >= 0.9 at 32 workers;
pull_share = share of kv_aware@pull's requests served with a pulled prefix, 0 without --ablation).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # `python bench/routing.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.machine import cpu_model
from bench.routing_quality import (
    FULL,
    FULL_LOADS,
    POLICIES,
    QUICK,
    SCALE_WORKERS,
    PolicyResult,
    Study,
    by_policy,
    print_study,
    proc_cpu_s,
    run_study,
    scale_study,
)
from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)

HUGE = 10_000_000  # context and max_tokens limits lifted for long streams
LONG = HUGE // 2  # max_tokens of a stream that runs until the client stops it
PROMPT = list(range(1, 33))


# ---- the zero-cost fake decode worker (runs as `python bench/routing.py --serve-fake`) ----


class ZeroCostDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Tokens as fast as gRPC takes them: one token per message, token id 65 ('A')."""

    def __init__(self, address_of):
        self._address_of = address_of
        self.link_port = 0  # its raw link port (serve_raw_link), offered in Stats like a real worker's
        self._msg = decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=[65]))

    async def Generate(self, request, context):
        msg = self._msg
        n = request.sampling.max_tokens - len(request.resume_token_ids)
        for _ in range(n):
            yield msg
        usage = common_pb2.Usage(computed_tokens=len(request.prompt_token_ids) + n)
        yield decode_pb2.DecodeServiceGenerateResponse(
            final=decode_pb2.DecodeFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage)
        )

    async def Link(self, request_iterator, context):
        """The link as a worker with zero step time: per "step", one frame with one token
        (id 65) for every open request, ends in the same frame as the last token."""
        left: dict[int, int] = {}  # link_id -> tokens still to send
        prompt: dict[int, int] = {}
        more = asyncio.Event()
        reading = True

        async def read() -> None:
            nonlocal reading
            async for f in request_iterator:
                if f.WhichOneof("frame") == "open":
                    r = f.open.request
                    left[f.open.link_id] = r.sampling.max_tokens - len(r.resume_token_ids)
                    prompt[f.open.link_id] = len(r.prompt_token_ids)
                elif f.cancel.link_id in left:
                    del left[f.cancel.link_id]
                    yield_cancel.append(f.cancel.link_id)
                more.set()
            reading = False
            more.set()

        yield_cancel: list[int] = []
        reader = asyncio.create_task(read())
        try:
            while reading or left:
                if not left and not yield_cancel:
                    more.clear()
                    await more.wait()
                    continue
                tokens, ends = [], []
                for lid in list(left):
                    tokens.append(decode_pb2.LinkTokens(link_id=lid, token_ids=(65,)))
                    left[lid] -= 1
                    if left[lid] <= 0:
                        del left[lid]
                        usage = common_pb2.Usage(computed_tokens=prompt.pop(lid))
                        final = decode_pb2.DecodeFinal(
                            finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage
                        )
                        ends.append(decode_pb2.LinkEnd(link_id=lid, final=final))
                for lid in yield_cancel:
                    ends.append(decode_pb2.LinkEnd(link_id=lid, error=decode_pb2.LinkStatus(code=1)))
                yield_cancel.clear()
                yield decode_pb2.DecodeServiceLinkResponse(tokens=tokens, ends=ends)
                await asyncio.sleep(0)  # let new opens and cancels in between "steps"
        finally:
            reader.cancel()

    async def SubscribeKvEvents(self, request, context):
        yield worker_pb2.SubscribeKvEventsResponse(worker_id="fake", snapshot=worker_pb2.KvCacheSnapshot())
        await asyncio.Event().wait()

    async def Stats(self, request, context):
        info = common_pb2.WorkerInfo(
            worker_id="fake",
            address=self._address_of(),
            role=common_pb2.WORKER_ROLE_DECODE,
            model_id="builtin-tiny",
            block_size=16,
            max_model_len=HUGE,
            link_port=self.link_port,
        )
        return worker_pb2.StatsResponse(info=info, load=common_pb2.WorkerLoad(free_blocks=1 << 20))


async def serve_raw_link(fake: ZeroCostDecode) -> int:
    """The fake's Link on a raw link port too (services/common/link_wire.py's frames), as a real
    decode worker serves it (services/decode/link_server.py); returns the port."""
    from services.common import link_wire

    class Conn(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.inbox = transport, link_wire.FrameInbox()
            self.frames = link_wire.FrameBuffer(1 << 26)
            self.writable = asyncio.Event()
            self.writable.set()
            self.task = asyncio.get_running_loop().create_task(self.serve())

        def pause_writing(self):  # the router is behind: wait, as a real worker's link does
            self.writable.clear()

        def resume_writing(self):
            self.writable.set()

        def data_received(self, data):
            for body in self.frames.feed(data):
                self.inbox.put(decode_pb2.DecodeServiceLinkRequest.FromString(body))

        def connection_lost(self, exc):
            self.inbox.close()
            self.task.cancel()

        async def serve(self):
            async for frame in fake.Link(self.inbox, None):
                self.transport.write(link_wire.encode(frame))
                await self.writable.wait()

    server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", 0)
    return server.sockets[0].getsockname()[1]


async def serve_fake(port_file: str) -> None:
    from services.common.server import MeshServer, ServerConfig

    server = MeshServer(ServerConfig(port=0, port_file=port_file, drain_grace_s=1), "pdmesh.v1.DecodeService")
    fake = ZeroCostDecode(lambda: server.address)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(fake, server.server)
    if RAW_LINK:
        fake.link_port = await serve_raw_link(fake)
    await server.start()
    await server.set_ready(True)
    server.install_signal_handlers()
    await server.wait_stopped()


# ---- client side ---------------------------------------------------------------


def channel(address: str) -> grpc.aio.Channel:
    # Own TCP connection per channel, so SO_REUSEPORT can spread them over processes.
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def router_request(max_tokens: int) -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
    return router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=PROMPT), sampling=sampling)


def decode_request(max_tokens: int, i: int) -> decode_pb2.DecodeServiceGenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
    return decode_pb2.DecodeServiceGenerateRequest(
        request_id=f"b{i}", prompt_token_ids=PROMPT, sampling=sampling
    )


async def ttft(address: str, direct: bool, n: int) -> list[float]:
    """Time to the first message of n sequential 1-token requests, in ms."""
    out = []
    async with channel(address) as ch:
        stub = decode_pb2_grpc.DecodeServiceStub(ch) if direct else router_pb2_grpc.RouterServiceStub(ch)
        for i in range(n + 20):  # the first 20 warm up
            req = decode_request(1, i) if direct else router_request(1)
            t0 = time.perf_counter()
            call = stub.Generate(req, timeout=30)
            await call.read()
            t1 = time.perf_counter()
            while await call.read() is not grpc.aio.EOF:
                pass
            if i >= 20:
                out.append((t1 - t0) * 1000)
    return out


async def stream_rate(addresses: list[str], direct: bool, streams: int, duration: float) -> dict[str, float]:
    """Rates of `streams` concurrent endless streams stopped after `duration` s: tokens/s,
    client messages/s, and the client's CPU share."""
    tokens = msgs = 0
    stop = time.perf_counter() + duration

    async def one(address: str, i: int) -> None:
        nonlocal tokens, msgs
        async with channel(address) as ch:
            if direct:
                call = decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_request(LONG, i), timeout=600)
            else:
                call = router_pb2_grpc.RouterServiceStub(ch).Generate(router_request(LONG), timeout=600)
            async for msg in call:
                tokens += len(msg.tokens.token_ids) if direct else len(msg.delta.token_ids)
                msgs += 1
                if time.perf_counter() >= stop:
                    call.cancel()
                    break

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(addresses[i % len(addresses)], i) for i in range(streams)))
    wall = time.perf_counter() - t0
    return {
        "tok": tokens / wall,
        "msgs": msgs / wall,
        "tokens": tokens,
        "client_cpu": (time.process_time() - cpu0) / wall,
    }


def run_cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run, from the scheduler's own account
    (/proc/<pid>/task/*/schedstat, nanoseconds). /proc/<pid>/stat counts clock ticks, which a
    process that runs in sub-tick bursts between epoll waits (a router relaying messages)
    dodges or catches by chance on a loaded machine: the same code read 5 to 500 us per
    message from it. Falls back to the tick count where schedstat is missing."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return proc_cpu_s(pid)
    return total / 1e9


async def routed_rate(
    router_pids: list[int], addresses: list[str], streams: int, duration: float
) -> dict[str, float]:
    """`stream_rate` through routers, with the routers' CPU microseconds per relayed token."""
    cpu0 = sum(run_cpu_s(p) for p in router_pids)
    r = await stream_rate(addresses, False, streams, duration)
    r["router_us_per_token"] = (sum(run_cpu_s(p) for p in router_pids) - cpu0) / max(r["tokens"], 1) * 1e6
    return r


async def http_rate(address: str, streams: int, duration: float) -> dict[str, float]:
    """SSE events/s (and tokens/s) of `streams` endless /v1/completions streams through the
    HTTP door, each on its own connection, stopped after `duration` s by closing it.

    A raw HTTP/1.1 client on asyncio streams: events are counted by their blank-line
    ends and tokens by their text (the fake's token 65 is "A", the only capital A a
    chunk holds), so the client parses no JSON and leaves the CPU to the router."""
    import json

    host, port = address.rsplit(":", 1)
    body = json.dumps({"prompt": PROMPT, "max_tokens": LONG, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    events = tokens = 0
    stop = time.perf_counter() + duration

    async def one() -> None:
        nonlocal events, tokens
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body)
        tail = b""
        try:
            status = await reader.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"HTTP door answered {status!r}: {await reader.read(500)!r}")
            while time.perf_counter() < stop:
                data = await reader.read(65536)
                if not data:
                    break
                events += (tail + data).count(b"\n\n")  # an event's end split over reads counts once
                tokens += data.count(b"A")
                tail = data[-1:]
        finally:
            writer.close()  # the client goes away: the router cancels the request

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(streams)))
    wall = time.perf_counter() - t0
    return {
        "msgs": events / wall,
        "tok": tokens / wall,
        "tokens": tokens,
        "events": events,
        "client_cpu": (time.process_time() - cpu0) / wall,
    }


async def http_routed_rate(router_pid: int, address: str, streams: int, duration: float) -> dict[str, float]:
    """`http_rate` with the router's CPU microseconds per SSE event."""
    cpu0 = run_cpu_s(router_pid)
    r = await http_rate(address, streams, duration)
    r["router_us_per_event"] = (run_cpu_s(router_pid) - cpu0) / max(r["events"], 1) * 1e6
    return r


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


# ---- orchestration -----------------------------------------------------------------


LINK = True  # the router reaches the fake over DecodeService.Link (--no-link: Generate per request)
RAW_LINK = True  # ... on the fake's raw link port (--grpc-link: Link over gRPC)


def start_router(launcher: Launcher, name: str, fake: str, port: int = 0):
    args = flags(
        decode_link=str(LINK).lower(),
        raw_link=str(RAW_LINK).lower(),
        port=port,
        http_port=0,  # the OpenAI-compatible door of the same process (http_msgs_per_s)
        so_reuseport=1,
        decode_workers=[fake],
        policy="round_robin",
        max_model_len=HUGE,
        limits_max_tokens_limit=HUGE,
        limits_max_prompt_tokens=HUGE,
        admission_max_inflight=1024,
        stall_timeout_s=0,
        log_level="warning",
    )
    return launcher.start_ready(
        ServiceSpec(name, "services.router.main", args, ready_service="pdmesh.v1.RouterService")
    )


async def measure(fake: str, router: str, router_pid: int, quick: bool) -> dict[str, dict[str, float]]:
    n_ttft = 200 if quick else 1000
    dur = 1.5 if quick else 4.0
    direct = await ttft(fake, True, n_ttft)
    via = await ttft(router, False, n_ttft)
    return {
        "ttft": {
            "direct_p50": pct(direct, 0.5),
            "direct_p99": pct(direct, 0.99),
            "p50": pct(via, 0.5),
            "p99": pct(via, 0.99),
            "overhead_p50": pct(via, 0.5) - pct(direct, 0.5),
        },
        "direct_1": await stream_rate([fake], True, 1, dur),
        "router_1": await routed_rate([router_pid], [router], 1, dur),
        "direct_8": await stream_rate([fake], True, 8, dur),
        "router_8": await routed_rate([router_pid], [router], 8, dur),
        "router_64": await routed_rate([router_pid], [router], 64, dur),
        "one_proc_16": await routed_rate([router_pid], [router], 16, dur),
    }


def plot_scale(runs: list[tuple[Study, list[PolicyResult], float]], folder: Path) -> Path:
    """One PNG: hit rate, TTFT p50, TTFT p99 and goodput against the worker count, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("prefix-cache hit rate", lambda r: r.hit),
        ("TTFT p50 (model ms)", lambda r: r.ttft_ms["p50"]),
        ("TTFT p99 (model ms)", lambda r: r.ttft_ms["p99"]),
        ("goodput (req/s, model)", lambda r: r.goodput_rps),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    workers = [study.workers for study, _, _ in runs]
    for ax, (title, metric) in zip(axes, panels, strict=True):
        for policy in runs[0][0].policies:
            ys = [metric(by_policy(results)[policy]) for _, results, _ in runs]
            ax.plot(workers, ys, marker="o", label=policy)
        if title.startswith("prefix"):
            ax.plot(workers, [ideal for _, _, ideal in runs], "k--", label="one unbounded cache")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("sim decode workers")
        ax.set_xticks(workers)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    s0 = runs[0][0]
    fig.suptitle(
        f"Mooncake conversation, first {s0.requests} requests, offered load per worker fixed "
        f"(model time_factor {s0.time_factor * s0.workers:g}/workers); {s0.profile}, "
        f"{s0.num_blocks * s0.block_size:,} KV tokens per worker; model time",
        fontsize=10,
    )
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "routing_scale.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def part1(studies: list[Study], sizes: tuple[int, ...] = ()) -> dict[str, str]:
    """Each study (one per offered load); the last line's fields come from the heaviest
    load at which round_robin still achieved >= 95% of kv_aware's throughput. Then the
    headline study at each of `sizes` workers (offered load per worker fixed)."""
    print(f"cpu: {cpu_model()} x{os.cpu_count()}; load average {os.getloadavg()[0]:.1f}")
    runs = []
    ideals = {}
    for study in studies:
        print(f"part 1: routing quality, {study.name} study, model time_factor {study.time_factor:g}")
        results, ideal = run_study(study)
        print_study(study, results, ideal)
        runs.append((study, by_policy(results)))
        ideals[study.name] = ideal
    print("load sweep (model time; offered = requests / model-time span of the trace):")
    head = None
    for study, p in runs:
        kv, rr = p["kv_aware"], p["round_robin"]
        equal = rr.request_rps >= 0.95 * kv.request_rps
        print(
            f"  time_factor {study.time_factor:g}: achieved {kv.request_rps:.2f} / {rr.request_rps:.2f} req/s "
            f"(kv / rr), mean TTFT x{kv.ttft_ms['mean'] / rr.ttft_ms['mean']:.2f}, p99 "
            f"x{kv.ttft_ms['p99'] / rr.ttft_ms['p99']:.2f}, hit {kv.hit:.3f} / {rr.hit:.3f}"
            + ("" if equal else "  (round_robin fell behind: not equal throughput)")
        )
        if equal and (head is None or study.time_factor < head[0].time_factor):
            head = (study, p)
    study, p = head or runs[-1]
    kv, rr, ll = p["kv_aware"], p["round_robin"], p["least_loaded"]
    print(f"headline: time_factor {study.time_factor:g}")
    out = {"pull_share": f"{p['kv_aware@pull'].pull_share:.3f}"} if "kv_aware@pull" in p else {}
    hit_vs_ideal = kv.hit / ideals[study.name]
    for n in sizes:
        scaled = scale_study(n, study)
        print(f"part 1: routing quality at {n} workers (the headline study, load per worker fixed)")
        results, ideal = run_study(scaled)
        print_study(scaled, results, ideal)
        q = by_policy(results)
        out |= {
            f"hit_kv_{n}": f"{q['kv_aware'].hit:.3f}",
            f"ttft_kv_vs_rr_{n}": f"{q['kv_aware'].ttft_ms['mean'] / q['round_robin'].ttft_ms['mean']:.2f}",
            f"ttft_p99_kv_vs_rr_{n}": f"{q['kv_aware'].ttft_ms['p99'] / q['round_robin'].ttft_ms['p99']:.2f}",
        }
        hit_vs_ideal = q["kv_aware"].hit / ideal  # at the largest size run
    return out | {
        "hit_vs_ideal": f"{hit_vs_ideal:.2f}",
        "hit_kv": f"{kv.hit:.3f}",
        "hit_rr": f"{rr.hit:.3f}",
        "ttft_kv_vs_rr": f"{kv.ttft_ms['mean'] / rr.ttft_ms['mean']:.2f}",
        "hit_ll": f"{ll.hit:.3f}",
        "ttft_ll_vs_rr": f"{ll.ttft_ms['mean'] / rr.ttft_ms['mean']:.2f}",
        "ttft_p99_kv_vs_rr": f"{kv.ttft_ms['p99'] / rr.ttft_ms['p99']:.2f}",
    }


def part2(quick: bool) -> dict[str, str]:
    import uvloop

    print("part 2: the router's own cost")
    dur = 1.5 if quick else 4.0
    with Launcher(tempfile.mkdtemp(prefix="bench-routing-")) as launcher:
        fake = launcher.start_ready(
            ServiceSpec(
                "fake-decode", "bench.routing", ("--serve-fake",), ready_service="pdmesh.v1.DecodeService"
            )
        )
        router = start_router(launcher, "router-1", fake.address)
        r = uvloop.run(measure(fake.address, router.address, router.proc.pid, quick))
        r["http_64"] = uvloop.run(http_routed_rate(router.proc.pid, router.http_address, 64, dur))
        second = start_router(launcher, "router-2", fake.address, port=router.port)
        pids = [router.proc.pid, second.proc.pid]
        r["two_proc_16"] = uvloop.run(routed_rate(pids, [router.address], 16, dur))
        launcher.stop(second)
    return report(r)


def run_scale() -> int:
    print(f"cpu: {cpu_model()} x{os.cpu_count()}; load average {os.getloadavg()[0]:.1f}")
    runs = []
    for n in SCALE_WORKERS:
        study = scale_study(n)
        print(f"scale study: {n} workers")
        results, ideal = run_study(study)
        print_study(study, results, ideal)
        runs.append((study, results, ideal))
    print(f"plot: {plot_scale(runs, Path(__file__).resolve().parent / 'results')}")
    kv = {}
    for study, results, _ in runs:
        p = by_policy(results)
        ratio = p["kv_aware"].ttft_ms["mean"] / p["round_robin"].ttft_ms["mean"]
        kv |= {
            f"hit_kv_{study.workers}": f"{p['kv_aware'].hit:.3f}",
            f"hit_rr_{study.workers}": f"{p['round_robin'].hit:.3f}",
            f"ttft_kv_vs_rr_{study.workers}": f"{ratio:.2f}",
        }
    print("routing_scale " + " ".join(f"{k}={v}" for k, v in kv.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter runs (< 3 min in all)")
    p.add_argument("--part", choices=("1", "2", "3", "all"), default="all")
    p.add_argument("--scale", action="store_true", help="part 1 at 8, 16 and 32 workers, with plots")
    p.add_argument("--decision", action="store_true", help="only part 3: the cost of one routing decision")
    p.add_argument(
        "--ablation",
        action="store_true",
        help="part 1 also runs kv_aware@lv (own load view), kv_aware@opt (+ optimistic prefixes) "
        "and kv_aware@pull (+ prefixes pulled instead of recomputed)",
    )
    p.add_argument(
        "--sizes", default="8", help="part 1 also at these worker counts (comma-separated; '' = none)"
    )
    p.add_argument(
        "--requests", type=int, help="part 1: first N requests of the trace (default: the study's)"
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="part 1: run the simulated GPUs this many times slower, for a busy machine (model figures stay)",
    )
    p.add_argument("--no-link", action="store_true", help="part 2: the router calls Generate per request")
    p.add_argument(
        "--grpc-link", action="store_true", help="part 2: the Link over gRPC, not the fake's raw link port"
    )
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_fake:
        import uvloop

        uvloop.run(serve_fake(args.port_file))
        return 0
    if args.scale:
        return run_scale()
    if args.decision:
        r = run_decision()
        print("routing_decision " + " ".join(f"{k}={v}" for k, v in r.items()))
        return 0
    global LINK, RAW_LINK
    LINK = not args.no_link
    RAW_LINK = not args.grpc_link
    studies = (
        [QUICK]
        if args.quick
        else [
            replace(FULL, name=f"full-tf{tf:g}", time_factor=tf, speedup=tf / FULL.wall_factor)
            for tf in FULL_LOADS
        ]
    )
    policies = POLICIES + (("kv_aware@lv", "kv_aware@opt", "kv_aware@pull") if args.ablation else ())
    studies = [
        replace(
            s,
            requests=args.requests or s.requests,
            speedup=s.speedup / args.slowdown,
            policies=policies,
        )
        for s in studies
    ]
    sizes = tuple(int(n) for n in args.sizes.split(",") if n.strip())
    quality = part1(studies, sizes) if args.part in ("1", "all") else {}
    cost = part2(args.quick) if args.part in ("2", "all") else {}
    decision = run_decision() if args.part in ("3", "all") else {}
    order = ("hit_kv", "hit_rr", "ttft_kv_vs_rr", "router_overhead_ms_p50", "ttft_p50_ms", "ttft_p99_ms")
    order += ("router_msgs_per_s", "router_tokens_per_s", "http_msgs_per_s", "scale_2proc", "hit_ll")
    order += ("ttft_ll_vs_rr",)
    order += ("ttft_p99_kv_vs_rr",)
    order += tuple(f"{k}_{n}" for n in sizes for k in ("hit_kv", "ttft_kv_vs_rr", "ttft_p99_kv_vs_rr"))
    order += ("hit_vs_ideal", "decision_ms_p50", "pull_share")
    fields = {"pull_share": "0"} | quality | cost | decision  # 0 unless --ablation ran kv_aware@pull
    kv = {k: fields[k] for k in order if k in fields}
    print("routing " + " ".join(f"{k}={v}" for k, v in kv.items()))
    return 0


def run_decision() -> dict[str, str]:
    """Part 3 (bench/routing_decision.py): one routing decision at 32 workers x 10,000 prefixes."""
    from bench.routing_decision import run

    print("part 3: one routing decision")
    r = run()
    return {
        "decision_ms_p50": f"{r['decision_ms_p50']:.3f}",
        "decision_cpu_ms_p50": f"{r['decision_cpu_ms_p50']:.3f}",
    }


def report(r: dict[str, dict[str, float]]) -> dict[str, str]:
    t, d1, r1, d8, r8 = r["ttft"], r["direct_1"], r["router_1"], r["direct_8"], r["router_8"]
    one, two = r["one_proc_16"], r["two_proc_16"]
    scale = two["tok"] / one["tok"]
    print(
        f"cpu: {cpu_model()} x{os.cpu_count()}; load average {os.getloadavg()[0]:.1f} (shared: rates follow "
        f"the load); token path: {'Link' if LINK else 'Generate per request'}"
    )
    print(
        f"TTFT of a 1-token request, sequential: direct p50 {t['direct_p50']:.2f} ms, p99 {t['direct_p99']:.2f} ms"
    )
    print(
        f"  through the router: p50 {t['p50']:.2f} ms, p99 {t['p99']:.2f} ms; router hop +{t['overhead_p50']:.2f} ms p50"
        " (targets: p50 <= 2.2 ms, p99 <= 10 ms)"
    )
    print(
        f"1 stream, 1 token per worker message: direct {d1['tok']:,.0f} msgs/s (client CPU {d1['client_cpu']:.0%}); "
        f"relayed {r1['tok']:,.0f} msgs/s as {r1['msgs']:,.0f} client msgs/s; "
        f"router CPU {r1['router_us_per_token']:.0f} us per relayed message (target >= 20,000 msgs/s)"
    )
    print(
        f"8 streams: direct {d8['tok']:,.0f} tokens/s; via the router {r8['tok']:,.0f} tokens/s in "
        f"{r8['msgs']:,.0f} client msgs/s (x{r8['tok'] / max(r8['msgs'], 1):.2f} coalesced), "
        f"router CPU {r8['router_us_per_token']:.0f} us/token (target >= 80,000 tokens/s)"
    )
    r64 = r["router_64"]
    print(
        f"64 streams, 1 token per worker message: via the router {r64['tok']:,.0f} tokens/s in "
        f"{r64['msgs']:,.0f} client msgs/s, router CPU {r64['router_us_per_token']:.0f} us/token "
        "(target >= 20,000 msgs/s)"
    )
    print(
        f"16 streams on 16 connections: 1 router {one['tok']:,.0f} tokens/s, 2 routers on one port "
        f"{two['tok']:,.0f} tokens/s: x{scale:.2f} (target >= 1.7)"
    )
    if (h := r.get("http_64")) is not None:
        print(
            f"HTTP door, 64 SSE streams on 64 connections: {h['msgs']:,.0f} events/s carrying "
            f"{h['tok']:,.0f} tokens/s (x{h['tok'] / max(h['msgs'], 1):.2f} tokens per event), router CPU "
            f"{h['router_us_per_event']:.0f} us per event, client CPU {h['client_cpu']:.0%} "
            "(target >= 20,000 msgs/s)"
        )
    return {
        "http_msgs_per_s": f"{r['http_64']['msgs']:.0f}" if "http_64" in r else "nan",
        "router_overhead_ms_p50": f"{t['overhead_p50']:.3f}",
        "ttft_p50_ms": f"{t['p50']:.3f}",
        "ttft_p99_ms": f"{t['p99']:.3f}",
        "router_msgs_per_s": f"{r64['msgs']:.0f}",
        "router_msgs_per_s_1stream": f"{r1['tok']:.0f}",
        "router_tokens_per_s": f"{r8['tok']:.0f}",
        "scale_2proc": f"{scale:.2f}",
    }


if __name__ == "__main__":
    sys.exit(main())
