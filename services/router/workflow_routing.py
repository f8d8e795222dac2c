"""What the request flow does with a request's WorkflowContext (issue 21).

Owns the router's `WorkflowAffinity` (workflow -> worker hint) and its
per-tenant `WorkflowLedger` (cost per successful workflow, completion rate,
waste by cause); reads the AdmissionController to forget a workflow's attained
service when it ends. Built once by `Router`, held by the `RoutingContext`;
services/router/generate.py calls it at four points of a request's life:

- admission: `info()` turns the proto's context into the `WorkflowInfo` the
  admission core orders and sheds by (attained service, sunk cost);
- recovery: `sunk_tokens()` raises the retry / migration allowance (the
  journey's limits and the retry budget's sunk-cost reserve);
- routing: `credit()` gives the workflow's last worker its previous context
  (workflow_affinity.py) before the policy ranks, and `steer()` keeps the step
  there after it ranks unless that worker's queue is the longer by more than
  a margin;
- the end: `finished()` / `shed()` fold the step into the ledger, record the
  home on success and forget the workflow after its final step.

A request without a WorkflowContext (plain chat) gets NO_WORKFLOW and is
untouched by all of it; with `enabled` false every request is treated so.
Plain Python, clock passed in; the gRPC types stay at the edge (`info()`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from services.router.admission import AdmissionController
from services.router.cost import RequestCost, RequestOutcome, WorkflowLedger, WorkflowStats
from services.router.policy import Choice
from services.router.workflow_affinity import WorkflowAffinity, WorkflowRoutingConfig
from services.router.workflow_sched import NO_WORKFLOW, WorkflowInfo


class WorkflowRouting:
    def __init__(
        self,
        config: WorkflowRoutingConfig | None = None,
        admission: AdmissionController | None = None,
        ledger: WorkflowLedger | None = None,
    ):
        self.config = config or WorkflowRoutingConfig()
        self.affinity = WorkflowAffinity(self.config)
        self.ledger = ledger or WorkflowLedger()
        self._admission = admission
        self._g_workflows: Gauge | None = None  # the gauges, once attach_metrics is called

    def info(self, workflow: Any) -> WorkflowInfo:
        """The scheduling part of a `common_pb2.WorkflowContext` (None or an empty id: none)."""
        if not self.config.enabled or workflow is None or not workflow.workflow_id:
            return NO_WORKFLOW
        return WorkflowInfo(workflow.workflow_id, workflow.step_index, workflow.tokens_spent)

    def sunk_tokens(self, workflow: Any) -> int:
        return self.info(workflow).tokens_spent

    def credit(
        self,
        workflow: Any,
        prompt_hashes: Sequence[int],
        overlaps: Mapping[str, int],
        now: float,
        eligible: set[str],
    ) -> Mapping[str, int]:
        info = self.info(workflow)
        if not info.workflow_id or not self.config.affinity:
            return overlaps
        return self.affinity.credit(info.workflow_id, prompt_hashes, overlaps, now, eligible)

    def steer(
        self,
        workflow: Any,
        prompt_hashes: Sequence[int],
        ranked: list[Choice],
        waiting: Mapping[str, int],
        now: float,
    ) -> list[Choice]:
        """The policy's ranking with the workflow's home first unless it is backed up
        (WorkflowAffinity.steer)."""
        info = self.info(workflow)
        if not info.workflow_id or not self.config.affinity:
            return ranked
        return self.affinity.steer(info.workflow_id, prompt_hashes, ranked, waiting, now)

    def finished(
        self,
        tenant: str,
        workflow: Any,
        cost: RequestCost,
        worker_id: str,
        prompt_hashes: Sequence[int] | None,
        now: float,
    ) -> None:
        """The step ended with `cost`; on success `worker_id` served it and holds
        the context of `prompt_hashes`."""
        info = self.info(workflow)
        if not info.workflow_id:
            return
        final = bool(workflow.final_step)
        self.ledger.record_step(tenant, info.workflow_id, cost, final=final, now=now)
        if final or cost.outcome is not RequestOutcome.SUCCEEDED:
            self._end(info.workflow_id)
        elif worker_id and prompt_hashes is not None:
            self.affinity.record(info.workflow_id, worker_id, prompt_hashes, now)

    def shed(self, tenant: str, workflow: Any, now: float) -> None:
        """The step was refused at admission: its workflow fails."""
        info = self.info(workflow)
        if info.workflow_id:
            self.ledger.record_shed(tenant, info.workflow_id, now)
            self._end(info.workflow_id)

    def stats(self, tenant: str | None = None) -> WorkflowStats:
        return self.ledger.stats(tenant)

    def expire(self, now: float) -> int:
        """Close workflows the ledger saw no step of for its idle timeout (housekeeping)."""
        return self.ledger.expire(now)

    def attach_metrics(self, registry: CollectorRegistry) -> None:
        """Per-tenant workflow gauges on the router's registry, refreshed by `publish`
        (on the event loop: the ledger is not read from the metrics thread)."""
        self._g_workflows = Gauge(
            "pdmesh_router_workflows",
            "Workflows closed, by tenant and outcome",
            ["tenant", "outcome"],
            registry=registry,
        )
        self._g_cost = Gauge(
            "pdmesh_router_tokens_per_successful_workflow",
            "Tokens computed for all steps (all attempts) of completed workflows / workflows completed",
            ["tenant"],
            registry=registry,
        )
        self._g_rate = Gauge(
            "pdmesh_router_workflow_completion_rate",
            "Completed / closed workflows",
            ["tenant"],
            registry=registry,
        )
        self._g_waste = Gauge(
            "pdmesh_router_workflow_wasted_tokens",
            "Tokens of workflow steps thrown away, by tenant and cause",
            ["tenant", "cause"],
            registry=registry,
        )
        self._g_affinity = Gauge(
            "pdmesh_router_workflow_affinity",
            "Workflow steps given their last worker's context (hit) or not (miss: hint expired, "
            "prompt diverged, worker gone)",
            ["result"],
            registry=registry,
        )

    def publish(self, now: float) -> None:
        """Close idle workflows, then refresh the gauges (housekeeping, on the loop)."""
        self.expire(now)
        if self._g_workflows is None:
            return
        for tenant in self.ledger.tenants():
            st = self.ledger.stats(tenant)
            self._g_workflows.labels(tenant, "completed").set(st.completed)
            self._g_workflows.labels(tenant, "failed").set(st.failed)
            self._g_workflows.labels(tenant, "open").set(st.open)
            self._g_cost.labels(tenant).set(st.cost_per_successful_workflow)
            self._g_rate.labels(tenant).set(st.completion_rate)
            for cause, tokens in st.wasted.items():
                self._g_waste.labels(tenant, cause.value).set(tokens)
        self._g_affinity.labels("hit").set(self.affinity.hits)
        self._g_affinity.labels("miss").set(self.affinity.misses)

    def _end(self, workflow_id: str) -> None:
        self.affinity.forget(workflow_id)
        if self._admission is not None:
            self._admission.forget_workflow(workflow_id)
