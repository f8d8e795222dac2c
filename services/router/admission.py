"""Admission control: who may start now, who waits, who is shed.

Owns the per-tenant token buckets (requests/s and tokens/s, tokens = prompt +
max_tokens; services/router/tenant_quota.py), each tenant's open requests
(running + queued) against its cap, the in-flight count against
`max_inflight`, and a bounded wait queue ordered by priority (higher first)
then arrival. The servicer calls
`try_admit` before routing and `release` when the request ends; it sheds with
the typed errors below (RESOURCE_EXHAUSTED with a "retry-after-ms" hint, or
DEADLINE_EXCEEDED).

The core is synchronous. A queued request gets a `Waiter`; the async edge
wraps it in a future of its own and resolves it from the return values of
`release` (waiters granted a slot), `expire` (waiters that timed out; call it
at `next_expiry()`) and `cancel` (client went away while queued). A released
slot goes straight to the next waiter, so while anyone waits every slot is
taken and a newcomer cannot jump the queue.

Queue order within a priority is earliest effective deadline first
(services/router/workflow_sched.py): the request's deadline, or arrival +
`default_horizon_s` without one (so deadline-less requests keep arrival
order), pushed back `level_delay_s` per attained-service level of its workflow
(tokens the workflow was served in the recent window, recorded at `release`):
a long agent cannot starve short chats, and its extra wait is bounded. When a
priority's queue is full, the waiter shed is the one whose loss wastes the
fewest already-spent workflow tokens (a newcomer with none is shed itself), so
a late step of an expensive workflow is not refused behind fresh work.

Slots can be held back for the higher priorities (`reserved_inflight`, below
`reserve_priority`; off by default): a request below it starts only while
fewer than max_inflight - reserved_inflight run. Why: max_inflight is usually
more than the workers' batch slots (the rest wait in the workers' own FIFO
queues), so low-priority work admitted in a lull would fill those queues, and
the next burst of higher-priority steps would wait behind it there, where the
priority order no longer reaches; bench/workflows.py measured it: late steps of
research agents kept alive by sunk-cost shedding filled the workers' queues and
cost a fifth of the copilots at 3x.

Deadlines are absolute times on the controller's clock. A request that cannot
start before its deadline is refused at once (`DeadlineUnreachable`) rather
than queued to die: when the deadline has passed, when its tenant's bucket
refills only after it, or when the estimated queue wait ends after it. The wait
estimate is (position + 1) x mean slot hold time / max_inflight, with the mean
an EWMA of observed holds: a lower bound when later arrivals outrank it. A
request shed because its priority's queue is full is told that same estimate
as its retry hint (the wait behind everyone at or above its priority), and the
shed itself is O(1): no scan of the queue unless the newcomer has sunk
workflow tokens to weigh against a waiter's.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.common.config import require, setting
from services.router.tenant_quota import TenantBuckets, TenantLimits
from services.router.workflow_sched import (
    NO_WORKFLOW,
    AttainedService,
    WorkflowInfo,
    WorkflowSchedConfig,
    effective_deadline,
    shed_rank,
)


class AdmissionRejected(Exception):
    """Shed: RESOURCE_EXHAUSTED at the edge, with `retry_after_s` as a hint.

    `reason` is a short label for metrics: "rate_limited", "tenant_inflight",
    "queue_full", "queue_timeout", "deadline_unreachable", "shed_for_sunk_cost"
    (a queued request displaced by one with more sunk workflow tokens).
    """

    def __init__(self, reason: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class DeadlineUnreachable(AdmissionRejected):
    """The request could not start before its deadline: DEADLINE_EXCEEDED at the edge."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__("deadline_unreachable", message, retry_after_s)


