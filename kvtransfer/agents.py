"""Agent records and the directory client every worker uses.

`AgentRecord` is what the KV-transfer service stores per NIXL agent (the
`AgentInfo` message): the agent's NIXL metadata, its registered pool region,
layout and KvSource address, and an incarnation the service bumps on every
(re-)registration under the name.

`AgentDirectory` is a worker's client of `KvTransferService`:
  - own agent: `register` then `start_heartbeats` (renews the liveness lease at
    a third of its length; re-registers when the service answers NOT_FOUND,
    e.g. after the service restarted or the lease lapsed), `deregister` on
    clean shutdown;
  - peers: `get(name)` with a local cache. A cached record is reused for at
    most `max_age_s`; callers pass `refresh=True` when they have reason to
    doubt it (a transfer failed, the handle names another KvSource address).
    A restarted holder comes back under the same name with a new incarnation
    and new metadata, and the NIXL transport reloads the agent when it sees
    the incarnation change, so stale metadata costs one failed attempt at
    most, never a wedged peer.
  - `is_alive(name)` for `LeaseKeeper` (holder side: is the requester alive?).

Ownership: the directory makes a random `owner_secret` when it is created
(one per process) and presents it on every register, heartbeat and deregister,
so nobody else can overwrite or remove its agent while the agent lives (with a
client certificate naming the worker, the certificate is the owner instead;
see services/kvtransfer/registry.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import structlog

from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.layout import KvLayout, layout_from_proto, layout_to_proto
from pdmesh.v1 import kvtransfer_pb2

log = structlog.get_logger()


@dataclass(frozen=True)
class AgentRecord:
    name: str
    metadata: bytes  # nixl_agent.get_agent_metadata(); b"" for a gRPC-only worker
    layout: KvLayout
    num_blocks: int
    address: int = 0  # pool base address in the agent's process
    length: int = 0  # pool bytes
    device_id: int = 0
    memory_type: str = "DRAM"
    worker_id: str = ""
    kv_source_address: str = ""
    incarnation: int = 0  # set by the service

    def to_proto(self) -> kvtransfer_pb2.AgentInfo:
        return kvtransfer_pb2.AgentInfo(
            name=self.name,
            metadata=self.metadata,
            region=kvtransfer_pb2.MemoryRegion(
                address=self.address,
                length=self.length,
                device_id=self.device_id,
                memory_type=self.memory_type,
            ),
            layout=layout_to_proto(self.layout),
            num_blocks=self.num_blocks,
            worker_id=self.worker_id,
            kv_source_address=self.kv_source_address,
            incarnation=self.incarnation,
        )

    @classmethod
    def from_proto(cls, info: kvtransfer_pb2.AgentInfo) -> AgentRecord:
        """Parse and check an AgentInfo; ValueError (LayoutMismatch included) names the problem."""
        if not info.name:
            raise ValueError("agent.name is required")
        layout = layout_from_proto(info.layout)
        if info.num_blocks == 0:
            raise ValueError("agent.num_blocks must be > 0")
        if info.metadata and info.region.length < info.num_blocks * layout.block_bytes:
            raise ValueError(
                f"agent.region.length {info.region.length} is smaller than "
                f"{info.num_blocks} blocks of {layout.block_bytes} bytes"
            )
        if info.region.memory_type not in ("", "DRAM", "VRAM"):
            raise ValueError(
                f"agent.region.memory_type must be DRAM or VRAM, got {info.region.memory_type!r}"
            )
        return cls(
            name=info.name,
            metadata=bytes(info.metadata),
            layout=layout,
            num_blocks=info.num_blocks,
            address=info.region.address,
            length=info.region.length,
            device_id=info.region.device_id,
            memory_type=info.region.memory_type or "DRAM",
            worker_id=info.worker_id,
            kv_source_address=info.kv_source_address,
            incarnation=info.incarnation,
        )

    def block_regions(self) -> list[tuple[int, int, int]]:
        """(address, length, device) of each of the agent's blocks (NIXL remote descriptors)."""
        bb = self.layout.block_bytes
        return [(self.address + b * bb, bb, self.device_id) for b in range(self.num_blocks)]


