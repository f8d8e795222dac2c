"""Before/after of issue 16's one front door: HTTP SSE through the router's own HTTP door
vs through a separate gateway process in front of the router (the front before it).

Both fronts run at once in front of the same router process and bench/routing.py's
zero-cost fake decode worker (one token per message), and are measured alternately,
so both see the same machine load: SSE events/s and tokens/s over N concurrent
endless /v1/completions streams (bench/routing.py `http_rate`: one connection each,
closed after the duration), and each process's CPU microseconds per event.

Run: `python bench/front_ab.py [--seconds 4] [--rounds 2] [--streams 64,8]`; the last
line is `front_ab door_events_per_s=.. gateway_events_per_s=.. door_us_per_event=..
gateway_us_per_event=..` (medians over the rounds at the first stream count; the
gateway figure is the gateway and router processes together).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from bench.routing import http_rate, start_router
from bench.routing_quality import proc_cpu_s
from pdmesh.launcher import Launcher, ServiceSpec, flags
from services.gateway.launch import gateway_spec, start_ready


async def measured(pids: list[int], address: str, streams: int, seconds: float) -> dict:
    cpu0 = [proc_cpu_s(p) for p in pids]
    r = await http_rate(address, streams, seconds)
    r["us"] = sum(proc_cpu_s(p) - c for p, c in zip(pids, cpu0, strict=True)) / max(r["events"], 1) * 1e6
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", default="64,8")
    a = p.parse_args(argv)
    from bench.profile_front import cpu_model

    cpu = cpu_model()
    print(
        f"cpu: {cpu} x{os.cpu_count()}; load avg {os.getloadavg()[0]:.1f} (shared machine: rates follow the load)"
    )
    counts = [int(x) for x in a.streams.split(",")]
    first: dict[str, list[float]] = {"door": [], "gw": [], "door_us": [], "gw_us": []}
    with Launcher(tempfile.mkdtemp(prefix="bench-front-ab-")) as launcher:
        fake = launcher.start_ready(
            ServiceSpec(
                "fake-decode", "bench.routing", ("--serve-fake",), ready_service="pdmesh.v1.DecodeService"
            )
        )
        router = start_router(launcher, "router", fake.address)
        gw = start_ready(launcher, gateway_spec(router.address, extra=flags(log_level="warning")))
        for streams in counts:
            for i in range(a.rounds):
                d = uvloop.run(measured([router.proc.pid], router.http_address, streams, a.seconds))
                g = uvloop.run(measured([gw.proc.pid, router.proc.pid], gw.address, streams, a.seconds))
                print(
                    f"{streams} streams, round {i + 1}: router's HTTP door {d['msgs']:,.0f} events/s "
                    f"({d['tok']:,.0f} tokens/s), {d['us']:.0f} us CPU/event | gateway process + router "
                    f"{g['msgs']:,.0f} events/s ({g['tok']:,.0f} tokens/s), {g['us']:.0f} us CPU/event; "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                if streams == counts[0]:
                    first["door"].append(d["msgs"])
                    first["gw"].append(g["msgs"])
                    first["door_us"].append(d["us"])
                    first["gw_us"].append(g["us"])
    med = {k: statistics.median(v) for k, v in first.items()}
    print(
        f"front_ab door_events_per_s={med['door']:.0f} gateway_events_per_s={med['gw']:.0f} "
        f"door_us_per_event={med['door_us']:.0f} gateway_us_per_event={med['gw_us']:.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
