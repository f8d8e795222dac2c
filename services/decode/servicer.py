"""DecodeService: the gRPC edge of a decode worker.

Converts a Generate message into a `DecodeJob` (validated: INVALID_ARGUMENT
before anything is allocated), runs it on the `DecodeWorker` core
(services/decode/worker.py: the disaggregation decision, the remote path and
its fallback, the deadline, accounting) and converts the core's events back
into messages. Link (services/decode/link.py) drives the same core for every
request of one router on one stream. A client cancel or an expired deadline cancels the handler;
`aclosing` then closes the core, which aborts the engine request and cancels
an in-flight Prefill call.
"""

from __future__ import annotations

import asyncio
import itertools
from contextlib import aclosing

import grpc

from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, worker_pb2
from services.common.errors import InvalidArgument, grpc_errors
from services.common.validation import (
    RequestLimits,
    check_enum,
    check_ident,
    check_priority,
    check_prompt,
    check_resume,
    check_waited,
)
from services.decode.config import DecodeConfig
from services.decode.disagg_policy import Candidate, DisaggregationPolicy, Mode
from services.decode.link import LinkSession
from services.decode.metrics import DecodeMetrics
from services.decode.prefill_load import OwnDispatches, PrefillLoadProbe
from services.decode.prefix_pull import PrefixPuller, PullHint
from services.decode.remote_prefill import RemotePrefill
from services.decode.worker import DecodeJob, DecodeWorker, Finished, Tokens
from services.engine.api import Engine, EngineRequest
from services.model.sampling import FINISH_TO_PROTO, check_sampling
from services.worker.health import HealthWatch
from services.worker.serving import counters_from_stats, kv_event_stream, load_from_stats

