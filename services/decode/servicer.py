"""DecodeService: validate, decide where to prefill, stream tokens.

Thin edge over the engine, the `DisaggregationPolicy` and `RemotePrefill`.
One request: validate (INVALID_ARGUMENT before anything is allocated) ->
look up this worker's cached prefix -> decide local/remote (counted by reason)
-> remote: RemotePrefill, falling back to a local prefill once on failure ->
stream token deltas -> final usage. A client cancel or an expired deadline
cancels the handler; `aclosing` then aborts the engine request, which frees
its blocks, and an in-flight Prefill call is cancelled with it.
"""

from __future__ import annotations

import itertools
import time
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog

from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, worker_pb2
from services.common import tracing
from services.common.errors import DeadlineExceeded, grpc_errors
from services.common.validation import (
    RequestLimits,
    check_enum,
    check_ident,
    check_priority,
    check_prompt,
    check_resume,
)
from services.common.wait_estimator import WaitEstimator
from services.decode.disagg_policy import Candidate, Decision, DisaggregationPolicy, Mode, Path, Reason
from services.decode.metrics import DecodeMetrics
from services.decode.prefill_load import OwnDispatches, PrefillLoadProbe
from services.decode.remote_prefill import RemotePrefill, RemotePrefillFailed, RemoteResult
from services.engine.api import Engine, EngineRequest, FinishReason, RequestOutput
from services.worker.sampling import FINISH_TO_PROTO, sampling_from_proto
from services.worker.serving import counters_from_stats, kv_event_stream, load_from_stats

log = structlog.get_logger()

_MODES = {
    decode_pb2.DISAGG_MODE_UNSPECIFIED: Mode.AUTO,
    decode_pb2.DISAGG_MODE_LOCAL: Mode.LOCAL,
    decode_pb2.DISAGG_MODE_REMOTE: Mode.REMOTE,
}
# A fallback needs at least this much of the deadline left to be worth trying.
_MIN_FALLBACK_S = 0.05


