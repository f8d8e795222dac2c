"""`KvTransferService` over gRPC: a thin edge over `AgentRegistry` and `TransferStatistics`.

Each method converts the message, calls the core, mirrors the change into
Prometheus and converts back. Domain errors become statuses in `grpc_errors`:
unknown / expired / superseded agents are NOT_FOUND (the agent re-registers on
that), malformed agents and records are INVALID_ARGUMENT, a caller that is not
the name's owner is PERMISSION_DENIED.

The owner of a call (`_owner`): with a client certificate that names a worker
(`pdmesh://<role>/<worker>`), that identity, and the agent it registers must be
its own (`agent.worker_id` is the certified worker and the name is
`<worker>` or `<worker>-...`, so no other certificate can squat a worker's
names); otherwise the `owner_secret` the caller presents (required). See
`services/kvtransfer/registry.py` for the rules.
"""

from __future__ import annotations

import math

import grpc
import structlog

from kvtransfer.agents import AgentRecord
from pdmesh.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.errors import InvalidArgument, PermissionDenied, grpc_errors
from services.common.tls import peer_identity
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry, Owner
from services.kvtransfer.stats import TransferStatistics

log = structlog.get_logger()

SERVICE_NAME = "pdmesh.v1.KvTransferService"
MAX_RECORDS_PER_REPORT = 10_000
SECRET_BYTES = (16, 64)  # accepted owner_secret lengths


class KvTransferServicer(kvtransfer_pb2_grpc.KvTransferServiceServicer):
    def __init__(self, registry: AgentRegistry, stats: TransferStatistics, metrics: KvServiceMetrics):
        self.registry = registry
        self.stats = stats
        self.metrics = metrics
        self._expirations_counted = 0

    def expire(self) -> int:
        """Sweep expired agents (called periodically by main); returns how many went."""
        gone = self.registry.expire()
        for record in gone:
            log.info("kv_agent_expired", agent=record.name, incarnation=record.incarnation)
        self._sync_agents()
        return len(gone)

    def _sync_agents(self) -> None:
        self.metrics.agents.set(len(self.registry))
        # Expirations also happen lazily inside lookups; count them from the core.
        new = self.registry.expirations - self._expirations_counted
        if new > 0:
            self.metrics.expirations.inc(new)
            self._expirations_counted += new

    def _owner(
        self, context: grpc.aio.ServicerContext, secret: bytes, agent: AgentRecord | None = None
    ) -> Owner:
        """Who is calling, for the registry's ownership rules."""
        lo, hi = SECRET_BYTES
        if secret and not lo <= len(secret) <= hi:
            raise InvalidArgument(f"owner_secret must be {lo}..{hi} bytes, got {len(secret)}")
        ident = peer_identity(context)
        if ident is not None and ident.name:
            if agent is not None:
                if agent.worker_id != ident.name:
                    raise PermissionDenied(
                        f"agent.worker_id {agent.worker_id!r} is not the certified worker {ident.name!r}"
                    )
                if agent.name != ident.name and not agent.name.startswith(ident.name + "-"):
                    raise PermissionDenied(
                        f"agent.name {agent.name!r}: worker {ident.name!r} may register "
                        f"{ident.name!r} or {ident.name + '-...'!r} only"
                    )
            return Owner.of(f"{ident.role}/{ident.name}", secret)
        if not secret:
            raise InvalidArgument("owner_secret is required without a client certificate naming a worker")
        return Owner.of("", secret)

    @grpc_errors
    async def RegisterAgent(
        self, request: kvtransfer_pb2.RegisterAgentRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.RegisterAgentResponse:
        try:
            record = AgentRecord.from_proto(request.agent)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        owner = self._owner(context, request.owner_secret, record)
        try:
            stored, lease_s = self.registry.register(
                record, request.lease_ms / 1000.0 if request.lease_ms else None, owner
            )
        except PermissionDenied:
            log.warning("kv_agent_registration_refused", agent=record.name, caller=repr(owner))
            raise
        self.metrics.registrations.inc()
        self._sync_agents()
        log.info(
            "kv_agent_registered",
            agent=stored.name,
            incarnation=stored.incarnation,
            worker=stored.worker_id,
            nixl=bool(stored.metadata),
        )
        return kvtransfer_pb2.RegisterAgentResponse(
            incarnation=stored.incarnation, lease_ms=round(lease_s * 1000)
        )

    @grpc_errors
    async def Heartbeat(
        self, request: kvtransfer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.HeartbeatResponse:
        try:
            lease_s = self.registry.heartbeat(
                request.name, request.incarnation, self._owner(context, request.owner_secret)
            )
        finally:
            self._sync_agents()
        return kvtransfer_pb2.HeartbeatResponse(lease_ms=round(lease_s * 1000))

    @grpc_errors
    async def DeregisterAgent(
        self, request: kvtransfer_pb2.DeregisterAgentRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.DeregisterAgentResponse:
        removed = self.registry.deregister(
            request.name, request.incarnation, self._owner(context, request.owner_secret)
        )
        self._sync_agents()
        return kvtransfer_pb2.DeregisterAgentResponse(removed=removed)

    @grpc_errors
    async def GetAgent(
        self, request: kvtransfer_pb2.GetAgentRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.GetAgentResponse:
        try:
            record = self.registry.get(request.name)
        finally:
            self._sync_agents()
        return kvtransfer_pb2.GetAgentResponse(agent=record.to_proto())

    @grpc_errors
    async def ReportTransfers(
        self, request: kvtransfer_pb2.ReportTransfersRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.ReportTransfersResponse:
        if len(request.records) > MAX_RECORDS_PER_REPORT:
            raise InvalidArgument(
                f"records: at most {MAX_RECORDS_PER_REPORT} per call, got {len(request.records)}"
            )
        for i, r in enumerate(request.records):  # all checked before any is counted
            if not r.transport:
                raise InvalidArgument(f"records[{i}].transport is required")
            if not (math.isfinite(r.duration_ms) and r.duration_ms >= 0):
                raise InvalidArgument(f"records[{i}].duration_ms must be a finite number >= 0")
        for r in request.records:
            self.stats.record(r.transport, r.bytes, r.duration_ms, r.ok, r.error)
            outcome = "ok" if r.ok else "failed"
            self.metrics.transfers.labels(r.transport, outcome).inc()
            if r.ok:
                self.metrics.bytes.labels(r.transport).inc(r.bytes)
                self.metrics.latency.labels(r.transport).observe(r.duration_ms / 1000.0)
            else:
                self.metrics.failures.labels(r.transport, r.error or "unknown").inc()
        return kvtransfer_pb2.ReportTransfersResponse()

    @grpc_errors
    async def Stats(
        self, request: kvtransfer_pb2.KvTransferServiceStatsRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.KvTransferServiceStatsResponse:
        self.registry.expire()
        self._sync_agents()
        s = self.stats.snapshot()
        return kvtransfer_pb2.KvTransferServiceStatsResponse(
            agents=len(self.registry),
            registrations=self.registry.registrations,
            expirations=self.registry.expirations,
            transfers=s.transfers,
            transfer_failures=s.failures,
            bytes=s.bytes,
            latency_ms_p50=s.latency_ms_p50,
            latency_ms_p99=s.latency_ms_p99,
        )
