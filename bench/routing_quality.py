"""Routing benchmark part 1: routing quality on simulated workers (issue 6 part 1, issue 7 item 4).

Real processes: N decode workers with the `sim` engine (services/engine/sim:
the real scheduler, block manager and prefix cache; pass times from a timing
profile, dynamo-mocker by default) and one router per policy in front of them.
The Mooncake conversation trace is replayed open loop by bench.loadgen, lengths
divided by `length_factor` and prompts synthesised from `hash_ids` (shared ids =
shared prefixes; bench.traces.PromptSynthesizer).

Time: the trace's inter-arrivals are multiplied by `time_factor` in *model*
time (the simulated GPU's clock), and every worker runs at `speedup` (wall =
model / speedup). Figures are reported in model time (wall x speedup). The
speedup is picked so the wall-clock request rate stays within what this
machine's CPUs serve (router, workers and load generator spend 20-45 ms of
CPU per request, see the "CPUs busy" lines): TTFT includes their queueing and
gRPC hops, scaled by the same factor, so a busy machine shows up as longer
model-time TTFTs for every policy alike.

Equal offered load: every policy gets the same arrival times and the same
lengths and sharing structure. Prompt token values differ per policy (another
synthesiser seed), so the cache a previous policy left on the workers (reused
across policies, not restarted) can never hit: its blocks are the first evicted.

Per policy: prefix-cache hit rate (cached / prompt tokens, from the final
usage of each request, and cross-checked with the workers' counters), TTFT
mean/p50/p99, TPOT p50, achieved throughput, goodput under model-time SLOs,
spread of requests over workers. `ideal_hit` is the hit rate of one unbounded
cache serving every request (an upper bound for any policy).

Run: bench/routing.py (quick or full, plus the router-cost part; `--scale` for
8-32 workers and the plot), or `python bench/routing_quality.py --study quick
--time-factor ...` to explore one study with overrides.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # `python bench/routing_quality.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.loadgen import WorkItem, build_workload, run_load
from bench.stats import RequestRecord, Summary, summarize, write_records
from bench.traces import VocabRange
from pdmesh.launcher import Launcher, RunningService, ServiceSpec, flags
from pdmesh.v1 import decode_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2
from services.model.hashing import block_hashes

POLICIES = ("kv_aware", "round_robin", "least_loaded")
HUGE = 1_000_000  # router limits lifted: admission and queues must not shed or reorder


@dataclass(frozen=True)
class Study:
    name: str
    workers: int
    requests: int
    length_factor: float  # trace lengths / this
    output_factor: float  # output lengths / this again (fewer token messages for the CPUs)
    time_factor: float  # trace inter-arrivals x this = model-time inter-arrivals
    speedup: float  # wall = model / speedup, on every worker
    num_blocks: int  # KV pool per worker, blocks of block_size tokens
    profile: str = "dynamo-mocker"
    block_size: int = 16
    max_num_batched_tokens: int = 8192  # the profile's (Dynamo mocker's default)
    max_num_seqs: int = 256
    policies: tuple[str, ...] = POLICIES
    slo_ttft_ms: float = 2000.0  # model time
    slo_tpot_ms: float = 100.0  # model time
    timeout_s: float = 300.0  # wall, per request
    host_tier_blocks: int = 0  # per worker, blocks of the profile's model (0 = no host KV tier)
    # A heterogeneous fleet (issue 21 item 3): worker i runs at speedup / slowdowns[i % len], an
    # older generation slower at everything; model time stays the fastest worker's clock.
    worker_slowdowns: tuple[float, ...] = ()

    @property
    def wall_factor(self) -> float:
        """Trace inter-arrival x this = wall inter-arrival."""
        return self.time_factor / self.speedup


@dataclass
class PolicyResult:
    policy: str
    study: Study
    summary: Summary
    records: list[RequestRecord]
    worker_delta: dict[str, dict[str, int]] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # CPU seconds of the workers, the router and this process during the run

    def _model_ms(self, seconds: float) -> float:
        return seconds * 1000.0 * self.study.speedup

    @property
    def hit(self) -> float:
        """Cached / prompt tokens over successful requests (first admission, from usage)."""
        ok = [r for r in self.records if r.ok]
        return sum(r.cached_tokens for r in ok) / max(sum(r.prompt_tokens for r in ok), 1)

    @property
    def worker_hit(self) -> float:
        """The workers' own counters: cached / (cached + computed) prompt tokens."""
        cached = sum(d["prompt_tokens_cached"] for d in self.worker_delta.values())
        computed = sum(d["prompt_tokens_computed"] for d in self.worker_delta.values())
        return cached / max(cached + computed, 1)

    @property
    def pull_share(self) -> float:
        """Share of successful requests served with a prefix pulled from another worker (issue 17)."""
        pulls = sum(d.get("prefix_pulls_ok", 0) for d in self.worker_delta.values())
        return pulls / max(self.summary.ok, 1)

    @property
    def preemptions(self) -> int:
        return sum(d["preemptions"] for d in self.worker_delta.values())

    @property
    def ttft_ms(self) -> dict[str, float]:
        t = self.summary.ttft
        return {k: self._model_ms(getattr(t, k)) for k in ("mean", "p50", "p99")}

    @property
    def tpot_p50_ms(self) -> float:
        return self._model_ms(self.summary.tpot.p50)

    @property
    def output_tok_s(self) -> float:
        """Achieved output tokens per model second."""
        return self.summary.output_tok_s / self.study.speedup

    @property
    def request_rps(self) -> float:
        return self.summary.request_rps / self.study.speedup

    @property
    def goodput_rps(self) -> float:
        return self.summary.goodput_rps / self.study.speedup

    @property
    def spread(self) -> float:
        """Requests on the busiest worker / the mean per worker (1 = even)."""
        counts = Counter(r.worker_id for r in self.records if r.ok)
        per = [counts.get(w, 0) for w in self.worker_delta] or [0]
        return max(per) / max(statistics.mean(per), 1e-9)


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def workload(study: Study, seed: int) -> list[WorkItem]:
    items = build_workload(
        "mooncake",
        num_requests=study.requests,
        max_duration_s=1e9,
        length_factor=study.length_factor,
        time_factor=study.wall_factor,
        seed=seed,
        vocab=VocabRange(0, 256),
    )
    return [replace(it, max_tokens=math.ceil(it.max_tokens / study.output_factor)) for it in items]


