"""Workflow -> worker affinity: the next step of a workflow goes where its context is.

Owns a bounded map workflow id -> (the worker that served its last step, that
step's prompt length in blocks, the hash of its last full block, expiry). The
request flow records a step when it succeeds (`record`) and, before ranking
workers for the next step of the same workflow, passes the prefix index's
overlaps through `credit`: the home worker's overlap is raised to the previous
step's prompt blocks when the new prompt extends that prompt (the chain hash of
its block n-1 equals the recorded one, so the match is exact, not a guess).

Why a hint on top of the prefix index: the index learns what a worker cached
from its KV events, which trail the step's end (an agent that fires its next
call at once arrives before them), and the index may have dropped entries
under its own bounds; the worker keeps the workflow's blocks pinned for its
TTL (services/engine/block_manager.py), so the recorded context is there. The
policy (services/router/policy.py) is unchanged: it reads the credited
overlaps as it reads the index's, weighing them against the home worker's load.

Then `steer` puts the home first in the policy's ranking unless the home has
more than `home_extra_waiting` requests waiting beyond the least-waiting
candidate. Why a second rule: the credit is capped at the prompt's blocks,
and kv_aware weighs it against 0.1 x the worker's active decode blocks; a
home running a few long-context steps loses a short follow-up step to any
lighter worker, which recomputes the whole conversation there and leaves the
home's pin (and a second copy of the context) for nothing. bench/workflows.py
measured it at 3x: every affinity miss was the router choosing another worker
(no pin was evicted), 95% of them copilot steps; with the rule the hit rate
went 0.81 -> 0.92 at the same completions. A home that is really backed up
(a longer queue than the others by more than the margin) still loses the step.

Plain, synchronous, clock passed in. Used by services/router/generate.py and
bench/workflows.py (the same code on the simulation's clock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import require, setting
from services.router.policy import Choice


@dataclass(frozen=True)
class WorkflowRoutingConfig:
    enabled: bool = setting(
        True,
        "use the request's WorkflowContext: admission order and shedding by sunk cost and "
        "attained service, sunk-cost retries, the workflow -> worker hint (no effect without one)",
    )
    affinity: bool = setting(True, "credit a workflow's last worker with its previous step's context")
    affinity_ttl_s: float = setting(300.0, "a workflow's hint lasts this long after its last step")
    home_extra_waiting: int = setting(
        1,
        "the next step stays on its workflow's last worker (holding its context) unless that worker "
        "has more than this many requests waiting beyond the least-waiting candidate (-1: the "
        "policy's ranking alone decides)",
    )
    max_workflows: int = setting(100_000, "workflows remembered; least recently seen beyond this dropped")

    def __post_init__(self) -> None:
        require(self.affinity_ttl_s > 0, "affinity_ttl_s must be > 0")
        require(self.max_workflows >= 1, "max_workflows must be >= 1")
        require(self.home_extra_waiting >= -1, "home_extra_waiting must be >= -1")


@dataclass(frozen=True)
class Home:
    worker_id: str
    blocks: int  # the previous step's prompt, in full blocks
    last_hash: int  # chain hash of its block blocks-1
    expires_at: float


class WorkflowAffinity:
    def __init__(self, config: WorkflowRoutingConfig | None = None):
        self.config = config or WorkflowRoutingConfig()
        self._homes: OrderedDict[str, Home] = OrderedDict()
        self.hits = 0  # credits given (the next step had a live home whose context it extends)
        self.misses = 0  # a known workflow whose home was gone or whose prompt diverged
        self.steered = 0  # steps kept home against the policy's first choice (`steer`)

    def record(self, workflow_id: str, worker_id: str, prompt_hashes: Sequence[int], now: float) -> None:
        """A step of `workflow_id` whose prompt had the block hashes `prompt_hashes`
        succeeded on `worker_id`."""
        if not workflow_id or not self.config.affinity or not prompt_hashes:
            return
        n = len(prompt_hashes)
        self._homes.pop(workflow_id, None)
        self._homes[workflow_id] = Home(worker_id, n, prompt_hashes[n - 1], now + self.config.affinity_ttl_s)
        while len(self._homes) > self.config.max_workflows:
            self._homes.popitem(last=False)

    def home(self, workflow_id: str, now: float) -> Home | None:
        home = self._homes.get(workflow_id) if workflow_id else None
        if home is None:
            return None
        if home.expires_at <= now:
            del self._homes[workflow_id]
            return None
        return home

    def credit(
        self,
        workflow_id: str,
        prompt_hashes: Sequence[int],
        overlaps: Mapping[str, int],
        now: float,
        eligible: frozenset[str] | set[str] | None = None,
    ) -> Mapping[str, int]:
        """`overlaps` (worker -> cached prefix blocks, from the index) with the
        workflow's home worker credited its previous step's context, when the
        new prompt extends it and the home is `eligible` (None: any). The input
        is returned unchanged otherwise."""
        if not workflow_id or workflow_id not in self._homes:
            return overlaps  # a first step, or a request of no workflow: nothing to say
        home = self.home(workflow_id, now)
        if home is None:  # its hint expired
            self.misses += 1
            return overlaps
        if eligible is not None and home.worker_id not in eligible:
            self.misses += 1
            return overlaps
        n = home.blocks
        if len(prompt_hashes) < n or prompt_hashes[n - 1] != home.last_hash:
            self.misses += 1
            return overlaps
        if overlaps.get(home.worker_id, 0) >= n:
            self.hits += 1
            return overlaps
        out = dict(overlaps)
        out[home.worker_id] = n
        self.hits += 1
        return out

    def steer(
        self,
        workflow_id: str,
        prompt_hashes: Sequence[int],
        ranked: list[Choice],
        waiting: Mapping[str, int],
        now: float,
    ) -> list[Choice]:
        """`ranked` (the policy's, best first) with the workflow's home moved to the
        front when the new prompt extends the home's context and the home has at
        most `home_extra_waiting` more requests waiting (`waiting`: worker id ->
        requests queued there) than the least-waiting ranked worker. Unchanged
        otherwise (no live home, prompt diverged, home not ranked, home backed up)."""
        margin = self.config.home_extra_waiting
        if margin < 0 or len(ranked) < 2 or not workflow_id:
            return ranked
        home = self._homes.get(workflow_id)
        if home is None or home.expires_at <= now or ranked[0].worker_id == home.worker_id:
            return ranked
        n = home.blocks
        if len(prompt_hashes) < n or prompt_hashes[n - 1] != home.last_hash:
            return ranked
        at = next((i for i, c in enumerate(ranked) if c.worker_id == home.worker_id), None)
        if at is None:
            return ranked
        least = min(waiting.get(c.worker_id, 0) for c in ranked)
        if waiting.get(home.worker_id, 0) > least + margin:
            return ranked
        self.steered += 1
        return [ranked[at], *ranked[:at], *ranked[at + 1 :]]

    def forget(self, workflow_id: str) -> None:
        """The workflow ended (its final step), or its home worker left."""
        self._homes.pop(workflow_id, None)

    def forget_worker(self, worker_id: str) -> int:
        """`worker_id` left the mesh: drop the hints that point at it."""
        gone = [w for w, h in self._homes.items() if h.worker_id == worker_id]
        for w in gone:
            del self._homes[w]
        return len(gone)

    def __len__(self) -> int:
        return len(self._homes)
