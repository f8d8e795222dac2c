"""Routing benchmarks. Part 2: the router's own cost.

The router runs as a real process (`services.router.main`) in front of a
zero-cost fake decode worker (another process, defined here: it answers
Generate with tokens as fast as gRPC lets it, one token per message, and
serves Stats/health/KV events like a worker). The client is this process
(grpc.aio on uvloop). Measured:

- TTFT of a 1-token request, sequentially: through the router vs calling the
  fake directly; the difference is the router hop (router_overhead_ms_p50);
- messages/s relayed with one token per message over 1 stream
  (router_msgs_per_s; the fake's own rate read directly, for comparison);
- tokens/s over 1 and 8 streams with the router coalescing whatever is ready
  into one client message (router_tokens_per_s is the 8-stream figure);
- 1 vs 2 router processes sharing one port with SO_REUSEPORT, 16 streams on
  16 connections (scale_2proc = aggregate tokens/s ratio).

Everything shares this machine's cores (client, fake, routers): on a 2-core
machine the fake and the client take CPU the routers would otherwise get, so
the scale ratio is bounded well below 2 there. Each rate is printed with the
client's CPU share. Part 1 (policy comparison on simulated workers) is not in
this file yet.

Run: `python bench/routing.py` or `python bench/routing.py --quick`. The last
line is `routing router_overhead_ms_p50=.. ttft_p50_ms=.. ttft_p99_ms=..
router_msgs_per_s=.. router_tokens_per_s=.. scale_2proc=..`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/routing.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

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
        )
        return worker_pb2.StatsResponse(info=info, load=common_pb2.WorkerLoad(free_blocks=1 << 20))


async def serve_fake(port_file: str) -> None:
    from services.common.server import MeshServer, ServerConfig

    server = MeshServer(ServerConfig(port=0, port_file=port_file, drain_grace_s=1), "pdmesh.v1.DecodeService")
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(ZeroCostDecode(lambda: server.address), server.server)
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


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


async def routed_rate(
    router_pids: list[int], addresses: list[str], streams: int, duration: float
) -> dict[str, float]:
    """`stream_rate` through routers, with the routers' CPU microseconds per relayed token."""
    cpu0 = sum(proc_cpu_s(p) for p in router_pids)
    r = await stream_rate(addresses, False, streams, duration)
    r["router_us_per_token"] = (sum(proc_cpu_s(p) for p in router_pids) - cpu0) / max(r["tokens"], 1) * 1e6
    return r


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


# ---- orchestration -----------------------------------------------------------------


def start_router(launcher: Launcher, name: str, fake: str, port: int = 0):
    args = flags(
        port=port,
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
        "one_proc_16": await routed_rate([router_pid], [router], 16, dur),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer samples, shorter runs (< 1 min)")
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import uvloop

    if args.serve_fake:
        uvloop.run(serve_fake(args.port_file))
        return 0
    dur = 1.5 if args.quick else 4.0
    with Launcher(tempfile.mkdtemp(prefix="bench-routing-")) as launcher:
        fake = launcher.start_ready(
            ServiceSpec(
                "fake-decode", "bench.routing", ("--serve-fake",), ready_service="pdmesh.v1.DecodeService"
            )
        )
        router = start_router(launcher, "router-1", fake.address)
        r = uvloop.run(measure(fake.address, router.address, router.proc.pid, args.quick))
        second = start_router(launcher, "router-2", fake.address, port=router.port)
        pids = [router.proc.pid, second.proc.pid]
        r["two_proc_16"] = uvloop.run(routed_rate(pids, [router.address], 16, dur))
        launcher.stop(second)
    report(r)
    return 0


def report(r: dict[str, dict[str, float]]) -> None:
    t, d1, r1, d8, r8 = r["ttft"], r["direct_1"], r["router_1"], r["direct_8"], r["router_8"]
    one, two = r["one_proc_16"], r["two_proc_16"]
    scale = two["tok"] / one["tok"]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared: rates follow the load)")
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
    print(
        f"16 streams on 16 connections: 1 router {one['tok']:,.0f} tokens/s, 2 routers on one port "
        f"{two['tok']:,.0f} tokens/s: x{scale:.2f} (target >= 1.7)"
    )
    print(
        f"routing router_overhead_ms_p50={t['overhead_p50']:.3f} ttft_p50_ms={t['p50']:.3f} "
        f"ttft_p99_ms={t['p99']:.3f} router_msgs_per_s={r1['tok']:.0f} "
        f"router_tokens_per_s={r8['tok']:.0f} scale_2proc={scale:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
