"""A request's WorkflowContext through RequestFlow (fake decode calls, fake clock), issue 21:
the next step goes to the workflow's last worker before any KV event said what it
caches; a late step with sunk tokens displaces a fresh waiter from a full queue and
gets a retry the budget refuses a fresh request; the ledger counts per tenant; a
request without a workflow is untouched."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdmesh.v1 import common_pb2, decode_pb2
from services.common.errors import ResourceExhausted, Unavailable
from services.router.admission import AdmissionConfig, AdmissionController
from services.router.admission_gate import AdmissionGate
from services.router.circuit_breaker import BreakerRegistry
from services.router.config import RouterConfig
from services.router.cost import CostLedger
from services.router.generate import FlowFinal, FlowRequest, RequestFlow, RoutingContext
from services.router.migration import JourneyConfig
from services.router.policy import WorkerLoad, make_policy
from services.router.prefix_index import PrefixIndex
from services.router.registry import WorkerInfo, WorkerRegistry, WorkerRole, WorkerSource
from services.router.retry_budget import RetryBudget, RetryBudgetConfig
from services.router.workflow_affinity import WorkflowRoutingConfig
from services.router.workflow_routing import WorkflowRouting
from tests.unit.router.fakes import FakeClock
from tests.unit.router.test_routing_burst import HeldCall

BS = 16
WORKERS = ("w0", "w1")


def tokens(*ids):
    return decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=ids))


def final():
    return decode_pb2.DecodeServiceGenerateResponse(
        final=decode_pb2.DecodeFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    )


def unavailable():
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")


class Mesh:
    """Two decode workers; every call answers at once from `script` (default: 4 tokens, done)."""

    def __init__(self, workflows: bool = True, admission: AdmissionConfig | None = None, budget=None):
        self.clock = FakeClock()
        cfg = RouterConfig(policy="kv_aware", block_size=BS, load_view=False, decode_weight=0.1)
        breakers = BreakerRegistry(clock=self.clock)
        self.registry = WorkerRegistry(cfg.registry_config(), self.clock, available=breakers.is_available)
        for w in WORKERS:
            self.registry.join(
                WorkerInfo(w, f"{w}:1", WorkerRole.DECODE, "builtin-tiny", BS), WorkerSource.STATIC
            )
        self.admission = AdmissionController(admission, clock=self.clock)
        self.budget = RetryBudget(budget, clock=self.clock)
        self.workflows = WorkflowRouting(WorkflowRoutingConfig(enabled=workflows), self.admission)
        self.sent: list[tuple[str, decode_pb2.DecodeServiceGenerateRequest]] = []
        self.script: list = []  # per call: a list of messages / errors; [] = the default
        self.hold: list[HeldCall] = []
        self.ctx = RoutingContext(
            config=cfg,
            registry=self.registry,
            index=PrefixIndex(),  # empty: no KV event has reached the router
            decode_policy=make_policy("kv_aware", cfg.policy_config()),
            prefill_policy=make_policy("kv_aware", cfg.policy_config()),
            breakers=breakers,
            budget=self.budget,
            ledger=CostLedger(),
            gate=AdmissionGate(self.admission, self.clock),
            journey_config=JourneyConfig(max_retries=0, max_migrations=0),
            call_decode=self._call,
            clock=self.clock,
            workflows=self.workflows,
        )

    def _call(self, worker, request, timeout):
        self.sent.append((worker, request))
        call = HeldCall()
        items = self.script.pop(0) if self.script else [tokens(7, 8, 9, 10), final()]
        if items == "hold":
            self.hold.append(call)
            return call
        for item in items:
            call.queue.put_nowait(item)
        return call

    def load(self, worker: str, tokens_waiting: int) -> None:
        for w in WORKERS:
            self.registry.update_load(w, WorkerLoad())
        self.registry.update_load(worker, WorkerLoad(tokens_waiting=tokens_waiting))

    def flow(self, rid, prompt, wf=None, tenant="t"):
        return RequestFlow(
            self.ctx,
            FlowRequest(
                rid, tuple(prompt), common_pb2.SamplingParams(max_tokens=4), tenant=tenant, workflow=wf
            ),
        )


async def run(flow) -> list:
    return [item async for item in flow.run()]


def wf(step, spent=0, final_step=False, wid="wf-1"):
    return common_pb2.WorkflowContext(
        workflow_id=wid, step_index=step, tokens_spent=spent, final_step=final_step
    )


async def test_each_step_goes_to_the_workflows_worker_before_any_kv_event_names_it():
    mesh = Mesh()
    convo = list(range(1, 8 * BS + 1))  # 8 blocks
    out = await run(mesh.flow("s0", convo, wf(0)))
    home = mesh.sent[-1][0]
    other = next(w for w in WORKERS if w != home)
    for k in range(1, 6):
        convo = [*convo, 7, 8, 9, 10, *range(1000 * k, 1000 * k + 2 * BS)]
        # The home has 4 blocks of prefill queued, the other none: without the hint the
        # empty index makes the other worker cheaper (no overlap anywhere).
        mesh.load(home, 4 * BS)
        out = await run(mesh.flow(f"s{k}", convo, wf(k, spent=100 * k, final_step=k == 5)))
        assert isinstance(out[-1], FlowFinal)
        assert mesh.sent[-1][0] == home, f"step {k} went to {mesh.sent[-1][0]}, not {home}"
    assert mesh.workflows.affinity.hits == 5 and len(mesh.workflows.affinity) == 0  # final: forgotten
    st = mesh.workflows.stats("t")
    assert (st.completed, st.failed, st.open) == (1, 0, 0) and st.cost_per_successful_workflow > 0
    # The same traffic without a workflow id goes to the cheaper worker.
    mesh.load(home, 4 * BS)
    await run(mesh.flow("plain", convo))
    assert mesh.sent[-1][0] == other


async def test_with_workflows_off_the_context_is_ignored():
    mesh = Mesh(workflows=False)
    convo = list(range(1, 8 * BS + 1))
    await run(mesh.flow("s0", convo, wf(0)))
    home = mesh.sent[-1][0]
    mesh.load(home, 4 * BS)
    await run(mesh.flow("s1", [*convo, *range(500, 500 + 2 * BS)], wf(1, spent=10)))
    assert mesh.sent[-1][0] != home
    assert mesh.workflows.stats().completed + mesh.workflows.stats().open == 0


async def test_a_late_step_displaces_a_fresh_waiter_from_a_full_queue():
    mesh = Mesh(admission=AdmissionConfig(max_inflight=1, queue_limit_per_priority=1))
    mesh.script = ["hold"]
    running = asyncio.create_task(run(mesh.flow("busy", range(1, 40))))
    while not mesh.hold:
        await asyncio.sleep(0)
    fresh = asyncio.create_task(run(mesh.flow("fresh", range(1, 40))))
    while mesh.admission.queued < 1:
        await asyncio.sleep(0)
    late = asyncio.create_task(run(mesh.flow("late", range(1, 40), wf(9, spent=40_000), tenant="agent")))
    with pytest.raises(ResourceExhausted, match="sunk"):
        await fresh
    assert mesh.admission.stats().rejected == {"shed_for_sunk_cost": 1}
    for item in (tokens(1), final()):
        mesh.hold[0].queue.put_nowait(item)
    await running
    assert isinstance((await late)[-1], FlowFinal)
    assert mesh.admission.attained.attained("wf-1", mesh.clock()) > 0  # its service was charged


async def test_sunk_tokens_earn_a_retry_the_spent_budget_refuses_a_fresh_request():
    budget = RetryBudgetConfig(retry_ratio=0.0, min_retries_per_second=0.0, sunk_reserve=3.0)
    mesh = Mesh(budget=budget)
    mesh.script = [[unavailable()]]
    with pytest.raises(Unavailable):
        await run(mesh.flow("fresh", range(1, 40)))
    mesh.script = [[unavailable()]]  # then the default answer, on the other worker
    out = await run(mesh.flow("late", range(1, 40), wf(30, spent=50_000)))
    assert isinstance(out[-1], FlowFinal) and len(mesh.sent) == 3
    assert mesh.sent[-1][0] != mesh.sent[-2][0]
    st = mesh.workflows.stats()
    assert st.open == 1 and st.failed == 0  # the step succeeded; the workflow goes on


async def test_the_per_tenant_gauges_show_cost_completion_and_waste():
    from prometheus_client import CollectorRegistry

    mesh = Mesh()
    reg = CollectorRegistry()
    mesh.workflows.attach_metrics(reg)
    convo = list(range(1, 4 * BS + 1))
    await run(mesh.flow("a0", convo, wf(0, wid="ok"), tenant="acme"))
    await run(
        mesh.flow("a1", [*convo, 7, 8, 9, 10, 5], wf(1, spent=70, final_step=True, wid="ok"), tenant="acme")
    )
    await run(mesh.flow("b0", convo, wf(0, wid="bad"), tenant="beta"))
    mesh.script = [[unavailable()]]
    with pytest.raises(Unavailable):
        await run(mesh.flow("b1", [*convo, 1, 2], wf(1, spent=70, wid="bad"), tenant="beta"))
    mesh.workflows.publish(mesh.clock())

    def value(name, **labels):
        return reg.get_sample_value(name, labels)

    assert value("pdmesh_router_workflows", tenant="acme", outcome="completed") == 1
    assert value("pdmesh_router_workflows", tenant="beta", outcome="failed") == 1
    assert value("pdmesh_router_workflow_completion_rate", tenant="beta") == 0
    assert value("pdmesh_router_tokens_per_successful_workflow", tenant="acme") > 0
    assert value("pdmesh_router_workflow_wasted_tokens", tenant="beta", cause="earlier_steps") > 0
    assert value("pdmesh_router_workflow_affinity", result="hit") == 2


async def test_a_busy_home_keeps_the_next_step_unless_its_queue_is_the_longer():
    """kv_aware alone moves a short follow-up step off a home that decodes long contexts
    (0.1 x its active blocks outweighs the prompt it would recompute); steering keeps it
    home while the home's queue is within the margin, and lets it go when it is not."""
    mesh = Mesh()
    convo = list(range(1, 8 * BS + 1))
    await run(mesh.flow("s0", convo, wf(0)))
    home = mesh.sent[-1][0]
    other = next(w for w in WORKERS if w != home)

    def busy_home(waiting: int) -> None:
        mesh.registry.update_load(other, WorkerLoad())
        mesh.registry.update_load(home, WorkerLoad(running=4, waiting=waiting, active_decode_blocks=400))

    for k, (waiting, expect) in enumerate(((0, home), (1, home), (2, other)), start=1):
        convo = [*convo, 7, 8, 9, 10, *range(1000 * k, 1000 * k + 2 * BS)]
        busy_home(waiting)
        await run(mesh.flow(f"s{k}", convo, wf(k, spent=100 * k)))
        assert mesh.sent[-1][0] == expect, f"step {k} (home waiting {waiting}) went to {mesh.sent[-1][0]}"
        if expect == other:
            break
    assert mesh.workflows.affinity.steered == 2