def ideal_hit(items: list[WorkItem], block_size: int) -> float:
    """Hit rate of one unbounded prefix cache that saw every earlier request
    (full blocks, the last prompt token always computed, as the engine does)."""
    seen: set[int] = set()
    cached = total = 0
    for it in items:
        hashes = block_hashes(it.prompt_ids, block_size)
        usable = (len(it.prompt_ids) - 1) // block_size
        n = 0
        while n < usable and hashes[n] in seen:
            n += 1
        cached += n * block_size
        total += len(it.prompt_ids)
        seen.update(hashes)
    return cached / max(total, 1)


# ---- processes -------------------------------------------------------------------------


def limits(study: Study) -> dict[str, int]:
    cap = study.num_blocks * study.block_size
    return {"limits_max_prompt_tokens": cap, "limits_max_tokens_limit": cap}


def start_workers(launcher: Launcher, study: Study) -> list[RunningService]:
    kv: tuple[str, ...] = ()
    if any(_pulls(p) for p in study.policies):  # pulls move KV: a transport, its registry
        svc = launcher.start_ready(
            ServiceSpec("kvtransfer", "services.kvtransfer.main", ready_service="pdmesh.v1.KvTransferService")
        )
        kv = flags(kvtransfer_address=svc.address, kv_transport="grpc")
    engine = kv + flags(
        engine_backend="sim",
        engine_preset="tiny",
        engine_sim_profile=study.profile,
        engine_sim_speedup=study.speedup,
        engine_num_blocks=study.num_blocks,
        engine_block_size=study.block_size,
        engine_max_num_batched_tokens=study.max_num_batched_tokens,
        engine_max_num_seqs=study.max_num_seqs,
        log_level="warning",
        **limits(study),
    )
    if study.host_tier_blocks:
        from services.model.timing import load_profile

        block_bytes = load_profile(study.profile).kv_bytes_per_token * study.block_size
        engine += flags(engine_host_tier_bytes=study.host_tier_blocks * block_bytes)
    slow = study.worker_slowdowns or (1.0,)
    workers = [
        launcher.start(
            ServiceSpec(
                f"decode-{i}",
                "services.decode.main",
                # a later flag wins: this worker's own speed
                flags(worker_id=f"decode-{i:02d}")
                + engine
                + flags(engine_sim_speedup=study.speedup / slow[i % len(slow)])
                # a slower generation says so at registration: the router's --speed-route auto
                + (
                    flags(accelerator_generation=f"sim-x{slow[i % len(slow)]:g}")
                    if slow[i % len(slow)] != 1
                    else ()
                ),
                ready_service="pdmesh.v1.DecodeService",
            )
        )
        for i in range(study.workers)
    ]
    for w in workers:
        launcher.wait_ready(w, 300)
    return workers


