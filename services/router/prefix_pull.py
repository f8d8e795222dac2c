"""Prefixes pulled instead of recomputed (issue 17 item 3): the router's decision.

Plain and synchronous. For one request it reads, per decode worker, the
leading prompt blocks that worker has cached (the prefix index's overlap), its
predicted wait before a new prefill starts and its prefill rate; for the link
between workers, the measured KV bandwidth and the bytes of one block. It
answers where to route and, optionally, which worker to pull the cached prefix
from (`PullPlan`).

In predicted time to first token (TTFT), for a target worker w:

    local(w) = wait(w) + (P - o(w)) * bs / rate(w)
    pull(w)  = pull_s(w) + wait(w) + (P - o(h)) * bs / rate(w)
    pull_s(w) = latency(w) + (o(h) - o(w)) * link(w)

with latency(w) and link(w) the fixed time and the time per block that w measured
on its own KV transfers (its load report's `link_latency_ms` and
`link_ms_per_block`: pulls and remote-prefill handoffs, fitted as a fixed part
plus a part per byte, services/common/wait_estimator.py `LinkFit`), or the
configured latency and block_bytes / the configured bandwidth while it has
measured fewer than 3 (the issue's "bytes at the measured bandwidth")

with P the prompt's full blocks, o the overlap, h the holder (the worker with
the longest cached prefix) and bs the block size. A pull is offered to w only
when pull_s(w) is below the recompute it replaces, (o(h) - o(w)) * bs /
rate(w) (the rule the issue states), and it starts before the local prefill
(the puller reserves, pulls, then queues the uncached remainder), hence the sum.

The routing policy has already picked `preferred` (its cost mixes prefill and
decode blocks, which balances decode load; this module does not second-guess
that unless time says so). The plan is:
  - the preferred worker with a pull from h when that is faster for it than
    recomputing (h too loaded to be chosen, w lacking the prefix);
  - or, when the preferred worker is the holder itself and it is loaded, the
    other worker whose pull(w) beats local(h) by at least `min_gain` (a share
    of local(h)): the request moves off the hot holder and takes its prefix;
  - otherwise the preferred worker alone (no pull).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import require, setting
from services.router.policy import Candidate, Choice


@dataclass(frozen=True)
class PrefixPullConfig:
    enabled: bool = setting(False, "route a request away from a loaded holder and pull its cached prefix")
    link_bytes_per_s: float = setting(
        2.5e9,
        "KV bandwidth between workers (NIXL on CPU: 2.8-5.3 GB/s), until a worker reports the link it measured",
    )
    kv_bytes_per_token: float = setting(46_080.0, "KV bytes of one token (SmolLM2-135M fp32: 46,080)")
    latency_s: float = setting(
        0.002,
        "fixed cost of one pull (lease call, metadata, completion), until a worker reports its measured one",
    )
    prior_tokens_per_s: float = setting(2_000.0, "prefill rate of a worker that reported none")
    min_pull_blocks: int = setting(4, "smallest prefix (blocks) worth a pull")
    min_gain: float = setting(0.2, "moving off the holder must save this share of its predicted TTFT")

    def __post_init__(self) -> None:
        require(self.link_bytes_per_s > 0 and math.isfinite(self.link_bytes_per_s), "link_bytes_per_s > 0")
        require(self.kv_bytes_per_token > 0, "kv_bytes_per_token must be > 0")
        require(self.latency_s >= 0, "latency_s must be >= 0")
        require(self.prior_tokens_per_s > 0, "prior_tokens_per_s must be > 0")
        require(self.min_pull_blocks >= 1, "min_pull_blocks must be >= 1")
        require(0 <= self.min_gain < 1, "min_gain must be in [0, 1)")


@dataclass(frozen=True)
class WorkerView:
    """One decode worker as the decision reads it."""

    worker_id: str
    overlap_blocks: int  # leading prompt blocks cached there
    wait_s: float  # predicted wait before a new prefill starts
    tokens_per_s: float  # its prefill rate (measured; the prior when unknown)
    link_s_per_block: float = 0.0  # measured time to move one block's KV to it (0: the configured link)
    link_latency_s: float = 0.0  # and the fixed time of a transfer to it (with a measured link)


@dataclass(frozen=True)
class PullPlan:
    """Where the request goes and, when `source` is set, the prefix it pulls."""

    target: str
    source: str = ""  # holder worker id; "" = no pull
    pull_blocks: int = 0  # leading prompt blocks to take from the holder (its overlap)
    predicted_s: float = 0.0  # predicted TTFT of the plan
    recompute_s: float = 0.0  # predicted TTFT of the target without the pull


def rate_of(tokens_waiting: int, estimated_wait_ms: float, prior: float) -> float:
    """A worker's prefill rate from its load report (backlog / predicted wait), else `prior`."""
    if tokens_waiting > 0 and estimated_wait_ms > 0:
        return tokens_waiting / (estimated_wait_ms / 1000.0)
    return prior


