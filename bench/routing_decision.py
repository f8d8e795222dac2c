"""Routing benchmark part 3: the cost of one routing decision (issue 17 item 4).

In process, no gRPC: the router's cores (PrefixIndex, WorkerRegistry, LoadView,
kv_aware policy) at 32 workers, each with 10,000 cached prefixes, and a
4,096-token prompt. One decision is what `RequestFlow._launch`
(services/router/generate.py) does before it calls the worker, in the same
order: start the prompt's lazy block-hash chain (through the router's hash memo, warm by
default: `--memo`), expire
unconfirmed optimistic entries, match the chain against the index (hashing the
blocks the walk reads), take the eligible workers from the registry,
rank with the own load view blended in (`own=`). The bookkeeping after the choice (load view
entry, hashing the rest of the prompt and inserting its blocks optimistically)
is timed separately.

Index contents: a pool of 4 x 10,000 distinct prefixes of 4 blocks each; every
worker holds a random 10,000 of them (so each prefix sits on ~8 workers), plus
the probe prompt's first 128 blocks, worker i holding its first 4 (i + 1) (so the
walk goes 128 blocks deep and drops a worker every 4 blocks). Loads are random.

Memory: the process's resident set before and after building the index, divided
by the (worker, block) entries it holds and by its distinct blocks.

`--memo partial --missed-chunks K`: the memo holds all but the last K of the chunks the
walk reads, as for a conversation's next turn whose newest chunks the router never
hashed (bench/routing_sim.py --memo-chunks counts K on the Mooncake trace: ~1 with
optimistic prefixes, which hash whole prompts; 4-8 without). `--memo all` includes it
when K > 0.

Run: `python bench/routing_decision.py` (also `bench/routing.py --decision`).
Last line: `routing_decision decision_ms_p50=.. decision_ms_p99=.. hash_ms_p50=..
match_ms_p50=.. rank_ms_p50=.. bookkeeping_ms_p50=.. index_bytes_per_entry=..
index_bytes_per_block=..` (target: decision p50 <= 0.1 ms), with `partialK_ms_p50=..`
when the partial mode ran.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/routing_decision.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_model
from services.model.hashing import BlockHashChain, block_hashes
from services.router.hash_memo import CHUNK, HashMemo, MemoHashChain
from services.router.load_view import LoadView
from services.router.policy import PolicyConfig, WorkerLoad, make_policy
from services.router.prefix_index import PrefixIndex
from services.router.registry import RegistryConfig, WorkerInfo, WorkerRegistry, WorkerRole, WorkerSource

BLOCK = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(workers: int, prefixes: int, prompt_tokens: int, rng: random.Random):
    registry = WorkerRegistry(RegistryConfig(model_id="m", block_size=BLOCK, max_workers=workers))
    ids = [f"decode-{i:02d}" for i in range(workers)]
    for i, w in enumerate(ids):
        registry.join(WorkerInfo(w, f"10.0.0.{i}:1", WorkerRole.DECODE, "m", BLOCK), WorkerSource.STATIC)
        load = WorkerLoad(
            tokens_waiting=rng.randrange(0, 20_000), active_decode_blocks=rng.randrange(0, 5_000)
        )
        registry.update_load(w, load)
    pool = [
        block_hashes([rng.randrange(1 << 31) for _ in range(4 * BLOCK)], BLOCK) for _ in range(4 * prefixes)
    ]
    probe = [rng.randrange(1 << 31) for _ in range(prompt_tokens)]
    probe_hashes = block_hashes(probe, BLOCK)
    gc.collect()
    before = rss_bytes()
    index = PrefixIndex()
    for i, w in enumerate(ids):
        for k in rng.sample(range(len(pool)), prefixes):
            index.apply_stored(w, None, pool[k])
        index.apply_stored(w, None, probe_hashes[: min(4 * (i + 1), 128)])
    gc.collect()
    mem = rss_bytes() - before
    entries = sum(index.blocks(w) for w in ids)
    return registry, index, probe, mem, entries


def memo_holding(tokens: tuple[int, ...]) -> HashMemo:
    """A fresh hash memo holding the chunks of `tokens` (a whole number of chunks)."""
    memo = HashMemo()
    for _ in MemoHashChain(tokens, BLOCK, memo):
        pass
    return memo


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(
    workers: int = 32,
    prefixes: int = 10_000,
    prompt_tokens: int = 4096,
    reps: int = 3000,
    memo: str = "warm",
    missed_chunks: int = 0,
) -> dict[str, float]:
    """`memo`: "warm" (the router's hash memo holds the prompt's prefix: it routed it before, as
    for a conversation's next turn), "cold" (an empty memo every decision: a prefix first seen),
    "off" (no memo, BlockHashChain: the hot path before the memo), "hashed" (every hash
    given: what the walk and the ranking cost alone), "partial" (the memo holds all but the
    last `missed_chunks` chunks the walk reads), "all" (the four, and "partial" when
    missed_chunks > 0, interleaved decision by decision; the returned figures are warm's)."""
    rng = random.Random(0)
    t0 = time.perf_counter()
    registry, index, probe, mem, entries = build(workers, prefixes, prompt_tokens, rng)
    print(
        f"index: {workers} workers x {prefixes:,} cached prefixes (+ the probe's path): {len(index):,} blocks, "
        f"{entries:,} (worker, block) entries, built in {time.perf_counter() - t0:.1f} s"
    )
    policy = make_policy("kv_aware", PolicyConfig(block_size=BLOCK, decode_weight=0.1), random.Random(1))
    view = LoadView()
    vrng = random.Random(2)
    for w in registry.workers():  # this router has traffic outstanding on every worker
        view.begin(w.worker_id, vrng.randrange(0, 20_000), vrng.randrange(0, 5_000))
    prompt = tuple(probe)
    hash_memo = HashMemo()
    clock = time.monotonic
    keys = ("decision", "decision_cpu", "hash", "match", "rank", "bookkeeping")
    # Modes interleaved decision by decision, so a loaded machine's noise falls on each alike.
    modes = ("off", "cold", "warm", "hashed") if memo == "all" else (memo,)
    if memo == "all" and missed_chunks > 0:
        modes += ("partial",)
    probe_hashes = block_hashes(probe, BLOCK)
    if "partial" in modes:
        counting = HashMemo()
        index.match(MemoHashChain(prompt, BLOCK, counting))
        walked = counting.misses  # chunks one decision's walk reads
        kept = prompt[: max(walked - missed_chunks, 0) * CHUNK * BLOCK]
        check = memo_holding(kept)
        before = check.misses
        index.match(MemoHashChain(prompt, BLOCK, check))
        print(
            f"partial memo: the walk reads {walked} chunks, the memo holds the first "
            f"{walked - missed_chunks} of them; the walk missed {check.misses - before}"
        )
    timings = {m: {k: [] for k in keys} for m in modes}
    pc, cpu = time.perf_counter, time.thread_time
    partial = HashMemo()
    gc.disable()  # a collection of the 100k-object index inside one decision is not the decision's cost
    try:
        for i in range(reps * len(modes)):
            mode = modes[i % len(modes)]
            if mode == "partial":  # untimed: a fresh memo holding the prefix's first chunks
                partial = memo_holding(kept)
            c_start = cpu()
            t_start = pc()
            # as _launch: hashed as far as match reads
            if mode == "off":
                hashes = BlockHashChain(prompt, BLOCK)
            elif mode == "hashed":  # the hashes given: the walk and the rest alone
                hashes = probe_hashes
            else:  # warm: the router's memo; partial: this rep's; cold: an empty one
                m = hash_memo if mode == "warm" else partial if mode == "partial" else HashMemo()
                hashes = MemoHashChain(prompt, BLOCK, m)
            t_hash = pc()
            now = clock()
            index.expire(now)
            overlaps = index.match(hashes)
            t_match = pc()
            cands = registry.eligible(WorkerRole.DECODE)
            choice = policy.rank(cands, len(hashes), overlaps, own=view.totals())[0]
            t_end = pc()
            c_end = cpu()
            # Bookkeeping after the choice, as _launch does it (then undone, so every rep is alike).
            total = -(-(len(prompt) + 256) // BLOCK)
            key = view.begin(choice.worker_id, len(prompt) - choice.overlap_blocks * BLOCK, total)
            index.apply_provisional(choice.worker_id, hashes, now + 5.0)
            t_book = pc()
            view.end(key)
            index.expire(now + 6.0)
            if i >= reps * len(modes) // 10:  # the first tenth warms up
                t = timings[mode]
                t["decision"].append(t_end - t_start)
                t["decision_cpu"].append(c_end - c_start)
                t["hash"].append(t_hash - t_start)
                t["match"].append(t_match - t_hash)
                t["rank"].append(t_end - t_match)
                t["bookkeeping"].append(t_book - t_end)
    finally:
        gc.enable()
    load = os.getloadavg()[0]
    print(
        f"one decision, {prompt_tokens}-token prompt ({len(probe) // BLOCK} blocks), best match "
        f"{max(overlaps.values())} blocks, load average {load:.1f} on {os.cpu_count()} CPUs ({cpu_model()}):"
    )
    out: dict[str, float] = {}
    partial_p50 = None
    for mode in sorted(modes, key=lambda m: m == "warm"):  # warm last: the summary's
        ms = {k: 1000 * statistics.median(v) for k, v in timings[mode].items()}
        p99 = 1000 * percentile(timings[mode]["decision"], 0.99)
        print(
            f"  hash memo {mode}: p50 {ms['decision']:.3f} ms (chain {ms['hash']:.3f}, expire + hash + match "
            f"{ms['match']:.3f}, eligible + rank with own load {ms['rank']:.3f}), p99 {p99:.3f} ms "
            f"(target p50 <= 0.1 ms); thread CPU time p50 {ms['decision_cpu']:.3f} ms; "
            f"bookkeeping after it {ms['bookkeeping']:.3f} ms"
        )
        if mode == "partial":
            partial_p50 = ms["decision"]
        out = {
            "decision_ms_p50": ms["decision"],
            "decision_ms_p99": p99,
            "decision_cpu_ms_p50": ms["decision_cpu"],
            "hash_ms_p50": ms["hash"],
            "match_ms_p50": ms["match"],
            "rank_ms_p50": ms["rank"],
            "bookkeeping_ms_p50": ms["bookkeeping"],
        }
    per_entry, per_block = mem / max(entries, 1), mem / max(len(index), 1)
    print(
        f"  index memory {mem / 2**20:.0f} MiB: {per_entry:.0f} B per (worker, block) entry, {per_block:.0f} B per block; "
        f"hash memo {len(hash_memo)} chunks"
    )
    if partial_p50 is not None:  # the summary's figures are warm's, unless partial ran alone
        out[f"partial{missed_chunks}_ms_p50"] = partial_p50
    return out | {"index_bytes_per_entry": per_entry, "index_bytes_per_block": per_block}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--prefixes", type=int, default=10_000)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3000)
    p.add_argument(
        "--memo",
        choices=("warm", "cold", "off", "hashed", "partial", "all"),
        default="warm",
        help="see run()",
    )
    p.add_argument(
        "--missed-chunks", type=int, default=0, help="partial: chunks of the walk the memo lacks (see run())"
    )
    a = p.parse_args(argv)
    if a.memo == "partial" and a.missed_chunks <= 0:
        p.error("--memo partial needs --missed-chunks >= 1")
    # "all": the summary is warm's (with partialK_ms_p50 beside it)
    r = run(a.workers, a.prefixes, a.prompt_tokens, a.reps, a.memo, a.missed_chunks)
    fields = " ".join(
        f"{k}={v:.3f}" if k.endswith("ms_p50") or "ms_" in k else f"{k}={v:.0f}" for k, v in r.items()
    )
    print("routing_decision " + fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