# Ablation variants (issue 17): "<policy>@<variant>" runs the router with these flags.
VARIANTS = {
    # the router before issue 17: heartbeat load, Dynamo's decode weight 1
    "old": {"load_view": "false", "optimistic_prefix_ttl_s": 0, "decode_weight": 1.0, "busy_blocks": 0},
    "hb": {"load_view": "false", "optimistic_prefix_ttl_s": 0},  # heartbeat load only, decode weight 0.1
    # session 5's default: own view and decode weight 0.1, no busy term (the blend with reports
    # is the code's: subtracting what was ours in each report has no switch)
    "lv0": {"load_view": "true", "optimistic_prefix_ttl_s": 0, "busy_blocks": 0},
    "lv1": {"load_view": "true", "optimistic_prefix_ttl_s": 0, "decode_weight": 1.0},  # own view, weight 1
    "lv": {"load_view": "true", "optimistic_prefix_ttl_s": 0},  # + the router's own load view (the default)
    "opt": {"load_view": "true", "optimistic_prefix_ttl_s": 10.0},  # + optimistic prefixes
    # + prefixes pulled instead of recomputed (the link and rates: pull_flags)
    "pull": {"load_view": "true", "optimistic_prefix_ttl_s": 10.0, "prefix_pull_enabled": "true"},
    # the default (own load view, no optimistic prefixes) + pulls: the routing model's kv@lv:pull=1
    "lvpull": {"load_view": "true", "optimistic_prefix_ttl_s": 0, "prefix_pull_enabled": "true"},
    # the same, but never moving a request off the holder the policy chose (pulls only to the choice)
    "pullkeep": {
        "load_view": "true",
        "optimistic_prefix_ttl_s": 10.0,
        "prefix_pull_enabled": "true",
        "prefix_pull_min_gain": 0.99,
    },
    "notier": {"tier_credit": "false"},  # host-tier blocks not credited (bench/kv_tiers.py)
    "speed": {"speed_route": "true"},  # ranked on each worker's measured speed (issue 21 item 3)
    "nospeed": {"speed_route": "false"},  # every worker weighs the same (auto with one kind of worker)
    "plain": {"speed_route": "false", "outlier_enabled": "false"},  # nor slowness seen as a fault
}


def _pulling(variant: str) -> bool:
    """Does the variant pull prefixes (prefix_pull_enabled among its flags)?"""
    return VARIANTS.get(variant, {}).get("prefix_pull_enabled") == "true"