class InvalidAdmission(ValueError):
    """A priority or cost out of range (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = setting(64, "requests the router runs at once; more wait in the queue")
    queue_limit_per_priority: int = setting(128, "waiting requests per priority level before shedding")
    queue_timeout_s: float = setting(30.0, "longest a request waits in the queue")
    min_priority: int = setting(-10, "lowest accepted priority")
    max_priority: int = setting(10, "highest accepted priority")
    initial_hold_s: float = setting(2.0, "assumed mean request duration before any has finished")
    min_retry_after_s: float = setting(0.05, "floor of the retry-after hint")
    max_retry_after_s: float = setting(60.0, "cap of the retry-after hint")
    max_tenants: int = setting(10_000, "tenant buckets kept; least recently used beyond this are dropped")
    tenant_max_inflight: int = setting(
        0, "open requests (running + queued) per tenant; one more is shed (0 = no limit)"
    )
    default_limits: TenantLimits = field(
        default_factory=TenantLimits, metadata={"help": "quota of a tenant without its own", "cli": False}
    )
    tenant_limits: Mapping[str, TenantLimits] = field(
        default_factory=dict, metadata={"help": "quota per tenant id", "cli": False}
    )
    reserved_inflight: int = setting(
        0,
        "slots of max_inflight held back for requests at or above reserve_priority: one below it "
        "starts only while fewer than max_inflight - reserved_inflight run (0 = none)",
    )
    reserve_priority: int = setting(0, "requests below this priority may not take the reserved slots")
    edf: bool = setting(True, "order a priority's queue by deadline (else by arrival)")
    attained_service: bool = setting(True, "defer workflows by their attained service in the window")
    sunk_cost_shedding: bool = setting(True, "a full queue sheds the waiter with the fewest sunk tokens")
    workflow: WorkflowSchedConfig = field(
        default_factory=WorkflowSchedConfig,
        metadata={"help": "attained-service levels and sunk-cost rules", "cli": False},
    )

    def __post_init__(self) -> None:
        require(self.max_inflight >= 1, "max_inflight must be >= 1")
        require(self.queue_limit_per_priority >= 0, "queue_limit_per_priority must be >= 0")
        require(self.queue_timeout_s > 0, "queue_timeout_s must be > 0")
        require(self.min_priority <= self.max_priority, "min_priority must be <= max_priority")
        require(self.initial_hold_s > 0, "initial_hold_s must be > 0")
        require(0 < self.min_retry_after_s <= self.max_retry_after_s, "need 0 < min_retry_after_s <= max")
        require(self.max_tenants >= 1, "max_tenants must be >= 1")
        require(self.tenant_max_inflight >= 0, "tenant_max_inflight must be >= 0")
        require(
            0 <= self.reserved_inflight < self.max_inflight, "reserved_inflight must be in [0, max_inflight)"
        )


@dataclass(frozen=True)
class Ticket:
    """A granted slot; hand it back with `release` exactly when the request ends."""

    id: int
    tenant: str
    priority: int
    cost_tokens: int
    granted_at: float
    workflow: WorkflowInfo = NO_WORKFLOW


class WaiterState(enum.Enum):
    WAITING = "waiting"
    GRANTED = "granted"  # `ticket` is set
    EXPIRED = "expired"  # `rejection` says why
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Waiter:
    """A queued request. Mutated only by the controller; the edge reads it."""

    id: int
    tenant: str
    priority: int
    cost_tokens: int
    deadline: float | None
    enqueued_at: float
    expires_at: float  # queue timeout or deadline, whichever is first
    workflow: WorkflowInfo = NO_WORKFLOW
    state: WaiterState = WaiterState.WAITING
    ticket: Ticket | None = None
    rejection: AdmissionRejected | None = None


@dataclass(frozen=True)
class AdmissionStats:
    inflight: int
    queued: int
    admitted: int  # granted at once or from the queue
    queued_total: int
    rejected: Mapping[str, int]  # by reason, queue timeouts included
    cancelled_waiting: int


class AdmissionController:
    _EWMA_ALPHA = 0.2  # weight of the latest slot hold in the mean

    def __init__(
        self,
        config: AdmissionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        limits_for: Callable[[str], TenantLimits | None] | None = None,
    ):
        self.config = config or AdmissionConfig()
        self._clock = clock
        # Quota of a tenant from elsewhere (the API-keys file) before the config's.
        self._limits_for = limits_for
        self._ids = itertools.count(1)
        self._tenants: OrderedDict[str, TenantBuckets] = OrderedDict()
        self._open_by_tenant: dict[str, int] = {}  # running + queued
        self._live: dict[int, Ticket] = {}
        # Heaps with lazy deletion: entries of waiters no longer WAITING are skipped.
        self._queue: list[tuple[int, float, int, Waiter]] = []  # (-priority, due, id, waiter)
        self._expiry: list[tuple[float, int, Waiter]] = []  # (expires_at, id, waiter)
        self._waiting_by_priority: dict[int, int] = {}
        self._expired_unreported: list[Waiter] = []
        self._mean_hold_s = self.config.initial_hold_s
        self._admitted = 0
        self._queued_total = 0
        self._cancelled_waiting = 0
        self._rejected: dict[str, int] = {}
        self.attained = AttainedService(self.config.workflow)

    # ---- admission ----------------------------------------------------------

    def try_admit(
        self,
        tenant: str,
        priority: int = 0,
        cost_tokens: int = 0,
        deadline: float | None = None,
        workflow: WorkflowInfo = NO_WORKFLOW,
    ) -> Ticket | Waiter:
        """A `Ticket` when the request may start now, a `Waiter` when it queues.

        A queued request this one displaced (sunk-cost shedding) is reported
        by the next `expire()`. Raises `DeadlineUnreachable` or `AdmissionRejected` when shed, and
        `InvalidAdmission` for a priority outside the configured range.
        """
        cfg = self.config
        if not (cfg.min_priority <= priority <= cfg.max_priority):
            raise InvalidAdmission(
                f"priority must be in [{cfg.min_priority}, {cfg.max_priority}], got {priority}"
            )
        if cost_tokens < 0:
            raise InvalidAdmission(f"cost_tokens must be >= 0, got {cost_tokens}")
        now = self._clock()
        if deadline is not None and deadline <= now:
            self._reject(DeadlineUnreachable("the deadline passed before admission"))
        buckets = self._buckets(tenant, now)
        cap = buckets.limits.max_inflight or cfg.tenant_max_inflight
        if cap and self._open_by_tenant.get(tenant, 0) >= cap:
            self._reject(
                AdmissionRejected(
                    "tenant_inflight",
                    f"tenant {tenant!r} has {cap} requests open (its limit); wait for one to finish",
                    self._clamp_retry(self._mean_hold_s),
                )
            )
        wait = buckets.wait_s(cost_tokens, now)
        if wait > 0:
            retry = self._clamp_retry(wait)
            if deadline is not None and now + wait >= deadline:
                self._reject(
                    DeadlineUnreachable(f"tenant {tenant!r} is over quota until after the deadline", retry)
                )
            self._reject(AdmissionRejected("rate_limited", f"tenant {tenant!r} is over its quota", retry))
        if self.inflight < self._cap(priority):
            buckets.take(cost_tokens, now)
            self._open(tenant, +1)
            return self._grant(tenant, priority, cost_tokens, now, workflow)
        waiting_here = self._waiting_by_priority.get(priority, 0)
        if waiting_here >= cfg.queue_limit_per_priority and self._shed_for(priority, workflow, now):
            waiting_here -= 1
        if waiting_here >= cfg.queue_limit_per_priority:
            # The hint is the wait a request of this priority queued now would see: every
            # waiter at or above it goes first, one slot release (measured hold time /
            # slots) each. Counting only the higher priorities (as before issue 18) told
            # clients ~50 ms while the queue took seconds, and they came back as a storm.
            retry = self._clamp_retry(self.estimated_wait_s(priority))
            self._reject(AdmissionRejected("queue_full", f"queue for priority {priority} is full", retry))
        est = self.estimated_wait_s(priority)
        if deadline is not None and now + est >= deadline:
            self._reject(
                DeadlineUnreachable(
                    f"estimated queue wait {est:.3f}s ends after the deadline", self._clamp_retry(est)
                )
            )
        buckets.take(cost_tokens, now)
        self._open(tenant, +1)
        expires_at = (
            now + cfg.queue_timeout_s if deadline is None else min(now + cfg.queue_timeout_s, deadline)
        )
        waiter = Waiter(next(self._ids), tenant, priority, cost_tokens, deadline, now, expires_at, workflow)
        heapq.heappush(self._queue, (-priority, self._due(now, deadline, workflow), waiter.id, waiter))
        heapq.heappush(self._expiry, (expires_at, waiter.id, waiter))
        self._waiting_by_priority[priority] = waiting_here + 1
        self._queued_total += 1
        return waiter

    def release(self, ticket: Ticket, served_tokens: int = 0) -> list[Waiter]:
        """The request holding `ticket` ended, having been served `served_tokens`
        (prompt computed + generated; charged to its workflow's attained
        service). Returns the waiters now granted (state GRANTED, `ticket`
        set), to be woken by the edge. Idempotent."""
        if self._live.pop(ticket.id, None) is None:
            return []
        self._open(ticket.tenant, -1)
        now = self._clock()
        self.attained.record(ticket.workflow.workflow_id, served_tokens, now)
        hold = max(now - ticket.granted_at, 0.0)
        self._mean_hold_s += self._EWMA_ALPHA * (hold - self._mean_hold_s)
        self._collect_expired(now)
        granted: list[Waiter] = []
        while self._queue and self.inflight < self.config.max_inflight:
            waiter = self._queue[0][-1]
            if waiter.state is not WaiterState.WAITING:
                heapq.heappop(self._queue)
                continue
            if self.inflight >= self._cap(waiter.priority):
                break  # the head is below the reserve priority, and so is everyone behind it
            heapq.heappop(self._queue)
            self._leave_queue(waiter, WaiterState.GRANTED)
            waiter.ticket = self._grant(
                waiter.tenant, waiter.priority, waiter.cost_tokens, now, waiter.workflow
            )
            granted.append(waiter)
        return granted

    def cancel(self, waiter: Waiter) -> bool:
        """Withdraw a queued request (client gone). False if it was no longer waiting;
        a GRANTED waiter's ticket must then be released instead."""
        if waiter.state is not WaiterState.WAITING:
            return False
        self._leave_queue(waiter, WaiterState.CANCELLED)
        self._refund(waiter, self._clock())
        self._cancelled_waiting += 1
        return True

    def expire(self, now: float | None = None) -> list[Waiter]:
        """Waiters whose queue timeout or deadline passed (state EXPIRED,
        `rejection` set): the edge fails them with that error."""
        self._collect_expired(self._clock() if now is None else now)
        out, self._expired_unreported = self._expired_unreported, []
        return out

    def next_expiry(self) -> float | None:
        """When the earliest waiting request expires (None: nobody waits)."""
        while self._expiry and self._expiry[0][2].state is not WaiterState.WAITING:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None

    # ---- views --------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return len(self._live)

    @property
    def queued(self) -> int:
        return sum(self._waiting_by_priority.values())

    def estimated_wait_s(self, priority: int) -> float:
        """Estimated wait of a request of `priority` that queued now (0 when a slot is free)."""
        if self.inflight < self._cap(priority):
            return 0.0
        return (self._waiting_at_or_above(priority) + 1) * self._slot_interval_s()

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            inflight=self.inflight,
            queued=self.queued,
            admitted=self._admitted,
            queued_total=self._queued_total,
            rejected=dict(self._rejected),
            cancelled_waiting=self._cancelled_waiting,
        )

    # ---- internals ----------------------------------------------------------

    def forget_workflow(self, workflow_id: str) -> None:
        """The workflow ended: drop its attained service."""
        self.attained.forget(workflow_id)

    def _due(self, now: float, deadline: float | None, workflow: WorkflowInfo) -> float:
        """Heap key within a priority: the effective deadline (EDF + attained-service
        delay), or arrival time when EDF is off."""
        cfg = self.config
        level = self.attained.level(workflow.workflow_id, now) if cfg.attained_service else 0
        if not cfg.edf:
            return now + level * cfg.workflow.level_delay_s
        return effective_deadline(now, deadline, level, cfg.workflow)

    def _shed_for(self, priority: int, workflow: WorkflowInfo, now: float) -> bool:
        """Make room in `priority`'s full queue for a newcomer with `workflow`'s
        sunk cost by shedding the waiter whose loss wastes the fewest spent
        tokens, if that is fewer than the newcomer's. True when one was shed."""
        if not self.config.sunk_cost_shedding or workflow.tokens_spent <= 0:
            # A newcomer with no sunk tokens displaces nobody (no waiter has fewer than
            # none): the common shed, in a storm, stays O(1) with no scan of the queue.
            return False
        # Scans the heap: bounded by queue_limit_per_priority per level, and only when one is full.
        candidates = [
            e[-1] for e in self._queue if e[-1].state is WaiterState.WAITING and e[-1].priority == priority
        ]
        victim = min(
            candidates,
            key=lambda w: shed_rank(w.priority, w.workflow.tokens_spent, w.enqueued_at),
            default=None,
        )
        if victim is None or victim.workflow.tokens_spent >= workflow.tokens_spent:
            return False
        self._leave_queue(victim, WaiterState.EXPIRED)
        self._refund(victim, now)
        err = AdmissionRejected(
            "shed_for_sunk_cost",
            f"shed for a request with more sunk workflow tokens ({workflow.tokens_spent})",
            self._clamp_retry(self.estimated_wait_s(priority)),
        )
        self._rejected[err.reason] = self._rejected.get(err.reason, 0) + 1
        victim.rejection = err
        self._expired_unreported.append(victim)
        return True

    def _grant(
        self, tenant: str, priority: int, cost: int, now: float, workflow: WorkflowInfo = NO_WORKFLOW
    ) -> Ticket:
        ticket = Ticket(next(self._ids), tenant, priority, cost, now, workflow)
        self._live[ticket.id] = ticket
        self._admitted += 1
        return ticket

    def _reject(self, err: AdmissionRejected) -> None:
        self._rejected[err.reason] = self._rejected.get(err.reason, 0) + 1
        raise err

    def _cap(self, priority: int) -> int:
        """Slots a request of `priority` may start within."""
        cfg = self.config
        if priority < cfg.reserve_priority:
            return cfg.max_inflight - cfg.reserved_inflight
        return cfg.max_inflight

    def _slot_interval_s(self) -> float:
        """Mean time between slot releases when all slots are busy."""
        return self._mean_hold_s / self.config.max_inflight

    def _clamp_retry(self, seconds: float) -> float:
        return min(max(seconds, self.config.min_retry_after_s), self.config.max_retry_after_s)

    def _waiting_at_or_above(self, priority: int) -> int:
        # O(priority levels with waiters), at most the configured range: never the queue.
        return sum(n for p, n in self._waiting_by_priority.items() if p >= priority)

    def _open(self, tenant: str, delta: int) -> None:
        n = self._open_by_tenant.get(tenant, 0) + delta
        if n > 0:
            self._open_by_tenant[tenant] = n
        else:
            self._open_by_tenant.pop(tenant, None)

    def open_requests(self, tenant: str) -> int:
        """Running + queued requests of `tenant`."""
        return self._open_by_tenant.get(tenant, 0)

    def _leave_queue(self, waiter: Waiter, state: WaiterState) -> None:
        waiter.state = state
        if state is not WaiterState.GRANTED:  # a granted waiter stays open, now running
            self._open(waiter.tenant, -1)
        n = self._waiting_by_priority[waiter.priority] - 1
        if n:
            self._waiting_by_priority[waiter.priority] = n
        else:
            del self._waiting_by_priority[waiter.priority]
        self._compact()

    def _collect_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, _, waiter = heapq.heappop(self._expiry)
            if waiter.state is not WaiterState.WAITING:
                continue
            self._leave_queue(waiter, WaiterState.EXPIRED)
            self._refund(waiter, now)
            if waiter.deadline is not None and waiter.expires_at >= waiter.deadline:
                err: AdmissionRejected = DeadlineUnreachable("the deadline passed while queued")
            else:
                retry = self._clamp_retry(self.estimated_wait_s(waiter.priority))
                err = AdmissionRejected("queue_timeout", "queued longer than the queue timeout", retry)
            self._rejected[err.reason] = self._rejected.get(err.reason, 0) + 1
            waiter.rejection = err
            self._expired_unreported.append(waiter)

    def _refund(self, waiter: Waiter, now: float) -> None:
        """Give back the quota of a request that never ran."""
        buckets = self._tenants.get(waiter.tenant)
        if buckets is not None:
            buckets.refund(waiter.cost_tokens, now)

    def _compact(self) -> None:
        """Drop dead heap entries once they outnumber the live ones (bounded memory)."""
        live = self.queued
        if len(self._queue) > 2 * live + 64:
            self._queue = [e for e in self._queue if e[-1].state is WaiterState.WAITING]
            heapq.heapify(self._queue)
        if len(self._expiry) > 2 * live + 64:
            self._expiry = [e for e in self._expiry if e[2].state is WaiterState.WAITING]
            heapq.heapify(self._expiry)

    def _limits(self, tenant: str) -> TenantLimits:
        found = self._limits_for(tenant) if self._limits_for is not None else None
        return found or self.config.tenant_limits.get(tenant, self.config.default_limits)

    def _buckets(self, tenant: str, now: float) -> TenantBuckets:
        """The tenant's buckets (LRU order). Full buckets at the cold end are
        dropped: a full bucket equals a fresh one, so nothing is lost."""
        buckets = self._tenants.get(tenant)
        limits = self._limits(tenant)
        if buckets is None or buckets.limits != limits:  # new tenant, or its quota changed
            buckets = TenantBuckets(limits, now)
            self._tenants[tenant] = buckets
        self._tenants.move_to_end(tenant)
        for _ in range(4):  # amortised pruning: a few idle tenants per call
            oldest, b = next(iter(self._tenants.items()))
            if oldest == tenant or not b.idle(now):
                break
            del self._tenants[oldest]
        while len(self._tenants) > self.config.max_tenants:
            self._tenants.popitem(last=False)
        return buckets
