"""CPU of the router's prefix index, before and after (issue 16): the same replay through two
implementations of `services/router/prefix_index.PrefixIndex`, alternated round by round in one
process.

    .venv/bin/python bench/prefix_index_cpu.py                 # HEAD's file against the working tree's
    .venv/bin/python bench/prefix_index_cpu.py --base e32bdbf  # any commit's file as the baseline

The replay is what the router's KV-event loop and routing decision do in the Dynamo side by side
(bench/peers/dynamo/run.py: the Mooncake conversation trace at length factor 8, 16-token blocks,
4 workers of 16,384 blocks): per request, `match` of its chain, an optimistic `apply_provisional`
on the chosen worker (the best match, ties to the least-used), then the worker's KV events as the
engine sends them: `apply_stored` of the blocks it computed (confirming the provisional ones) and
`apply_removed` of what its LRU pool evicts to make room. Every `match` result of the two
implementations is compared (they must agree exactly), so a speed-up that changes an answer fails.
CPU is the thread's (`time.thread_time`), garbage collection timed by `gc.callbacks` inside it.
Ends with `prefix_index_cpu us_per_request_base=.. us_per_request_new=.. ratio=.. gc_share_base=..
gc_share_new=..`.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_model  # noqa: E402
from bench.traces import default_trace_path, load_mooncake  # noqa: E402

BLOCK = 16
MOONCAKE_BLOCK = 512


def load_module(name: str, source: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def chains(n: int, length_factor: float) -> list[list[int]]:
    """Each request's chained 16-token block hashes: a Mooncake id stands for its 512-token block
    and everything before it, so (id, sub-block) names a prefix uniquely."""
    out = []
    per_id = max(1, round(MOONCAKE_BLOCK / length_factor / BLOCK))
    for r in load_mooncake(default_trace_path("mooncake"))[:n]:
        blocks = max(1, int(r.input_len / length_factor) // BLOCK)
        hs = []
        for hid in r.hash_ids:
            for j in range(per_id):
                if len(hs) == blocks:
                    break
                d = hashlib.blake2b(f"{hid}/{j}".encode(), digest_size=8).digest()
                hs.append(int.from_bytes(d, "little"))
        while len(hs) < blocks:  # the tail past the trace's ids: unique to this request
            d = hashlib.blake2b(f"u{len(out)}/{len(hs)}".encode(), digest_size=8).digest()
            hs.append(int.from_bytes(d, "little"))
        out.append(hs)
    return out


def replay(mod, reqs: list[list[int]], workers: int, pool_blocks: int) -> tuple[float, float, list]:
    """(thread CPU seconds, of which GC, every match result)."""
    idx = mod.PrefixIndex()
    pools = [OrderedDict() for _ in range(workers)]  # the engines' LRU pools
    names = [f"decode-{i}" for i in range(workers)]
    used = [0] * workers
    results = []
    gc_s = [0.0]
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.thread_time()
        else:
            gc_s[0] += time.thread_time() - started[0]

    gc.collect()
    gc.callbacks.append(on_gc)
    t0 = time.thread_time()
    try:
        for i, hs in enumerate(reqs):
            m = idx.match(hs)
            results.append(m)
            w = max(range(workers), key=lambda k: (m.get(names[k], 0), -used[k]))
            used[w] += 1
            idx.apply_provisional(names[w], hs, expires_at=i + 100.0)
            pool = pools[w]
            # The engine reuses the leading cached blocks and computes the rest (a cached block
            # after the first miss is not reused: prefix caching stops there), storing them.
            k = 0
            while k < len(hs) and hs[k] in pool:
                pool.move_to_end(hs[k])
                k += 1
            for h in hs[k:]:
                pool[h] = None
                pool.move_to_end(h)
            if k < len(hs):
                idx.apply_stored(names[w], hs[k - 1] if k else None, hs[k:])
            evicted = []
            while len(pool) > pool_blocks:
                evicted.append(pool.popitem(last=False)[0])
            if evicted:
                idx.apply_removed(names[w], evicted)
            idx.expire(float(i))
    finally:
        gc.callbacks.remove(on_gc)
    return time.thread_time() - t0, gc_s[0], results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="commit whose prefix_index.py is the baseline")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--length-factor", type=float, default=8.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--pool-blocks", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    base_src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{args.base}:services/router/prefix_index.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    new_src = (ROOT / "services/router/prefix_index.py").read_text()
    mods = {
        "base": load_module("prefix_index_base", base_src),
        "new": load_module("prefix_index_new", new_src),
    }
    reqs = chains(args.requests, args.length_factor)
    n_blocks = sum(map(len, reqs))
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    print(
        f"replay: {len(reqs)} Mooncake requests at length factor {args.length_factor:g}, "
        f"{n_blocks / len(reqs):.0f} blocks of {BLOCK} per request, {args.workers} workers x "
        f"{args.pool_blocks} blocks; base = {args.base}:services/router/prefix_index.py, new = working tree"
    )
    cpu: dict[str, list[float]] = {"base": [], "new": []}
    gcs: dict[str, list[float]] = {"base": [], "new": []}
    for r in range(args.rounds):
        answers = {}
        for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
            s, g, answers[name] = replay(mods[name], reqs, args.workers, args.pool_blocks)
            cpu[name].append(s)
            gcs[name].append(g)
            print(
                f"  round {r + 1} {name:>4}: {s * 1e6 / len(reqs):7.1f} us CPU per request "
                f"({g / s:.0%} in GC); load {os.getloadavg()[0]:.1f}"
            )
        if answers["base"] != answers["new"]:
            bad = next(
                i for i, (a, b) in enumerate(zip(answers["base"], answers["new"], strict=True)) if a != b
            )
            print(f"MISMATCH at request {bad}: base {answers['base'][bad]} new {answers['new'][bad]}")
            return 1
    per = {k: statistics.median(v) * 1e6 / len(reqs) for k, v in cpu.items()}
    gshare = {k: sum(gcs[k]) / sum(cpu[k]) for k in cpu}
    print(f"every match result equal in {args.rounds} rounds")
    print(
        f"prefix_index_cpu us_per_request_base={per['base']:.1f} us_per_request_new={per['new']:.1f} "
        f"ratio={per['new'] / per['base']:.2f} gc_share_base={gshare['base']:.2f} gc_share_new={gshare['new']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
