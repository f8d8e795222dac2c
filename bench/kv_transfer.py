"""KV transfer benchmark: NIXL vs gRPC between two processes, against memcpy.

A KV holder runs in its own process (`tests/e2e/kv_peer.py`, the program the
cross-process tests use) with a pool in the KV layout of the engine's `small`
preset; this process is the receiver. For payloads of 1, 16, 64 and 256 MiB
(whole KV blocks, contiguous block ids) it measures:
- NIXL: a prepped READ of the holder's blocks into ours (`NixlTransport.pull`),
- gRPC: the KvSource byte stream written into our blocks (`GrpcTransport.pull`),
- memcpy: one `tensor.copy_` of the same bytes in one process, one thread (the limit),
each the median of several runs, timed by the transport's own TransferStats
(lookup, descriptor building, transfer, completion; not the lease bookkeeping
before and after). Also: a scattered block list at 64 MiB, the time to hand
off the KV of a 2,048-token prompt of the `small` preset through each transport,
and what the integrity check costs on that handoff (issue 13): the holder's
per-block xxh3-128 digests plus the receiver's check of the pulled blocks
(`kvtransfer.digest`), each timed on the same bytes right after a NIXL pull,
against the NIXL handoff time (target <= 10%). Then (issue 22) the same 2,048-token
handoff with the `small` preset's KV in float32, bfloat16 and int8 (int8 blocks with their
per-block, per-head float32 scales inside each block, kvtransfer/layout.py), each between a
fresh holder process and this one, over NIXL and gRPC: bytes and time against float32; and
`wire-int8` (`--kv-wire-quant int8`: float32 caches, int8 blocks on the wire), int8's pull plus
the holder's quantize and the receiver's dequantize of the same blocks, timed in this process.
GB/s = 1e9 bytes per second.

Last line: `kv_transfer nixl_gbps=.. grpc_gbps=.. memcpy_gbps=.. nixl_vs_memcpy=.. nixl_vs_grpc=..
digest_vs_handoff=.. int8_bytes_ratio=.. int8_handoff_vs_fp32=..` (the GB/s figures at 64 MiB;
the int8 ratios against float32 for the 2,048-token handoff, the time one over NIXL; goals
<= 0.3 and <= 0.4).
Run: `python bench/kv_transfer.py` (full) or `python bench/kv_transfer.py --quick` (< 2 min).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/kv_transfer.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import torch

from bench.machine import cpu_model
from kvtransfer import digest
from kvtransfer.agents import AgentDirectory
from kvtransfer.grpc_transport import GrpcTransport, GrpcTransportConfig
from kvtransfer.layout import KvLayout
from kvtransfer.nixl_transport import NixlConfig, NixlTransport
from kvtransfer.pool import PoolView
from kvtransfer.testing import checksum
from kvtransfer.transport import BlockHandle
from pdmesh.v1 import common_pb2, kvtransfer_pb2_grpc
from services.engine.config import EngineConfig
from services.engine.engine_spec import EngineSpec
from services.engine.kv_wire import dequantize_blocks, quantize_blocks, wire_layout
from tests.e2e.kv_peer import REPO, Peer

MIB = 1024 * 1024
PAYLOADS_MIB = (1, 16, 64, 256)
PROMPT_TOKENS = 2048


def small_layout(**overrides) -> KvLayout:
    """The KV layout the torch engine uses for the `small` preset with its default settings
    (and `overrides`: dtype, kv_cache_quant). Without the fingerprint: the holder is a raw pool."""
    layout = EngineSpec.resolve(EngineConfig(preset="small", **overrides)).layout
    return KvLayout(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_size, layout.quant
    )


def layout_arg(layout: KvLayout) -> str:
    """kv_peer's --layout."""
    return (
        f"{layout.num_layers},{layout.num_kv_heads},{layout.head_dim},{layout.dtype},"
        f"{layout.block_size},{layout.quant}"
    )


def start_kv_service(tmp: Path) -> tuple[subprocess.Popen, str]:
    port_file = tmp / "kvtransfer.json"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "services.kvtransfer.main", "--port", "0", "--port-file", str(port_file)),
            *("--log-level", "warning"),
        ],
        cwd=REPO,
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("kvtransfer service did not start")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{json.loads(port_file.read_text())['port']}"


