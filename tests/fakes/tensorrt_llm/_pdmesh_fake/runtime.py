"""The fake executor: pdmesh's TorchEngine on a private event-loop thread.

Like the real LLM's executor, it runs in the background and feeds each
request's GenerationResult from another thread. Three request kinds:

- plain (no DisaggregatedParams, or "context_and_generation"): TorchEngine.generate;
- "context_only": TorchEngine.prefill (the first token is sampled, the KV blocks
  stay held), then the ContextServer keeps them for one pull (see transceiver.py);
- "generation_only": reserve blocks here, pull the missing ones from the context
  side named in opaque_state, import them, then TorchEngine.generate_external
  continues from the first token.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from services.engine.api import EngineRequest, FinishReason, RequestOutput
from services.engine.api import SamplingParams as PdSampling
from services.engine.async_engine import TorchEngine
from services.engine.config import EngineConfig

from ..disaggregated_params import DisaggregatedParams
from ..executor.result import GenerationResult, _Update
from ..sampling_params import SamplingParams
from .kv_events import KvEventFeed
from .transceiver import ContextServer, HandoffState, pull_blocks

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "cancelled"}


class FakeExecutor:
    def __init__(self, config: EngineConfig, transfer_timeout_s: float | None, with_transceiver: bool):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="fake-trtllm-executor"
        )
        self._thread.start()
        self.engine = TorchEngine(config)
        self._call(self.engine.start())
        info = self.engine.info
        self.eos = set(info.eos_token_ids)
        self.feed = KvEventFeed(self.engine, info.block_size, info.num_blocks, info.max_model_len)
        self._transfer_timeout_s = transfer_timeout_s
        self._ids = itertools.count(1)
        self._tasks: dict[int, asyncio.Future] = {}
        self.server: ContextServer | None = None
        if with_transceiver:
            self.server = ContextServer(
                self._loop,
                lambda ids: self._call(self.engine.export_blocks(ids)),
                self.engine.release,
                transfer_timeout_s,
            )

    # -- called on the user's thread ---------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        sp: SamplingParams,
        dp: DisaggregatedParams | None,
        streaming: bool,
    ) -> GenerationResult:
        sampling = to_pdmesh_sampling(sp)  # NotImplementedError for what the fake cannot do
        kind = dp.request_type if dp is not None else None
        rid = dp.disagg_request_id if dp is not None and dp.disagg_request_id is not None else next(self._ids)
        result = GenerationResult(rid, prompt, streaming, self.abort)
        req = EngineRequest(f"trt-{rid}", tuple(prompt), sampling)
        if kind == "context_only":
            coro = self._context_only(result, req, sp, dp)
        elif kind == "generation_only":
            coro = self._generation_only(result, req, dp)
        else:
            coro = self._plain(result, req)
        self._tasks[rid] = asyncio.run_coroutine_threadsafe(self._guard(result, coro), self._loop)
        return result

    def abort(self, rid: int) -> None:
        self._loop.call_soon_threadsafe(self._abort_on_loop, rid)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        self._call(self.engine.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _call(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- engine loop -------------------------------------------------------------------
    def _abort_on_loop(self, rid: int) -> None:
        if self.server is not None and self.server.drop(rid):
            return  # a finished context-only request: its held KV is freed
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel()

    async def _guard(self, result: GenerationResult, coro: Coroutine) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            result._deliver(_Update([], "cancelled"))
        except Exception as e:  # handed to the reader as RequestError, like the real executor
            result._deliver(_Update([], error=f"{type(e).__name__}: {e}"))
        finally:
            self._tasks.pop(result.request_id, None)

    async def _plain(self, result: GenerationResult, req: EngineRequest) -> None:
        await self._stream(result, req, self.engine.generate(req))

    async def _stream(self, result: GenerationResult, req: EngineRequest, outputs) -> None:
        seen = list(req.prompt_token_ids)
        async with aclosing(outputs) as stream:
            async for out in stream:
                seen += out.token_ids
                self.feed.note(seen)
                result._deliver(_Update(list(out.token_ids), _finish(out)))

    async def _context_only(self, result, req: EngineRequest, sp: SamplingParams, dp) -> None:
        if self.server is None:
            raise ValueError("context_only requests need cache_transceiver_config")
        # Sample the first token without letting it finish the request, so the KV stays held.
        held_req = replace(
            req, sampling=replace(req.sampling, max_tokens=2, ignore_eos=True, stop_token_ids=())
        )
        res = await self.engine.prefill(held_req)
        self.feed.note(req.prompt_token_ids)
        first = res.first_token_id
        assert res.held is not None
        self.server.hold(result.request_id, req.request_id, res.held)
        state = HandoffState(
            self.server.endpoint, result.request_id, len(req.prompt_token_ids), res.held.layout
        )
        stops = (set() if sp.ignore_eos else self.eos) | set(sp.stop_token_ids or ())
        params = DisaggregatedParams(
            request_type="context_only",
            first_gen_tokens=[first],
            ctx_request_id=result.request_id,
            opaque_state=state.to_bytes(),
            draft_tokens=None,
            disagg_request_id=dp.disagg_request_id,
            ctx_dp_rank=0,
            ctx_info_endpoint=self.server.endpoint,
        )
        result._deliver(_Update([first], "stop" if first in stops else "length", params))

    async def _generation_only(self, result, req: EngineRequest, dp) -> None:
        if self.server is None:
            raise ValueError("generation_only requests need cache_transceiver_config")
        state = HandoffState.from_bytes(dp.opaque_state)
        if not dp.first_gen_tokens:
            raise ValueError("generation_only request without first_gen_tokens")
        if state.num_tokens != len(req.prompt_token_ids):
            raise ValueError(
                f"context covers {state.num_tokens} tokens, prompt has {len(req.prompt_token_ids)}"
            )
        resv = await self.engine.reserve_external(req)
        try:
            state.layout.check_compatible(self.engine.info.layout)
            blocks = await asyncio.wait_for(
                asyncio.to_thread(pull_blocks, state, resv.first_transfer_block, self._transfer_timeout_s),
                self._transfer_timeout_s,
            )
            if resv.transfer_block_ids:
                await self.engine.import_blocks(resv.transfer_block_ids, blocks, state.layout)
        except BaseException:
            self.engine.cancel_external(req.request_id)
            raise
        await self._stream(result, req, self.engine.generate_external(req.request_id, dp.first_gen_tokens[0]))


def _finish(out: RequestOutput) -> str | None:
    return _FINISH[out.finish_reason] if out.finished else None


def to_pdmesh_sampling(sp: SamplingParams) -> PdSampling:
    unsupported = {
        "n": sp.n != 1 or (sp.best_of or 1) != 1,
        "use_beam_search": sp.use_beam_search,
        "stop": bool(sp.stop),
        "bad": bool(sp.bad or sp.bad_token_ids),
        "penalties": any(
            v is not None for v in (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty)
        ),
        "logprobs": bool(sp.logprobs or sp.prompt_logprobs),
        "min_tokens": (sp.min_tokens or 0) > 1,
        "guided_decoding": sp.guided_decoding is not None,
    }
    bad = [name for name, used in unsupported.items() if used]
    if bad:
        raise NotImplementedError(f"the fake TensorRT-LLM runtime does not support {', '.join(bad)}")
    greedy = sp.top_k == 1 or sp.temperature == 0.0
    return PdSampling(
        max_tokens=sp.max_tokens,
        temperature=0.0 if greedy else (1.0 if sp.temperature is None else sp.temperature),
        top_p=1.0 if not sp.top_p else sp.top_p,
        top_k=0 if greedy or sp.top_k is None else sp.top_k,
        seed=sp.seed,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
    )
