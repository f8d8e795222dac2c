"""Routing policies: rank candidate workers for one request, best first.

Owns the `Policy` protocol, its three implementations and the one factory that
chooses among them (`make_policy`), plus the boundary types a policy reads:
`WorkerLoad` (what heartbeats report), `Candidate` (a worker as the registry
sees it) and `Choice` (a ranked worker with its cost). The registry builds
candidates; the prefix index gives overlaps; the servicer calls `rank` once for
decode workers and once for prefill candidates, and walks the ranking until a
worker's breaker lets the request through.

- `round_robin`: rotate through candidates in worker-id order.
- `least_loaded`: lowest load cost (below, with no prefix credit).
- `kv_aware`: Dynamo's cost (lib/kv-router/src/scheduling/selector.rs):

      cost = prefill_weight * (max(prompt_blocks - overlap_blocks, 0) + queued_prefill_blocks)
             + decode_weight * active_decode_blocks

  where queued_prefill_blocks = ceil(tokens_waiting / block_size) is the
  prefill work already queued on the worker (Dynamo's active_prefill_blocks).
  Dynamo weighs a decode block like a prefill block (decode_weight 1, the
  default here). The router runs 0.1 (RouterConfig): with long prompts a
  worker's active decode blocks (every running sequence's whole context) are
  thousands of blocks, which at weight 1 outweigh any prefix credit and any
  prefill queue, while in the timing model a decode block costs a pass a tiny
  fraction of what a block to prefill costs (bench/routing_sim.py measured it:
  BENCHMARKS.md, issue 17).
  Lowest cost wins; ties are broken by the injected RNG. With temperature > 0
  the ranking is sampled (without replacement) from softmax(-normalized cost /
  temperature), normalized to [0, 1] by the spread of costs, as Dynamo does.

Overlap credit from more than one KV tier (`overlap_credit`): a block held in
device memory saves its whole prefill; one held in a slower tier (host memory,
later) saves the prefill minus its restore, so its weight is
`tier_weight(restore_s, recompute_s)` = 1 - restore / recompute (0 when
restoring is no faster), from measured times, not a constant
(`measured_tier_weight`: the tier's measured bandwidth and per-transfer latency
against the worker's measured prefill rate). kv_aware takes
per-worker credits in place of device overlaps when the caller passes them.

Heterogeneous workers (`speeds`, services/router/worker_profile.py): a worker's
measured speed as (prefill factor, decode factor) against the fleet's median
worker. kv_aware and least_loaded multiply each term by its factor (the busy
term by the prefill factor), so a cost in blocks becomes one in the median
worker's blocks: predicted time. A worker with no entry has factors 1. With
speeds, kv_aware's decode term also counts the request's own prompt blocks
(the context it will decode over): the same on every worker of a homogeneous
fleet, so Dynamo's formula leaves it out, but on a slower decoder it is slower.

Unhealthy candidates are dropped even though the caller should not pass them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from services.common.config import require, setting


@dataclass(frozen=True)
class WorkerLoad:
    """Load of a worker (mirrors pdmesh.v1.WorkerLoad)."""

    running: int = 0
    waiting: int = 0
    tokens_waiting: int = 0
    used_blocks: int = 0
    free_blocks: int = 0
    estimated_wait_ms: float = 0.0
    active_decode_blocks: int = 0
    # The worker's own readiness verdict (issue 18): "" while ready, else why not
    # ("no_progress"), and how long it has had work and computed nothing.
    not_serving_reason: str = ""
    no_progress_ms: int = 0
    # Host KV tier (0 = none / not measured): measured ms to restore one block
    # from it and to prefill one block; tier_index.host_weight turns them into credit.
    host_restore_ms_per_block: float = 0.0
    prefill_ms_per_block: float = 0.0
    # Its measured KV link, ms per block and per transfer (0 = not measured): a pull's price
    # (prefix_pull.py).
    link_ms_per_block: float = 0.0
    link_latency_ms: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """A worker a request may go to. `inflight`: the router's own count of
    requests it has running there (fresher than the last heartbeat)."""

    worker_id: str
    load: WorkerLoad = WorkerLoad()
    healthy: bool = True
    inflight: int = 0


class Choice(NamedTuple):
    """A ranked worker (a named tuple: one is built per candidate per decision)."""

    worker_id: str
    cost: float
    overlap_blocks: int


@dataclass(frozen=True)
class PolicyConfig:
    block_size: int = setting(16, "tokens per KV block (converts queued prefill tokens to blocks)")
    prefill_weight: float = setting(1.0, "kv_aware: weight of a block to prefill against a decode block")
    temperature: float = setting(0.0, "kv_aware: 0 = lowest cost wins; > 0 samples softmax(-cost/T)")
    decode_weight: float = setting(1.0, "kv_aware, least_loaded: weight of an active decode block")
    busy_blocks: float = setting(
        0.0, "kv_aware: blocks added for a worker with any request running or queued (its pass in progress)"
    )

    def __post_init__(self) -> None:
        require(self.block_size >= 1, "block_size must be >= 1")
        require(
            self.prefill_weight >= 0 and math.isfinite(self.prefill_weight), "prefill_weight must be >= 0"
        )
        require(self.temperature >= 0 and math.isfinite(self.temperature), "temperature must be >= 0")
        require(self.decode_weight >= 0 and math.isfinite(self.decode_weight), "decode_weight must be >= 0")
        require(self.busy_blocks >= 0 and math.isfinite(self.busy_blocks), "busy_blocks must be >= 0")


def tier_weight(restore_s: float, recompute_s: float) -> float:
    """Credit of a cached block in a tier, as a fraction of a device-resident block's:
    the share of its recompute time that restoring it saves (in [0, 1]).

    `restore_s`: measured time to bring the block to the device (bytes / measured
    bandwidth, plus per-transfer latency); `recompute_s`: measured time to prefill
    its tokens on this worker (tokens / measured prefill rate). Device: restore 0 -> 1.
    """
    if not (math.isfinite(restore_s) and restore_s >= 0):
        raise ValueError(f"restore_s must be finite and >= 0, got {restore_s}")
    if not (math.isfinite(recompute_s) and recompute_s >= 0):
        raise ValueError(f"recompute_s must be finite and >= 0, got {recompute_s}")
    if recompute_s == 0:
        return 0.0  # nothing to save
    return max(0.0, 1.0 - restore_s / recompute_s)


def measured_tier_weight(
    block_bytes: int,
    restore_bytes_per_s: float,
    restore_latency_s: float,
    block_tokens: int,
    prefill_tokens_per_s: float,
    blocks: int = 1,
) -> float:
    """`tier_weight` from what a worker measured: restoring `blocks` blocks of
    `block_bytes` takes one transfer (`restore_latency_s`) plus bytes at the tier's
    measured bandwidth; recomputing them takes their tokens at the worker's measured
    prefill rate. Per-transfer latency is why a short host-tier prefix earns less
    per block than a long one. A rate of 0 (not measured yet) gives no credit."""
    if blocks <= 0 or restore_bytes_per_s <= 0 or prefill_tokens_per_s <= 0:
        return 0.0
    restore_s = restore_latency_s + blocks * block_bytes / restore_bytes_per_s
    recompute_s = blocks * block_tokens / prefill_tokens_per_s
    return tier_weight(restore_s, recompute_s)


@dataclass(frozen=True)
class TierOverlap:
    """Leading prompt blocks a worker holds in one tier, beyond the tiers before it
    (a prefix is contiguous: device blocks first, then host, ...), and their weight."""

    blocks: int
    weight: float

    def __post_init__(self) -> None:
        if self.blocks < 0 or not (0.0 <= self.weight <= 1.0):
            raise ValueError(f"need blocks >= 0 and 0 <= weight <= 1, got {self.blocks}, {self.weight}")


def overlap_credit(tiers: Sequence[TierOverlap]) -> float:
    """Prefill blocks saved by a worker's cached prefix across tiers (device first)."""
    return sum(t.blocks * t.weight for t in tiers)