def _pulls(policy: str) -> bool:
    """Does "<policy>@<variant>" pull prefixes?"""
    return _pulling(policy.partition("@")[2])


def pull_flags(study: Study) -> dict[str, float]:
    """The router's pull model in wall time (the sim runs `speedup` times faster than its
    profile): the profile's KV bytes and link, its prefill rate as the prior for a worker
    that reported none, and ~3 ms of RPCs (lease, read) per pull on this machine."""
    from services.model.timing import load_profile

    prof = load_profile(study.profile)
    return {
        "prefix_pull_kv_bytes_per_token": float(prof.kv_bytes_per_token),
        "prefix_pull_link_bytes_per_s": prof.kv_bandwidth_gbps * 1e9 * study.speedup,
        "prefix_pull_prior_tokens_per_s": 4096 / (prof.prefill_ms(4096) / 1000) * study.speedup,
        "prefix_pull_latency_s": 0.003,
    }


def start_router(launcher: Launcher, study: Study, policy: str, workers: list[RunningService]):
    """`policy` is a router policy name, or "kv_aware:W" for kv_aware with --prefill-weight W,
    optionally with "@variant" (VARIANTS) appended."""
    policy, _, variant = policy.partition("@")
    name, _, weight = policy.partition(":")
    args = flags(
        decode_workers=[w.address for w in workers],
        policy=name,
        prefill_weight=float(weight) if weight else None,
        **VARIANTS.get(variant, {}),
        **(pull_flags(study) if _pulling(variant) else {}),
        preset="tiny",
        block_size=study.block_size,
        max_model_len=study.num_blocks * study.block_size,
        admission_max_inflight=HUGE,
        admission_queue_limit_per_priority=HUGE,
        admission_queue_timeout_s=study.timeout_s,
        max_waiting_per_worker=0,
        first_token_timeout_s=0,
        stall_timeout_s=0,
        log_level="warning",
        **limits(study),
    )
    return launcher.start_ready(
        ServiceSpec(
            f"router-{name}{weight}{variant}",
            "services.router.main",
            args,
            ready_service="pdmesh.v1.RouterService",
        ),
        300,
    )


def worker_counters(workers: list[RunningService]) -> dict[str, dict[str, int]]:
    out = {}
    for w in workers:
        with grpc.insecure_channel(w.address) as ch:
            s = decode_pb2_grpc.DecodeServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=30)
        c = s.counters
        out[s.info.worker_id] = {
            "prompt_tokens_cached": c.prompt_tokens_cached,
            "prompt_tokens_computed": c.prompt_tokens_computed,
            "prompt_tokens_restored": c.prompt_tokens_restored,
            # host tier (bench/kv_tiers.py): what it lost against an unbounded, always-restoring tier
            "host_evicted": c.host_evicted,
            "host_restores_declined": c.host_restores_declined,
            "host_rejected": c.host_rejected,
            "preemptions": c.preemptions,
            "prefix_pulls_ok": s.prefix_pulls.get("ok", 0),
            "prefix_pulls_fallback": s.prefix_pulls.get("fallback", 0),  # tried, failed: recomputed
            "prefix_pulls_skipped": s.prefix_pulls.get("skipped", 0),  # the worker's own check said no
            "prefix_pull_tokens": s.prefix_pull_tokens_saved,
        }
    return out


