"""The puller's side of a prefix pull (issue 17 item 3): a cached prefix taken from another worker.

The router sends a `PrefixPullHint` when another worker (the holder) has a
longer cached prefix of the prompt than this one and pulling it is predicted
faster than recomputing it. On the local path the decode worker then:

    lease the prefix on the holder (PrefixSourceService.LeasePrefix: the holder
    hashes the tokens itself, pins its cached blocks, returns a KvHandle with
    per-block digests)
      -> reserve the prefix's blocks here (this worker's own cached part reused)
      -> pull the blocks we lack over the KV transport (NIXL READ / gRPC
         ReadBlocks; the transport verifies the holder's digests before
         returning, and releases the lease on completion)
      -> engine.generate_with_prefix: the pulled blocks join the prefix cache
         and the request prefills only the uncached remainder.

The same transport and lease path as a prefill handoff (remote_prefill.py).
Every failure (holder unreachable or dead mid-pull, no longer cached, digest
mismatch, lease expired, layout or model mismatch, out of blocks, the pull's
time bound) is a `PrefixPullFailed` raised only after this worker's
reservation is freed and the holder has been asked to release its lease; the
caller then prefills locally as if no hint had come, within the same deadline.

This worker checks the router's prediction against its own measurements too:
with a measured link bandwidth, a pull predicted slower than recomputing the
tokens here (at the measured local prefill rate) is skipped.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter

from kvtransfer.errors import KvTransferFailed
from kvtransfer.transport import BlockHandle, KvTransport
from pdmesh.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.channels import ChannelCache
from services.common.config import require, setting
from services.common.wait_estimator import PathRates
from services.engine.api import (
    EngineCapacityError,
    EngineRequest,
    PrefixCacheEngine,
    RequestOutput,
    SamplingParams,
)

log = structlog.get_logger()


@dataclass(frozen=True)
class PullerConfig:
    prefix_pull: bool = setting(
        True, "follow the router's prefix-pull hints (pull a cached prefix from a peer)"
    )
    prefix_pull_timeout_s: float = setting(2.0, "longest a prefix pull (lease + transfer) may take")
    prefix_pull_lease_ms: int = setting(5_000, "lease asked of the holder on its prefix blocks")

    def __post_init__(self) -> None:
        require(self.prefix_pull_timeout_s > 0, "prefix_pull_timeout_s must be > 0")
        require(self.prefix_pull_lease_ms >= 100, "prefix_pull_lease_ms must be >= 100")


@dataclass(frozen=True)
class PullHint:
    """PrefixPullHint, converted (validated by the servicer)."""

    worker_id: str
    address: str
    kv_agent_name: str
    blocks: int


class PrefixPullFailed(Exception):
    """The pull failed at `stage`; nothing of it is held here."""

    def __init__(self, stage: str, reason: str, message: str):
        super().__init__(f"prefix pull failed at {stage} ({reason}): {message}")
        self.stage = stage
        self.reason = reason


@dataclass(frozen=True)
class PulledPrefix:
    prefix_request_id: str  # the reservation holding the prefix (for generate_with_prefix)
    prefix_tokens: int  # tokens the prefix covers (this worker's cached part included)
    pulled_tokens: int  # of them, tokens whose KV came over the wire
    nbytes: int
    seconds: float


class PrefixPullMetrics:
    def __init__(self, registry: CollectorRegistry):
        self._pulls = Counter(
            "pdmesh_prefix_pulls",
            "prefix-pull hints by outcome (ok: pulled; fallback: failed, prefilled locally; "
            "skipped: not worth it here, or nothing new to pull)",
            ["outcome"],
            registry=registry,
        )
        self._saved = Counter(
            "pdmesh_prefix_pull_tokens_saved",
            "prompt tokens pulled from a peer's prefix cache instead of recomputed",
            registry=registry,
        )
        self.counts = {"ok": 0, "fallback": 0, "skipped": 0}
        self.tokens_saved = 0

    def outcome(self, outcome: str, tokens_saved: int = 0) -> None:
        self._pulls.labels(outcome).inc()
        self.counts[outcome] += 1
        if tokens_saved:
            self._saved.inc(tokens_saved)
            self.tokens_saved += tokens_saved


class PrefixPuller:
    def __init__(
        self,
        engine: PrefixCacheEngine,
        transport: KvTransport,
        channels: ChannelCache,
        worker_id: str,
        metrics: PrefixPullMetrics,
        config: PullerConfig | None = None,
    ):
        self.engine = engine
        self.transport = transport
        self.channels = channels
        self.worker_id = worker_id
        self.metrics = metrics
        self.config = config or PullerConfig()
        self._release_tasks: set[asyncio.Task[None]] = set()

    async def generate(
        self, req: EngineRequest, hint: PullHint, deadline: float, rates: PathRates | None = None
    ) -> tuple[AsyncIterator[RequestOutput], int]:
        """The local path's engine stream, after pulling the hinted prefix when that
        works; (stream, tokens pulled). Never raises for a failed pull: it falls back.
        `rates`: the worker's measurements (checked against the hint, fed the pull)."""
        bound = min(deadline, time.monotonic() + self.config.prefix_pull_timeout_s)
        try:
            pulled = await self.pull(req, hint, bound, rates)
        except PrefixPullFailed as e:
            self.metrics.outcome("skipped" if e.stage == "skip" else "fallback")
            log.info(
                "prefix_pull_skipped" if e.stage == "skip" else "prefix_pull_failed",
                request_id=req.request_id,
                holder=hint.worker_id,
                stage=e.stage,
                reason=e.reason,
                error=str(e),
            )
            return self.engine.generate(req), 0
        try:
            outputs = self.engine.generate_with_prefix(req, pulled.prefix_request_id)
        except BaseException:
            self.engine.cancel_external(pulled.prefix_request_id)
            raise
        self.metrics.outcome("ok", pulled.pulled_tokens)
        if rates is not None:
            rates.pulled(pulled.nbytes, pulled.seconds, pulled.pulled_tokens)
        return outputs, pulled.pulled_tokens

    async def pull(
        self, req: EngineRequest, hint: PullHint, deadline: float, rates: PathRates | None = None
    ) -> PulledPrefix:
        """Lease, reserve and pull; the reservation returned holds the prefix. Raises
        PrefixPullFailed (stage "skip" when there was nothing worth pulling)."""
        context = [*req.prompt_token_ids, *req.resume_token_ids]
        bs = self.engine.info.block_size
        blocks = min(hint.blocks, len(context) // bs)
        local = self.engine.prefix_lookup(context) // bs
        if blocks <= local:
            raise PrefixPullFailed("skip", "cached_here", f"{local} of {blocks} blocks are cached here")
        if rates is not None:
            _check_worth_it(rates, (blocks - local) * bs)
        stub = kvtransfer_pb2_grpc.PrefixSourceServiceStub(self.channels.get(hint.address))
        t0 = time.monotonic()
        handle = await self._lease(stub, req, context[: blocks * bs], blocks, hint, deadline)
        prefix_rid = f"{req.request_id}/prefix"
        reserved = pulled = False
        try:
            n = len(handle.block_ids)
            try:
                res = await self.engine.reserve_external(
                    EngineRequest(prefix_rid, context[: n * bs], SamplingParams(max_tokens=1))
                )
            except EngineCapacityError as e:
                raise PrefixPullFailed("reserve", "capacity", str(e)) from e
            reserved = True
            first = res.first_transfer_block
            if first >= n:
                raise PrefixPullFailed("skip", "cached_here", "the holder's blocks are cached here now")
            try:
                stats = await self.transport.pull(
                    handle,
                    handle.block_ids[first:n],
                    res.block_ids[first:n],
                    deadline_s=deadline - time.monotonic(),
                    on_failure=lambda: self.engine.cancel_external(prefix_rid),
                )
            except KvTransferFailed as e:
                reserved = False  # pull() freed the reservation (on_failure) before raising
                raise PrefixPullFailed("transfer", e.kind.value, str(e)) from e
            pulled = True  # the transport's completion released the holder's lease
            log.info(
                "prefix_pulled",
                request_id=req.request_id,
                holder=hint.worker_id,
                blocks=n - first,
                kv_bytes=stats.bytes,
                pull_ms=round((time.monotonic() - t0) * 1000, 1),
            )
            return PulledPrefix(prefix_rid, n * bs, (n - first) * bs, stats.bytes, stats.seconds)
        finally:
            if not pulled:  # failed or cancelled: nothing of it stays here or there
                if reserved:
                    self.engine.cancel_external(prefix_rid)
                self._release(stub, handle.handle_id)

    async def _lease(
        self,
        stub: kvtransfer_pb2_grpc.PrefixSourceServiceStub,
        req: EngineRequest,
        tokens: list[int],
        blocks: int,
        hint: PullHint,
        deadline: float,
    ) -> BlockHandle:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PrefixPullFailed("lease", "timeout", "no time left for a prefix pull")
        msg = kvtransfer_pb2.LeasePrefixRequest(
            request_id=req.request_id,
            prompt_token_ids=tokens,
            max_blocks=blocks,
            requester_id=self.worker_id,
            requester_agent=self.transport.agent_name,
            lease_ms=self.config.prefix_pull_lease_ms,
        )
        try:
            resp = await stub.LeasePrefix(msg, timeout=remaining)
        except grpc.aio.AioRpcError as e:
            reason = "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name.lower()
            raise PrefixPullFailed("lease", reason, e.details() or e.code().name) from e
        try:
            handle = BlockHandle.from_proto(resp.handle)
        except KvTransferFailed as e:
            self._release(stub, resp.handle.handle_id)
            raise PrefixPullFailed("handle", e.kind.value, str(e)) from e
        problems = []
        bs = self.engine.info.block_size
        if resp.handle.model_id != self.engine.info.model_id:
            problems.append(f"model {resp.handle.model_id!r} != {self.engine.info.model_id!r}")
        if handle.issued_to != self.worker_id:
            problems.append(f"issued to {handle.issued_to!r}")
        if hint.kv_agent_name and handle.agent_name != hint.kv_agent_name:
            # The registry binds an agent name to its owner; the router knows the holder's.
            problems.append(f"agent {handle.agent_name!r} is not the holder's {hint.kv_agent_name!r}")
        n = len(handle.block_ids)
        if not 0 < n <= blocks or handle.num_tokens != n * bs:
            problems.append(f"{n} blocks covering {handle.num_tokens} tokens (asked for <= {blocks} blocks)")
        if problems:
            self._release(stub, handle.handle_id)
            raise PrefixPullFailed("handle", "invalid", "; ".join(problems))
        return handle

    def _release(self, stub: kvtransfer_pb2_grpc.PrefixSourceServiceStub, handle_id: str) -> None:
        """Ask the holder to end the lease now; best effort (it expires anyway)."""
        if not handle_id:
            return

        async def release() -> None:
            try:
                await stub.ReleasePrefix(kvtransfer_pb2.ReleasePrefixRequest(handle_id=handle_id), timeout=2)
            except grpc.aio.AioRpcError as e:
                log.info("prefix_release_failed", handle_id=handle_id, code=e.code().name)

        task = asyncio.ensure_future(release())
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)


def _check_worth_it(rates: PathRates, tokens: int) -> None:
    """This worker's own measurements against the router's prediction."""
    r = rates.snapshot()
    if not math.isfinite(r.link_bytes_per_s) or r.kv_bytes_per_token <= 0:
        # Fewer than LINK_MIN_SAMPLES transfers measured: trust the router. One is not enough:
        # the first pull from a peer pays its connection's setup (55-70 ms against ~5 on NIXL
        # here), and a worker that took that for its link skipped every later pull and never
        # measured another.
        return
    pull_s = r.link_latency_s + tokens * r.kv_bytes_per_token / r.link_bytes_per_s
    recompute_s = tokens / r.local_tokens_per_s
    if pull_s >= recompute_s:
        raise PrefixPullFailed(
            "skip", "slower", f"pull {pull_s * 1000:.1f} ms >= recompute {recompute_s * 1000:.1f} ms here"
        )
