"""The router: composition root of the cores, the worker pool and running requests.

`Router` creates and owns every core (registry, membership guard, prefix index + sequencer,
breakers, retry budget, cost ledger, API keys, admission) and the `WorkerPool`, wires
them (the registry asks the breakers whether a worker is available; removing a
worker stops its KV subscription before clearing its state), and keeps the
running `RequestFlow`s by request id for Router.Cancel. The servicer converts
messages and calls the methods here; `main` builds one Router per process.

Everything runs on one event loop; the clock is injected (tests move a fake
clock to expire leases and open/close breakers).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from pdmesh.v1 import decode_pb2
from services.common import tracing
from services.common.errors import FailedPrecondition, ResourceExhausted, Unavailable
from services.router.admission import AdmissionController
from services.router.admission_gate import AdmissionGate
from services.router.auth import ApiKeyStore
from services.router.circuit_breaker import BreakerRegistry, BreakerState
from services.router.config import ModelSpec, RouterSettings
from services.router.cost import CostLedger, RequestCost, RequestOutcome
from services.router.generate import (
    AlreadyExists,
    CallDecode,
    FlowRequest,
    RequestFlow,
    RoutingContext,
    check_capacity,
)
from services.router.hash_memo import HashMemo
from services.router.load_view import LoadView
from services.router.membership import Caller, MembershipGuard
from services.router.metrics import RouterMetrics, WorkerGauges
from services.router.outlier import OutlierDetector, OutlierState
from services.router.policy import WorkerLoad, make_policy
from services.router.prefix_index import EventSequencer
from services.router.prefix_pull import PrefixPullPlanner
from services.router.registry import (
    JoinResult,
    Resolver,
    WorkerInfo,
    WorkerRecord,
    WorkerRegistry,
    WorkerRole,
    WorkerSource,
    system_resolver,
)
from services.router.retries import RetriedArrivals, SharedFlow
from services.router.retry_budget import RetryBudget
from services.router.tier_index import TieredPrefixIndex
from services.router.worker_pool import WorkerPool
from services.router.worker_profile import WorkerProfile, WorkerProfiles
from services.router.workflow_routing import WorkflowRouting

log = structlog.get_logger()


@dataclass(frozen=True)
class RouterStats:
    requests_total: int
    requests_succeeded: int
    requests_failed: int
    requests_cancelled: int
    requests_shed: int
    retries: int
    retries_denied: int
    migrations: int
    tokens_per_successful_request: float
    wasted_tokens: int
    computed_tokens: int
    inflight: int
    queued: int
    prompt_tokens: int = 0  # of finished requests (the planner's ISL)
    completion_tokens: int = 0
    # "ttft"/"itl": (upper bounds, cumulative counts, sum) since start (RouterMetrics.latency_histograms)
    latency: dict[str, tuple[tuple[float, ...], tuple[int, ...], float]] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerView:
    record: WorkerRecord
    breaker: BreakerState
    indexed_blocks: int
    profile: WorkerProfile | None = None  # what the router measured it do (None: nothing yet)
    speed: tuple[float, float] = (1.0, 1.0)  # its (prefill, decode) factors (the cost's with --speed-route)


class _FailedCall:
    """A call that fails at once (the chosen worker vanished between pick and call)."""

    def __init__(self, details: str):
        self._details = details

    def __aiter__(self) -> Any:
        return self._fail()

    async def _fail(self) -> Any:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), self._details
        )
        yield  # pragma: no cover

    def cancel(self) -> bool:
        return False


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        model: ModelSpec,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        call_decode: CallDecode | None = None,
        resolver: Resolver = system_resolver,
        subscriber: str = "router",
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ):
        cfg = settings.router
        self.settings = settings
        self.config = cfg
        self.model = model
        self.clock = clock
        rng = rng or random.Random(cfg.seed)
        self.metrics = RouterMetrics(self.stats)
        self.breakers = BreakerRegistry(settings.breaker, clock, self._on_breaker)
        # Always there: with --outlier-enabled false it only predicts TTFTs (nobody is ejected).
        self.outliers = OutlierDetector(
            settings.outlier, clock, self._on_outlier, self._out_otherwise, self._waiting_at
        )
        self.registry = WorkerRegistry(cfg.registry_config(), clock, available=self._available)
        self.profiles = WorkerProfiles(settings.speed)  # measured always; ranked on with --speed-route
        self.membership = MembershipGuard()  # who may speak for a registered worker
        self.index = TieredPrefixIndex(settings.index)  # pool blocks + host tiers
        self.sequencer = EventSequencer()
        self.load_view = LoadView() if cfg.load_view else None
        if self.load_view is not None:  # what of ours each load report holds (load_view.py)
            self.registry.on_load = self.load_view.reported
        self.budget = RetryBudget(settings.retry_budget, clock)
        self.ledger = CostLedger()
        self.auth = (
            ApiKeyStore(settings.auth, on_reload_error=self.metrics.api_keys_reload_failed)
            if settings.auth.enabled
            else None
        )
        self.admission = AdmissionController(
            settings.admission, clock, self.auth.limits_for if self.auth is not None else None
        )
        self.gate = AdmissionGate(self.admission, clock)
        self.workflows = WorkflowRouting(settings.workflow, self.admission)
        self.workflows.attach_metrics(self.metrics.registry)
        self.pool = WorkerPool(
            cfg,
            self.registry,
            self.index,
            self.sequencer,
            self.breakers,
            self.changed,
            subscriber,
            resolver,
            tls=settings.tls,
            interceptors=interceptors,  # tracing: the trace context goes to the workers
        )
        self.pool.drain_grace_s = settings.server.drain_grace_s
        self.pool.notify_started = settings.hedge.enabled and settings.hedge.tied
        self.pool.on_unhealthy = lambda worker_id: self.reroute_unstarted(worker_id, "not_serving")
        self.pool.on_forget = self._forget_latency
        self.ctx = RoutingContext(
            config=cfg,
            registry=self.registry,
            index=self.index,
            decode_policy=make_policy(cfg.policy, cfg.policy_config(), rng),
            prefill_policy=make_policy(cfg.policy, cfg.policy_config(), rng),
            breakers=self.breakers,
            budget=self.budget,
            ledger=self.ledger,
            gate=self.gate,
            journey_config=settings.journey,
            call_decode=call_decode or self._call_decode,
            clock=clock,
            metrics=self.metrics,
            notify=self.changed,
            load_view=self.load_view,
            outliers=self.outliers,
            hedge=settings.hedge,
            reroute=self.reroute_unstarted,
            pull_planner=PrefixPullPlanner(settings.prefix_pull, cfg.block_size)
            if settings.prefix_pull.enabled
            else None,
            hash_memo=HashMemo(),
            workflows=self.workflows,
            profiles=self.profiles,
        )
        self.flows: dict[str, RequestFlow] = {}
        # Keyed requests, so that a client's retry joins the running one (retries.py).
        self.retried = RetriedArrivals(settings.retry_attach) if settings.retry_attach.enabled else None
        self.requests_total = 0
        self._changed = asyncio.Event()
        self._housekeeping: asyncio.Task[None] | None = None

    # ---- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        await self.pool.start_static()
        self._housekeeping = asyncio.create_task(self._housekeep(), name="router:housekeeping")

    async def close(self) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeping
        for flow in list(self.flows.values()):
            flow.cancel("the router is shutting down")
        await self.pool.close()
        self.gate.close()

    async def _housekeep(self) -> None:
        while True:
            await asyncio.sleep(self.config.housekeeping_interval_s)
            await self.expire_leases()
            if self.outliers is not None:  # the live view is judged without traffic too
                self.outliers.tick()
            self._export_worker_gauges()
            self.workflows.publish(self.clock())

    def _export_worker_gauges(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for role in WorkerRole:
            for health in ("serving", "not_serving", "breaker_open"):
                counts[(role.value, health)] = 0
        rows = []
        for view in self.workers():
            rec = view.record
            role = rec.info.role.value  # type: ignore[union-attr]
            counts[(role, _health_label(view))] += 1
            rows.append(
                WorkerGauges(
                    rec.worker_id,
                    role,
                    view.breaker.value,
                    rec.load.waiting,
                    rec.load.running,
                    rec.inflight,
                    *view.speed,
                )
            )
        self.metrics.set_workers(counts, len(self.index), rows)

    # ---- change notification (readiness, tests) -----------------------------

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        """Wait until `predicate()` holds, re-checking on every state change."""
        async with asyncio.timeout(timeout):
            while not predicate():
                await self.wait_changed()

    def ready(self) -> bool:
        """At least one healthy decode worker."""
        return any(r.healthy for r in self.registry.workers(WorkerRole.DECODE))

    # ---- requests -----------------------------------------------------------

    def open_flow(self, req: FlowRequest, client_id: str | None = None) -> RequestFlow:
        """A validated request becomes a flow (registered for Cancel) or is refused fast.
        `req.request_id` is the tenant-scoped id; `client_id` the one the client sent."""
        self.requests_total += 1
        if req.request_id in self.flows:
            raise AlreadyExists(f"request_id {(client_id or req.request_id)!r} is already running")
        try:
            check_capacity(self.ctx)
        except ResourceExhausted:
            self.ledger.record_shed()
            self.metrics.shed("saturated")
            raise
        except Unavailable:  # no decode worker at all: a failure that computed nothing
            self.ledger.record(RequestCost(RequestOutcome.FAILED, 0, 0))
            raise
        flow = RequestFlow(self.ctx, req)
        self.flows[req.request_id] = flow
        return flow

    def follow_retry(self, tenant: str, key: str, print_: bytes) -> SharedFlow | None:
        """A keyed arrival: the shared flow it is a retry of (attached to a running one, or
        a replay of a success), or None (a new request: `open_shared` it). Counted
        (`pdmesh_router_retried_arrivals_total{outcome}`); FailedPrecondition for a reused key."""
        if self.retried is None:
            return None
        try:
            shared, outcome = self.retried.find(tenant, key, print_)
        except FailedPrecondition:
            self.metrics.retried_arrival("conflict")
            raise
        if shared is not None:
            self.requests_total += 1
            self.metrics.retried_arrival(outcome)
            log.info("retried_arrival", request_id=shared.flow.req.request_id, outcome=outcome)
        return shared

    def open_shared(self, req: FlowRequest, client_id: str, key: str, print_: bytes) -> SharedFlow:
        """`open_flow` for a keyed request (retried arrivals on): run it as a SharedFlow
        that its retries can follow."""
        assert self.retried is not None
        flow = self.open_flow(req, client_id)
        table, tenant = self.retried, req.tenant

        def done(shared: SharedFlow) -> None:
            table.ended(tenant, key, shared)
            self.close_flow(shared.flow)

        shared = SharedFlow(flow, print_, self.settings.retry_attach.detach_grace_s, done)
        table.add(tenant, key, shared)
        return shared

    def close_flow(self, flow: RequestFlow) -> None:
        if self.flows.get(flow.req.request_id) is flow:
            del self.flows[flow.req.request_id]
            self.changed()

    def cancel(self, request_id: str, tenant: str | None = None) -> bool:
        """Cancel a running request; with `tenant` (authenticated callers) only one of its own."""
        flow = self.flows.get(request_id)
        if flow is None or (tenant is not None and flow.req.tenant != tenant):
            return False
        flow.cancel()
        return True

    def _call_decode(
        self, worker_id: str, request: decode_pb2.DecodeServiceGenerateRequest, timeout: float | None
    ) -> Any:
        conn = self.pool.connection(worker_id)
        if conn is None:
            return _FailedCall(f"worker {worker_id} left the router's registry")
        if tracing.recording():  # one event per attempt, in order, on the router's Generate span
            tracing.event("attempt", worker=worker_id, resume_tokens=len(request.resume_token_ids))
            # A traced request keeps its own call: its trace context travels in that call's
            # metadata, and a shared link has no per-request metadata.
            return conn.decode.Generate(request, timeout=timeout)
        if self.config.decode_link:
            link = conn.link()
            if link is not None:
                return link.open(request, timeout)
        return conn.decode.Generate(request, timeout=timeout)

    # ---- workers ------------------------------------------------------------

    async def register(
        self,
        info: WorkerInfo,
        lease_s: float | None,
        load: WorkerLoad | None = None,
        caller: Caller | None = None,
    ) -> tuple[JoinResult, str]:
        """A worker joins at run time: (the join, its new incarnation secret).
        Raises JoinRefused, or PermissionDenied when `caller` may not speak for the id."""
        caller = caller or Caller()
        existing = self.registry.get(info.worker_id)
        same_address = [
            r
            for r in self.registry.workers()
            if r.info.address == info.address and r.worker_id != info.worker_id
        ]
        self.membership.check_register(info.worker_id, existing, same_address, caller)
        result = self.registry.join(info, WorkerSource.REGISTERED, lease_s, load)
        secret = self.membership.bind(info.worker_id, result.replaced)
        for gone in result.replaced:
            await self.pool.detach(gone)
        assert info.role is not None
        self.profiles.register(
            info.worker_id,
            accelerator="/".join(filter(None, (info.accelerator, info.accelerator_generation))),
            memory_headroom_bytes=info.memory_headroom_bytes,
            warm_models=info.warm_models,
            model_load_s=info.model_load_s,
        )
        await self.pool.attach(info.worker_id, info.address, info.role)
        log.info("worker_joined", worker=info.worker_id, address=info.address, source="registered")
        self.changed()
        return result, secret

    def heartbeat(self, worker_id: str, load: WorkerLoad, caller: Caller | None = None) -> bool:
        """Take a worker's load and renew its lease; False when unknown (register again)."""
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.membership.check_speaks_for(record, caller or Caller(), "heartbeat")
        return self.registry.heartbeat(worker_id, load)

    async def deregister(self, worker_id: str, caller: Caller | None = None) -> bool:
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.membership.check_speaks_for(record, caller or Caller(), "deregister")
        self.registry.deregister(worker_id)
        self.membership.forget([worker_id])
        await self.pool.detach(worker_id)
        log.info("worker_left", worker=worker_id)
        self.changed()
        return True

    async def expire_leases(self) -> list[str]:
        gone = self.registry.expire()
        self.membership.forget(gone)
        for worker_id in gone:
            log.info("worker_lease_expired", worker=worker_id)
            await self.pool.detach(worker_id)
        if gone:
            self.changed()
        return gone

    def workers(self) -> list[WorkerView]:
        speeds = self.profiles.speeds()
        return [
            WorkerView(
                r,
                self.breakers.state(r.worker_id),
                self.index.blocks(r.worker_id),
                self.profiles.get(r.worker_id),
                speeds.get(r.worker_id, (1.0, 1.0)),
            )
            for r in self.registry.workers()
        ]

    def _on_breaker(self, worker_id: str, old: BreakerState, new: BreakerState) -> None:
        log.info("breaker", worker=worker_id, old=old.value, new=new.value)
        self.metrics.breaker_transition(new.value)
        if new is BreakerState.OPEN:
            self.reroute_unstarted(worker_id, "breaker_open")

    def _on_outlier(self, worker_id: str, old: OutlierState, new: OutlierState) -> None:
        log.info("latency_outlier", worker=worker_id, old=old.value, new=new.value)
        self.metrics.outlier_transition(new.value)
        if new is OutlierState.EJECTED:
            self.reroute_unstarted(worker_id, "ejected")

    def _available(self, worker_id: str) -> bool:
        """May the registry offer this worker? Its breaker and the outlier detector agree."""
        if not self.breakers.is_available(worker_id):
            return False
        return self.outliers is None or self.outliers.is_available(worker_id)

    def _out_otherwise(self, worker_id: str) -> bool:
        """Is the worker out of routing for a reason of its own (not serving, breaker open)?
        The outlier detector counts these against its ejection share."""
        rec = self.registry.get(worker_id)
        return rec is None or not rec.healthy or not self.breakers.is_available(worker_id)

    def _waiting_at(self, worker_id: str) -> int | None:
        """Requests waiting at the worker, its last load report (the outlier detector asks
        whether a slow worker's peers have room for its load)."""
        rec = self.registry.get(worker_id)
        return None if rec is None else rec.load.waiting

    def _forget_latency(self, worker_id: str) -> None:
        if self.outliers is not None:
            self.outliers.remove(worker_id)
        self.profiles.forget(worker_id)

    def reroute_unstarted(self, worker_id: str, cause: str) -> int:
        """`worker_id` went unhealthy (cause: not_serving, breaker_open, ejected, stalled): move every
        request there that has had nothing back yet to another worker, now (issue 18: they
        used to wait for the first-token timeout). How many were moved."""
        if not self.config.reroute_unstarted:
            return 0
        if not any(c.worker_id != worker_id for c in self.registry.eligible(WorkerRole.DECODE)):
            return 0  # nowhere to go: they wait there (it may recover, or drain them)
        why = {
            "not_serving": "is not serving",
            "breaker_open": "has its breaker open",
            "stalled": "stalled a stream",
        }.get(cause, "was ejected as a latency outlier")
        moved = sum(flow.reroute_unstarted(worker_id, why) for flow in list(self.flows.values()))
        if moved:
            log.info("rerouted_unstarted", worker=worker_id, cause=cause, requests=moved)
            self.metrics.reroute(cause, moved)
        return moved

    # ---- stats --------------------------------------------------------------

    def stats(self) -> RouterStats:
        c = self.ledger.stats()
        return RouterStats(
            requests_total=self.requests_total,
            requests_succeeded=c.requests_succeeded,
            requests_failed=c.requests_failed,
            requests_cancelled=c.requests_cancelled,
            requests_shed=c.requests_shed,
            retries=self.budget.retries_granted,
            retries_denied=self.budget.retries_denied,
            migrations=c.migrations,
            tokens_per_successful_request=c.tokens_per_successful_request,
            wasted_tokens=c.wasted_tokens,
            computed_tokens=c.computed_tokens,
            inflight=self.admission.inflight,
            queued=self.admission.queued,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            latency=self.metrics.latency_histograms(),
        )


def _health_label(view: WorkerView) -> str:
    if view.breaker is BreakerState.OPEN:
        return "breaker_open"
    return "serving" if view.record.healthy else "not_serving"
