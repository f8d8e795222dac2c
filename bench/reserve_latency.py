"""How long a KV reservation waits on a loaded worker (issue 17 item 3, issue 19).

A prefix pull and a remote prefill both start with `reserve_external` on the
worker that will decode: blocks for the KV that is about to arrive. Until
session 29 that was a command for the engine's step thread, run between steps,
so on a worker busy with long prefill steps it waited for the step in progress.
The router's pull price (services/router/prefix_pull.py: a fixed latency plus
bytes over the link) never counted that wait; the routing model says an
unpriced wait of one loaded step turns the pulls' gain into a loss
(BENCHMARKS.md, issue 17).

Method: one in-process sim engine (the dynamo-mocker profile, wall = model time /
--speedup) kept busy by --streams requests of --prompt tokens each, replaced as
they finish, so most steps carry max_num_batched_tokens of prefill. At random
times (uniform gaps, so an arrival lands anywhere in a step) a reservation of
--reserve tokens is made and cancelled at once; its latency is the wall time of
the `reserve_external` await. Printed with the step time it waits against: the
wall time of the engine's passes over the same run.

Run: `python bench/reserve_latency.py` (about 20 s). To compare with an older
tree, run this file from a worktree of that commit (it uses only the Engine API).
Last line: `reserve_latency p50_ms=.. p90_ms=.. step_ms_p50=.. ratio_p50=..`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/reserve_latency.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_model
from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.sim.engine import SimEngine


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run(args) -> tuple[list[float], list[float]]:
    config = EngineConfig(
        backend="sim",
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.mbt,
        sim_speedup=args.speedup,
    )
    engine = SimEngine(config)
    await engine.start()
    rng = random.Random(args.seed)
    vocab = engine.info.vocab_size
    stop = asyncio.Event()
    n = 0

    def prompt(length: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(length)]

    async def stream() -> None:
        nonlocal n
        while not stop.is_set():
            n += 1
            req = EngineRequest(f"load-{n}", prompt(args.prompt), SamplingParams(max_tokens=2))
            async for _ in engine.generate(req):
                pass

    # The passes' wall time, from the runner's own clock: how long a reservation could wait.
    steps: list[float] = []
    runner = engine.runner
    inner = runner.run

    def timed(scheduled):
        t0 = time.perf_counter()
        try:
            return inner(scheduled)
        finally:
            steps.append(time.perf_counter() - t0)

    runner.run = timed  # the step thread reads the attribute per pass
    loaders = [asyncio.ensure_future(stream()) for _ in range(args.streams)]
    waits: list[float] = []
    try:
        await asyncio.sleep(args.warmup_s)
        for i in range(args.reservations):
            await asyncio.sleep(rng.uniform(0, 2 * args.gap_s))
            req = EngineRequest(f"reserve-{i}", prompt(args.reserve), SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            await engine.reserve_external(req)
            waits.append(time.perf_counter() - t0)
            engine.cancel_external(req.request_id)
    finally:
        stop.set()
        for t in loaders:
            t.cancel()
        await asyncio.gather(*loaders, return_exceptions=True)
        await engine.close()
    return waits, steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--speedup", type=float, default=6.0, help="sim wall = model time / this (the quick study's)"
    )
    p.add_argument("--mbt", type=int, default=8192, help="max_num_batched_tokens (the routing studies')")
    p.add_argument("--num-blocks", type=int, default=65536)
    p.add_argument("--streams", type=int, default=4, help="concurrent long prompts keeping the engine busy")
    p.add_argument("--prompt", type=int, default=8192, help="tokens of each loading prompt")
    p.add_argument("--reserve", type=int, default=2048, help="tokens of each reservation")
    p.add_argument("--reservations", type=int, default=100)
    p.add_argument("--gap-s", type=float, default=0.1, help="mean wall time between reservations")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_model()} x{os.cpu_count()}")
    waits, steps = asyncio.run(run(args))
    w = [x * 1000 for x in waits]
    s = [x * 1000 for x in steps if x > 0]
    print(
        f"sim engine, dynamo-mocker profile at speedup {args.speedup:g}, {args.streams} streams of "
        f"{args.prompt}-token prompts, max_num_batched_tokens {args.mbt}; {len(w)} reservations of "
        f"{args.reserve} tokens at random times"
    )
    print(f"  pass wall time: p50 {statistics.median(s):.1f} ms, p90 {pct(s, 0.9):.1f} ms ({len(s)} passes)")
    print(
        f"  reservation wait: p50 {statistics.median(w):.2f} ms, p90 {pct(w, 0.9):.2f} ms, max {max(w):.2f} ms, "
        f"mean {statistics.mean(w):.2f} ms (model time x{args.speedup:g})"
    )
    print(
        f"reserve_latency p50_ms={statistics.median(w):.3f} p90_ms={pct(w, 0.9):.3f} "
        f"step_ms_p50={statistics.median(s):.1f} ratio_p50={statistics.median(w) / statistics.median(s):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