_MODES = {
    decode_pb2.DISAGG_MODE_UNSPECIFIED: None,  # the policy's default mode
    decode_pb2.DISAGG_MODE_LOCAL: Mode.LOCAL,
    decode_pb2.DISAGG_MODE_REMOTE: Mode.REMOTE,
}


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
        prefill_timeout_s: float = DecodeConfig.prefill_timeout_s,
        probe: PrefillLoadProbe | None = None,
        max_request_s: float = DecodeConfig.max_request_s,
        draining: asyncio.Event | None = None,
        health: HealthWatch | None = None,
        puller: PrefixPuller | None = None,
    ):
        self.engine = engine
        self.health = health  # the forward-progress verdict Stats and heartbeats carry
        self.metrics = metrics
        self.limits = limits
        self.info = worker_info
        self.worker = DecodeWorker(
            engine,
            policy,
            remote,
            metrics,
            static_candidates=static_candidates,
            prefill_timeout_s=prefill_timeout_s,
            max_request_s=max_request_s,
            probe=probe,
            puller=puller,
        )
        self._ids = itertools.count()
        self._draining = draining  # set when the server drains: links finish their requests, then end

    @property
    def own_dispatches(self) -> OwnDispatches:
        return self.worker.own_dispatches

    # -- Generate ----------------------------------------------------------------
    @grpc_errors
    async def Generate(
        self, request: decode_pb2.DecodeServiceGenerateRequest, context: grpc.aio.ServicerContext
    ):
        job = self._job(request, context.time_remaining())
        async with aclosing(self.worker.generate(job)) as events:
            async for event in events:
                if isinstance(event, Tokens):
                    yield decode_pb2.DecodeServiceGenerateResponse(
                        tokens=decode_pb2.TokenIdsDelta(token_ids=event.token_ids)
                    )
                else:
                    yield decode_pb2.DecodeServiceGenerateResponse(final=_final(event))

    @grpc_errors
    async def Link(self, request_iterator, context: grpc.aio.ServicerContext):
        async for frame in self.link_session().run(request_iterator):
            yield frame

    def link_session(self) -> LinkSession:
        """A session of the token link (over gRPC here, or services/decode/link_server.py)."""
        return LinkSession(self.worker, self._job, _final, self._draining)

    # -- validation and inputs ---------------------------------------------------
    def _job(self, r: decode_pb2.DecodeServiceGenerateRequest, timeout_s: float | None) -> DecodeJob:
        info = self.engine.info
        check_ident(r.request_id, "request_id", self.limits.max_request_id_bytes, required=True)
        check_ident(r.tenant, "tenant", self.limits.max_tenant_bytes)
        check_priority(r.priority, self.limits)
        check_enum(r.disagg_mode, decode_pb2.DisaggMode, "disagg_mode")
        sampling = check_sampling(
            r.sampling if r.HasField("sampling") else None, self.limits, info.vocab_size
        )
        # max_tokens counts resume tokens, so prompt + max_tokens bounds the whole context.
        check_prompt(
            list(r.prompt_token_ids), sampling.max_tokens, info.vocab_size, info.max_model_len, self.limits
        )
        check_resume(list(r.resume_token_ids), sampling.max_tokens, info.vocab_size)
        check_waited(r.waited_s)
        for i, c in enumerate(r.prefill_candidates):
            check_ident(c.address, f"prefill_candidates[{i}].address", 256, required=True)
        pull = _pull_hint(r) if r.HasField("prefix_pull") else None
        req = EngineRequest(
            request_id=f"{r.request_id}@{next(self._ids)}",
            prompt_token_ids=tuple(r.prompt_token_ids),
            sampling=sampling,
            resume_token_ids=tuple(r.resume_token_ids),
            priority=r.priority,
            # Pins this step's KV for the workflow's next step (EngineConfig.workflow_pin_ttl_s).
            workflow_id=r.workflow.workflow_id,
            workflow_final=r.workflow.final_step,
            waited_s=r.waited_s,
            front=r.front,
        )
        candidates = [
            Candidate(c.worker_id or c.address, c.address, c.estimated_wait_ms / 1000.0)
            for c in r.prefill_candidates
        ]
        return DecodeJob(
            request=req,
            client_request_id=r.request_id,
            mode=_MODES[r.disagg_mode],
            candidates=candidates or None,
            timeout_s=timeout_s,
            pull=pull,
        )

    # -- KV events and stats -----------------------------------------------------
    async def SubscribeKvEvents(self, request: worker_pb2.SubscribeKvEventsRequest, context):
        async for msg in kv_event_stream(self.engine, self.info.worker_id, context):
            yield msg

    @grpc_errors
    async def Stats(self, request: worker_pb2.StatsRequest, context) -> worker_pb2.StatsResponse:
        return self.stats_response()

    def load(self) -> common_pb2.WorkerLoad:
        s = self.engine.stats()
        link = self.worker.rates.link_ms(self.engine.info.block_size)
        return load_from_stats(s, self.worker.local_wait_s(s) * 1000.0, self.health, link)

    def stats_response(self) -> worker_pb2.StatsResponse:
        s = self.engine.stats()
        pulls = self.worker.puller.metrics if self.worker.puller is not None else None
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
            prefix_pulls=pulls.counts if pulls is not None else {},
            prefix_pull_tokens_saved=pulls.tokens_saved if pulls is not None else 0,
        )


def _final(f: Finished) -> decode_pb2.DecodeFinal:
    return decode_pb2.DecodeFinal(
        finish_reason=FINISH_TO_PROTO[f.finish_reason],
        usage=common_pb2.Usage(
            prompt_tokens=f.prompt_tokens,
            completion_tokens=f.completion_tokens,
            cached_prompt_tokens=f.cached_prompt_tokens,
            computed_tokens=f.computed_tokens,
        ),
        prefill_path=f.path.value,
        disagg_reason=f.reason.value,
        prefill_worker_id=f.prefill_worker_id,
        kv_bytes_transferred=f.kv_bytes_transferred,
        pulled_prefix_tokens=f.pulled_prefix_tokens,
    )


def _pull_hint(r: decode_pb2.DecodeServiceGenerateRequest) -> PullHint:
    h = r.prefix_pull
    check_ident(h.worker_id, "prefix_pull.worker_id", 256, required=True)
    check_ident(h.address, "prefix_pull.address", 256, required=True)
    check_ident(h.kv_agent_name, "prefix_pull.kv_agent_name", 256)
    if h.blocks < 1:
        raise InvalidArgument("prefix_pull.blocks: must be >= 1")
    return PullHint(h.worker_id, h.address, h.kv_agent_name, h.blocks)
