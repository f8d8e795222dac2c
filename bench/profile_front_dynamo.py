"""Where pdmesh's router CPU goes in the Dynamo side by side's configuration (py-spy).

`bench/peers/dynamo/run.py` compares the router process's CPU with Dynamo's
frontend (`cpu_front_ratio`) under its own configuration: 4 `sim` workers
(dynamo-mocker profile), a WordLevel tokenizer folder, kv_aware, the HTTP door
with continuous usage, token-id prompts of the Mooncake trace / 8 (~1,800
tokens each, ~45 output tokens) at x4. bench/profile_front.py profiles a
zero-cost fake at one token per message instead, where per-request work
(parsing a long prompt, hashing and routing it, its KV events) is absent. This
starts pdmesh exactly as run.py's `start_pdmesh` does (no Dynamo needed),
sends `--requests` of that load through the HTTP door while py-spy samples the
router, and prints the router's CPU per request and per output token, the
functions with the most self samples, and the busy samples by what they
serve (`CATEGORIES`: the first marker a stack contains decides). `--probe`
profiles the near-zero-load probe instead (64-token prompts sent one at a time,
as run.py's, through the HTTP door and over gRPC).

Three more ways to watch the same load: `--perf` samples the router's on-CPU time
with Linux perf (libraries and C symbols: uvloop, libpython, upb, the kernel;
py-spy samples wall time and cannot see below uvloop's `Runner.run`);
`--cprofile` counts every Python call of the router's loop with cProfile, timed
in thread CPU time (bench/cprofile_hook: between two SIGUSR1s; it inflates small
functions, so its calls per output token are the firmer figure); `--rate 0`
runs no profiler and prints only the router's CPU (for before/after runs).
`--max-tokens 1` gives every request one output token, so what is profiled is the
per-request cost (parse, route, admission, prefill, KV events) without the relays.

Run: `python bench/profile_front_dynamo.py [--requests 500] [--probe] [--rate 40] [--perf | --cprofile]`.
Last line: `profile_front_dynamo router_ms_per_request=.. router_us_per_token=.. gc=.. kv_events=..`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import build_workload, run_load
from bench.peers.dynamo import run as D
from bench.profile_front import cpu_model, idle, print_summary, start_profile, summarize
from bench.routing import run_cpu_s
from bench.traces import VocabRange

# (category, marker in the stack), checked in order; the first match wins.
CATEGORIES = (
    ("gc", "gc_collect_main"),
    ("kv events (_kv_loop: parse, prefix index)", "_kv_loop"),
    ("worker polls (stats, health)", "_stats_loop"),
    ("worker polls (stats, health)", "_probe_health"),
    ("link: frames in (DecodeLink._read)", "DecodeLink._read"),
    ("link: frames out (open, cancel)", "DecodeLink._write"),
    ("flow: route (hash, match, rank, open)", "RequestFlow._launch"),
    ("flow: validate (Generation.__init__)", "Generation.__init__"),
    ("flow: admission", "RequestFlow._admit"),
    ("http: parse body", "parse_completion"),
    ("http: parse body", "parse_chat"),
    ("flow: relay (detokenize, stop text, deltas)", "Generation._stream"),
    ("http: SSE events (Gateway._events)", "Gateway._events"),
    ("http: SSE writes (ASGI send)", "EventStream.__call__"),
    ("http: request (Gateway._serve)", "Gateway._serve"),
    ("http: starlette/uvicorn", "run_asgi"),
    ("http: connections (httptools)", "httptools_impl"),
    ("grpc door: Generate (its writes, headers)", "RouterServicer.Generate"),
)


def side_by_side_load(requests: int) -> list:
    """The side by side's x4 load (bench/peers/dynamo/run.py's defaults): the first `requests`
    Mooncake requests, prompts / 8, those that fit half of one worker's 16,384 blocks."""
    items = build_workload(
        "mooncake",
        num_requests=requests,
        max_duration_s=120.0,
        length_factor=8.0,
        time_factor=1 / 4,
        seed=0,
        vocab=VocabRange(D.FIRST_WORD_ID, D.DEFAULT_VOCAB),
    )
    return [it for it in items if len(it.prompt_ids) + it.max_tokens <= 16384 * 16 // 2]


def categories(raw: Path) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or idle(stack.rsplit(";", 1)[-1]):
            continue
        total += int(n)
        for name, marker in CATEGORIES:
            if marker in stack:
                counts[name] += int(n)
                break
        else:
            main_thread = "_run_module_as_main" in stack
            counts["other, event-loop thread" if main_thread else "other threads (gRPC C-core)"] += int(n)
    return {k: v / max(total, 1) for k, v in counts.most_common()}


PERF_HZ = 997  # perf samples on-CPU time in the kernel: no pause of the router, unlike py-spy


def start_perf(pid: int | list[int], seconds: float, out: Path) -> subprocess.Popen:
    """`perf record` of the router's threads: where its CPU goes, down to C symbols (uvloop's
    Cython, libpython, upb, httptools, the kernel). py-spy samples wall time and cannot see
    below uvloop's `Runner.run`; perf counts only time on a CPU."""
    pids = ",".join(map(str, pid)) if isinstance(pid, list) else str(pid)
    cmd = ["perf", "record", "-F", str(PERF_HZ), "-p", pids, "-o", str(out), "--", "sleep", str(seconds)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def perf_rows(raw: Path, sort: str) -> list[tuple[float, str]]:
    text = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            str(raw),
            "--stdio",
            "--no-children",
            "--sort",
            sort,
            "--percent-limit",
            "0.3",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = []
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].endswith("%") and not line.startswith("#"):
            rows.append((float(parts[0].rstrip("%")), " ".join(parts[1].split())))
    return rows


def print_perf(raw: Path, who: str = "router") -> None:
    print(f"\n== {who} on-CPU samples by library (perf, {PERF_HZ} Hz); raw {raw}")
    for share, name in perf_rows(raw, "dso")[:15]:
        print(f"  {share:6.1f}%  {name}")
    print("  by symbol (self):")
    for share, name in perf_rows(raw, "dso,sym")[:40]:
        print(f"  {share:6.1f}%  {name[:150]}")


def wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():  # the hook renames the whole file into place
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router wrote no cProfile stats to {path}")
        time.sleep(0.1)  # polling a file another process writes, with a deadline


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process, by thread name."""
    out: dict[str, float] = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = "main (event loop)" if task.name == str(pid) else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return out


def print_cprofile(paths: list[Path], tokens: int) -> None:
    """The functions with the most own time, with their calls per output token (cProfile
    inflates the cost of small functions, so the calls per token are the firmer figure)."""
    st = pstats.Stats(*map(str, paths))
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    calls = sum(v[1] for _, v in rows)
    print(
        f"\n== event loop(s), cProfile: {total:.2f} s own time, {calls / tokens:.0f} Python calls per output token"
    )
    print("  own%   own us/token  calls/token  function")
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in rows[:45]:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        print(f"  {tt / total * 100:5.1f}  {tt / tokens * 1e6:10.1f}  {nc / tokens:11.2f}  {name} ({where})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=500)
    # --native pauses the router at every sample: at 250 Hz on 2 cores the mesh overloaded and
    # 334 of 500 requests failed (BENCHMARKS.md, issue 16 session 11); 40 Hz left it undisturbed.
    p.add_argument(
        "--rate",
        type=int,
        default=40,
        help="py-spy samples per second (0: no profiler, the router's CPU only)",
    )
    p.add_argument("--probe", action="store_true", help="profile the near-zero-load probe instead")
    p.add_argument(
        "--perf",
        action="store_true",
        help="sample the router's CPU with Linux perf (on-CPU time, C symbols) instead of py-spy",
    )
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="count every Python call of the router's loop with cProfile (bench/cprofile_hook) instead",
    )
    p.add_argument(
        "--workers",
        action="store_true",
        help="--cprofile / --perf: the decode workers instead of the router (their samples summed)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="every request's output tokens (default 0: the trace's); 1 isolates the per-request cost",
    )
    p.add_argument("--seconds", type=float, default=20.0, help="--probe: seconds of probing")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "profiles"))
    a = p.parse_args(argv)
    if a.probe and (a.cprofile or a.perf or a.workers):
        p.error("--cprofile, --workers and --perf profile the load, not --probe")
    if a.workers and not (a.cprofile or a.perf):
        p.error("--workers goes with --cprofile or --perf")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-profile-dynamo-"))
    folder = tmp / "model"
    D.write_folder(folder, D.DEFAULT_VOCAB)
    setup = D.Setup(4, 16, 16384, 1.0, 256, 8192, folder, Path("/nonexistent"))
    print(f"cpu: {cpu_model()} x{os.cpu_count()}; load avg {os.getloadavg()[0]:.1f}")
    stats = out / "router_dynamo_load.pstats"
    if a.cprofile:  # the hook reads these in the router process only
        stats.unlink(missing_ok=True)
        os.environ["PDMESH_CPROFILE_OUT"] = str(stats)
        if a.workers:
            os.environ["PDMESH_CPROFILE_MODULE"] = "services.decode.main"
            for old in out.glob("router_dynamo_load.pstats.*"):
                old.unlink()
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).parent / "cprofile_hook"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    dep = D.start_pdmesh(setup, "kv", tmp)
    pid = dep.front_pids["router"]
    results: dict[str, str] = {}
    try:
        if a.probe:
            raw = out / "router_dynamo_probe.raw"
            asyncio.run(D.probe(dep, 10, 0, 64, D.DEFAULT_VOCAB))  # warm connections and caches
            cpu0, rounds = run_cpu_s(pid), []
            prof = start_profile(pid, a.seconds + 1, a.rate, raw)
            t0 = time.monotonic()
            while time.monotonic() - t0 < a.seconds:
                rounds.append(asyncio.run(D.probe(dep, 20, len(rounds) + 1, 64, D.DEFAULT_VOCAB)))
            prof.wait()
            n = len(rounds) * 25 * 3  # requests per probe round: (20 + 5 warm) per path, 3 paths
            cpu = run_cpu_s(pid) - cpu0
            for k in ("http", "router", "direct"):
                vals = sorted(r[k] for r in rounds)
                print(f"  {k:6s} TTFT p50 over rounds {vals[len(vals) // 2]:.2f} ms")
            print(f"router CPU {cpu:.2f} s over ~{n} probe requests (a third of them bypass it)")
            what = "near-zero-load probe"
        else:
            raw = out / (
                "workers_dynamo_load.perf"
                if a.workers
                else "router_dynamo_load.perf"
                if a.perf
                else "router_dynamo_load.raw"
            )
            items = side_by_side_load(a.requests)
            if a.max_tokens > 0:
                items = [dataclasses.replace(it, max_tokens=a.max_tokens) for it in items]
            span, tokens = items[-1].arrival_s, sum(it.max_tokens for it in items)
            print(f"{len(items)} requests over {span:.1f} s, {tokens} output tokens")
            cpu0 = run_cpu_s(pid)
            watched = list(dep.worker_pids) if a.workers else [pid]
            threads0 = {p: thread_cpu_s(p) for p in watched}
            if a.cprofile:
                for p in watched:
                    os.kill(p, signal.SIGUSR1)  # start counting
                prof = None
            elif a.rate == 0:  # no profiler: the router's CPU alone
                prof = None
            else:
                prof = (
                    start_perf(watched if a.workers else pid, span + 2, raw)
                    if a.perf
                    else start_profile(pid, span + 2, a.rate, raw)
                )
            client = D.HttpClient(dep.url, D.MODEL_NAME)
            recs = asyncio.run(
                run_load(items, client, max_requests=len(items), max_duration_s=span + 1.0, timeout_s=60)
            )
            cpu = run_cpu_s(pid) - cpu0
            threads = collections.Counter()
            for p in watched:
                for name, t in thread_cpu_s(p).items():
                    threads[name] += t - threads0[p].get(name, 0.0)
            if a.cprofile:
                for p in watched:
                    os.kill(p, signal.SIGUSR1)  # stop and write the stats
                files = [Path(f"{stats}.{p}") for p in watched] if a.workers else [stats]
                for f in files:
                    wait_for_file(f, 30.0)
            elif prof is not None:
                prof.wait()
            errors = collections.Counter(f"{r.error_code}: {r.error_detail[:80]}" for r in recs if not r.ok)
            for why, n in errors.most_common(3):
                print(f"  {n} failed: {why}")
            print(
                f"ok {sum(r.ok for r in recs)}/{len(items)}; router CPU {cpu:.2f} s: "
                f"{cpu / len(items) * 1e3:.2f} ms per request, {cpu / tokens * 1e6:.1f} us per output token; "
                f"load avg {os.getloadavg()[0]:.1f}"
            )
            results["router_ms_per_request"] = f"{cpu / len(items) * 1e3:.2f}"
            results["router_us_per_token"] = f"{cpu / tokens * 1e6:.1f}"
            who = "decode workers'" if a.workers else "router's"
            print(f"the {who} CPU by thread over the load (us per output token):")
            for name, t in threads.most_common():
                print(f"  {t / tokens * 1e6:8.1f}  {name}")
            if a.workers:
                wcpu = sum(threads.values())
                print(f"decode workers' CPU {wcpu:.2f} s: {wcpu / tokens * 1e6:.1f} us per output token")
                results["workers_us_per_token"] = f"{wcpu / tokens * 1e6:.1f}"
            what = "load"
    finally:
        dep.stop()
    if a.cprofile:
        print_cprofile(files, tokens)
        print("profile_front_dynamo " + " ".join(f"{k}={v}" for k, v in results.items()))
        return 0
    if a.rate == 0 and not a.perf:
        print("profile_front_dynamo " + " ".join(f"{k}={v}" for k, v in results.items()))
        return 0
    if a.perf:
        print_perf(raw, "decode workers" if a.workers else "router")
        print("profile_front_dynamo " + " ".join(f"{k}={v}" for k, v in results.items()))
        return 0
    print_summary(f"router ({what})", summarize(raw, 25), f"raw profile {raw}")
    cats = categories(raw)
    print("  busy samples by what they serve:")
    for k, v in cats.items():
        print(f"  {v * 100:9.1f}%  {k}")
    results["gc"] = f"{cats.get('gc', 0):.3f}"
    results["kv_events"] = f"{cats.get(CATEGORIES[1][0], 0):.3f}"
    print("profile_front_dynamo " + " ".join(f"{k}={v}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
