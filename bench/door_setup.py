"""The router's CPU per HTTP request, set-up included: what a burst of arrivals queues behind.

    .venv/bin/python bench/door_setup.py [--requests 1500] [--burst 10] [--prompt 1782] [--rounds 3]

A router process (the HTTP door, the raw link) in front of `bench/routing.py`'s zero-cost
fake decode worker, both real processes on loopback. The client sends streaming
/v1/completions requests with token-id prompts of `--prompt` ids (1,782: the mean of the
Dynamo side by side's Mooncake trace at length factor 8) and 2 output tokens, `--burst` at a
time on new connections (as bench.loadgen's client does: no pool), and reads each to its
end. Per round: the router's CPU per request (its /proc CPU time over the round / requests)
and the TTFT of the burst's requests (send to the first SSE event). Each round starts a
fresh router. With 2 tokens a request, the per-token path is a small share: this measures
parse, validation, routing and the link's open, which a burst's requests pay one after
another on the router's one event loop (BENCHMARKS.md, issue 16, session 9).

Ends with `door_setup router_us_per_request=.. ttft_burst_mean_ms=.. ttft_burst_p50_ms=..`
(medians over the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

from bench import routing
from bench.machine import cpu_model
from pdmesh.launcher import Launcher, ServiceSpec


async def _one(host: str, port: int, body: bytes) -> float:
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    writer.write(head + body)
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"the HTTP door answered {status!r}: {await reader.read(500)!r}")
        first, buf = None, b""
        while True:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError("the stream ended before [DONE]")
            buf += data
            if first is None and b"data: {" in buf:
                first = time.perf_counter() - t0
            if b"[DONE]" in buf:
                return first if first is not None else time.perf_counter() - t0
    finally:
        writer.close()


async def _round(pid: int, address: str, requests: int, burst: int, prompt: int) -> tuple[float, list[float]]:
    host, port = address.rsplit(":", 1)
    rng = random.Random(0)
    bodies = [
        json.dumps(
            {"prompt": [rng.randrange(3, 250) for _ in range(prompt)], "max_tokens": 2, "stream": True}
        ).encode()
        for _ in range(50)
    ]
    for i in range(20):  # warm up: channels, caches, the loop
        await _one(host, int(port), bodies[i % 50])
    cpu0 = routing.run_cpu_s(pid)
    ttfts: list[float] = []
    for i in range(0, requests, burst):
        ttfts += await asyncio.gather(*(_one(host, int(port), bodies[(i + k) % 50]) for k in range(burst)))
    return (routing.run_cpu_s(pid) - cpu0) / len(ttfts) * 1e6, ttfts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--burst", type=int, default=10)
    p.add_argument("--prompt", type=int, default=1782, help="token ids per prompt")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import uvloop

    print(f"cpu: {cpu_model()} x{os.cpu_count()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(
        f"door set-up: {args.requests} requests in bursts of {args.burst}, {args.prompt}-id prompts, "
        "2 tokens each, zero-cost fake over the raw link",
        flush=True,
    )
    cpus, means, p50s = [], [], []
    for r in range(args.rounds):
        with Launcher(tempfile.mkdtemp(prefix="door-setup-")) as launcher:
            fake = launcher.start_ready(
                ServiceSpec(
                    "fake-decode", "bench.routing", ("--serve-fake",), ready_service="pdmesh.v1.DecodeService"
                )
            )
            router = routing.start_router(launcher, "router", fake.address)
            us, ttfts = uvloop.run(
                _round(router.proc.pid, router.http_address, args.requests, args.burst, args.prompt)
            )
        ms = sorted(t * 1e3 for t in ttfts)
        cpus.append(us)
        means.append(statistics.mean(ms))
        p50s.append(ms[len(ms) // 2])
        print(
            f"  round {r + 1}: router CPU {us:.0f} us per request; TTFT mean {means[-1]:.2f} ms, "
            f"p50 {p50s[-1]:.2f} ms, p99 {ms[min(len(ms) - 1, int(len(ms) * 0.99))]:.2f} ms",
            flush=True,
        )
    print(
        f"door_setup router_us_per_request={statistics.median(cpus):.0f} "
        f"ttft_burst_mean_ms={statistics.median(means):.2f} ttft_burst_p50_ms={statistics.median(p50s):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
