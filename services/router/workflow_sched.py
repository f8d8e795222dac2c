"""Workflow-aware scheduling rules: attained service, sunk cost, deadlines.

Pure core, no I/O; the clock is passed in. Agentic traffic makes the unit of
work a *workflow* (one chat turn, a 10-20-call copilot session, a ~50-call
research agent), and the request's `WorkflowContext` says which one a request
belongs to (id, step index, tokens already spent on earlier steps). Losing step
k of a workflow wastes the tokens of steps 0..k-1 too, so the control plane
weighs two things besides tenant priority:

- attained service (Autellix's program-level least-attained-service): the
  tokens a workflow was served in the recent window. The more it got, the
  lower its *level*, so one long agent cannot starve short chats. A level is
  charged as a delay (`level_delay_s` each) added to the request's effective
  deadline, so order stays a static heap key and the extra wait a long
  workflow suffers is bounded (levels are capped): nobody starves;
- sunk cost: tokens already spent on the workflow's earlier steps. It picks
  the shedding victim (the waiter whose loss wastes the fewest spent tokens,
  lowest tenant priority first) and earns a bounded bonus of retries and
  migrations (`sunk_cost_extra`).

Within one tenant priority, order is earliest effective deadline first (EDF);
a request without a deadline counts as due `default_horizon_s` after arrival.

Used by AdmissionController (queue order, shedding), RetryBudget and
decide_recovery (allowances), and bench/workflows.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from services.common.config import require, setting


@dataclass(frozen=True)
class WorkflowInfo:
    """The scheduling-relevant part of a request's WorkflowContext."""

    workflow_id: str = ""
    step_index: int = 0
    tokens_spent: int = 0

    def __post_init__(self) -> None:
        require(self.step_index >= 0, "step_index must be >= 0")
        require(self.tokens_spent >= 0, "tokens_spent must be >= 0")


NO_WORKFLOW = WorkflowInfo()


@dataclass(frozen=True)
class WorkflowSchedConfig:
    window_s: float = setting(60.0, "attained service counts tokens served in this window")
    level_base_tokens: int = setting(2_000, "attained tokens that move a workflow to level 1")
    level_growth: float = setting(4.0, "each further level needs this factor more attained tokens")
    max_level: int = setting(4, "levels are capped: the most a long workflow is deferred")
    level_delay_s: float = setting(2.0, "effective-deadline delay per attained-service level")
    default_horizon_s: float = setting(30.0, "due time of a request without a deadline, after arrival")
    sunk_unit_tokens: int = setting(4_000, "sunk tokens that earn the first extra retry/migration")
    max_sunk_extra: int = setting(2, "most extra retries (and migrations) sunk cost may earn")
    max_workflows: int = setting(100_000, "workflows tracked; least recently served beyond this dropped")

    def __post_init__(self) -> None:
        require(self.window_s > 0, "window_s must be > 0")
        require(self.level_base_tokens >= 1, "level_base_tokens must be >= 1")
        require(self.level_growth > 1, "level_growth must be > 1")
        require(self.max_level >= 0, "max_level must be >= 0")
        require(self.level_delay_s >= 0, "level_delay_s must be >= 0")
        require(self.default_horizon_s > 0, "default_horizon_s must be > 0")
        require(self.sunk_unit_tokens >= 1, "sunk_unit_tokens must be >= 1")
        require(self.max_sunk_extra >= 0, "max_sunk_extra must be >= 0")
        require(self.max_workflows >= 1, "max_workflows must be >= 1")


def service_level(attained_tokens: float, cfg: WorkflowSchedConfig) -> int:
    """0 for under level_base_tokens attained, +1 per level_growth factor more, capped."""
    if attained_tokens < cfg.level_base_tokens:
        return 0
    level = 1 + int(math.log(attained_tokens / cfg.level_base_tokens, cfg.level_growth))
    return min(level, cfg.max_level)


def effective_deadline(
    enqueued_at: float, deadline: float | None, level: int, cfg: WorkflowSchedConfig
) -> float:
    """EDF key within a priority class: the deadline (or the default horizon),
    pushed back by the workflow's attained-service level."""
    due = enqueued_at + cfg.default_horizon_s if deadline is None else deadline
    return due + level * cfg.level_delay_s


def sunk_cost_extra(tokens_spent: int, cfg: WorkflowSchedConfig) -> int:
    """Extra retries (and migrations) a request with `tokens_spent` behind it
    may take: 0 below sunk_unit_tokens, +1 per doubling beyond, capped."""
    if tokens_spent < cfg.sunk_unit_tokens:
        return 0
    return min(1 + int(math.log2(tokens_spent / cfg.sunk_unit_tokens)), cfg.max_sunk_extra)


def shed_rank(priority: int, tokens_spent: int, enqueued_at: float) -> tuple[int, int, float]:
    """Smallest = shed first: lowest tenant priority, then fewest sunk tokens,
    then the newest (it has waited least)."""
    return (priority, tokens_spent, -enqueued_at)


class AttainedService:
    """Tokens each workflow was served in the last `window_s` (program-level
    attained service). Two half-window buckets per workflow, so memory is
    fixed per workflow; old workflows are dropped LRU beyond max_workflows."""

    def __init__(self, cfg: WorkflowSchedConfig | None = None):
        self.cfg = cfg or WorkflowSchedConfig()
        # workflow id -> [epoch of `cur`, tokens in previous half-window, tokens in current]
        self._by_wf: OrderedDict[str, list[float]] = OrderedDict()

    def _epoch(self, now: float) -> int:
        return int(now // (self.cfg.window_s / 2))

    def _roll(self, entry: list[float], epoch: int) -> None:
        gap = epoch - int(entry[0])
        if gap == 1:
            entry[1], entry[2] = entry[2], 0.0
        elif gap > 1:
            entry[1] = entry[2] = 0.0
        entry[0] = epoch

    def record(self, workflow_id: str, tokens: int, now: float) -> None:
        """`tokens` were served to `workflow_id` (prompt computed + generated)."""
        if not workflow_id or tokens <= 0:
            return
        epoch = self._epoch(now)
        entry = self._by_wf.get(workflow_id)
        if entry is None:
            entry = self._by_wf[workflow_id] = [epoch, 0.0, 0.0]
        self._roll(entry, epoch)
        entry[2] += tokens
        self._by_wf.move_to_end(workflow_id)
        while len(self._by_wf) > self.cfg.max_workflows:
            self._by_wf.popitem(last=False)

    def attained(self, workflow_id: str, now: float) -> float:
        entry = self._by_wf.get(workflow_id) if workflow_id else None
        if entry is None:
            return 0.0
        self._roll(entry, self._epoch(now))
        return entry[1] + entry[2]

    def level(self, workflow_id: str, now: float) -> int:
        return service_level(self.attained(workflow_id, now), self.cfg)

    def forget(self, workflow_id: str) -> None:
        """The workflow ended."""
        self._by_wf.pop(workflow_id, None)

    def __len__(self) -> int:
        return len(self._by_wf)
