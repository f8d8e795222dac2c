"""TrtllmEngine: the `Engine` protocol over TensorRT-LLM's LLM API (PyTorch backend).

Owns one `tensorrt_llm.LLM` (built in `start()`, the only place that imports
tensorrt_llm), the live request handles, a KvEventMapper and a poller thread
that drains `get_kv_cache_events` / `get_stats` into the event loop.

    generate(req)                 -> llm.generate_async(ids, streaming=True)               (local prefill)
    prefill(req)                  -> llm.generate_async(ids, SamplingParams(max_tokens=1),
                                       DisaggregatedParams(request_type="context_only",
                                                           disagg_request_id=<cluster-unique>))
                                     -> PrefillResult.engine_state = the returned DisaggregatedParams
    generate_from_state(req, st)  -> llm.generate_async(ids, streaming=True,
                                       DisaggregatedParams(request_type="generation_only", **st))
    abort(rid) / closing a stream -> RequestOutput.abort()

The KV itself moves through TensorRT-LLM's cache transceiver (NIXL), so the
engine reports `moves_kv_itself` and exports no KV pool. See docs/GPU.md for
the pinned version and what was verified on GPUs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog

from services.engine.api import (
    EngineCapabilities,
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineStats,
    ExternalKvReservation,
    FinishReason,
    InvalidRequestError,
    KvEvent,
    PrefillResult,
    RequestOutput,
)
from services.engine.config import EngineConfig
from services.engine.trtllm.config import TrtllmConfig
from services.engine.trtllm.handoff import params_fields, sampling_kwargs, state_from_params
from services.engine.trtllm.kv_events import KvEventMapper
from services.engine.validation import validate_request
from services.model.model_config import ModelConfig
from services.model.tokenizer import HfTokenizer

log = structlog.get_logger()

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.ABORT}
_POLL_S = 0.2  # how long one poll of events / stats may block the poller thread


class TrtllmEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.trt_config = TrtllmConfig.from_engine_config(config)
        model = ModelConfig.from_hf_folder(self.trt_config.model)
        self.tokenizer = HfTokenizer(self.trt_config.model, model.vocab_size, model.eos_token_ids)
        max_len = min(model.max_position_embeddings, config.max_model_len or model.max_position_embeddings)
        self.info = EngineInfo(
            backend="trtllm",
            model_id=config.resolved_model_id,
            vocab_size=model.vocab_size,
            max_model_len=max_len,
            block_size=config.block_size,
            num_blocks=config.num_blocks or 0,
            layout=None,
            eos_token_ids=model.eos_token_ids or tuple(self.tokenizer.eos_token_ids),
            device="cuda",
            capabilities=EngineCapabilities(moves_kv_itself=True, exports_kv_pool=False),
        )
        self._trt: Any = None  # the tensorrt_llm.llmapi module, once started
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events = KvEventMapper(config.block_size, config.kv_event_buffer)
        self._event_waiters: list[asyncio.Future] = []
        self._live: dict[str, Any] = {}  # request id -> TensorRT-LLM RequestOutput
        self._kv_stats: dict[str, Any] = {}
        self._counters = dict.fromkeys(("computed", "decoded", "cached", "transferred"), 0)
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        if self._llm is not None:
            return
        import tensorrt_llm  # lazy: only a trtllm worker needs TensorRT-LLM
        import tensorrt_llm.llmapi as trt

        self._trt, self._loop = trt, asyncio.get_running_loop()
        kwargs = self.trt_config.llm_kwargs(trt)
        log.info("trtllm_start", version=getattr(tensorrt_llm, "__version__", "?"), model=kwargs["model"])
        self._llm = trt.LLM(**kwargs)
        for event in await asyncio.to_thread(self._llm.get_kv_cache_events, 1.0):  # the "created" event
            self._events.apply(event)
        if self._events.num_blocks:
            self.info = dataclasses.replace(self.info, num_blocks=self._events.num_blocks)
        self._poller = threading.Thread(target=self._poll, name="trtllm-events", daemon=True)
        self._poller.start()

    async def close(self) -> None:
        if self._llm is None:
            return
        for result in list(self._live.values()):
            _abort(result)
        self._stop.set()
        if self._poller is not None:
            await asyncio.to_thread(self._poller.join)
        await asyncio.to_thread(self._llm.shutdown)
        self._llm = None
        self._wake_event_waiters()

    # ---- requests ----------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self._check_new(request)
        context = [*request.prompt_token_ids, *request.resume_token_ids]
        cached = self._events.prefix_lookup(context)
        result = self._submit(request, streaming=True)
        self._counters["computed"] += len(context) - cached
        self._counters["cached"] += cached
        return self._stream(request, result, cached=cached, computed=len(context) - cached, remote=False)

    def divert(self, request_id: str, sink: Callable[[RequestOutput], None]) -> bool:
        return False  # its stream is TensorRT-LLM's own: iterate it

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        self._check_new(request)
        rid = request.request_id
        context = [*request.prompt_token_ids, *request.resume_token_ids]
        cached = self._events.prefix_lookup(context)
        params = self._trt.DisaggregatedParams(request_type="context_only", disagg_request_id=_cluster_id())
        result = self._submit(request, streaming=False, max_tokens=1, params=params)
        try:
            await result.aresult()
        except asyncio.CancelledError:
            _abort(result)
            raise
        except RuntimeError as e:  # tensorrt_llm.executor.RequestError
            raise EngineError(f"context phase of {rid!r} failed: {e}") from e
        finally:
            self._live.pop(rid, None)
        out = result.outputs[0]
        if out.finish_reason in ("cancelled", "timeout") or not out.token_ids:
            raise EngineError(f"context phase of {rid!r} ended without a token ({out.finish_reason})")
        first = int(out.token_ids[0])
        self._counters["computed"] += len(context) - cached
        self._counters["cached"] += cached
        finish = self._first_token_finishes(request, first)
        if finish is not None:
            _abort(result, finished_too=True)  # nobody will pull this KV: ask TensorRT-LLM to drop it
        return PrefillResult(
            request_id=rid,
            first_token_id=first,
            finished=finish is not None,
            finish_reason=finish,
            cached_prefix_tokens=cached,
            computed_tokens=len(context) - cached,
            held=None,
            engine_state=None if finish is not None else state_from_params(out.disaggregated_params),
        )

    def generate_from_state(self, request: EngineRequest, engine_state: dict) -> AsyncIterator[RequestOutput]:
        fields = params_fields(engine_state, self.info.vocab_size)
        self._check_new(request)
        valid = {f.name for f in dataclasses.fields(self._trt.DisaggregatedParams)}
        params = self._trt.DisaggregatedParams(
            request_type="generation_only", **{k: v for k, v in fields.items() if k in valid}
        )
        context = len(request.prompt_token_ids) + len(request.resume_token_ids)
        result = self._submit(request, streaming=True, params=params)
        self._counters["transferred"] += context
        return self._stream(request, result, cached=0, computed=0, remote=True)

    def release(self, request_id: str) -> bool:
        return False  # nothing is held at pdmesh's level: TensorRT-LLM owns the context KV

    async def reserve_external(self, request: EngineRequest) -> ExternalKvReservation:
        raise NotImplementedError("the trtllm engine moves KV itself: use generate_from_state")

    def generate_external(self, request_id: str, first_token_id: int) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError("the trtllm engine moves KV itself: use generate_from_state")

    def cancel_external(self, request_id: str) -> None:
        return None

    def abort(self, request_id: str) -> bool:
        result = self._live.get(request_id)
        if result is None:
            return False
        _abort(result)
        return True

    # ---- views -------------------------------------------------------------------------
    def kv_pool(self):
        return None

    def prefix_lookup(self, token_ids: Sequence[int]) -> int:
        return self._events.prefix_lookup(token_ids)

    def stats(self) -> EngineStats:
        kv = self._kv_stats
        total = int(kv.get("maxNumBlocks", self.info.num_blocks))
        return EngineStats(
            running=len(self._live),
            waiting=0,
            total_blocks=total,
            free_blocks=int(kv.get("freeNumBlocks", total)),
            cached_blocks=self._events.cached_blocks,
            held_blocks=0,
            tokens_waiting=0,
            active_decode_blocks=0,
            prompt_tokens_computed=self._counters["computed"],
            decode_tokens_computed=self._counters["decoded"],
            prompt_tokens_cached=self._counters["cached"],
            prompt_tokens_transferred=self._counters["transferred"],
            preemptions=0,
        )

    def kv_events_since(self, seq: int) -> list[KvEvent]:
        return self._events.log.since(seq)

    def kv_snapshot(self) -> tuple[int, list[tuple[int | None, int]]]:
        return self._events.snapshot()

    async def wait_kv_events(self, after_seq: int) -> None:
        while self._events.log.last_seq <= after_seq:
            if self._llm is None:
                raise EngineError("engine not started (or closed)")
            fut = self._loop.create_future()
            self._event_waiters.append(fut)
            await fut

    # ---- internals ---------------------------------------------------------------------
    def _check_new(self, request: EngineRequest) -> None:
        if self._llm is None:
            raise EngineError("engine not started (or closed)")
        validate_request(request, self.info)
        sampling_kwargs(request)  # InvalidRequestError for unsupported options, before anything runs
        if request.request_id in self._live:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")

    def _submit(self, request: EngineRequest, streaming: bool, max_tokens: int | None = None, params=None):
        kwargs = sampling_kwargs(request)
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        ids = [*request.prompt_token_ids, *request.resume_token_ids]
        try:
            result = self._llm.generate_async(
                ids,
                sampling_params=self._trt.SamplingParams(**kwargs),
                streaming=streaming,
                disaggregated_params=params,
            )
        except ValueError as e:  # TensorRT-LLM's argument checks (lengths, sampling values)
            raise InvalidRequestError("sampling", str(e)) from e
        self._live[request.request_id] = result
        return result

    async def _stream(self, request: EngineRequest, result, *, cached: int, computed: int, remote: bool):
        rid, limit = request.request_id, request.sampling.max_tokens - len(request.resume_token_ids)
        num_prompt = len(request.prompt_token_ids)
        emitted, done = 0, False
        try:
            async for out in result:
                comp = out.outputs[0]
                new = [int(t) for t in comp.token_ids[emitted:]]
                reason = comp.finish_reason
                if reason in ("cancelled", "timeout") and remote and emitted + len(new) == 0:
                    raise EngineError(f"generation phase of {rid!r} {reason} before its first token")
                if len(new) >= limit - emitted and reason is None:
                    new, reason = new[: limit - emitted], "length"  # never exceed max_tokens
                    _abort(result)
                if reason is None and out.finished:
                    reason = "stop"
                done = reason is not None
                first = emitted == 0
                emitted += len(new)
                self._counters["decoded"] += len(new)
                yield RequestOutput(
                    rid,
                    new,
                    finished=done,
                    finish_reason=_FINISH.get(reason, FinishReason.ABORT) if done else None,
                    num_prompt_tokens=num_prompt if first else 0,
                    num_cached_tokens=cached if first else 0,
                    num_computed_prompt_tokens=computed,
                )
                if done:
                    return
        except RuntimeError as e:  # tensorrt_llm.executor.RequestError
            raise EngineError(f"TensorRT-LLM request {rid!r} failed: {e}") from e
        finally:
            self._live.pop(rid, None)
            if not done:
                _abort(result)

    def _first_token_finishes(self, request: EngineRequest, first: int) -> FinishReason | None:
        s = request.sampling
        if first in s.stop_token_ids or (not s.ignore_eos and first in self.info.eos_token_ids):
            return FinishReason.STOP
        if s.max_tokens - len(request.resume_token_ids) <= 1:
            return FinishReason.LENGTH
        return None

    def _poll(self) -> None:
        """Poller thread: hand events and stats to the event loop until close()."""
        llm, loop = self._llm, self._loop
        while not self._stop.is_set():
            try:
                events = llm.get_kv_cache_events(_POLL_S)
                stats = llm.get_stats(_POLL_S)
            except RuntimeError as e:  # the LLM is shutting down
                log.info("trtllm_poller_stopped", error=str(e))
                return
            if events or stats:
                try:
                    loop.call_soon_threadsafe(self._apply_polled, events, stats)
                except RuntimeError:  # the loop is closed
                    return

    def _apply_polled(self, events: list[dict], stats: list[dict]) -> None:
        before = self._events.log.last_seq
        for event in events:
            self._events.apply(event)
        for s in stats:
            self._kv_stats = s.get("kvCacheStats") or self._kv_stats
        if self._events.log.last_seq != before:
            self._wake_event_waiters()

    def _wake_event_waiters(self) -> None:
        waiters, self._event_waiters = self._event_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


def _cluster_id() -> int:
    """A disagg_request_id unique across the cluster: random 62 bits (>= 2**61, clear of
    the small per-process ids TensorRT-LLM assigns itself)."""
    return (uuid.uuid4().int & (2**61 - 1)) | 2**61


def _abort(result, finished_too: bool = False) -> None:
    """Best effort: the request may already be finished or gone inside TensorRT-LLM.

    `finished_too`: abort a finished context-only request too, so the KV it keeps
    for a generation worker is dropped (else kv_transfer_timeout_ms frees it)."""
    if result.finished and not finished_too:
        return
    try:
        result.abort()
    except Exception as e:  # logged, not raised: abort runs from clean-up paths
        log.warning("trtllm_abort_failed", request_id=getattr(result, "request_id", None), error=repr(e))