def wait_index_synced(
    router: RunningService, workers: list[RunningService], timeout_s: float = 300.0
) -> float:
    """Wait until the new router's prefix index holds every worker's cached blocks (its
    KV-event snapshots are applied); returns the seconds waited.

    Without this, a router started on workers whose caches the previous policy filled
    spends its first seconds applying 4 x 65k-block snapshots while the first requests
    of the trace wait: every policy after the first paid ~10 s on its first requests.
    """
    t0 = time.perf_counter()
    want = {}
    for w in workers:
        with grpc.insecure_channel(w.address) as ch:
            s = decode_pb2_grpc.DecodeServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=30)
        want[s.info.worker_id] = s.cached_blocks
    # ListWorkers is an operator RPC: the router's internal listener serves it
    with grpc.insecure_channel(router.internal_address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        while True:
            try:
                resp = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=30)
            except grpc.RpcError as e:  # e.g. ListWorkers moved to an internal port: go on unsynced
                print(f"  (router index sync not checked: {e.code().name})")
                return time.perf_counter() - t0
            have = {ws.info.worker_id: ws.indexed_blocks for ws in resp.workers}
            if all(have.get(w, -1) >= n for w, n in want.items()):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"router index not synced after {timeout_s:.0f} s: {have} vs {want}")
            time.sleep(0.2)


def print_speeds(router: RunningService, policy: str, records: list[RequestRecord]) -> None:
    """What the router measured of each worker (ListWorkers: issue 21 item 3), and the requests
    each got: whether the learned speeds separate a heterogeneous fleet."""
    counts = Counter(r.worker_id for r in records)
    # Requests are not work: a router that sends the long prompts to the fast workers and the
    # short ones to the slow can keep the request counts even. Prompt tokens computed (not
    # served from a cache) and tokens decoded, as shares of the run's, say where the work went.
    computed, decoded = Counter(), Counter()
    for r in records:
        if r.ok:
            computed[r.worker_id] += r.prompt_tokens - r.cached_tokens
            decoded[r.worker_id] += r.output_tokens
    total_c, total_d = sum(computed.values()) or 1, sum(decoded.values()) or 1
    with grpc.insecure_channel(router.internal_address) as ch:
        resp = router_pb2_grpc.RouterServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=30)
    for w in sorted(resp.workers, key=lambda w: w.info.worker_id):
        print(
            f"  {policy}: {w.info.worker_id} ({w.info.accelerator_generation}) {counts[w.info.worker_id]} requests, "
            f"computed prompt {computed[w.info.worker_id] / total_c:.2f} decoded {decoded[w.info.worker_id] / total_d:.2f}, "
            f"prefill {w.measured_prefill_s_per_token * 1e6:.1f} us/token x{w.prefill_speed_factor:.2f}, "
            f"decode {w.measured_decode_s_per_token * 1e3:.2f} ms/token x{w.decode_speed_factor:.2f}"
        )


def run_policy(
    launcher: Launcher, study: Study, policy: str, workers: list[RunningService], items: list[WorkItem]
) -> PolicyResult:
    router = start_router(launcher, study, policy, workers)
    pids = [w.proc.pid for w in workers] + [router.proc.pid]
    try:
        synced = wait_index_synced(router, workers)
        if synced > 1:
            print(f"  {policy}: router index synced with the workers' caches in {synced:.0f} s")
        before = worker_counters(workers)
        cpu0 = sum(proc_cpu_s(pid) for pid in pids) + time.process_time()
        t0 = time.perf_counter()
        records = asyncio.run(
            run_load(
                items,
                f"grpc://{router.address}",
                max_requests=len(items),
                max_duration_s=items[-1].arrival_s + 1,
                timeout_s=study.timeout_s,
            )
        )
        wall = time.perf_counter() - t0
        cpu = sum(proc_cpu_s(pid) for pid in pids) + time.process_time() - cpu0
        after = worker_counters(workers)
        if study.worker_slowdowns:
            print_speeds(router, policy, records)
    finally:
        launcher.stop(router)
    delta = {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in after}
    summary = summarize(
        records, study.slo_ttft_ms / 1000 / study.speedup, study.slo_tpot_ms / 1000 / study.speedup
    )
    return PolicyResult(policy, study, summary, records, delta, wall, cpu)


