"""PrefillService: context-only prefill with the KV held under a lease.

Prefill validates (INVALID_ARGUMENT before anything is allocated), runs the
prompt on the engine as a prefill-only request (it joins the engine's running
batch like any other: continuous batching across concurrent prefills), then
issues a lease on the held blocks to the requesting decode worker and returns
the handle. The lease frees the blocks (engine.release) when the decode
worker has pulled them, releases them, when the lease expires, or when the
requester's agent is known dead. Cancelling the call before it returns frees
everything. What callers may pin is bounded before anything runs (`LeaseBudget`:
lease length clamped, a requester agent required so the lease ends with it, a
share of the pool per requester, new calls shed while the pool is held). Each
handle carries a digest of every held block (`kvtransfer.digest`), computed
here from the bytes this worker holds, which the receiver checks before it
uses or caches the blocks. An engine that moves KV itself (trtllm) returns `engine_state`
instead of held blocks: the handle then carries that state and no lease.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable

import grpc
import structlog

from kvtransfer import digest
from kvtransfer.errors import StaleHandle
from kvtransfer.layout import KvLayout
from kvtransfer.leases import LeaseManager
from kvtransfer.pool import PoolView
from kvtransfer.transport import BlockHandle
from pdmesh.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc, worker_pb2
from services.common import tracing
from services.common.errors import InvalidArgument, PermissionDenied, ResourceExhausted, grpc_errors
from services.common.tls import certified_worker
from services.common.validation import (
    RequestLimits,
    check_ident,
    check_priority,
    check_prompt,
)
from services.common.wait_estimator import WaitEstimator
from services.engine.api import Engine, EngineRequest, PrefillResult
from services.model.sampling import FINISH_TO_PROTO, check_sampling
from services.prefill.config import PrefillConfig
from services.prefill.lease_budget import LeaseBudget
from services.prefill.metrics import PrefillMetrics
from services.worker.health import HealthWatch
from services.worker.serving import counters_from_stats, kv_event_stream, load_from_stats
from services.worker.wire_kv import WireStage

log = structlog.get_logger()


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(
        self,
        engine: Engine,
        leases: LeaseManager,
        metrics: PrefillMetrics,
        limits: RequestLimits,
        worker_info: common_pb2.WorkerInfo,
        kv_source_address: str,
        agent_name: str,
        config: PrefillConfig | None = None,
        health: HealthWatch | None = None,
        wire: WireStage | None = None,
    ):
        self.engine = engine
        self.health = health  # the forward-progress verdict Stats and heartbeats carry
        self.leases = leases
        self.metrics = metrics
        self.limits = limits
        self.info = worker_info
        self.kv_source_address = kv_source_address
        self.agent_name = agent_name
        self.waits = WaitEstimator()
        self._ids = itertools.count()
        self.config = config or PrefillConfig()
        self.budget = LeaseBudget(self.config, leases, engine.info.num_blocks)
        self._hasher: digest.BlockHasher | None = None  # made on first use (over the engine's pool)
        # --kv-wire-quant: handles point at quantized copies in this staging pool (wire_kv.py)
        self.wire = wire

    @grpc_errors
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        req = self._validate(request)
        certified = certified_worker(context)
        if certified and certified != request.requester_id:
            raise PermissionDenied(f"requester_id: the client certificate is for worker {certified!r}")
        leases_kv = not self.engine.info.capabilities.moves_kv_itself
        if leases_kv:
            check_ident(request.requester_agent, "requester_agent", 256, required=True)
        context_len = len(req.prompt_token_ids) + len(req.resume_token_ids)
        admission = None
        if leases_kv:
            try:
                admission = self.budget.admit(
                    request.requester_id, -(-context_len // self.engine.info.block_size)
                )
            except ResourceExhausted:
                self.metrics.finished("shed")  # pdmesh_prefill_requests{outcome="shed"}
                raise
        try:
            return await self._prefill(req, request)
        finally:
            if admission is not None:  # by now a lease (if any) counts the blocks
                admission.done()

    async def _prefill(
        self, req: EngineRequest, request: prefill_pb2.PrefillRequest
    ) -> prefill_pb2.PrefillResponse:
        started = time.monotonic()
        try:
            result = await self.engine.prefill(req)  # cancelling this frees the blocks
        except BaseException:
            self.metrics.finished("failed")
            raise
        self.metrics.prefilled(
            time.monotonic() - started, result.computed_tokens, result.cached_prefix_tokens
        )
        tracing.annotate(
            request_id=request.request_id,
            requester=request.requester_id,
            cached=result.cached_prefix_tokens,
            computed=result.computed_tokens,
        )
        resp = prefill_pb2.PrefillResponse(
            first_token_id=result.first_token_id,
            cached_prefix_tokens=result.cached_prefix_tokens,
            computed_tokens=result.computed_tokens,
            finished=result.finished,
            finish_reason=FINISH_TO_PROTO[result.finish_reason],
        )
        if result.finished:
            return resp
        if result.engine_state is not None:  # the engine moves the KV itself (trtllm)
            resp.handle.CopyFrom(self._engine_handle(req, request, result.engine_state))
            log.info(
                "prefilled",
                request_id=request.request_id,
                handle_id=resp.handle.handle_id,
                backend=result.engine_state.get("backend"),
                cached=result.cached_prefix_tokens,
                computed=result.computed_tokens,
                requester=request.requester_id,
            )
            return resp
        if result.held is None:
            return resp
        if self.wire is not None:
            resp.handle.CopyFrom(await self._wire_lease(req, request, result))
        else:
            try:
                digests = await self._digests(result.held.block_ids)
                resp.handle.CopyFrom(self._lease(req, request, result, digests))
            except BaseException:
                self.engine.release(req.request_id)
                raise
        log.info(
            "prefilled",
            request_id=request.request_id,
            handle_id=resp.handle.handle_id,
            blocks=len(result.held.block_ids),
            cached=result.cached_prefix_tokens,
            computed=result.computed_tokens,
            requester=request.requester_id,
        )
        return resp

    async def _digests(self, block_ids: tuple[int, ...]) -> bytes:
        """The holder's digests of the held blocks, from the bytes in our pool."""
        if self._hasher is None:
            pool, layout = self.engine.kv_pool(), self.engine.info.layout
            assert pool is not None and layout is not None, "a held result needs the engine's KV pool"
            self._hasher = digest.BlockHasher(PoolView(pool, layout))
        return await self._hasher.digest_blocks_async(block_ids)

    async def _wire_lease(
        self, req: EngineRequest, request: prefill_pb2.PrefillRequest, result: PrefillResult
    ) -> common_pb2.KvHandle:
        """Quantize the held blocks into staging blocks, free the engine's (they stay cached),
        and lease the staging blocks: the handle carries the wire layout and the wire bytes' digests."""
        wire = self.wire
        held = result.held
        assert wire is not None and held is not None
        try:
            staged = await wire.stage(self.engine, held.block_ids)
        finally:
            self.engine.release(req.request_id)
        try:
            if self._hasher is None:
                self._hasher = digest.BlockHasher(wire.view)
            digests = await self._hasher.digest_blocks_async(staged)
            return self._lease(
                req,
                request,
                result,
                digests,
                block_ids=tuple(staged),
                layout=wire.layout,
                on_free=lambda ids=staged: wire.free(ids),
            )
        except BaseException:
            wire.free(staged)
            raise

    def _lease(
        self,
        req: EngineRequest,
        request: prefill_pb2.PrefillRequest,
        result: PrefillResult,
        digests: bytes,
        block_ids: tuple[int, ...] | None = None,
        layout: KvLayout | None = None,
        on_free: Callable[[], object] | None = None,
    ) -> common_pb2.KvHandle:
        """Lease the held blocks (or, with the wire stage, `block_ids` in `layout`, freed by `on_free`)."""
        held = result.held
        assert held is not None
        ttl_s = self.budget.lease_ttl_s(request.lease_ms)
        block_ids = held.block_ids if block_ids is None else block_ids
        lease = self.leases.issue(
            req.request_id,
            block_ids,
            issued_to=request.requester_id,
            requester_agent=request.requester_agent,
            ttl_s=ttl_s,
            on_free=on_free or (lambda rid=req.request_id: self.engine.release(rid)),
        )
        handle = BlockHandle(
            handle_id=req.request_id,
            agent_name=self.agent_name,
            layout=layout or held.layout,
            block_ids=block_ids,
            num_tokens=held.num_tokens,
            kv_source_address=self.kv_source_address,
            issued_to=request.requester_id,
            lease_expires_unix_ms=lease.expires_unix_ms,
            block_digests=digests,
            digest_algorithm=digest.ALGORITHM,
        )
        return handle.to_proto(model_id=self.engine.info.model_id)

    def _engine_handle(
        self, req: EngineRequest, request: prefill_pb2.PrefillRequest, state: dict
    ) -> common_pb2.KvHandle:
        """A handle whose payload is the engine's own transfer state. No lease: the
        engine keeps the KV until the requester's engine pulls it or its own transfer
        timeout passes (lease_expires_unix_ms = 0, engine-managed), so Release is a no-op."""
        return common_pb2.KvHandle(
            handle_id=req.request_id,
            issued_to=request.requester_id,
            model_id=self.engine.info.model_id,
            num_tokens=len(req.prompt_token_ids) + len(req.resume_token_ids),
            engine_state=common_pb2.EngineState(**state),
        )

    def _validate(self, r: prefill_pb2.PrefillRequest) -> EngineRequest:
        info = self.engine.info
        check_ident(r.request_id, "request_id", self.limits.max_request_id_bytes, required=True)
        check_ident(r.requester_id, "requester_id", 256, required=True)
        check_ident(r.tenant, "tenant", self.limits.max_tenant_bytes)
        check_priority(r.priority, self.limits)
        sampling = check_sampling(
            r.sampling if r.HasField("sampling") else None, self.limits, info.vocab_size, assign_seed=False
        )
        ids = list(r.prompt_token_ids)
        check_prompt(ids, 1, info.vocab_size, info.max_model_len, self.limits)
        pos = r.output_position
        if pos >= len(ids) or pos >= sampling.max_tokens:
            raise InvalidArgument(
                f"output_position: {pos} must be < the prompt length ({len(ids)}) and max_tokens "
                f"({sampling.max_tokens})"
            )
        if sampling.temperature > 0 and sampling.seed is None:
            raise InvalidArgument("sampling.seed: sampled prefill needs the seed the decode worker uses")
        cut = len(ids) - pos
        return EngineRequest(
            request_id=f"{r.request_id}#{next(self._ids)}",
            prompt_token_ids=tuple(ids[:cut]),
            resume_token_ids=tuple(ids[cut:]),
            sampling=sampling,
            priority=r.priority,
        )

    @grpc_errors
    async def Release(self, request: prefill_pb2.ReleaseRequest, context) -> prefill_pb2.ReleaseResponse:
        check_ident(request.handle_id, "handle_id", 256, required=True)
        certified = certified_worker(context)  # mTLS with per-worker certificates: only the owner
        if certified:
            with contextlib.suppress(StaleHandle):  # unknown: released=False below
                self.leases.get(request.handle_id, certified)  # NotOwner: PERMISSION_DENIED
        return prefill_pb2.ReleaseResponse(released=self.leases.release(request.handle_id))

    async def SubscribeKvEvents(self, request: worker_pb2.SubscribeKvEventsRequest, context):
        async for msg in kv_event_stream(self.engine, self.info.worker_id, context):
            yield msg

    @grpc_errors
    async def Stats(self, request: worker_pb2.StatsRequest, context) -> worker_pb2.StatsResponse:
        s = self.engine.stats()
        c = self.leases.counters
        info = common_pb2.WorkerInfo()
        info.CopyFrom(self.info)
        info.free_blocks = s.free_blocks
        return worker_pb2.StatsResponse(
            info=info,
            load=self.load(),
            counters=counters_from_stats(s),
            cached_blocks=s.cached_blocks,
            leases=worker_pb2.LeaseCounters(
                held=c.held,
                held_blocks=c.held_blocks,
                issued=c.issued,
                pulled=c.pulled,
                released=c.released,
                expired=c.expired,
            ),
            requests_total=self.metrics.count("total"),
            requests_failed=self.metrics.count("failed"),
        )

    def load(self) -> common_pb2.WorkerLoad:
        s = self.engine.stats()
        self.waits.observe(s.prompt_tokens_computed, s.tokens_waiting)
        return load_from_stats(s, self.waits.wait_s(s.tokens_waiting) * 1000.0, self.health)