class AgentDirectory:
    def __init__(
        self,
        stub: object,  # kvtransfer_pb2_grpc.KvTransferServiceStub or a look-alike
        *,
        lease_ms: int = 10_000,
        max_age_s: float = 5.0,
        rpc_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        owner_secret: bytes | None = None,
    ):
        self._stub = stub
        self.owner_secret = owner_secret or secrets.token_bytes(32)
        self.lease_ms = lease_ms
        self.max_age_s = max_age_s
        self.rpc_timeout_s = rpc_timeout_s
        self._clock = clock
        self._cache: dict[str, tuple[AgentRecord, float]] = {}
        self.own: AgentRecord | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self.registrations = 0

    # -- own agent ---------------------------------------------------------------
    async def register(self, record: AgentRecord) -> AgentRecord:
        """Register (or re-register) this worker's agent; returns it with its incarnation.

        PERMISSION_DENIED means another owner's lease on the name still runs, e.g.
        this worker's previous process (a container restarts under the same name)
        crashed moments ago: wait, for at most one lease and a margin, until it
        lapses and the name may be claimed. Beyond that the refusal is raised."""
        give_up = time.monotonic() + self.lease_ms / 1000.0 + 2.0
        delay = 0.1
        while True:
            try:
                resp = await self._stub.RegisterAgent(
                    kvtransfer_pb2.RegisterAgentRequest(
                        agent=record.to_proto(), lease_ms=self.lease_ms, owner_secret=self.owner_secret
                    ),
                    timeout=self.rpc_timeout_s,
                )
                break
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.PERMISSION_DENIED or time.monotonic() >= give_up:
                    raise
                log.warning("kv_agent_name_held_by_another_owner_waiting", agent=record.name)
                await asyncio.sleep(delay)  # a retry backoff, not synchronisation
                delay = min(delay * 2, 1.0)
        self.own = replace(record, incarnation=resp.incarnation)
        self.lease_ms = resp.lease_ms or self.lease_ms
        self.registrations += 1
        log.info(
            "kv_agent_registered", agent=record.name, incarnation=resp.incarnation, lease_ms=self.lease_ms
        )
        return self.own

    async def heartbeat_once(self) -> None:
        """Renew the lease; re-register when the service no longer knows us."""
        if self.own is None:
            raise RuntimeError("register() before heartbeats")
        try:
            resp = await self._stub.Heartbeat(
                kvtransfer_pb2.HeartbeatRequest(
                    name=self.own.name, incarnation=self.own.incarnation, owner_secret=self.owner_secret
                ),
                timeout=self.rpc_timeout_s,
            )
            self.lease_ms = resp.lease_ms or self.lease_ms
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning("kv_agent_lease_lost_reregistering", agent=self.own.name)
            await self.register(replace(self.own, incarnation=0))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000.0)  # a periodic timer, not synchronisation
            try:
                await self.heartbeat_once()
            except grpc.aio.AioRpcError as e:  # service down: keep trying, the lease may survive
                log.warning("kv_agent_heartbeat_failed", code=e.code().name, details=e.details())

    def start_heartbeats(self) -> asyncio.Task[None]:
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(), name="kv-heartbeat"
            )
        return self._heartbeat

    async def deregister(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self.own is not None:
            try:
                await self._stub.DeregisterAgent(
                    kvtransfer_pb2.DeregisterAgentRequest(
                        name=self.own.name,
                        incarnation=self.own.incarnation,
                        owner_secret=self.owner_secret,
                    ),
                    timeout=self.rpc_timeout_s,
                )
            except grpc.aio.AioRpcError as e:  # shutting down: the lease expiry cleans up
                log.warning("kv_agent_deregister_failed", code=e.code().name)
            self.own = None

    # -- peers -------------------------------------------------------------------
    async def get(self, name: str, *, refresh: bool = False) -> AgentRecord:
        """A peer's record; KvTransferFailed(UNKNOWN_AGENT) when the service does not know it."""
        cached = self._cache.get(name)
        if cached is not None and not refresh and self._clock() - cached[1] < self.max_age_s:
            return cached[0]
        try:
            resp = await self._stub.GetAgent(
                kvtransfer_pb2.GetAgentRequest(name=name), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self._cache.pop(name, None)
                raise KvTransferFailed(
                    FailureKind.UNKNOWN_AGENT, f"KV agent {name!r} is not registered"
                ) from e
            if cached is not None:  # service unreachable: the last known record beats none
                log.warning("kv_directory_unreachable_using_cache", agent=name, code=e.code().name)
                return cached[0]
            raise KvTransferFailed(
                FailureKind.TRANSPORT, f"cannot look up KV agent {name!r}: {e.code().name}: {e.details()}"
            ) from e
        try:
            record = AgentRecord.from_proto(resp.agent)
        except ValueError as e:
            raise KvTransferFailed(FailureKind.LAYOUT_MISMATCH, f"KV agent {name!r}: {e}") from e
        self._cache[name] = (record, self._clock())
        return record

    def invalidate(self, name: str) -> None:
        self._cache.pop(name, None)

    async def is_alive(self, agent_name: str) -> bool | None:
        try:
            await self.get(agent_name, refresh=True)
            return True
        except KvTransferFailed as e:
            return False if e.kind == FailureKind.UNKNOWN_AGENT else None