def run_study(study: Study, log=print) -> tuple[list[PolicyResult], float]:
    """Every policy of `study` on one set of workers; (results, ideal hit rate)."""
    workdir = tempfile.mkdtemp(prefix=f"bench-routing-{study.name}-")
    results = []
    with Launcher(workdir) as launcher:
        t0 = time.perf_counter()
        workers = start_workers(launcher, study)
        log(f"  {study.workers} sim workers up in {time.perf_counter() - t0:.0f} s (logs: {workdir})")
        ideal = math.nan
        for seed, policy in enumerate(study.policies):
            items = workload(study, seed)
            if seed == 0:
                ideal = ideal_hit(items, study.block_size)
            results.append(run_policy(launcher, study, policy, workers, items))
            r = results[-1]
            again = study.policies[:seed].count(policy)  # a repeated policy keeps each run's records
            name = f"{policy}.{again}.jsonl" if again else f"{policy}.jsonl"
            write_records(Path(workdir) / name, r.records, meta={"study": study.name})
            log(
                f"  {policy}: {r.summary.ok}/{r.summary.requests} ok in {r.wall_s:.0f} s wall "
                f"(trace span {items[-1].arrival_s:.0f} s), {r.cpu_s / r.wall_s:.2f} CPUs busy "
                f"({1000 * r.cpu_s / len(items):.0f} ms CPU/request), hit {r.hit:.3f}, "
                f"TTFT p50 {r.ttft_ms['p50']:.0f} ms"
            )
    return results, ideal


# ---- report ----------------------------------------------------------------------------


def describe(study: Study) -> str:
    return (
        f"{study.workers} sim decode workers ({study.profile}, {study.num_blocks} blocks x "
        f"{study.block_size} tokens each = {study.num_blocks * study.block_size:,} tokens, "
        f"max_num_batched_tokens {study.max_num_batched_tokens}); Mooncake conversation, first "
        f"{study.requests} requests, length_factor={study.length_factor:g} (outputs / "
        f"{study.length_factor * study.output_factor:g}), model time_factor="
        f"{study.time_factor:g}, speedup={study.speedup:g} (wall time_factor={study.wall_factor:g})"
        + (
            f"; heterogeneous: worker i runs at speedup / {','.join(f'{x:g}' for x in study.worker_slowdowns)}"
            "[i mod len]"
            if study.worker_slowdowns
            else ""
        )
    )


def table(results: list[PolicyResult]) -> list[str]:
    head = (
        f"  {'policy':<16}{'ok':>6}{'hit':>7}{'hit_w':>7}{'ttft_mean':>11}{'ttft_p50':>10}{'ttft_p99':>10}"
        f"{'tpot_p50':>10}{'out_tok/s':>11}{'req/s':>7}{'goodput':>9}{'spread':>8}{'preempt':>9}"
    )
    lines = [head]
    for r in results:
        t = r.ttft_ms
        lines.append(
            f"  {r.policy:<16}{r.summary.ok:>6}{r.hit:>7.3f}{r.worker_hit:>7.3f}{t['mean']:>11.0f}"
            f"{t['p50']:>10.0f}{t['p99']:>10.0f}{r.tpot_p50_ms:>10.1f}{r.output_tok_s:>11.0f}"
            f"{r.request_rps:>7.2f}{r.goodput_rps:>9.2f}{r.spread:>8.2f}{r.preemptions:>9}"
        )
    return lines


def by_policy(results: list[PolicyResult]) -> dict[str, PolicyResult]:
    return {r.policy: r for r in results}