class PrefixPullPlanner:
    def __init__(self, config: PrefixPullConfig, block_size: int):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.config = config
        self.block_size = block_size
        self.block_bytes = config.kv_bytes_per_token * block_size

    def pull_s(self, blocks: int, link_s_per_block: float = 0.0, link_latency_s: float = 0.0) -> float:
        """Predicted seconds to pull `blocks` blocks: at a measured link (its time per block and
        per transfer) when given, else the configured one."""
        if link_s_per_block > 0:
            return link_latency_s + blocks * link_s_per_block
        return self.config.latency_s + blocks * self.block_bytes / self.config.link_bytes_per_s

    def _local(self, w: WorkerView, prompt_blocks: int) -> float:
        return w.wait_s + max(prompt_blocks - w.overlap_blocks, 0) * self.block_size / w.tokens_per_s

    def _with_pull(self, w: WorkerView, holder: WorkerView, prompt_blocks: int) -> float | None:
        """Predicted TTFT of `w` pulling `holder`'s prefix; None when the pull does not pay."""
        delta = min(holder.overlap_blocks, prompt_blocks) - w.overlap_blocks
        if delta < self.config.min_pull_blocks:
            return None
        pull = self.pull_s(delta, w.link_s_per_block, w.link_latency_s)
        if pull >= delta * self.block_size / w.tokens_per_s:  # the rule: pull < recompute
            return None
        rest = max(prompt_blocks - holder.overlap_blocks, 0) * self.block_size / w.tokens_per_s
        return pull + w.wait_s + rest

    def plan(self, workers: Sequence[WorkerView], prompt_blocks: int, preferred: str) -> PullPlan:
        """The plan for a request of `prompt_blocks` full blocks whose policy choice is `preferred`
        (which must be among `workers`)."""
        by_id = {w.worker_id: w for w in workers}
        pref = by_id[preferred]
        local_pref = self._local(pref, prompt_blocks)
        stay = PullPlan(preferred, predicted_s=local_pref, recompute_s=local_pref)
        if prompt_blocks < self.config.min_pull_blocks or len(workers) < 2:
            return stay
        # The holder: longest prefix; among equals the preferred one, then the least waiting.
        holder = max(workers, key=lambda w: (w.overlap_blocks, w.worker_id == preferred, -w.wait_s))
        if holder.worker_id == preferred:
            return self._move_off(workers, pref, prompt_blocks, stay)
        t = self._with_pull(pref, holder, prompt_blocks)
        if t is None or t >= local_pref:
            return stay
        return PullPlan(preferred, holder.worker_id, min(holder.overlap_blocks, prompt_blocks), t, local_pref)

    def _move_off(
        self, workers: Sequence[WorkerView], holder: WorkerView, prompt_blocks: int, stay: PullPlan
    ) -> PullPlan:
        """The policy chose the holder: another worker pulling its prefix, for a clear gain only."""
        best: PullPlan | None = None
        for w in workers:
            if w.worker_id == holder.worker_id:
                continue
            t = self._with_pull(w, holder, prompt_blocks)
            if t is not None and (best is None or t < best.predicted_s):
                blocks = min(holder.overlap_blocks, prompt_blocks)
                best = PullPlan(w.worker_id, holder.worker_id, blocks, t, self._local(w, prompt_blocks))
        if best is not None and best.predicted_s < stay.predicted_s * (1.0 - self.config.min_gain):
            return best
        return stay


def plan_for_ranking(
    planner: PrefixPullPlanner,
    ranked: Sequence[Choice],
    candidates: Sequence[Candidate],
    overlaps: Mapping[str, int],
    prompt_blocks: int,
) -> tuple[list[Choice], PullPlan | None]:
    """The router's hook (services/router/generate.py): the policy's ranking with the
    plan's target first, and the plan when it pulls (None: the ranking unchanged).

    Per candidate, the wait is its prompt backlog (blended with the router's own
    load view when that is on) at its prefill rate (backlog / predicted wait of its
    last report, else the configured prior), and its link the one it measured (`link_ms_per_block`
    of its report, else the configured one)."""
    if not ranked or prompt_blocks < planner.config.min_pull_blocks:
        return list(ranked), None
    prior = planner.config.prior_tokens_per_s
    views = []
    for c in candidates:
        rate = rate_of(c.load.tokens_waiting, c.load.estimated_wait_ms, prior)
        views.append(
            WorkerView(
                c.worker_id,
                overlaps.get(c.worker_id, 0),
                c.load.tokens_waiting / rate,
                rate,
                c.load.link_ms_per_block / 1000.0,
                c.load.link_latency_ms / 1000.0,
            )
        )
    if ranked[0].worker_id not in {v.worker_id for v in views}:
        return list(ranked), None
    plan = planner.plan(views, prompt_blocks, ranked[0].worker_id)
    if not plan.source:
        return list(ranked), None
    first = [ch for ch in ranked if ch.worker_id == plan.target]
    if not first:
        return list(ranked), None
    return first + [ch for ch in ranked if ch.worker_id != plan.target], plan
