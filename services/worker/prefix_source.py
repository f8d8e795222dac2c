"""PrefixSourceService: a worker's cached prefix blocks, leased to a peer that pulls them (issue 17).

Any worker role can mount it (the decode worker does, services/decode/main.py).
`LeasePrefix` hashes the caller's tokens here (the caller never names blocks or
hashes), pins the leading blocks this engine has cached for them
(`hold_prefix`: a HELD request made only of cache hits, nothing computed),
computes a digest of every held block from the bytes in the pool, and issues a
lease on them to the requester, exactly as the prefill worker does for a
prefill handoff (services/prefill/servicer.py): the same `LeaseManager`, the
same `KvHandle` with per-block digests, the same transports (the NIXL holder's
notification loop releases a lease on the puller's completion notice; the gRPC
`KvSourceServicer` on this port streams the bytes and releases after the last
chunk). The lease ends, and the blocks go back to the free queue (still
cached), on the first of: release (notification, full read, ReleasePrefix), its
TTL (`LeaseKeeper`), the requester's agent known dead, the holder's shutdown.

What a peer may pin is bounded before anything is held (`PrefixLeaseBudget`):
the lease length is clamped, a requester agent is required (so the lease ends
with it), one requester holds at most `max_requester_held_share` of the pool
and all together `max_held_share`; past that, RESOURCE_EXHAUSTED with a retry
hint. With per-worker certificates `requester_id` must be the caller's worker.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from kvtransfer import digest
from kvtransfer.errors import StaleHandle
from kvtransfer.grpc_transport import KvSourceServicer, add_kv_source
from kvtransfer.leases import LeaseKeeper, LeaseManager
from kvtransfer.pool import PoolView
from kvtransfer.transport import BlockHandle, KvTransport
from pdmesh.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.config import require, setting
from services.common.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    grpc_errors,
)
from services.common.tls import certified_worker
from services.common.validation import RequestLimits, check_ident
from services.engine.api import Engine, EngineRequest, PrefixCacheEngine, SamplingParams

log = structlog.get_logger()

MIN_RETRY_S = 0.05


@dataclass(frozen=True)
class PrefixSourceConfig:
    # A pull takes milliseconds; a short lease bounds what a puller that vanished pins.
    prefix_lease_ttl_s: float = setting(5.0, "default lease on cached prefix blocks leased to a puller")
    prefix_lease_check_s: float = setting(0.25, "how often expired prefix leases are freed")
    prefix_max_lease_ms: int = setting(
        30_000, "longest lease on leased prefix blocks (longer asks are clamped)"
    )
    prefix_max_requester_share: float = setting(
        0.25, "share of the KV pool one puller may hold under prefix leases at once"
    )
    prefix_max_held_share: float = setting(
        0.5, "refuse new prefix leases (RESOURCE_EXHAUSTED) while they hold this share of the pool"
    )

    def __post_init__(self) -> None:
        require(self.prefix_lease_ttl_s > 0, "prefix_lease_ttl_s must be > 0")
        require(self.prefix_lease_check_s > 0, "prefix_lease_check_s must be > 0")
        require(
            self.prefix_lease_ttl_s * 1000 <= self.prefix_max_lease_ms,
            "prefix_lease_ttl_s must not exceed prefix_max_lease_ms",
        )
        require(0 < self.prefix_max_requester_share <= 1, "prefix_max_requester_share must be in (0, 1]")
        require(0 < self.prefix_max_held_share <= 1, "prefix_max_held_share must be in (0, 1]")


class PrefixLeaseBudget:
    """What peers may pin under prefix leases (counted from admission, so concurrent
    calls see each other's blocks before any is leased). Plain and synchronous."""

    def __init__(
        self,
        config: PrefixSourceConfig,
        leases: LeaseManager,
        pool_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.leases = leases
        self.pool_blocks = pool_blocks
        self._clock = clock
        self._pending: dict[str, int] = {}
        self.shed = 0

    def lease_ttl_s(self, asked_ms: int) -> float:
        if asked_ms <= 0:
            return self.config.prefix_lease_ttl_s
        return min(asked_ms, self.config.prefix_max_lease_ms) / 1000.0

    def admit(self, requester: str, blocks: int) -> None:
        """Count `blocks` for `requester` until `done`, or raise ResourceExhausted."""
        held = self.leases.held_blocks + sum(self._pending.values())
        mine = self.leases.held_blocks_of(requester) + self._pending.get(requester, 0)
        if held + blocks > self.config.prefix_max_held_share * self.pool_blocks:
            why = f"prefix leases hold {held} of {self.pool_blocks} KV blocks"
        elif mine + blocks > self.config.prefix_max_requester_share * self.pool_blocks:
            why = f"requester {requester!r} holds {mine} of {self.pool_blocks} KV blocks under prefix leases"
        else:
            self._pending[requester] = self._pending.get(requester, 0) + blocks
            return
        self.shed += 1
        nxt = self.leases.next_expiry()
        retry = MIN_RETRY_S if nxt is None else max(MIN_RETRY_S, nxt - self._clock())
        raise ResourceExhausted(f"{why}; {blocks} more would pass the limit", retry_after_s=retry)

    def done(self, requester: str, blocks: int) -> None:
        left = self._pending.get(requester, 0) - blocks
        if left > 0:
            self._pending[requester] = left
        else:
            self._pending.pop(requester, None)


class PrefixSourceServicer(kvtransfer_pb2_grpc.PrefixSourceServiceServicer):
    def __init__(
        self,
        engine: PrefixCacheEngine,
        leases: LeaseManager,
        limits: RequestLimits,
        *,
        agent_name: str,
        kv_source_address: str,
        config: PrefixSourceConfig | None = None,
    ):
        self.engine = engine
        self.leases = leases
        self.limits = limits
        self.agent_name = agent_name
        self.kv_source_address = kv_source_address
        self.config = config or PrefixSourceConfig()
        self.budget = PrefixLeaseBudget(self.config, leases, engine.info.num_blocks)
        self._ids = itertools.count()
        self._hasher: digest.BlockHasher | None = None
        self.served = 0  # leases issued

    @grpc_errors
    async def LeasePrefix(
        self, request: kvtransfer_pb2.LeasePrefixRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.LeasePrefixResponse:
        tokens = self._validate(request)
        certified = certified_worker(context)
        if certified and certified != request.requester_id:
            raise PermissionDenied(f"requester_id: the client certificate is for worker {certified!r}")
        bs = self.engine.info.block_size
        blocks = len(tokens) // bs
        if request.max_blocks:
            blocks = min(blocks, request.max_blocks)
        if blocks == 0:
            raise InvalidArgument(f"prompt_token_ids: fewer than one block ({bs} tokens) to lease")
        requester = request.requester_id
        self.budget.admit(requester, blocks)
        try:
            return await self._lease(request, tokens[: blocks * bs])
        finally:
            self.budget.done(requester, blocks)  # by now a lease (if any) counts the blocks

    async def _lease(
        self, request: kvtransfer_pb2.LeasePrefixRequest, tokens: list[int]
    ) -> kvtransfer_pb2.LeasePrefixResponse:
        rid = f"prefix:{request.request_id}#{next(self._ids)}"
        held = await self.engine.hold_prefix(EngineRequest(rid, tokens, SamplingParams(max_tokens=1)))
        if held is None:
            raise NotFound("no leading block of these tokens is cached here")
        try:
            digests = await self._digests(held.block_ids)
            lease = self.leases.issue(
                rid,
                held.block_ids,
                issued_to=request.requester_id,
                requester_agent=request.requester_agent,
                ttl_s=self.budget.lease_ttl_s(request.lease_ms),
                on_free=lambda: self.engine.release(rid),
            )
        except BaseException:
            self.engine.release(rid)
            raise
        self.served += 1
        handle = BlockHandle(
            handle_id=rid,
            agent_name=self.agent_name,
            layout=held.layout,
            block_ids=held.block_ids,
            num_tokens=held.num_tokens,
            kv_source_address=self.kv_source_address,
            issued_to=request.requester_id,
            lease_expires_unix_ms=lease.expires_unix_ms,
            block_digests=digests,
            digest_algorithm=digest.ALGORITHM,
        )
        log.info(
            "prefix_leased",
            request_id=request.request_id,
            handle_id=rid,
            blocks=len(held.block_ids),
            requester=request.requester_id,
        )
        return kvtransfer_pb2.LeasePrefixResponse(handle=handle.to_proto(model_id=self.engine.info.model_id))

    async def _digests(self, block_ids: tuple[int, ...]) -> bytes:
        if self._hasher is None:
            pool, layout = self.engine.kv_pool(), self.engine.info.layout
            assert pool is not None and layout is not None, "a held prefix needs the engine's KV pool"
            self._hasher = digest.BlockHasher(PoolView(pool, layout))
        return await self._hasher.digest_blocks_async(block_ids)

    def _validate(self, r: kvtransfer_pb2.LeasePrefixRequest) -> list[int]:
        info = self.engine.info
        check_ident(r.request_id, "request_id", self.limits.max_request_id_bytes, required=True)
        check_ident(r.requester_id, "requester_id", 256, required=True)
        check_ident(r.requester_agent, "requester_agent", 256, required=True)
        n = len(r.prompt_token_ids)
        if not 0 < n < info.max_model_len:
            raise InvalidArgument(f"prompt_token_ids: {n} tokens, need 1..{info.max_model_len - 1}")
        tokens = list(r.prompt_token_ids)
        if max(tokens) >= info.vocab_size:
            raise InvalidArgument(f"prompt_token_ids: token id {max(tokens)} not in [0, {info.vocab_size})")
        return tokens

    @grpc_errors
    async def ReleasePrefix(
        self, request: kvtransfer_pb2.ReleasePrefixRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.ReleasePrefixResponse:
        check_ident(request.handle_id, "handle_id", 256, required=True)
        certified = certified_worker(context)  # per-worker certificates: only the owner
        if certified:
            with contextlib.suppress(StaleHandle):
                self.leases.get(request.handle_id, certified)  # NotOwner: PERMISSION_DENIED
        return kvtransfer_pb2.ReleasePrefixResponse(released=self.leases.release(request.handle_id))


class PrefixSource:
    """Everything a worker mounts to serve its cached prefixes: the lease manager and
    its keeper, the gRPC byte source, the transport's completion notices, the servicer."""

    def __init__(
        self,
        server: grpc.aio.Server,
        engine: Engine,
        transport: KvTransport | None,
        limits: RequestLimits,
        *,
        address: str,
        liveness=None,
        config: PrefixSourceConfig | None = None,
        mount_kv_source: bool = True,
    ):
        """`liveness`: the AgentDirectory (a requester agent known dead ends its leases).
        `mount_kv_source=False` when the server serves KvSourceService already."""
        if not isinstance(engine, PrefixCacheEngine):
            raise TypeError(f"the {engine.info.backend} engine cannot lease cached prefixes")
        self.config = config or PrefixSourceConfig()
        self.leases = LeaseManager(default_ttl_s=self.config.prefix_lease_ttl_s)
        self.keeper = LeaseKeeper(self.leases, liveness, interval_s=self.config.prefix_lease_check_s)
        if transport is not None:
            transport.attach_source(self.leases)
        pool, layout = engine.kv_pool(), engine.info.layout
        if mount_kv_source and pool is not None and layout is not None:
            add_kv_source(
                server, KvSourceServicer(PoolView(pool, layout), self.leases, caller_worker=certified_worker)
            )
        self.servicer = PrefixSourceServicer(
            engine,
            self.leases,
            limits,
            agent_name=transport.agent_name if transport is not None else "",
            kv_source_address=address,
            config=self.config,
        )
        kvtransfer_pb2_grpc.add_PrefixSourceServiceServicer_to_server(self.servicer, server)

    def start(self) -> None:
        self.keeper.start()

    async def stop(self) -> None:
        await self.keeper.stop()
        self.leases.close()