def print_study(study: Study, results: list[PolicyResult], ideal: float) -> None:
    print(describe(study))
    print(
        f"  model-time figures (wall x {study.speedup:g}): TTFT/TPOT in ms, throughput per model second; "
        f"SLO TTFT <= {study.slo_ttft_ms:g} ms, TPOT <= {study.slo_tpot_ms:g} ms; hit = cached/prompt "
        f"tokens (usage), hit_w = workers' counters; ideal (one unbounded cache) {ideal:.3f}"
    )
    for line in table(results):
        print(line)
    for r in results:
        if _pulls(r.policy):
            tokens = sum(d.get("prefix_pull_tokens", 0) for d in r.worker_delta.values())
            fell, skipped = (
                sum(d.get(k, 0) for d in r.worker_delta.values())
                for k in ("prefix_pulls_fallback", "prefix_pulls_skipped")
            )
            print(
                f"  {r.policy}: pull_share {r.pull_share:.3f} of requests, {tokens:,} prompt tokens pulled; "
                f"hints that fell back to a local prefill {fell}, skipped by the worker's check {skipped}"
            )
    p = by_policy(results)
    rr = p.get("round_robin")
    for name, kv in p.items():
        if rr is None or name == "round_robin":
            continue
        print(
            f"  {name} vs round_robin: mean TTFT x{kv.ttft_ms['mean'] / rr.ttft_ms['mean']:.2f}, "
            f"p50 x{kv.ttft_ms['p50'] / rr.ttft_ms['p50']:.2f}, p99 x{kv.ttft_ms['p99'] / rr.ttft_ms['p99']:.2f}, "
            f"hit {kv.hit:.3f} vs {rr.hit:.3f}, throughput x{kv.output_tok_s / rr.output_tok_s:.2f} "
            "(target: mean TTFT <= 0.5x at equal throughput)"
        )


# ---- studies ---------------------------------------------------------------------------

# Real prompt lengths (the sim needs no scaling: mean 13.7k tokens, the regime the
# dynamo-mocker profile models), outputs / 8 so token messages do not swamp the 2 CPUs,
# arrivals 1/0.6 = 1.7x the trace's rate, the simulated GPU run 4x faster than real time
# (wall time_factor 0.15); 1M KV tokens per worker (Dynamo mocker's 16,384 blocks of 64).
FULL = Study(
    "full",
    workers=4,
    requests=2000,
    length_factor=1,
    output_factor=8,
    time_factor=0.6,
    speedup=4.0,
    num_blocks=65536,
)
# bench/routing.py runs FULL at these model time_factors (offered load 1/0.6 and 1/0.45 times
# the trace's), each with the speedup that keeps the wall time_factor at 0.15.
FULL_LOADS = (0.6, 0.45)
# make bench: the first 800 requests, outputs / 16, run 6x faster (about 27 s per policy).
QUICK = replace(FULL, name="quick", requests=800, output_factor=16, speedup=6.0)
SCALE_WORKERS = (8, 16, 32)


def scale_study(workers: int, base: Study = FULL) -> Study:
    """The same load per worker at `workers` workers (arrivals compressed `workers`/4 times
    more), and the simulated GPU slowed down as much so the wall-clock request rate (CPU) stays."""
    k = workers / base.workers
    return replace(
        base,
        name=f"scale{workers}",
        workers=workers,
        time_factor=base.time_factor / k,
        speedup=base.speedup / k,
    )


def paired_by_request(a: PolicyResult, b: PolicyResult) -> str:
    """B against A request by request (the same trace, paired by position): the TTFT change
    (model ms) of the requests B served with more of the prompt cached than A did (a prefix
    pulled there, or routed to a holder) and of the rest, so a mechanism's own requests and
    what it did to the others are told apart."""

    def key(x: RequestRecord) -> str:  # bench.loadgen's ids: lg-<run>-<position in the trace>
        return x.request_id.rsplit("-", 1)[-1]

    ttft_a = {key(x): (x.ttft_s, x.cached_tokens) for x in a.records if x.ok and x.ttft_s is not None}
    gained, rest = [], []
    for x in b.records:
        if not x.ok or x.ttft_s is None or key(x) not in ttft_a:
            continue
        t0, c0 = ttft_a[key(x)]
        (gained if x.cached_tokens > c0 else rest).append((x.ttft_s - t0) * 1000.0 * b.study.speedup)

    def part(name: str, d: list[float]) -> str:
        if not d:
            return f"{name} 0"
        return f"{name} {len(d)}: TTFT change mean {statistics.mean(d):+.0f} ms, median {statistics.median(d):+.0f}"

    return f"per request, {b.policy} - {a.policy}: " + "; ".join(
        (part("more cached", gained), part("the rest", rest))
    )


