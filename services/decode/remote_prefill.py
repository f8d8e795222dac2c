"""The remote prefill path of a decode worker: reserve, Prefill, pull, commit.

    reserve blocks here (reusing this worker's cached prefix)
      -> PrefillService.Prefill on the chosen prefill worker (KV held there under a lease)
      -> pull the blocks we lack with the KV transport (NIXL READ / gRPC stream)
      -> commit: the engine decodes on from the remotely sampled first token

An engine that moves KV itself (`capabilities.moves_kv_itself`, trtllm) skips
reserve and pull: Prefill returns the prefill engine's transfer state
(KvHandle.engine_state), this engine's `generate_from_state` fetches the KV, and
the path waits for its first output under the deadline, so a malformed state, a
failed transfer or a timeout still falls back to local prefill.

Every failure is a `RemotePrefillFailed` raised only after this worker's
reservation is freed and the holder has been asked to release its lease; the
caller then falls back to a local prefill. That includes a pull whose bytes
fail the holder's digests (reason "integrity"): the transport checks them
before `pull` returns, so unverified blocks are never committed to the
sequence nor offered to the prefix cache. Cancellation (client gone,
deadline) cleans up the same way and re-raises. The engine owns the blocks;
this module only sequences the calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog

from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.transport import BlockHandle, KvTransport, TransferStats
from pdmesh.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.common import tracing
from services.common.channels import ChannelCache
from services.decode.disagg_policy import Candidate
from services.engine.api import (
    Engine,
    EngineCapacityError,
    EngineError,
    EngineRequest,
    FinishReason,
    InvalidHandoffError,
    RequestOutput,
)
from services.model.sampling import sampling_to_proto
from services.worker.wire_kv import WireStage

log = structlog.get_logger()

_FINISH_FROM_PROTO = {
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


class RemotePrefillFailed(Exception):
    """The remote path failed at `stage`; nothing of this request is held here."""

    def __init__(self, stage: str, reason: str, message: str):
        super().__init__(f"remote prefill failed at {stage} ({reason}): {message}")
        self.stage = stage
        self.reason = reason


@dataclass
class RemoteResult:
    """What the remote path produced. `outputs` streams the tokens from the
    first one on (None when the first token already finished the request)."""

    prefill_worker_id: str
    first_token_id: int
    finished: bool
    finish_reason: FinishReason | None
    cached_prefix_tokens: int  # cached on the prefill worker
    local_cached_tokens: int  # cached here (not transferred)
    prefill_computed_tokens: int
    bytes_transferred: int
    transfer_seconds: float
    outputs: AsyncIterator[RequestOutput] | None


class RemotePrefill:
    def __init__(
        self,
        engine: Engine,
        transport: KvTransport | None,
        channels: ChannelCache,
        worker_id: str,
        lease_ms: int = 30_000,
        wire: WireStage | None = None,
    ):
        self.engine = engine
        self.transport = transport
        # --kv-wire-quant: pulls land in this staging pool and are dequantized into the
        # reserved blocks (wire_kv.py); the transport is published over it
        self.wire = wire
        self.channels = channels
        self.worker_id = worker_id
        self.lease_ms = lease_ms
        self._release_tasks: set[asyncio.Task[None]] = set()

    async def run(self, req: EngineRequest, candidate: Candidate, deadline: float) -> RemoteResult:
        """`deadline` is absolute on time.monotonic(); the whole path must fit in it."""
        if self.engine.info.capabilities.moves_kv_itself:
            return await self._run_engine_handoff(req, candidate, deadline)
        assert self.transport is not None, "an engine without its own KV transfer needs a transport"
        try:
            reservation = await self.engine.reserve_external(req)
        except EngineCapacityError as e:
            raise RemotePrefillFailed("reserve", "capacity", str(e)) from e
        committed = False
        handle_id = ""
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(candidate.address))
        t0 = time.monotonic()
        try:
            resp = await self._prefill(stub, req, candidate, deadline)
            t1 = time.monotonic()
            if resp.finished:
                return self._finished_early(candidate, resp)
            handle_id = resp.handle.handle_id
            handle = self._check_handle(resp, req, len(reservation.block_ids))
            n_blocks = len(reservation.block_ids)
            first = reservation.first_transfer_block
            nbytes, seconds = 0, 0.0
            if first < n_blocks:
                with tracing.span("kv.pull", transport=self.transport.kind, blocks=n_blocks - first) as span:
                    if self.wire is None:
                        stats = await self.transport.pull(
                            handle,
                            handle.block_ids[first:n_blocks],
                            reservation.block_ids[first:n_blocks],
                            deadline_s=deadline - time.monotonic(),
                            on_failure=lambda: self.engine.cancel_external(req.request_id),
                        )
                    else:
                        stats = await self._wire_pull(
                            req,
                            handle,
                            handle.block_ids[first:n_blocks],
                            reservation.block_ids[first:n_blocks],
                            deadline,
                        )
                    if span is not None:
                        span.set_attribute("pdmesh.kv_bytes", stats.bytes)
                nbytes, seconds = stats.bytes, stats.seconds
            else:
                self._release(stub, handle_id)  # everything was cached here already
            outputs = self.engine.generate_external(req.request_id, resp.first_token_id)
            committed = True
            log.info(
                "remote_prefill_done",
                request_id=req.request_id,
                prefill_worker=candidate.worker_id,
                prefill_ms=round((t1 - t0) * 1000, 1),
                pull_ms=round((time.monotonic() - t1) * 1000, 1),
                pulled_blocks=n_blocks - first,
                kv_bytes=nbytes,
            )
            return RemoteResult(
                prefill_worker_id=candidate.worker_id,
                first_token_id=resp.first_token_id,
                finished=False,
                finish_reason=None,
                cached_prefix_tokens=resp.cached_prefix_tokens,
                local_cached_tokens=reservation.num_cached_tokens,
                prefill_computed_tokens=resp.computed_tokens,
                bytes_transferred=nbytes,
                transfer_seconds=seconds,
                outputs=outputs,
            )
        except KvTransferFailed as e:
            # pull() has already freed our reservation (on_failure) before raising.
            committed = True
            if handle_id:
                self._release(stub, handle_id)
            raise RemotePrefillFailed("transfer", e.kind.value, str(e)) from e
        finally:
            if not committed:
                self.engine.cancel_external(req.request_id)
                if handle_id:
                    self._release(stub, handle_id)

    async def _wire_pull(
        self,
        req: EngineRequest,
        handle: BlockHandle,
        src: tuple[int, ...],
        dst: Sequence[int],
        deadline: float,
    ) -> TransferStats:
        """Pull the holder's quantized `src` blocks into staging blocks, then dequantize them
        into the reserved `dst`. Failures keep `pull`'s contract: the reservation is freed
        (KvTransferFailed) or, with no staging block free, left to run()'s cleanup."""
        wire, transport = self.wire, self.transport
        assert wire is not None and transport is not None
        try:
            staging = wire.alloc(len(src))
        except EngineCapacityError as e:
            raise RemotePrefillFailed("reserve", "capacity", str(e)) from e
        freed = False

        def on_failure() -> None:
            nonlocal freed
            freed = True
            wire.free(staging)
            self.engine.cancel_external(req.request_id)

        try:
            stats = await transport.pull(
                handle, src, staging, deadline_s=deadline - time.monotonic(), on_failure=on_failure
            )
        except KvTransferFailed:
            if not freed:
                # Quarantined (a NIXL READ that could not be cancelled): the writer may still
                # write the staging blocks, so they are never reused; the engine's reserved
                # blocks were never a destination, so they are freed.
                self.engine.cancel_external(req.request_id)
            raise
        try:
            await wire.unstage(self.engine, staging, dst)
        except Exception as e:
            self.engine.cancel_external(req.request_id)
            raise KvTransferFailed(FailureKind.INVALID, f"dequantizing the pulled blocks: {e}") from e
        finally:
            if not freed:
                wire.free(staging)
        return stats

    async def _prefill(
        self,
        stub: prefill_pb2_grpc.PrefillServiceStub,
        req: EngineRequest,
        candidate: Candidate,
        deadline: float,
    ) -> prefill_pb2.PrefillResponse:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RemotePrefillFailed("prefill", "timeout", "no time left for a remote prefill")
        context = [*req.prompt_token_ids, *req.resume_token_ids]
        msg = prefill_pb2.PrefillRequest(
            request_id=req.request_id,
            prompt_token_ids=context,
            sampling=sampling_to_proto(req.sampling),
            output_position=len(req.resume_token_ids),
            requester_id=self.worker_id,
            requester_agent=self.transport.agent_name if self.transport is not None else "",
            lease_ms=self.lease_ms,
            priority=req.priority,
        )
        try:
            return await stub.Prefill(msg, timeout=remaining)
        except grpc.aio.AioRpcError as e:
            reason = "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name.lower()
            raise RemotePrefillFailed("prefill", reason, e.details() or e.code().name) from e

    async def _run_engine_handoff(
        self, req: EngineRequest, candidate: Candidate, deadline: float
    ) -> RemoteResult:
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(candidate.address))
        t0 = time.monotonic()
        resp = await self._prefill(stub, req, candidate, deadline)
        if resp.finished:
            return self._finished_early(candidate, resp)
        state = self._check_engine_state(resp, req)
        try:
            outputs = self.engine.generate_from_state(req, state)  # type: ignore[attr-defined]
        except InvalidHandoffError as e:
            raise RemotePrefillFailed("handle", "invalid", str(e)) from e
        with tracing.span("kv.pull", transport="engine"):  # the engine fetches the KV itself
            first = await _first_output(outputs, deadline)
        log.info(
            "remote_prefill_done",
            request_id=req.request_id,
            prefill_worker=candidate.worker_id,
            handoff_ms=round((time.monotonic() - t0) * 1000, 1),
            kv_moved_by="engine",
        )
        return RemoteResult(
            prefill_worker_id=candidate.worker_id,
            first_token_id=resp.first_token_id,
            finished=False,
            finish_reason=None,
            cached_prefix_tokens=resp.cached_prefix_tokens,
            local_cached_tokens=first.num_cached_tokens,
            prefill_computed_tokens=resp.computed_tokens,
            bytes_transferred=0,
            transfer_seconds=0.0,
            outputs=_prepend(first, outputs),
        )

    def _check_engine_state(self, resp: prefill_pb2.PrefillResponse, req: EngineRequest) -> dict:
        h = resp.handle
        problems = []
        if h.WhichOneof("payload") != "engine_state":
            problems.append(f"payload is {h.WhichOneof('payload')!r}, not engine_state")
        if h.model_id and h.model_id != self.engine.info.model_id:
            problems.append(f"model {h.model_id!r} != {self.engine.info.model_id!r}")
        if h.issued_to and h.issued_to != self.worker_id:
            problems.append(f"issued to {h.issued_to!r}")
        if h.num_tokens != len(req.prompt_token_ids) + len(req.resume_token_ids):
            problems.append(f"covers {h.num_tokens} tokens")
        if problems:
            raise RemotePrefillFailed("handle", "invalid", "; ".join(problems))
        return engine_state_from_proto(h.engine_state)

    def _check_handle(
        self, resp: prefill_pb2.PrefillResponse, req: EngineRequest, n_blocks: int
    ) -> BlockHandle:
        try:
            handle = BlockHandle.from_proto(resp.handle)
        except KvTransferFailed as e:
            raise RemotePrefillFailed("handle", e.kind.value, str(e)) from e
        context_len = len(req.prompt_token_ids) + len(req.resume_token_ids)
        problems = []
        if resp.handle.model_id and resp.handle.model_id != self.engine.info.model_id:
            problems.append(f"model {resp.handle.model_id!r} != {self.engine.info.model_id!r}")
        if handle.issued_to and handle.issued_to != self.worker_id:
            problems.append(f"issued to {handle.issued_to!r}")
        if handle.num_tokens != context_len:
            problems.append(f"covers {handle.num_tokens} tokens, expected {context_len}")
        if len(handle.block_ids) < n_blocks:
            problems.append(f"{len(handle.block_ids)} blocks < {n_blocks} reserved")
        if problems:
            raise RemotePrefillFailed("handle", "invalid", "; ".join(problems))
        return handle

    def _finished_early(self, candidate: Candidate, resp: prefill_pb2.PrefillResponse) -> RemoteResult:
        return RemoteResult(
            prefill_worker_id=candidate.worker_id,
            first_token_id=resp.first_token_id,
            finished=True,
            finish_reason=_FINISH_FROM_PROTO.get(resp.finish_reason, FinishReason.STOP),
            cached_prefix_tokens=resp.cached_prefix_tokens,
            local_cached_tokens=0,
            prefill_computed_tokens=resp.computed_tokens,
            bytes_transferred=0,
            transfer_seconds=0.0,
            outputs=None,
        )

    def _release(self, stub: prefill_pb2_grpc.PrefillServiceStub, handle_id: str) -> None:
        """Ask the holder to free its lease now; best effort (the lease expires anyway)."""

        async def release() -> None:
            try:
                await stub.Release(prefill_pb2.ReleaseRequest(handle_id=handle_id), timeout=2)
            except grpc.aio.AioRpcError as e:
                log.info("release_failed", handle_id=handle_id, code=e.code().name)

        task = asyncio.ensure_future(release())
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)


