"""Cost per successful request: the router's aggregate token accounting.

Owns lifetime counters only (no per-request history, so memory is fixed): a
finished request's `RequestCost` (built by its `RequestJourney`) is folded in
by `CostLedger.record`, admission rejections by `record_shed`. Read by the
servicer's Stats RPC and the metrics exporter.

Definitions (the proto's RouterServiceStatsResponse):
- computed tokens: every token position computed for a request across all its
  attempts (prefill + decode + recomputation after retry or migration);
- tokens per successful request: computed tokens of successful requests, all
  their attempts included, divided by successful requests;
- wasted tokens: all computed tokens of failed and cancelled requests, plus,
  for successful requests, the tokens of attempts that did not finish it
  (their KV was thrown away and recomputed elsewhere).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestOutcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # by the client or its deadline


@dataclass(frozen=True)
class RequestCost:
    """What one finished request cost."""

    outcome: RequestOutcome
    computed_tokens: int
    wasted_tokens: int  # part of computed_tokens
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0
    migrations: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.wasted_tokens <= self.computed_tokens):
            raise ValueError(f"need 0 <= wasted ({self.wasted_tokens}) <= computed ({self.computed_tokens})")


@dataclass(frozen=True)
class CostStats:
    requests_succeeded: int
    requests_failed: int
    requests_cancelled: int
    requests_shed: int
    computed_tokens: int
    successful_computed_tokens: int
    wasted_tokens: int
    retries: int
    migrations: int
    prompt_tokens: int = 0  # of finished requests (the planner's ISL)
    completion_tokens: int = 0  # delivered, of finished requests (the planner's OSL)

    @property
    def requests_finished(self) -> int:
        return self.requests_succeeded + self.requests_failed + self.requests_cancelled

    @property
    def tokens_per_successful_request(self) -> float:
        """Computed tokens of successful requests (all attempts) per success; 0 before any."""
        return self.successful_computed_tokens / self.requests_succeeded if self.requests_succeeded else 0.0

    @property
    def all_tokens_per_successful_request(self) -> float:
        """Every computed token, failures included, per success: the full cost of one success."""
        return self.computed_tokens / self.requests_succeeded if self.requests_succeeded else 0.0


class CostLedger:
    def __init__(self) -> None:
        self._by_outcome = dict.fromkeys(RequestOutcome, 0)
        self._shed = 0
        self._computed = 0
        self._successful_computed = 0
        self._wasted = 0
        self._retries = 0
        self._migrations = 0
        self._prompt = 0
        self._completion = 0

    def record(self, cost: RequestCost) -> None:
        """Fold in one finished request (call exactly once per request)."""
        self._by_outcome[cost.outcome] += 1
        self._computed += cost.computed_tokens
        self._wasted += cost.wasted_tokens
        if cost.outcome is RequestOutcome.SUCCEEDED:
            self._successful_computed += cost.computed_tokens
        self._retries += cost.retries
        self._migrations += cost.migrations
        self._prompt += cost.prompt_tokens
        self._completion += cost.completion_tokens

    def record_shed(self) -> None:
        """A request refused at admission (it computed nothing)."""
        self._shed += 1

    def stats(self) -> CostStats:
        return CostStats(
            requests_succeeded=self._by_outcome[RequestOutcome.SUCCEEDED],
            requests_failed=self._by_outcome[RequestOutcome.FAILED],
            requests_cancelled=self._by_outcome[RequestOutcome.CANCELLED],
            requests_shed=self._shed,
            computed_tokens=self._computed,
            successful_computed_tokens=self._successful_computed,
            wasted_tokens=self._wasted,
            retries=self._retries,
            migrations=self._migrations,
            prompt_tokens=self._prompt,
            completion_tokens=self._completion,
        )


# ---- per workflow ------------------------------------------------------------
#
# Agentic traffic makes the workflow the unit that succeeds or fails: when step
# k fails, the tokens of steps 0..k-1 are wasted too. `WorkflowLedger` keeps one
# open account per workflow (bounded, LRU) and folds closed ones into per-tenant
# counters:
# - cost per successful workflow: tokens computed for all steps (all attempts)
#   of workflows that completed / workflows completed;
# - completion rate: completed / (completed + failed);
# - wasted tokens by cause (WasteCause).


class WasteCause(enum.Enum):
    RECOMPUTE = "recompute"  # attempts of a successful step that did not finish it (retry/migration)
    FAILED_STEP = "failed_step"  # the tokens of a step that failed or was cancelled
    EARLIER_STEPS = "earlier_steps"  # steps that succeeded, of a workflow that then failed
    SHED = "shed"  # earlier steps of a workflow whose next step was refused at admission
    ABANDONED = "abandoned"  # earlier steps of a workflow with no final step before its idle timeout


@dataclass(frozen=True)
class WorkflowStats:
    completed: int
    failed: int
    open: int
    completed_tokens: int  # computed tokens of completed workflows (all steps, all attempts)
    computed_tokens: int  # every token computed for any workflow step (closed workflows)
    wasted: dict[WasteCause, int]

    @property
    def completion_rate(self) -> float:
        done = self.completed + self.failed
        return self.completed / done if done else 0.0

    @property
    def cost_per_successful_workflow(self) -> float:
        return self.completed_tokens / self.completed if self.completed else 0.0

    @property
    def wasted_tokens(self) -> int:
        return sum(self.wasted.values())

    @property
    def wasted_per_successful_workflow(self) -> float:
        return self.wasted_tokens / self.completed if self.completed else 0.0


@dataclass
class _Account:
    tenant: str
    computed: int = 0
    recompute: int = 0
    last_seen: float = 0.0


@dataclass
class _TenantWorkflows:
    completed: int = 0
    failed: int = 0
    completed_tokens: int = 0
    computed_tokens: int = 0
    wasted: dict[WasteCause, int] | None = None

    def waste(self, cause: WasteCause, tokens: int) -> None:
        if self.wasted is None:
            self.wasted = dict.fromkeys(WasteCause, 0)
        self.wasted[cause] += tokens


class WorkflowLedger:
    def __init__(self, abandon_after_s: float = 600.0, max_open: int = 100_000):
        if abandon_after_s <= 0 or max_open < 1:
            raise ValueError("need abandon_after_s > 0 and max_open >= 1")
        self.abandon_after_s = abandon_after_s
        self.max_open = max_open
        self._open: dict[str, _Account] = {}  # insertion order = least recently seen first
        self._tenants: dict[str, _TenantWorkflows] = {}

    def record_step(self, tenant: str, workflow_id: str, cost: RequestCost, final: bool, now: float) -> None:
        """One finished step (request) of `workflow_id`; `final`: its last step."""
        acct = self._open.pop(workflow_id, None) or _Account(tenant)
        acct.last_seen = now
        acct.computed += cost.computed_tokens
        if cost.outcome is RequestOutcome.SUCCEEDED:
            acct.recompute += cost.wasted_tokens
            if final:
                self._close(workflow_id, acct, None)
            else:
                self._open[workflow_id] = acct
                self._bound()
            return
        earlier = acct.computed - cost.computed_tokens
        t = self._tenant(acct.tenant)
        t.waste(WasteCause.FAILED_STEP, cost.computed_tokens)
        t.waste(WasteCause.EARLIER_STEPS, earlier - acct.recompute)
        self._close(workflow_id, acct, WasteCause.EARLIER_STEPS, counted=True)

    def record_shed(self, tenant: str, workflow_id: str, now: float) -> None:
        """A step of `workflow_id` was refused at admission: the workflow fails."""
        acct = self._open.pop(workflow_id, None) or _Account(tenant, last_seen=now)
        self._close(workflow_id, acct, WasteCause.SHED)

    def expire(self, now: float) -> int:
        """Close workflows idle longer than abandon_after_s (as failed); returns how many."""
        old = [w for w, a in self._open.items() if now - a.last_seen >= self.abandon_after_s]
        for w in old:
            self._close(w, self._open.pop(w), WasteCause.ABANDONED)
        return len(old)

    def stats(self, tenant: str | None = None) -> WorkflowStats:
        """Of one tenant, or of all together (None)."""
        parts = [self._tenants[tenant]] if tenant in self._tenants else []
        if tenant is None:
            parts = list(self._tenants.values())
        wasted = dict.fromkeys(WasteCause, 0)
        for p in parts:
            for c, n in (p.wasted or {}).items():
                wasted[c] += n
        return WorkflowStats(
            completed=sum(p.completed for p in parts),
            failed=sum(p.failed for p in parts),
            open=sum(1 for a in self._open.values() if tenant is None or a.tenant == tenant),
            completed_tokens=sum(p.completed_tokens for p in parts),
            computed_tokens=sum(p.computed_tokens for p in parts),
            wasted=wasted,
        )

    def tenants(self) -> list[str]:
        return sorted(self._tenants)

    def _tenant(self, tenant: str) -> _TenantWorkflows:
        return self._tenants.setdefault(tenant, _TenantWorkflows())

    def _close(
        self, workflow_id: str, acct: _Account, cause: WasteCause | None, counted: bool = False
    ) -> None:
        """Fold a closed account in: completed (cause None) or failed for `cause`
        (`counted`: its waste was already split by the caller)."""
        t = self._tenant(acct.tenant)
        t.computed_tokens += acct.computed
        t.waste(WasteCause.RECOMPUTE, acct.recompute)
        if cause is None:
            t.completed += 1
            t.completed_tokens += acct.computed
            return
        t.failed += 1
        if not counted:
            t.waste(cause, acct.computed - acct.recompute)

    def _bound(self) -> None:
        while len(self._open) > self.max_open:
            w = next(iter(self._open))
            self._close(w, self._open.pop(w), WasteCause.ABANDONED)
