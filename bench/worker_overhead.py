"""The decode worker's own overhead and CPU, A/B between two source trees (issue 16 item 4).

    .venv/bin/python bench/worker_overhead.py [--base /work/main] [--rounds 4] [--load-rounds 2]

Reproduces the Dynamo side by side's "a worker over gRPC directly" probe
(bench/peers/dynamo/run.py): one decode worker on the `sim` backend with that
bench's engine flags (the `dynamo-mocker` timing profile, block 16, 16,384
blocks, 256 seqs, 8,192 tokens a pass, speedup 1, local prefill), sequential
64-token fresh prompts with 2 output tokens sent straight to its
`DecodeService.Generate` by bench.loadgen's gRPC client; overhead = median
TTFT - the modeled prefill (17.5 ms). A zero-cost fake worker
(bench/routing.py --serve-fake) gives this client's own gRPC floor on the same
path, probed in the same rounds.

Two workers run side by side: A from `--base` (another checkout, e.g. main) and
B from this tree; rounds alternate A and B (the order flips every round), so a
drifting machine load hits both alike. Per arm it prints the overhead, the
worker's CPU ms per probe request, and under load (each arm behind its own
router from this tree over the multiplexed link, every 4th request of the
Mooncake trace at the x4 rate: one worker's share of the Dynamo bench's x4 run)
the worker's CPU us per output token and per request, and the TTFT mean at the
client (the check that nothing got slower). `--profile SECONDS` samples B's
worker with py-spy --native during its first load round and prints the top
self entries.

Prints the CPU model and the load average; last line `worker_overhead key=value ...`.
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

import numpy as np

from bench.loadgen import GrpcClient, build_workload, run_load
from bench.peers.dynamo.make_model_folder import DEFAULT_VOCAB, FIRST_WORD_ID, write_folder
from bench.peers.dynamo.run import probe_items, sequential_ttfts
from bench.profile_front import cpu_model, print_summary, start_profile, summarize
from bench.routing import run_cpu_s
from bench.traces import VocabRange
from pdmesh.launcher import Launcher, ServiceSpec, flags
from services.model.timing import load_profile

ROOT = Path(__file__).resolve().parent.parent
PROFILE = "dynamo-mocker"
PROMPT_LEN = 64


def engine_flags(folder: Path) -> tuple[str, ...]:
    """bench/peers/dynamo/run.py's start_pdmesh engine flags (its defaults)."""
    return flags(
        engine_backend="sim",
        engine_model_path=str(folder),
        engine_sim_profile=PROFILE,
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


def start_worker(launcher: Launcher, name: str, tree: Path, folder: Path) -> object:
    return launcher.start_ready(
        ServiceSpec(
            name,
            "services.decode.main",
            flags(worker_id=name) + engine_flags(folder),
            env={"PYTHONPATH": str(tree)},
            ready_service="pdmesh.v1.DecodeService",
        ),
        180,
    )


def start_router(launcher: Launcher, name: str, worker: str, folder: Path) -> object:
    return launcher.start_ready(
        ServiceSpec(
            name,
            "services.router.main",
            flags(
                decode_workers=[worker],
                model_path=str(folder),
                block_size=16,
                policy="round_robin",
                admission_max_inflight=256,
                limits_max_prompt_tokens=1 << 20,
                metrics_port=0,
                log_level="warning",
            ),
            env={"PYTHONPATH": str(ROOT)},
            ready_service="pdmesh.v1.RouterService",
        ),
        180,
    )


async def probe(address: str, n: int, seed: int) -> list[float]:
    client = GrpcClient(address, "decode")
    try:
        items = probe_items(n + 3, seed, PROMPT_LEN, DEFAULT_VOCAB)
        return [t * 1e3 for t in (await sequential_ttfts(client, items))[3:]]  # 3 warm the channel
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, default=Path("/work/main"), help="source tree of arm A")
    p.add_argument("--tree-b", type=Path, default=ROOT, help="source tree of arm B")
    p.add_argument("--rounds", type=int, default=4, help="probe rounds per arm")
    p.add_argument("--probes", type=int, default=30, help="sequential probe requests per round")
    p.add_argument("--load-rounds", type=int, default=1, help="load rounds per arm (0: none)")
    p.add_argument("--load-requests", type=int, default=500, help="of the trace, before taking every 4th")
    p.add_argument("--profile", type=float, default=0.0, help="py-spy B's worker this many seconds of load")
    p.add_argument("--profile-rate", type=int, default=200)
    p.add_argument("--arms", default="A,B", help="which arms to run (B alone: profiling this tree)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "profiles")
    a = p.parse_args(argv)
    modeled = load_profile(PROFILE).prefill_ms(PROMPT_LEN)
    print(f"cpu: {cpu_model()} x{os.cpu_count()}; load avg {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"A = {a.base}, B = {a.tree_b}; modeled prefill of {PROMPT_LEN} tokens {modeled:.2f} ms")
    tmp = Path(tempfile.mkdtemp(prefix="bench-wkr-"))
    os.chdir(tmp)  # `python -m` puts the cwd first on sys.path: each arm must import only its own tree
    folder = tmp / "model"
    write_folder(folder, DEFAULT_VOCAB)
    res: dict[str, dict[str, list[float]]] = {k: {} for k in ("A", "B", "fake")}

    def add(arm: str, key: str, v) -> None:
        res[arm].setdefault(key, []).extend(v if isinstance(v, list) else [v])

    with Launcher(tmp / "run") as launcher:
        fake = launcher.start_ready(
            ServiceSpec("fake", "bench.routing", ("--serve-fake",), ready_service="pdmesh.v1.DecodeService")
        )
        arms = a.arms.split(",")
        trees = {"A": a.base, "B": a.tree_b}
        workers = {arm: start_worker(launcher, f"decode-{arm.lower()}", trees[arm], folder) for arm in arms}
        for r in range(a.rounds):
            for k, arm in enumerate(arms if r % 2 == 0 else arms[::-1]):
                w = workers[arm]
                c0 = run_cpu_s(w.proc.pid)
                t = asyncio.run(probe(w.address, a.probes, 1000 * r + k))
                add(arm, "cpu_ms_per_probe", (run_cpu_s(w.proc.pid) - c0) / (a.probes + 3) * 1e3)
                add(arm, "ttft", t)
                add(arm, "round_median", statistics.median(t))
            add("fake", "ttft", asyncio.run(probe(fake.address, a.probes, 99 + r)))
        load_avg_probes = os.getloadavg()[0]
        if a.load_rounds:
            routers = {
                arm: start_router(launcher, f"router-{arm}", workers[arm].address, folder) for arm in arms
            }
            items = build_workload(
                "mooncake",
                num_requests=a.load_requests,
                max_duration_s=120.0,
                length_factor=8.0,
                time_factor=1 / 4.0,
                vocab=VocabRange(FIRST_WORD_ID, DEFAULT_VOCAB),
            )
            for r in range(a.load_rounds):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    # A different quarter of the trace per round (a fresh share for the prefix cache).
                    share = items[r % 4 :: 4]
                    share = [
                        type(it)(it.arrival_s - share[0].arrival_s, it.prompt_ids, it.max_tokens)
                        for it in share
                    ]
                    pid = workers[arm].proc.pid
                    prof = None
                    if a.profile and arm == "B" and r == 0:
                        a.out.mkdir(parents=True, exist_ok=True)
                        prof = start_profile(pid, a.profile, a.profile_rate, a.out / "worker_b.raw")
                    c0, t0 = run_cpu_s(pid), time.perf_counter()
                    recs = asyncio.run(
                        run_load(
                            share,
                            f"grpc://{routers[arm].address}",
                            grpc_service="router",
                            max_requests=len(share),
                            max_duration_s=share[-1].arrival_s + 1,
                            timeout_s=60,
                        )
                    )
                    cpu = run_cpu_s(pid) - c0
                    ok = [x for x in recs if x.ok]
                    tokens = sum(x.output_tokens for x in ok)
                    add(arm, "load_cpu_s", cpu)
                    add(arm, "load_wall_s", time.perf_counter() - t0)
                    add(arm, "us_per_token", cpu / max(tokens, 1) * 1e6)
                    add(arm, "ms_per_request", cpu / max(len(ok), 1) * 1e3)
                    add(arm, "load_ttft_mean", float(np.mean([x.ttft_s for x in ok])) * 1e3)
                    add(arm, "load_failed", float(len(recs) - len(ok)))
                    print(
                        f"  load {arm} round {r}: {len(ok)}/{len(recs)} ok, {tokens} tokens, worker CPU "
                        f"{cpu:.2f} s, load avg {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                    if prof is not None:
                        _, err = prof.communicate(timeout=120)
                        if prof.returncode != 0:
                            print(f"  py-spy failed: {err.strip()[-300:]}")
                        else:
                            print_summary("worker B under load", summarize(a.out / "worker_b.raw", 25), "")

    fake_p50 = statistics.median(res["fake"]["ttft"])
    out: dict[str, str] = {}
    print(
        f"\nnear-zero load ({a.rounds} rounds x {a.probes} probes per arm; fake worker p50 {fake_p50:.2f} ms):"
    )
    for arm in arms:
        d = res[arm]
        ovh = statistics.median(d["ttft"]) - modeled
        rounds = " ".join(f"{m - modeled:.2f}" for m in d["round_median"])
        print(
            f"  {arm}: TTFT p50 {statistics.median(d['ttft']):.2f} ms -> overhead {ovh:.2f} ms (per round: "
            f"{rounds}); beyond the fake's floor {statistics.median(d['ttft']) - fake_p50 - modeled:.2f} ms; "
            f"worker CPU {statistics.median(d['cpu_ms_per_probe']):.2f} ms per request"
        )
        out[f"overhead_ms_{arm}"] = f"{ovh:.2f}"
        out[f"cpu_ms_per_probe_{arm}"] = f"{statistics.median(d['cpu_ms_per_probe']):.2f}"
        if "us_per_token" in d:
            print(
                f"     under load: worker CPU {statistics.median(d['us_per_token']):.0f} us/token, "
                f"{statistics.median(d['ms_per_request']):.2f} ms/request ({sum(d['load_cpu_s']):.1f} s in all); "
                f"TTFT mean {statistics.median(d['load_ttft_mean']):.1f} ms; failed {sum(d['load_failed']):.0f}"
            )
            out[f"us_per_token_{arm}"] = f"{statistics.median(d['us_per_token']):.0f}"
            out[f"load_ttft_mean_ms_{arm}"] = f"{statistics.median(d['load_ttft_mean']):.1f}"
    out["fake_floor_ms"] = f"{fake_p50:.2f}"
    out["load_avg"] = f"{load_avg_probes:.1f}/{os.getloadavg()[0]:.1f}"
    print("worker_overhead " + " ".join(f"{k}={v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