def engine_state_from_proto(s: common_pb2.EngineState) -> dict:
    """The engine_state dict (PrefillResult.engine_state) of an EngineState message."""
    state: dict = {"backend": s.backend}
    if s.first_gen_tokens:
        state["first_gen_tokens"] = list(s.first_gen_tokens)
    if s.draft_tokens:
        state["draft_tokens"] = list(s.draft_tokens)
    for name in ("opaque_state", "ctx_request_id", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint"):
        if s.HasField(name):
            state[name] = getattr(s, name)
    return state


async def _first_output(outputs: AsyncIterator[RequestOutput], deadline: float) -> RequestOutput:
    """Wait for the engine's first output (its KV has arrived) within the deadline."""
    try:
        return await asyncio.wait_for(anext(outputs), max(deadline - time.monotonic(), 0.0))
    except TimeoutError as e:
        await outputs.aclose()  # type: ignore[attr-defined]
        raise RemotePrefillFailed(
            "transfer", "timeout", "no KV from the prefill engine within the deadline"
        ) from e
    except (EngineError, StopAsyncIteration) as e:
        await outputs.aclose()  # type: ignore[attr-defined]
        raise RemotePrefillFailed("transfer", "engine", str(e) or "the stream ended before any output") from e
    except BaseException:
        await outputs.aclose()  # type: ignore[attr-defined]
        raise


async def _prepend(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    async with aclosing(rest) as stream:  # type: ignore[type-var]
        yield first
        if first.finished:
            return
        async for out in stream:
            yield out