class Bench:
    def __init__(
        self, args: argparse.Namespace, layout: KvLayout, kv_address: str, peer: Peer, num_blocks: int = 0
    ):
        self.args = args
        self.layout = layout
        self.peer = peer
        self.num_blocks = num_blocks or max(PAYLOADS_MIB) * MIB // layout.block_bytes
        self.channel = grpc.aio.insecure_channel(kv_address)
        directory = AgentDirectory(kvtransfer_pb2_grpc.KvTransferServiceStub(self.channel))
        self.pool = PoolView(layout.allocate_pool(self.num_blocks), layout)
        self.pool.pool.view(torch.uint8).fill_(1)  # fault every page in before timing
        self.nixl = NixlTransport(
            f"bench-recv-{os.getpid()}",
            self.pool,
            directory,
            worker_id="bench",
            config=NixlConfig(num_threads=args.nixl_threads),
        )
        self.grpc = GrpcTransport(
            "bench-recv-grpc",
            self.pool,
            worker_id="bench",
            config=GrpcTransportConfig(chunk_bytes=args.grpc_chunk_kib * 1024),
        )
        self.seq = 0

    async def pull_once(self, kind: str, src: list[int], dst: list[int]) -> float:
        """One export + pull + wait for the holder to free; returns the pull's seconds."""
        self.seq += 1
        reply = await self.peer.request(
            op="export", handle_id=f"b{self.seq}", block_ids=src, issued_to="bench", ttl_s=120
        )
        handle = BlockHandle.from_proto(common_pb2.KvHandle.FromString(base64.b64decode(reply["handle"])))
        transport = self.nixl if kind == "nixl" else self.grpc
        stats = await transport.pull(handle, src, dst, deadline_s=120, on_failure=lambda: None)
        if self.args.verify and checksum(self.pool, dst) != reply["checksum"]:
            raise AssertionError(f"{kind}: bytes differ after pulling {len(src)} blocks")
        freed = await self.peer.request(op="wait_free", free=self.num_blocks, timeout_s=30)
        if not freed["ok"]:
            raise AssertionError("holder did not free its blocks")
        return stats.seconds

    async def measure(self, src: list[int], dst: list[int], reps: int) -> tuple[float, float, float]:
        """Median GB/s of NIXL, gRPC and memcpy, interleaved run by run so that
        load from elsewhere on the machine hits all three alike."""
        nbytes = len(src) * self.layout.block_bytes
        for kind in ("nixl", "grpc"):  # warm-up: connection, metadata, first touch
            await self.pull_once(kind, src, dst)
        times: dict[str, list[float]] = {"nixl": [], "grpc": [], "memcpy": []}
        mem_src = torch.ones(nbytes, dtype=torch.uint8)
        mem_dst = torch.zeros(nbytes, dtype=torch.uint8)
        mem_dst.copy_(mem_src)  # fault in
        for _ in range(reps):
            times["nixl"].append(await self.pull_once("nixl", src, dst))
            times["grpc"].append(await self.pull_once("grpc", src, dst))
            times["memcpy"].append(self.memcpy_seconds(mem_src, mem_dst))
        nixl, grpc_, mem = (nbytes / statistics.median(times[k]) / 1e9 for k in ("nixl", "grpc", "memcpy"))
        return nixl, grpc_, mem

    async def digest_seconds(self, ids: list[int], reps: int, threads: int) -> tuple[float, float, float]:
        """Median (NIXL pull, holder digest, receiver check) seconds of one handoff of
        `ids` with `threads` hashing threads, the digests timed on the bytes the pull
        just wrote (as a receiver sees them)."""
        hasher = digest.BlockHasher(self.pool, threads)
        hasher.digest_blocks(ids)  # start the threads
        pulls, digests, checks = [], [], []
        try:
            for _ in range(reps):
                pulls.append(await self.pull_once("nixl", ids, ids))
                t0 = time.perf_counter()
                blob = hasher.digest_blocks(ids)
                t1 = time.perf_counter()
                expected = digest.split_digests(blob, digest.ALGORITHM, len(ids), "bench")
                hasher.verify_blocks(expected, ids, "bench")
                t2 = time.perf_counter()
                digests.append(t1 - t0)
                checks.append(t2 - t1)
        finally:
            hasher.close()
        return statistics.median(pulls), statistics.median(digests), statistics.median(checks)

    @staticmethod
    def memcpy_seconds(src: torch.Tensor, dst: torch.Tensor) -> float:
        """One single-threaded copy of src into dst, in this process."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)

    async def close(self) -> None:
        await self.nixl.close()
        await self.grpc.close()
        await self.channel.close()


def reps_for(mib: int, quick: bool) -> int:
    if quick:
        return 2 if mib >= 256 else 3
    return 5 if mib >= 256 else 9


async def run(args: argparse.Namespace) -> None:
    layout = small_layout()
    bb = layout.block_bytes
    print("kv_transfer benchmark")
    print(
        f"  date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  host: {platform.node()}  cpus: {os.cpu_count()} "
        f"({cpu_model()})  load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"  python {platform.python_version()}, torch {torch.__version__}, grpcio {grpc.__version__}")
    print(
        f"  layout: `small` preset KV, {layout.num_layers} layers x 2 x {layout.block_size} tokens x "
        f"{layout.num_kv_heads} kv heads x {layout.head_dim} ({layout.dtype}) = {bb // 1024} KiB per block"
    )
    print(
        f"  nixl: UCX, num_threads={args.nixl_threads}, UCX_TLS={os.environ.get('UCX_TLS', '(default)')}; "
        f"grpc: {args.grpc_chunk_kib} KiB chunks; {'quick' if args.quick else 'full'} run"
    )
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        svc, kv_address = start_kv_service(tmp)
        num_blocks = max(PAYLOADS_MIB) * MIB // bb
        peer = Peer(
            tmp,
            kv_address,
            f"bench-holder-{os.getpid()}",
            seed=1,
            num_blocks=num_blocks,
            layout=layout_arg(layout),
            chunk_bytes=args.grpc_chunk_kib * 1024,
            agent_lease_ms=10_000,
            lease_ttl_s=120,
        )
        bench = None
        try:
            await peer.ready()
            bench = Bench(args, layout, kv_address, peer)
            await bench.nixl.start()
            rows = {}
            print()
            print(
                f"  {'payload':>9} {'blocks':>6} {'nixl GB/s':>10} {'grpc GB/s':>10} {'memcpy GB/s':>12}"
                f" {'nixl/memcpy':>12} {'nixl/grpc':>10}"
            )
            for mib in PAYLOADS_MIB:
                n = mib * MIB // bb
                ids = list(range(n))
                nixl, grpc_, mem = await bench.measure(ids, ids, reps_for(mib, args.quick))
                rows[mib] = (nixl, grpc_, mem)
                print(
                    f"  {mib:>5} MiB {n:>6} {nixl:>10.2f} {grpc_:>10.2f} {mem:>12.2f}"
                    f" {nixl / mem:>12.2f} {nixl / grpc_:>10.1f}"
                )
            # Scattered: 64 MiB of blocks picked at random from the whole pool, in random order.
            n = 64 * MIB // bb
            rng = random.Random(7)
            src = rng.sample(range(num_blocks), n)
            dst = rng.sample(range(num_blocks), n)
            s_nixl, s_grpc, _ = await bench.measure(src, dst, reps_for(64, args.quick))
            print(f"  scattered 64 MiB ({n} random blocks): nixl {s_nixl:.2f} GB/s, grpc {s_grpc:.2f} GB/s")
            # Handoff of one 2,048-token prompt.
            n = PROMPT_TOKENS // layout.block_size
            ids = list(range(n))
            h_nixl, h_grpc, h_mem = await bench.measure(ids, ids, reps_for(1, args.quick))
            ms = [n * bb / gbps / 1e6 for gbps in (h_nixl, h_grpc, h_mem)]
            print(
                f"  handoff of a {PROMPT_TOKENS}-token prompt's KV ({n} blocks, {n * bb / MIB:.0f} MiB): "
                f"nixl {ms[0]:.1f} ms, grpc {ms[1]:.1f} ms, memcpy {ms[2]:.1f} ms"
            )
            # The ratio is taken at the default thread count (what the services use).
            for threads in sorted({1, digest.default_threads()}):
                pull_s, digest_s, check_s = await bench.digest_seconds(
                    ids, max(5, reps_for(1, args.quick)), threads
                )
                digest_ratio = (digest_s + check_s) / pull_s
                print(
                    f"  integrity of that handoff ({digest.ALGORITHM}, {n} blocks, {threads} thread(s)): "
                    f"holder digests {digest_s * 1e3:.2f} ms + receiver check {check_s * 1e3:.2f} ms = "
                    f"{digest_ratio:.0%} of the NIXL pull ({pull_s * 1e3:.2f} ms, median of the same runs)"
                )
            await bench.close()
            bench = None
            peer.stop()
            schemes = await handoff_by_scheme(args, tmp, kv_address)
        finally:
            if bench is not None:
                await bench.close()
            peer.stop()
            svc.terminate()
            svc.wait(timeout=30)

    print()
    big = [m for m in PAYLOADS_MIB if m >= 16]
    worst_mem = min(rows[m][0] / rows[m][2] for m in big)
    worst_grpc = min(rows[m][0] / rows[m][1] for m in big)
    grpc_64 = rows[64][1]
    print(
        f"  target NIXL >= 50% of memcpy at >= 16 MiB: worst {worst_mem:.0%} -> {'met' if worst_mem >= 0.5 else 'MISSED'}"
    )
    print(
        f"  target NIXL >= 5x gRPC at >= 16 MiB: worst {worst_grpc:.1f}x -> {'met' if worst_grpc >= 5 else 'MISSED'}"
    )
    print(f"  target gRPC >= 0.5 GB/s (64 MiB): {grpc_64:.2f} -> {'met' if grpc_64 >= 0.5 else 'MISSED'}")
    print(
        f"  target digest + check <= 10% of the NIXL handoff ({PROMPT_TOKENS} tokens, "
        f"{digest.default_threads()} thread(s)): "
        f"{digest_ratio:.0%} -> {'met' if digest_ratio <= 0.10 else 'MISSED'}"
    )
    fp32, int8 = schemes["float32"], schemes["int8"]
    bytes_ratio = int8[0] / fp32[0]
    time_ratio = int8[1] / fp32[1]
    print(
        f"  target int8 KV bytes <= 0.3 of float32: {bytes_ratio:.3f} -> {'met' if bytes_ratio <= 0.3 else 'MISSED'}"
    )
    print(
        f"  target int8 handoff time <= 0.4 of float32 (NIXL): {time_ratio:.2f} -> "
        f"{'met' if time_ratio <= 0.4 else 'MISSED'} (gRPC: {int8[2] / fp32[2]:.2f})"
    )
    wire = schemes["wire-int8"]
    wire_ratio = wire[1] / fp32[1]
    print(
        f"  wire-only int8 (float32 caches): bytes {wire[0] / fp32[0]:.3f} of float32, handoff time "
        f"{wire_ratio:.2f} of float32 over NIXL (gRPC: {wire[2] / fp32[2]:.2f})"
    )
    nixl, grpc_, mem = rows[64]
    print(
        f"kv_transfer nixl_gbps={nixl:.2f} grpc_gbps={grpc_:.2f} memcpy_gbps={mem:.2f} "
        f"nixl_vs_memcpy={nixl / mem:.2f} nixl_vs_grpc={nixl / grpc_:.1f} digest_vs_handoff={digest_ratio:.2f} "
        f"int8_bytes_ratio={bytes_ratio:.3f} int8_handoff_vs_fp32={time_ratio:.2f} "
        f"fp8_bytes_ratio={schemes['fp8'][0] / fp32[0]:.3f} fp8_handoff_vs_fp32={schemes['fp8'][1] / fp32[1]:.2f} "
        f"wire_int8_bytes_ratio={wire[0] / fp32[0]:.3f} wire_int8_handoff_vs_fp32={wire_ratio:.2f}"
    )


async def handoff_by_scheme(args: argparse.Namespace, tmp: Path, kv_address: str) -> dict:
    """Per KV scheme: (bytes, NIXL ms, gRPC ms) of the 2,048-token handoff, a fresh holder each."""
    out = {}
    print()
    print(f"  handoff of a {PROMPT_TOKENS}-token prompt's KV by scheme (`small` preset):")
    for name, overrides in (
        ("float32", {"dtype": "float32"}),
        ("bfloat16", {"dtype": "bfloat16"}),
        ("int8", {"dtype": "float32", "kv_cache_quant": "int8"}),
        ("fp8", {"dtype": "float32", "kv_cache_quant": "fp8"}),  # e4m3 values: int8's bytes
    ):
        layout = small_layout(**overrides)
        n = PROMPT_TOKENS // layout.block_size
        peer = Peer(
            tmp,
            kv_address,
            f"bench-holder-{name}-{os.getpid()}",
            seed=2,
            num_blocks=n,
            layout=layout_arg(layout),
            chunk_bytes=args.grpc_chunk_kib * 1024,
            agent_lease_ms=10_000,
            lease_ttl_s=120,
        )
        bench = None
        try:
            await peer.ready()
            bench = Bench(args, layout, kv_address, peer, num_blocks=n)
            await bench.nixl.start()
            ids = list(range(n))
            nixl, grpc_, _ = await bench.measure(ids, ids, max(5, reps_for(1, args.quick)))
            nbytes = n * layout.block_bytes
            out[name] = (nbytes, nbytes / nixl / 1e6, nbytes / grpc_ / 1e6)
            print(
                f"    {name:9s} {nbytes / MIB:6.2f} MiB ({layout.block_bytes} B/block): "
                f"nixl {out[name][1]:.2f} ms, grpc {out[name][2]:.2f} ms"
            )
        finally:
            if bench is not None:
                await bench.close()
            peer.stop()
    # --kv-wire-quant int8: float32 caches on both sides, int8's bytes on the wire. The pull is
    # the int8 row's (same layout, same bytes); added: the holder's quantize (export from its
    # float32 pool, quantize, write the staging blocks) and the receiver's dequantize (read the
    # staging blocks, dequantize, write its float32 pool), timed here at this process's threads.
    fp, wire = small_layout(dtype="float32"), wire_layout(small_layout(dtype="float32"), "int8")
    n = PROMPT_TOKENS // fp.block_size
    quant_s, dequant_s, quant_cpu, dequant_cpu = codec_seconds(fp, wire, n, max(5, reps_for(1, args.quick)))
    nbytes = n * wire.block_bytes
    codec_ms = (quant_s + dequant_s) * 1e3
    out["wire-int8"] = (nbytes, out["int8"][1] + codec_ms, out["int8"][2] + codec_ms)
    print(
        f"    {'wire-int8':9s} {nbytes / MIB:6.2f} MiB ({wire.block_bytes} B/block): "
        f"nixl {out['wire-int8'][1]:.2f} ms, grpc {out['wire-int8'][2]:.2f} ms "
        f"(int8's pull + quantize {quant_s * 1e3:.2f} ms + dequantize {dequant_s * 1e3:.2f} ms wall, "
        f"{quant_cpu * 1e3:.2f} + {dequant_cpu * 1e3:.2f} ms CPU, one torch thread)"
    )
    return out


def codec_seconds(fp: KvLayout, wire: KvLayout, n: int, reps: int) -> tuple[float, float, float, float]:
    """Median (quantize wall, dequantize wall, quantize CPU, dequantize CPU) seconds of the wire
    stage's two halves on `n` blocks (services/worker/wire_kv.py), on one torch thread (CPU
    seconds are the figure to trust on a loaded machine)."""
    g = torch.Generator().manual_seed(3)
    holder = torch.randn(n, *fp.kv_shape, generator=g)
    receiver = fp.allocate_pool(n)
    staging = wire.allocate_pool(n)
    idx = torch.arange(n)
    rows: list[tuple[float, float, float, float]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(reps + 1):  # the first is a warm-up
            w0, c0 = time.perf_counter(), time.thread_time()
            staging.index_copy_(0, idx, quantize_blocks(holder.index_select(0, idx), wire))
            w1, c1 = time.perf_counter(), time.thread_time()
            receiver.index_copy_(0, idx, dequantize_blocks(staging.index_select(0, idx), wire))
            w2, c2 = time.perf_counter(), time.thread_time()
            rows.append((w1 - w0, w2 - w1, c1 - c0, c2 - c1))
    finally:
        torch.set_num_threads(threads)
    err = float((receiver - holder).abs().max() / holder.abs().max())
    assert err < 0.01, f"wire round trip error {err}"
    q, dq, qc, dqc = (statistics.median(col) for col in zip(*rows[1:], strict=True))
    return q, dq, qc, dqc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 2 minutes)")
    ap.add_argument("--grpc-chunk-kib", type=int, default=512, help="gRPC chunk size in KiB")
    ap.add_argument("--nixl-threads", type=int, default=0, help="UCX backend threads (0 = NIXL default)")
    ap.add_argument(
        "--verify", action="store_true", help="checksum every pull (slower; the tests already do)"
    )
    args = ap.parse_args(argv)
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