def repeat_order(policies: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """`policies` `repeat` times, reversed every other time (A B, B A, A B, ...), so each policy
    runs as often early in the study as late."""
    return tuple(n for rep in range(repeat) for n in (policies if rep % 2 == 0 else policies[::-1]))


def main(argv: list[str] | None = None) -> int:
    """One study with overrides, for exploring (bench/routing.py runs the recorded ones)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", choices=("quick", "full"), default="quick")
    for name in ("requests", "workers", "num_blocks"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"override {name}")
    for name in ("time_factor", "speedup", "length_factor", "output_factor"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, help=f"override {name}")
    p.add_argument("--policies", help="comma-separated, e.g. kv_aware,kv_aware:4,round_robin")
    p.add_argument(
        "--worker-slowdowns", help="heterogeneous fleet: worker i at speedup / entry i mod len, e.g. 1,2.5"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the policies N times, the order reversed every other time (A B, B A, ...): a "
        "policy's place in the run moves its figures (BENCHMARKS.md, issue 21), so compare paired",
    )
    args = vars(p.parse_args(argv))
    repeat = args.pop("repeat")
    if repeat < 1:
        p.error("--repeat must be >= 1")
    if args["worker_slowdowns"]:
        args["worker_slowdowns"] = tuple(float(x) for x in args["worker_slowdowns"].split(","))
    study = QUICK if args.pop("study") == "quick" else FULL
    if args["policies"]:
        args["policies"] = tuple(args["policies"].split(","))
    study = replace(study, **{k: v for k, v in args.items() if v is not None})
    names = study.policies
    study = replace(study, policies=repeat_order(names, repeat))
    from bench.machine import cpu_model

    print(f"CPU: {cpu_model()} x{os.cpu_count()}")
    results, ideal = run_study(study)
    print_study(study, results, ideal)
    k = len(names)
    reps = [{r.policy: r for r in results[i : i + k]} for i in range(0, len(results), k)]
    first = names[0]
    for name in names[1:]:  # the same arrivals, lengths and workers: ratios within a repetition
        for rep, got in enumerate(reps):
            r, f = got[name], got[first]
            print(
                f"  {name} vs {first}{f' (repetition {rep + 1})' if repeat > 1 else ''}: "
                f"mean TTFT x{r.ttft_ms['mean'] / f.ttft_ms['mean']:.2f}, "
                f"p99 x{r.ttft_ms['p99'] / f.ttft_ms['p99']:.2f}, goodput x{r.goodput_rps / max(f.goodput_rps, 1e-9):.2f}, "
                f"tpot p50 x{r.tpot_p50_ms / max(f.tpot_p50_ms, 1e-9):.2f}"
            )
            print("    " + paired_by_request(f, r))
        if repeat > 1:
            ratios = sorted(got[name].ttft_ms["mean"] / got[first].ttft_ms["mean"] for got in reps)
            print(
                f"  {name} vs {first}, mean TTFT over {repeat} repetitions: median x{statistics.median(ratios):.2f}, "
                f"range x{ratios[0]:.2f}-x{ratios[-1]:.2f}, lower in {sum(x < 1 for x in ratios)} of {repeat}"
            )
    # with repetitions, each key is the median over them
    print(
        "routing_quality "
        + " ".join(
            f"{n.replace('@', '_').replace(':', '_')}_ttft_mean={statistics.median(got[n].ttft_ms['mean'] for got in reps):.0f} "
            f"{n.replace('@', '_').replace(':', '_')}_goodput={statistics.median(got[n].goodput_rps for got in reps):.3f}"
            for n in names
        )
        + (f" repeat={repeat}" if repeat > 1 else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