@dataclass
class _Attempt:
    """Accounting of one Generate call."""

    decision: Decision
    prompt_tokens: int
    cached_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    prefill_worker_id: str = ""
    kv_bytes: int = 0
    finish: FinishReason | None = None


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        engine: Engine,
        policy: DisaggregationPolicy,
        remote: RemotePrefill | None,
        metrics: DecodeMetrics,
        limits: RequestLimits,
        worker_info: common_pb2.WorkerInfo,
        static_candidates: list[Candidate],
        prefill_timeout_s: float = 30.0,
        probe: PrefillLoadProbe | None = None,
    ):
        self.engine = engine
        self.policy = policy
        self.remote = remote
        self.metrics = metrics
        self.limits = limits
        self.info = worker_info
        self.static_candidates = static_candidates
        self.prefill_timeout_s = prefill_timeout_s
        self.probe = probe
        self.own_dispatches = OwnDispatches()
        self.waits = WaitEstimator()
        self._ids = itertools.count()

    # -- Generate ----------------------------------------------------------------
    @grpc_errors
    async def Generate(
        self, request: decode_pb2.DecodeServiceGenerateRequest, context: grpc.aio.ServicerContext
    ):
        req, mode = self._validate(request)
        self.metrics.requests.inc()
        started = time.monotonic()
        deadline = started + (context.time_remaining() or 3600.0)
        context_ids = [*req.prompt_token_ids, *req.resume_token_ids]
        cached = self.engine.prefix_lookup(context_ids)
        candidates = self._candidates(request)
        if candidates and self.probe is not None and self._may_go_remote(len(context_ids) - cached, mode):
            candidates = await self.probe.refresh(candidates)
        candidates = self.own_dispatches.apply(candidates, self.waits.tokens_per_s)
        decision = self.policy.decide(
            len(context_ids), cached, candidates, self._local_wait_s(), mode, self.waits.tokens_per_s
        )
        attempt = _Attempt(decision, prompt_tokens=len(req.prompt_token_ids), cached_tokens=cached)
        self.metrics.decided(decision)
        log.info(
            "disagg_decision",
            request_id=request.request_id,
            path=decision.path.value,
            reason=decision.reason.value,
            prompt_tokens=len(context_ids),
            cached_tokens=cached,
            prefill_worker=decision.candidate.worker_id if decision.candidate else None,
        )
        tracing.annotate(
            request_id=request.request_id,
            path=decision.path.value,
            reason=decision.reason.value,
            prefill_worker=decision.candidate.worker_id if decision.candidate else None,
        )
        outcome = "cancelled"
        try:
            async for chunk in self._run(req, attempt, deadline, started):
                yield chunk
            outcome = "ok"
            yield decode_pb2.DecodeServiceGenerateResponse(final=self._final(attempt))
        except Exception:
            outcome = "failed"
            raise
        finally:
            self.metrics.finished(outcome)

    async def _run(self, req: EngineRequest, attempt: _Attempt, deadline: float, started: float):
        outputs = None
        if attempt.decision.path is Path.REMOTE:
            result = await self._try_remote(req, attempt, deadline)
            if result is not None and result.outputs is None:  # the first token finished it
                attempt.completion_tokens, attempt.finish = 1, result.finish_reason
                self.metrics.ttft.observe(time.monotonic() - started)
                yield _tokens([result.first_token_id])
                return
            outputs = result.outputs if result is not None else None
        if outputs is None:
            outputs = self.engine.generate(req)
        first, last = True, started
        async with aclosing(outputs) as stream:
            async for out in stream:
                if first and attempt.decision.path is Path.LOCAL:
                    attempt.cached_tokens = out.num_cached_tokens or attempt.cached_tokens
                self._account(attempt, out)
                if out.token_ids:
                    now = time.monotonic()
                    if first:
                        self.metrics.ttft.observe(now - started)
                        first = False
                    else:
                        self.metrics.itl(now - last, len(out.token_ids))
                    last = now
                    yield _tokens(out.token_ids)
                if out.finished:
                    attempt.finish = out.finish_reason
                    return

    async def _try_remote(
        self, req: EngineRequest, attempt: _Attempt, deadline: float
    ) -> RemoteResult | None:
        """The remote path; None after a failure (counted) means: prefill locally."""
        candidate = attempt.decision.candidate
        assert candidate is not None and self.remote is not None
        sent = max(len(req.prompt_token_ids) + len(req.resume_token_ids) - attempt.cached_tokens, 0)
        self.own_dispatches.begin(candidate.address, sent)
        try:
            result = await self.remote.run(
                req, candidate, min(deadline, time.monotonic() + self.prefill_timeout_s)
            )
        except RemotePrefillFailed as e:
            self.metrics.fallback(e.stage, e.reason)
            log.warning(
                "remote_prefill_failed",
                request_id=req.request_id,
                stage=e.stage,
                reason=e.reason,
                prefill_worker=candidate.worker_id,
                error=str(e),
            )
            if deadline - time.monotonic() < _MIN_FALLBACK_S:
                raise DeadlineExceeded("deadline passed during a failed remote prefill") from e
            attempt.decision = Decision(Path.LOCAL, Reason.FALLBACK)
            self.metrics.decided(attempt.decision)
            tracing.annotate(path="local", reason=Reason.FALLBACK.value, fallback=f"{e.stage}: {e.reason}")
            return None
        finally:
            self.own_dispatches.end(candidate.address, sent)
        attempt.prefill_worker_id = result.prefill_worker_id
        attempt.kv_bytes = result.bytes_transferred
        attempt.cached_tokens = max(result.cached_prefix_tokens, result.local_cached_tokens)
        attempt.computed_tokens += result.prefill_computed_tokens
        if result.bytes_transferred:
            self.metrics.transferred(result.bytes_transferred, result.transfer_seconds)
        tracing.annotate(kv_bytes=result.bytes_transferred)
        return result

    def _account(self, attempt: _Attempt, out: RequestOutput) -> None:
        attempt.completion_tokens += len(out.token_ids)
        if attempt.decision.path is Path.LOCAL and out.num_computed_prompt_tokens:
            attempt.computed_tokens = max(attempt.computed_tokens, out.num_computed_prompt_tokens)

    def _final(self, attempt: _Attempt) -> decode_pb2.DecodeFinal:
        # Decode work: every generated token after the first needed a forward pass,
        # and the first one too on the local path (it came out of the prefill pass).
        computed = attempt.computed_tokens + max(attempt.completion_tokens - 1, 0)
        return decode_pb2.DecodeFinal(
            finish_reason=FINISH_TO_PROTO[attempt.finish],
            usage=common_pb2.Usage(
                prompt_tokens=attempt.prompt_tokens,
                completion_tokens=attempt.completion_tokens,
                cached_prompt_tokens=attempt.cached_tokens,
                computed_tokens=computed,
            ),
            prefill_path=attempt.decision.path.value,
            disagg_reason=attempt.decision.reason.value,
            prefill_worker_id=attempt.prefill_worker_id,
            kv_bytes_transferred=attempt.kv_bytes,
        )

    # -- validation and inputs ---------------------------------------------------
    def _validate(self, r: decode_pb2.DecodeServiceGenerateRequest) -> tuple[EngineRequest, Mode]:
        info = self.engine.info
        check_ident(r.request_id, "request_id", self.limits.max_request_id_bytes, required=True)
        check_ident(r.tenant, "tenant", self.limits.max_tenant_bytes)
        check_priority(r.priority, self.limits)
        check_enum(r.disagg_mode, decode_pb2.DisaggMode, "disagg_mode")
        sampling = sampling_from_proto(
            r.sampling if r.HasField("sampling") else None, self.limits, info.vocab_size
        )
        # max_tokens counts resume tokens, so prompt + max_tokens bounds the whole context.
        check_prompt(
            list(r.prompt_token_ids), sampling.max_tokens, info.vocab_size, info.max_model_len, self.limits
        )
        check_resume(list(r.resume_token_ids), sampling.max_tokens, info.vocab_size)
        for i, c in enumerate(r.prefill_candidates):
            check_ident(c.address, f"prefill_candidates[{i}].address", 256, required=True)
        req = EngineRequest(
            request_id=f"{r.request_id}@{next(self._ids)}",
            prompt_token_ids=tuple(r.prompt_token_ids),
            sampling=sampling,
            resume_token_ids=tuple(r.resume_token_ids),
            priority=r.priority,
        )
        mode = _MODES[r.disagg_mode]
        if r.disagg_mode == decode_pb2.DISAGG_MODE_UNSPECIFIED:
            mode = Mode(self.policy.config.default_mode)
        return req, mode

    def _candidates(self, r: decode_pb2.DecodeServiceGenerateRequest) -> list[Candidate]:
        if self.remote is None:
            return []
        if r.prefill_candidates:
            return [
                Candidate(c.worker_id or c.address, c.address, c.estimated_wait_ms / 1000.0)
                for c in r.prefill_candidates
            ]
        return self.static_candidates

    def _may_go_remote(self, uncached: int, mode: Mode) -> bool:
        return mode is Mode.REMOTE or (
            mode is Mode.AUTO and uncached > self.policy.config.max_local_prefill_tokens
        )

    def _local_wait_s(self) -> float:
        s = self.engine.stats()
        self.waits.observe(s.prompt_tokens_computed, s.tokens_waiting)
        return self.waits.wait_s(s.tokens_waiting)

    # -- KV events and stats -----------------------------------------------------
    async def SubscribeKvEvents(self, request: worker_pb2.SubscribeKvEventsRequest, context):
        async for msg in kv_event_stream(self.engine, self.info.worker_id, context):
            yield msg

    @grpc_errors
    async def Stats(self, request: worker_pb2.StatsRequest, context) -> worker_pb2.StatsResponse:
        return self.stats_response()

    def load(self) -> common_pb2.WorkerLoad:
        s = self.engine.stats()
        self.waits.observe(s.prompt_tokens_computed, s.tokens_waiting)
        return load_from_stats(s, self.waits.wait_s(s.tokens_waiting) * 1000.0)

    def stats_response(self) -> worker_pb2.StatsResponse:
        s = self.engine.stats()
        info = common_pb2.WorkerInfo()
        info.CopyFrom(self.info)
        info.free_blocks = s.free_blocks
        return worker_pb2.StatsResponse(
            info=info,
            load=self.load(),
            counters=counters_from_stats(s),
            cached_blocks=s.cached_blocks,
            transfers=self.metrics.transfer_counters(),
            disagg_decisions=self.metrics.decision_counts(),
            requests_total=self.metrics.count("total"),
            requests_failed=self.metrics.count("failed"),
            requests_cancelled=self.metrics.count("cancelled"),
        )


def _tokens(ids: list[int]) -> decode_pb2.DecodeServiceGenerateResponse:
    return decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=ids))
