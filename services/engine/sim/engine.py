"""SimEngine: the `Engine` protocol with a timing model instead of a model.

Everything but the forward pass is the torch engine's own code: TorchEngine's
step thread and command queue, LLMEngine, Scheduler, BlockManager (prefix
cache, LRU eviction, KV events), validation. Only the runner is swapped for
a `SimRunner` (runner.py: step times from the profile, deterministic tokens)
and the spec for `sim_spec` (spec.py: tiny real KV pool sized like the
modeled one). Used for routing and scale studies with dozens of workers on
one machine, like Dynamo's mocker and llm-d's inference simulator.

Where time is modeled:
- every scheduler pass: SimRunner.run sleeps prefill_ms + decode_ms (timing.py)
  / speedup on the step thread;
- a degraded accelerator (fault studies): with `sim_slowdown_file` set, every
  pass's wall time is multiplied by the factor in that file (runner.py's
  `SlowdownFile`). Stopping the process (SIGSTOP) is no slowdown: a pass
  that overran its modeled time while stopped counts as done;
- a KV handoff: the bytes are real but tiny, so `generate_external` (decode
  side, after the transport pulled the blocks) waits
  `profile.transfer_s(transferred tokens) / speedup` on the event loop before
  the request joins the batch. The reserved blocks stay reserved meanwhile,
  and other requests keep stepping (a transfer does not stall compute).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import partial

from services.engine.api import EngineRequest, ExternalKvReservation, RequestOutput, UnknownRequestError
from services.engine.async_engine import TorchEngine
from services.engine.config import EngineConfig
from services.engine.sim.runner import SimRunner, SlowdownFile
from services.engine.sim.spec import sim_spec
from services.model.timing import TimingProfile, load_profile


class SimEngine(TorchEngine):
    def __init__(self, config: EngineConfig, profile: TimingProfile | None = None):
        profile = profile or load_profile(config.sim_profile)
        spec = sim_spec(config, profile)
        # Decode utilisation is of *this* pool (as the mocker uses its own block count).
        self.profile = profile.scaled_to(spec.num_blocks, config.block_size)
        slowdown = SlowdownFile(config.sim_slowdown_file) if config.sim_slowdown_file else None
        runner = partial(SimRunner, profile=self.profile, speedup=config.sim_speedup, slowdown=slowdown)
        super().__init__(config, spec, runner)
        self._transfer_tokens: dict[str, int] = {}  # request id -> tokens its handoff moves

    @property
    def runner(self) -> SimRunner:
        """The step thread's runner (read its counters; do not call it)."""
        return self._started().runner

    async def reserve_external(self, request: EngineRequest) -> ExternalKvReservation:
        res = await super().reserve_external(request)
        context = len(request.prompt_token_ids) + len(request.resume_token_ids)
        self._transfer_tokens[request.request_id] = context - res.num_cached_tokens
        return res

    def generate_external(self, request_id: str, first_token_id: int) -> AsyncIterator[RequestOutput]:
        self._check_open()
        if request_id not in self._reserved:
            raise UnknownRequestError(f"no KV reservation for request {request_id!r}")
        tokens = self._transfer_tokens.pop(request_id, 0)
        delay_s = self.profile.transfer_s(tokens) / self.config.sim_speedup
        return self._after_transfer(request_id, first_token_id, delay_s)

    def cancel_external(self, request_id: str) -> None:
        self._transfer_tokens.pop(request_id, None)
        super().cancel_external(request_id)

    def abort(self, request_id: str) -> bool:
        self._transfer_tokens.pop(request_id, None)
        return super().abort(request_id)

    def generate_with_prefix(
        self, request: EngineRequest, prefix_request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """As the torch engine's, after waiting out the modeled pull of the prefix."""
        self._check_new(request)
        if prefix_request_id not in self._reserved:
            raise UnknownRequestError(f"no KV reservation for request {prefix_request_id!r}")
        tokens = self._transfer_tokens.pop(prefix_request_id, 0)
        delay_s = self.profile.transfer_s(tokens) / self.config.sim_speedup
        return self._after_prefix_pull(request, prefix_request_id, delay_s)

    async def _after_prefix_pull(
        self, request: EngineRequest, prefix_request_id: str, delay_s: float
    ) -> AsyncIterator[RequestOutput]:
        outputs = None
        try:
            await self._model_transfer(delay_s)
            outputs = TorchEngine.generate_with_prefix(self, request, prefix_request_id)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield out
        finally:
            if outputs is None:  # closed or cancelled during the transfer: free the reservation
                self.cancel_external(prefix_request_id)

    async def _model_transfer(self, delay_s: float) -> None:
        """Wait out the modeled KV transfer (wall time, not synchronisation; tests replace it)."""
        await asyncio.sleep(delay_s)

    async def _after_transfer(
        self, request_id: str, first_token_id: int, delay_s: float
    ) -> AsyncIterator[RequestOutput]:
        outputs = None
        try:
            await self._model_transfer(delay_s)
            outputs = TorchEngine.generate_external(self, request_id, first_token_id)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield out
        finally:
            if outputs is None:  # closed or cancelled during the transfer: free the reservation
                self.cancel_external(request_id)
