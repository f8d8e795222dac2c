"""Shedding under a burst (issue 18 items 0 and 4): how fast a shed request hears
so, and whether its retry hint tells the truth about the queue.

A real router process (`services.router.main`, admission on: `--admission-max-inflight`
slots, `--admission-queue-limit-per-priority` waiters) in front of a fake decode
worker process defined here (`--serve-fake`): each Generate sends its first token at
once, then holds for `--service-s` and ends (so a request's TTFT through the router is
its queue wait, and the mesh's capacity is slots / service time). The client (this
process, grpc.aio on uvloop) offers `--burst` x that capacity, open loop (arrivals on
a fixed schedule, not waiting for answers), for `--seconds`, and measures per request:

- a shed one (RESOURCE_EXHAUSTED): the time from sending to the status (rejection
  p50/p99) and its "retry-after-ms" hint;
- an admitted one: its TTFT, i.e. how long it waited in the queue.

`hint_vs_wait` = median hint of the queue-full sheds / median queue wait of the
admitted requests that queued (before issue 18 the hint counted only higher
priorities: ~50 ms against seconds of queue, ratio ~0.02; target ~1). The client
shares the machine's cores with the router and the fake: on a busy 2-core machine
the rejection latency includes the client's and the router's scheduling delays.

Run: `python bench/shed.py [--burst 20] [--seconds 3]`; the last line is
`shed rejection_p50_ms=.. rejection_p99_ms=.. shed_share=.. hint_p50_ms=..
queued_wait_p50_ms=.. hint_vs_wait=.. hint_spread=.. admitted_ok=.. router_us_per_request=.. core_shed_us=.. core_shed_10k_vs_16=..`
(hint_spread = distinct hints / queue-full sheds: the jitter; admitted_ok = share of
admitted requests that completed; router_us_per_request = the router process's CPU
over the burst per request sent, which does not depend on the machine's load;
core_shed_us = one rejection in the admission core alone, and core_shed_10k_vs_16 its
cost with 10,000 waiters queued over 16: ~1 when the shed path is O(1)).
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

import grpc

from bench.machine import cpu_model
from bench.routing_quality import proc_cpu_s
from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2

PROMPT = list(range(1, 17))


class SlowDecode(decode_pb2_grpc.DecodeServiceServicer):
    """First token at once, then `service_s` of "decoding", then the end."""

    def __init__(self, address_of, service_s: float):
        self._address_of = address_of
        self.service_s = service_s

    async def Generate(self, request, context):
        yield decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=[65]))
        await asyncio.sleep(self.service_s)
        usage = common_pb2.Usage(computed_tokens=len(request.prompt_token_ids) + 1, completion_tokens=2)
        yield decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=[66]))
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
            max_model_len=4096,
        )
        return worker_pb2.StatsResponse(info=info, load=common_pb2.WorkerLoad(free_blocks=1 << 20))


async def serve_fake(port_file: str, service_s: float) -> None:
    from services.common.server import MeshServer, ServerConfig

    server = MeshServer(ServerConfig(port=0, port_file=port_file, drain_grace_s=1), "pdmesh.v1.DecodeService")
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(
        SlowDecode(lambda: server.address, service_s), server.server
    )
    await server.start()
    await server.set_ready(True)
    server.install_signal_handlers()
    await server.wait_stopped()


def start_router(launcher: Launcher, fake: str, slots: int, queue: int):
    args = flags(
        decode_link="false",  # one Generate per request to the fake
        port=0,
        decode_workers=[fake],
        policy="round_robin",
        admission_max_inflight=slots,
        admission_queue_limit_per_priority=queue,
        admission_queue_timeout_s=60,
        stall_timeout_s=0,
        log_level="warning",
    )
    return launcher.start_ready(
        ServiceSpec("router", "services.router.main", args, ready_service="pdmesh.v1.RouterService")
    )


async def one(stub, i: int, out: dict) -> None:
    req = router_pb2.GenerateRequest(
        request_id=f"s{i}",
        token_ids=common_pb2.TokenIds(ids=PROMPT),
        sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
    )
    t0 = time.perf_counter()
    call = stub.Generate(req, timeout=120)
    try:
        await call.read()
        out["ttft"].append(time.perf_counter() - t0)
        while await call.read() is not grpc.aio.EOF:
            pass
        out["ok"] += 1
    except grpc.aio.AioRpcError as e:
        dt = time.perf_counter() - t0
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            out["rejected"].append(dt)
            md = dict(e.trailing_metadata() or ())
            if "queue" in (e.details() or "") and "retry-after-ms" in md:
                out["hints"].append(int(md["retry-after-ms"]) / 1000.0)
        else:
            out["errors"][e.code().name] = out["errors"].get(e.code().name, 0) + 1


async def burst(address: str, rate: float, seconds: float, channels: int = 8) -> dict:
    out: dict = {"ttft": [], "rejected": [], "hints": [], "ok": 0, "errors": {}}
    chans = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(channels)
    ]
    stubs = [router_pb2_grpc.RouterServiceStub(c) for c in chans]
    for s in stubs:  # warm the connections
        await one(s, -1, {"ttft": [], "rejected": [], "hints": [], "ok": 0, "errors": {}})
    n = int(rate * seconds)
    tasks = []
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(stubs[i % channels], i, out)))
    await asyncio.gather(*tasks)
    for c in chans:
        await c.close()
    out["sent"] = n
    return out


def core_shed_us(queue: int, n: int = 20_000) -> float:
    """Microseconds per queue-full rejection of the admission core alone, with `queue`
    waiters queued: flat in `queue` when the shed path scans nothing (issue 18 item 4)."""
    from services.router.admission import AdmissionConfig, AdmissionController, AdmissionRejected

    ctl = AdmissionController(AdmissionConfig(max_inflight=8, queue_limit_per_priority=queue))
    for _ in range(8 + queue):
        ctl.try_admit("t")
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            ctl.try_admit("t")
        except AdmissionRejected:
            pass
    return (time.perf_counter() - t0) / n * 1e6


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--service-s", type=float, default=0.5, help="how long each request holds its slot")
    p.add_argument("--slots", type=int, default=8, help="router admission slots")
    p.add_argument("--queue", type=int, default=16, help="waiters per priority before shedding")
    p.add_argument("--burst", type=float, default=20.0, help="offered load / capacity")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--core-n", type=int, default=20_000, help="sheds timed in the admission core alone")
    p.add_argument(
        "--profile", default="", help="py-spy the router during the burst into this file (collapsed stacks)"
    )
    a = p.parse_args(argv)
    import uvloop

    if a.serve_fake:
        uvloop.run(serve_fake(a.port_file, a.service_s))
        return 0
    small, large = core_shed_us(16, a.core_n), core_shed_us(10_000, a.core_n)
    print(f"cpu: {cpu_model()}; load avg {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"admission core: {small:.1f} us per shed with 16 queued, {large:.1f} us with 10,000 queued")
    capacity = a.slots / a.service_s
    rate = a.burst * capacity
    print(f"capacity {capacity:.0f} req/s, offered {rate:.0f} req/s for {a.seconds}s ({a.burst}x)")
    with Launcher(tempfile.mkdtemp(prefix="bench-shed-")) as launcher:
        fake_args = ("--serve-fake", "--service-s", str(a.service_s))
        spec = ServiceSpec("fake-decode", "bench.shed", fake_args, ready_service="pdmesh.v1.DecodeService")
        fake = launcher.start_ready(spec)
        router = start_router(launcher, fake.address, a.slots, a.queue)
        cpu0 = proc_cpu_s(router.proc.pid)
        if a.profile:  # py-spy on the router for the burst (raw collapsed stacks)
            import subprocess

            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).with_name("py-spy")),  # the venv's (pip install py-spy)
                    "record",
                    "--format",
                    "raw",
                    "-p",
                    str(router.proc.pid),
                    "-o",
                    a.profile,
                    "-d",
                    str(int(a.seconds) + 2),
                ]
            )
        r = uvloop.run(burst(router.address, rate, a.seconds))
        router_cpu = proc_cpu_s(router.proc.pid) - cpu0
        if a.profile:
            spy.wait()
    rej, hints = r["rejected"], r["hints"]
    admitted = r["sent"] - len(rej) - sum(r["errors"].values())
    queued = sorted(r["ttft"])[a.slots :]  # the first `slots` ran at once
    wait_p50 = statistics.median(queued) if queued else float("nan")
    hint_p50 = statistics.median(hints) if hints else float("nan")
    print(
        f"sent {r['sent']}, shed {len(rej)}, admitted {admitted} (completed {r['ok']}), "
        f"other errors {r['errors'] or 'none'}"
    )
    print(f"router CPU {router_cpu:.2f}s over the burst: {router_cpu / r['sent'] * 1e6:.0f} us per request")
    print(
        f"rejection ms p50 {pct(rej, 0.5) * 1e3:.1f} p99 {pct(rej, 0.99) * 1e3:.1f}; "
        f"queue-full hint p50 {hint_p50 * 1e3:.0f} ms vs queued wait p50 {wait_p50 * 1e3:.0f} ms"
    )
    fields = {
        "rejection_p50_ms": f"{pct(rej, 0.5) * 1e3:.1f}",
        "rejection_p99_ms": f"{pct(rej, 0.99) * 1e3:.1f}",
        "shed_share": f"{len(rej) / max(r['sent'], 1):.3f}",
        "hint_p50_ms": f"{hint_p50 * 1e3:.0f}",
        "queued_wait_p50_ms": f"{wait_p50 * 1e3:.0f}",
        "hint_vs_wait": f"{hint_p50 / wait_p50:.2f}" if queued and hints else "nan",
        "hint_spread": f"{len(set(hints)) / max(len(hints), 1):.2f}",
        "admitted_ok": f"{r['ok'] / max(admitted, 1):.3f}",
        "router_us_per_request": f"{router_cpu / max(r['sent'], 1) * 1e6:.0f}",
        "core_shed_us": f"{small:.1f}",
        "core_shed_10k_vs_16": f"{large / small:.2f}",
    }
    print("shed " + " ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
