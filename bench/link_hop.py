"""One link frame's trip from a decode worker to a router: grpc.aio against a plain asyncio stream.

    .venv/bin/python bench/link_hop.py [--seconds 8] [--streams 4] [--step-ms 6.4] [--hogs 0,2]

Why (issue 16; BENCHMARKS.md "Session 8: where the TTFT gap is"): in the Dynamo side by side
the hop between pdmesh's decode workers and its router took 8.8-10.5 ms of TTFT under load
against ~1 ms idle, while the engines' own TTFT equalled the mocker's. Every link frame in
grpc.aio is a write the sending loop awaits until the C core's poller thread reports it done,
and a read the receiving loop gets from its poller thread: more thread wakeups per frame than a
socket read by the loop itself. This measures that difference alone, in two processes, on the
real frame type (`DecodeServiceLinkResponse` with one `LinkTokens` per stream):

- a sender process (this script with `--serve`) emits one frame every `--step-ms` (an engine
  step) carrying a token for each of `--streams` requests, stamped with `time.monotonic_ns()`
  (CLOCK_MONOTONIC is one clock for every process of the machine) in the first entry's ids;
- over (a) a grpc.aio bidi stream of `DecodeService.Link` (a bare servicer, no pdmesh code)
  and (b) 4-byte-length-prefixed frames on an asyncio TCP stream, both on uvloop, loopback;
- the receiver (this process, uvloop) takes each frame's age at arrival (its latency) and both
  processes' CPU per frame;
- with `--hogs` busy-loop processes beside them (0 = none), at the same priority: the 2-vCPU
  machine shared the way the side by side shares it.

Prints the CPU model and load; last line
`link_hop grpc_p50_ms=.. grpc_p99_ms=.. tcp_p50_ms=.. tcp_p99_ms=.. ... hogs=..` with one set
per hog count (keys suffixed `_h<N>`) and the CPU us per frame of each side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import uvloop

from bench.machine import cpu_model
from pdmesh.v1 import decode_pb2, decode_pb2_grpc

_LEN = struct.Struct("<I")


def frame(streams: int, seq: int) -> bytes:
    now = time.monotonic_ns()
    tokens = [decode_pb2.LinkTokens(link_id=1, token_ids=[now >> 32, now & 0xFFFFFFFF, seq & 0xFFFF])]
    tokens += [decode_pb2.LinkTokens(link_id=i + 1, token_ids=[seq & 0xFFFF]) for i in range(1, streams)]
    return decode_pb2.DecodeServiceLinkResponse(tokens=tokens).SerializeToString()


def stamp_ns(msg: decode_pb2.DecodeServiceLinkResponse) -> int:
    hi, lo = msg.tokens[0].token_ids[0], msg.tokens[0].token_ids[1]
    return (hi << 32) | lo


# ---- sender (--serve) ------------------------------------------------------------------------


class _Link(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, streams: int, step_s: float):
        self.streams, self.step_s = streams, step_s

    async def Link(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        seq, next_at = 0, loop.time()
        while True:
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            seq += 1
            yield decode_pb2.DecodeServiceLinkResponse.FromString(frame(self.streams, seq))


async def serve(streams: int, step_s: float) -> None:
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Link(streams, step_s), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def on_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        seq, next_at = 0, loop.time()
        try:
            while True:
                next_at += step_s
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                seq += 1
                data = frame(streams, seq)
                writer.write(_LEN.pack(len(data)) + data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    tcp = await asyncio.start_server(on_tcp, "127.0.0.1", 0)
    tcp_port = tcp.sockets[0].getsockname()[1]
    print(f"{grpc_port} {tcp_port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    tcp.close()
    await server.stop(0)


# ---- receiver ---------------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def receive_grpc(port: int, seconds: float) -> list[float]:
    ages: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = decode_pb2_grpc.DecodeServiceStub(channel).Link()
        end = time.monotonic() + seconds
        async for msg in call:
            ages.append((time.monotonic_ns() - stamp_ns(msg)) / 1e6)
            if time.monotonic() > end:
                break
        call.cancel()
    return ages


async def receive_tcp(port: int, seconds: float) -> list[float]:
    ages: list[float] = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() <= end:
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            msg = decode_pb2.DecodeServiceLinkResponse.FromString(await reader.readexactly(n))
            ages.append((time.monotonic_ns() - stamp_ns(msg)) / 1e6)
    finally:
        writer.close()
    return ages


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--seconds", type=float, default=8.0, help="per transport and hog count (two halves, ABBA)"
    )
    p.add_argument("--streams", type=int, default=4, help="requests with a token in each frame")
    p.add_argument("--step-ms", type=float, default=6.4, help="one frame this often (an engine step)")
    p.add_argument("--hogs", default="0,2", help="busy-loop processes beside the pair, per pass")
    a = p.parse_args()
    if not 0 < a.seconds <= 60:
        p.error("--seconds must be in (0, 60]")
    if a.serve:
        uvloop.run(serve(a.streams, a.step_ms / 1e3))
        return 0
    print(f"cpu: {cpu_model()}; load avg {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(
        f"{a.streams} streams, a frame every {a.step_ms} ms, {a.seconds:.0f} s per transport; loopback, uvloop"
    )
    summary: list[str] = []
    for hogs in [int(h) for h in a.hogs.split(",")]:
        sender = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--streams", str(a.streams), "--step-ms", str(a.step_ms)],
            stdout=subprocess.PIPE,
            text=True,
        )
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            grpc_port, tcp_port = map(int, sender.stdout.readline().split())
            runs = {"grpc": (receive_grpc, grpc_port), "tcp": (receive_tcp, tcp_port)}
            got: dict[str, tuple[list[float], float, float]] = {k: ([], 0.0, 0.0) for k in runs}
            for name in ("grpc", "tcp", "tcp", "grpc"):  # ABBA: a drifting load hits both alike
                receive, port = runs[name]
                c0s, c0r = cpu_s(sender.pid), time.process_time()
                ages = uvloop.run(receive(port, a.seconds / 2))
                ds, dr = cpu_s(sender.pid) - c0s, time.process_time() - c0r
                prev = got[name]
                got[name] = (prev[0] + ages, prev[1] + ds, prev[2] + dr)
            for name, (ages, ds, dr) in got.items():
                n = len(ages)
                p50, p99 = statistics.median(ages), quantile(ages, 0.99)
                print(
                    f"hogs {hogs}  {name:4s}: {n} frames, age at arrival p50 {p50:.3f} ms p99 {p99:.3f} ms "
                    f"max {max(ages):.2f} ms; CPU per frame sender {1e6 * ds / n:.0f} us (both transports' "
                    f"idle cost in it), receiver {1e6 * dr / n:.0f} us; load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                summary += [f"{name}_p50_ms_h{hogs}={p50:.3f}", f"{name}_p99_ms_h{hogs}={p99:.3f}"]
                summary += [f"{name}_rx_us_h{hogs}={1e6 * dr / n:.0f}"]
        finally:
            for proc in (sender, *busy):
                proc.terminate()
            for proc in (sender, *busy):
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    print("link_hop " + " ".join(summary) + f" hogs={a.hogs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