class OwnLoad(Protocol):
    """What this router routed to a worker and has outstanding there (LoadView's totals):
    `synced` once a report of the worker arrived, with what was ours in it (`snap_*`)."""

    prefill_tokens: int
    decode_blocks: int
    synced: bool
    snap_tokens: int
    snap_blocks: int


class Policy(Protocol):
    name: str

    def rank(
        self,
        candidates: Sequence[Candidate],
        prompt_blocks: int = 0,
        overlaps: Mapping[str, int] | None = None,
        *,
        own: Mapping[str, OwnLoad] | None = None,
        speeds: Mapping[str, tuple[float, float]] | None = None,
    ) -> list[Choice]:
        """Healthy candidates, best first (empty when there are none).

        `prompt_blocks`: full blocks of the prompt; `overlaps`: worker id ->
        leading prompt blocks that worker has cached (PrefixIndex.match);
        `own`: worker id -> the router's own outstanding load there
        (LoadView.totals), blended with the reported load per component as
        LoadView.blend does (load_view.blended: the report beyond what was ours in
        it, plus ours now), without building new candidates (that blend was most
        of a decision's ranking time);
        `speeds`: worker id -> (prefill factor, decode factor) (WorkerProfiles.speeds).
        """
        ...


def _healthy(candidates: Sequence[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.healthy]


def _queued_prefill_blocks(load: WorkerLoad, block_size: int) -> int:
    return -(-load.tokens_waiting // block_size)


def _blended(c: Candidate, own: Mapping[str, OwnLoad] | None) -> tuple[int, int]:
    """(tokens waiting, active decode blocks) of `c` blended with `own` (load_view.blended;
    repeated here because load_view imports this module)."""
    load = c.load
    t = own.get(c.worker_id) if own else None
    if t is None:
        return load.tokens_waiting, load.active_decode_blocks
    if t.synced:
        return (
            max(load.tokens_waiting - t.snap_tokens, 0) + t.prefill_tokens,
            max(load.active_decode_blocks - t.snap_blocks, 0) + t.decode_blocks,
        )
    return max(load.tokens_waiting, t.prefill_tokens), max(load.active_decode_blocks, t.decode_blocks)


_SAME = (1.0, 1.0)  # the speed factors of a worker not measured

# Choice(w, cost, overlap) without the named tuple's Python-level __new__ (kv_aware's hot path).
_choice, _tuple = tuple.__new__, Choice


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def rank(self, candidates, prompt_blocks=0, overlaps=None, *, own=None, speeds=None):
        healthy = sorted(_healthy(candidates), key=lambda c: c.worker_id)
        if not healthy:
            return []
        start = self._next % len(healthy)
        self._next += 1
        order = healthy[start:] + healthy[:start]
        overlaps = overlaps or {}
        return [Choice(c.worker_id, float(i), overlaps.get(c.worker_id, 0)) for i, c in enumerate(order)]


class LeastLoadedPolicy:
    """Lowest queued prefill + active decode blocks; then fewest router in-flight
    requests; then random."""

    name = "least_loaded"

    def __init__(self, config: PolicyConfig, rng: random.Random):
        self.config = config
        self._rng = rng

    def rank(self, candidates, prompt_blocks=0, overlaps=None, *, own=None, speeds=None):
        overlaps = overlaps or {}
        cfg = self.config
        keyed = []
        for c in _healthy(candidates):
            waiting, decode = _blended(c, own)
            pf, df = speeds.get(c.worker_id, _SAME) if speeds else _SAME
            cost = pf * cfg.prefill_weight * -(-waiting // cfg.block_size) + df * cfg.decode_weight * decode
            keyed.append((cost, c.inflight, self._rng.random(), c))
        keyed.sort(key=lambda k: k[:3])
        return [Choice(c.worker_id, cost, overlaps.get(c.worker_id, 0)) for cost, _, _, c in keyed]


class KvAwarePolicy:
    name = "kv_aware"

    def __init__(self, config: PolicyConfig, rng: random.Random):
        self.config = config
        self._rng = rng

    def cost(self, candidate: Candidate, prompt_blocks: int, overlap_blocks: float) -> float:
        cfg = self.config
        to_prefill = max(prompt_blocks - overlap_blocks, 0)
        queued = _queued_prefill_blocks(candidate.load, cfg.block_size)
        return (
            cfg.prefill_weight * (to_prefill + queued)
            + cfg.decode_weight * candidate.load.active_decode_blocks
        )

    def rank(self, candidates, prompt_blocks=0, overlaps=None, credits=None, *, own=None, speeds=None):
        """As `Policy.rank`; `credits`: worker id -> overlap credit over every tier
        (`overlap_credit`), used in the cost in place of that worker's device overlap."""
        overlaps = overlaps or {}
        cfg = self.config
        weight, dweight, bs, busy = cfg.prefill_weight, cfg.decode_weight, cfg.block_size, cfg.busy_blocks
        sample = cfg.temperature > 0
        rnd = self._rng.random
        keyed = []
        # self.cost inlined: this loop runs once per candidate per decision (hot path). The
        # tie-break draw is taken here, in candidate order (as before), so the sort below
        # compares plain tuples with no key function.
        for c in candidates:
            if not c.healthy:
                continue
            wid = c.worker_id
            overlap = overlaps.get(wid, 0)
            if overlap > prompt_blocks:
                overlap = prompt_blocks
            credit = min(credits.get(wid, overlap), prompt_blocks) if credits else overlap
            load = c.load
            waiting, decode = load.tokens_waiting, load.active_decode_blocks
            t = own.get(wid) if own else None
            if t is not None:  # as _blended
                if t.synced:  # the report beyond what was ours in it, plus ours now
                    waiting = (waiting - t.snap_tokens if waiting > t.snap_tokens else 0) + t.prefill_tokens
                    decode = (decode - t.snap_blocks if decode > t.snap_blocks else 0) + t.decode_blocks
                else:
                    if t.prefill_tokens > waiting:
                        waiting = t.prefill_tokens
                    if t.decode_blocks > decode:
                        decode = t.decode_blocks
            if speeds:  # predicted time: blocks of the fleet's median worker
                pf, df = speeds.get(wid, _SAME)
                to_prefill = max(prompt_blocks - credit, 0) - (-waiting // bs)
                cost = pf * weight * to_prefill + df * dweight * (decode + prompt_blocks)
                if busy and (waiting or decode or load.running):
                    cost += pf * busy
            else:
                cost = weight * (max(prompt_blocks - credit, 0) - (-waiting // bs)) + dweight * decode
                if busy and (waiting or decode or load.running):
                    cost += busy
            keyed.append((cost, 0.0 if sample else rnd(), wid, overlap))
        if sample and len(keyed) > 1:
            return self._sample([Choice(w, cost, o) for cost, _, w, o in keyed])
        keyed.sort()
        return [_choice(_tuple, (w, cost, o)) for cost, _, w, o in keyed]

    def _sample(self, scored: list[Choice]) -> list[Choice]:
        """Sequential sampling without replacement from softmax(-norm cost / T)."""
        lo = min(ch.cost for ch in scored)
        spread = max(ch.cost for ch in scored) - lo
        temperature = self.config.temperature
        weights = [math.exp(-((ch.cost - lo) / spread if spread > 0 else 0.0) / temperature) for ch in scored]
        remaining = list(range(len(scored)))
        ranked: list[Choice] = []
        while remaining:
            total = sum(weights[i] for i in remaining)
            if total <= 0:  # every weight underflowed (tiny temperature): uniform
                pick = self._rng.choice(remaining)
            else:
                r = self._rng.random() * total
                pick = remaining[-1]
                for i in remaining:
                    r -= weights[i]
                    if r < 0:
                        pick = i
                        break
            remaining.remove(pick)
            ranked.append(scored[pick])
        return ranked


POLICY_NAMES = ("round_robin", "least_loaded", "kv_aware")


def make_policy(name: str, config: PolicyConfig | None = None, rng: random.Random | None = None) -> Policy:
    """The routing policy called `name` (one of POLICY_NAMES)."""
    config = config or PolicyConfig()
    rng = rng or random.Random()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy(config, rng)
    if name == "kv_aware":
        return KvAwarePolicy(config, rng)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
