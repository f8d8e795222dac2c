"""CPU per token of a decode worker's core in one process, without gRPC (issue 16 item 4).

    .venv/bin/python bench/worker_core.py [--tree DIR] [--mode link|generate] [--requests 256] [--tokens 64]

Wires a decode worker in-process exactly as `services.decode.main` does (the
Dynamo side by side's engine flags: sim, `dynamo-mocker` profile, block 16,
16,384 blocks; speedup --speedup), then drives its servicer directly: `link`
opens --concurrency requests at a time on one `LinkSession` (the router's
path), `generate` iterates `DecodeServicer.Generate` per request. Prints the
process CPU (both threads) per output token and per request, the event loop
thread's share of it, the collector's
time and count, and the pool's free count (it must end full). To compare two
trees, run it once per tree (`--tree`, which goes first on sys.path), alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tree", default=str(Path(__file__).resolve().parent.parent), help="source tree to import"
    )
    p.add_argument("--mode", choices=("link", "generate"), default="link")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--speedup", type=float, default=1000.0)
    a = p.parse_args()
    sys.path.insert(0, a.tree)
    import uvloop

    uvloop.run(run(a))
    return 0


async def run(a: argparse.Namespace) -> None:
    from bench.machine import cpu_model
    from bench.peers.dynamo.make_model_folder import DEFAULT_VOCAB, write_folder
    from bench.peers.dynamo.run import probe_items
    from pdmesh.launcher import flags
    from pdmesh.v1 import common_pb2, decode_pb2
    from services.decode import main as dm
    from services.decode.link import LinkSession
    from services.decode.servicer import _final
    from services.worker.settings import start_runtime

    tmp = Path(tempfile.mkdtemp(prefix="bench-worker-core-"))
    write_folder(tmp / "model", DEFAULT_VOCAB)
    argv = flags(
        worker_id="core", port=0, engine_backend="sim", engine_model_path=str(tmp / "model"),
        engine_sim_profile="dynamo-mocker", engine_sim_speedup=a.speedup, engine_block_size=16,
        engine_num_blocks=16384, engine_max_num_seqs=256, engine_max_num_batched_tokens=8192,
        default_mode="local", metrics_port=0, limits_max_prompt_tokens=1 << 20, log_level="warning",
    )  # fmt: skip
    settings = dm.parse_settings(list(argv), dict(os.environ))
    rt = await start_runtime("decode", dm.SERVICE_NAME, settings)
    sv = dm.wire(rt, settings).servicer
    items = probe_items(a.requests + 32, 3, a.prompt_len, DEFAULT_VOCAB)
    sampling = common_pb2.SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    reqs = [
        decode_pb2.DecodeServiceGenerateRequest(
            request_id=f"r{i}", prompt_token_ids=it.prompt_ids, sampling=sampling
        )
        for i, it in enumerate(items)
    ]

    class Context:
        def time_remaining(self):
            return None

    async def generate(batch) -> None:
        async def one(r) -> None:
            async for _ in sv.Generate(r, Context()):
                pass

        await asyncio.gather(*(one(r) for r in batch))

    async def link(batch) -> None:
        frames_in: asyncio.Queue = asyncio.Queue()
        for k, r in enumerate(batch):
            frames_in.put_nowait(
                decode_pb2.DecodeServiceLinkRequest(open=decode_pb2.LinkOpen(link_id=k + 1, request=r))
            )

        async def frames():
            while (f := await frames_in.get()) is not None:
                yield f

        ends = 0
        async for frame in LinkSession(sv.worker, sv._job, _final).run(frames()):
            ends += len(frame.ends)
            if ends == len(batch):
                frames_in.put_nowait(None)

    drive = link if a.mode == "link" else generate
    await drive(reqs[:32])  # warm-up
    try:  # the collector as services.decode.main sets it after start-up (trees since session 6)
        from services.common.gc_tuning import tune_gc
    except ImportError:
        pass
    else:
        tune_gc()
    spent = [0.0, 0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            spent[2] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - spent[2]
            spent[1] += 1

    gc.callbacks.append(on_gc)
    cpu0, loop0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    rest = reqs[32:]
    for i in range(0, len(rest), a.concurrency):
        await drive(rest[i : i + a.concurrency])
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    loop_cpu = time.thread_time() - loop0  # the event loop's thread; the rest is the engine's step thread
    s = rt.engine.stats()
    print(
        f'worker_core cpu="{cpu_model()}" mode={a.mode} tree={a.tree} load={os.getloadavg()[0]:.1f} '
        f"us_per_token={cpu / (a.requests * a.tokens) * 1e6:.1f} "
        f"loop_us_per_token={loop_cpu / (a.requests * a.tokens) * 1e6:.1f} ms_per_request={cpu / a.requests * 1e3:.3f} "
        f"wall_s={wall:.2f} gc_s={spent[0]:.3f} gc_collections={spent[1]} free_blocks={s.free_blocks}/{s.total_blocks}",
        flush=True,
    )
    os._exit(0 if s.free_blocks == s.total_blocks else 1)  # the engine thread is not joined: a bench


if __name__ == "__main__":
    sys.exit(main())
