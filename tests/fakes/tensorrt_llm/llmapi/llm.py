"""Fake of `tensorrt_llm/llmapi/llm.py` (1.3.0rc13): the LLM class, PyTorch backend only.

Same constructor and method names and signatures as the pinned version for what
pdmesh calls: `LLM(model, ..., **kwargs)` (unknown kwargs -> ValueError),
`generate`, `generate_async` (returns a RequestOutput that is awaitable and,
with streaming=True, an async iterator), `get_kv_cache_events`,
`get_kv_cache_events_async`, `get_stats`, `shutdown`. See the package docstring
for what is and is not faithful.

Fake-only convention: `model="pdmesh-preset:tiny"` runs pdmesh's built-in tiny
model instead of a Hugging Face folder.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from services.engine.config import EngineConfig

from .._pdmesh_fake.runtime import FakeExecutor
from ..disaggregated_params import DisaggregatedParams
from ..executor.result import GenerationResult
from ..sampling_params import SamplingParams
from .llm_args import TORCH_LLM_ARG_NAMES, CacheTransceiverConfig, KvCacheConfig

PRESET_PREFIX = "pdmesh-preset:"
RequestOutput = GenerationResult  # the real RequestOutput subclasses GenerationResult


class LLM:
    def __init__(
        self,
        model: str | Path,
        tokenizer: Any = None,
        tokenizer_mode: str = "auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        **kwargs: Any,
    ) -> None:
        for key in kwargs:
            if key not in TORCH_LLM_ARG_NAMES:
                raise ValueError(f"{type(self).__name__} got invalid argument: {key}")
        if kwargs.get("backend") != "pytorch":
            raise NotImplementedError(
                "the fake TensorRT-LLM only has the PyTorch backend (backend='pytorch')"
            )
        if tensor_parallel_size != 1:
            raise NotImplementedError("the fake TensorRT-LLM runs one rank only")
        self.kv_cache_config: KvCacheConfig = kwargs.get("kv_cache_config") or KvCacheConfig()
        self.cache_transceiver_config: CacheTransceiverConfig | None = kwargs.get("cache_transceiver_config")
        self._overlap = not kwargs.get("disable_overlap_scheduler", False)
        self._stats_enabled = bool(kwargs.get("enable_iter_perf_stats", False))
        self._last_stats: tuple | None = None
        self._iter = 0
        config = _engine_config(str(model), dtype, self.kv_cache_config, kwargs)
        timeout_ms = self.cache_transceiver_config and self.cache_transceiver_config.kv_transfer_timeout_ms
        self._executor: FakeExecutor | None = FakeExecutor(
            config,
            transfer_timeout_s=timeout_ms / 1000.0 if timeout_ms else None,
            with_transceiver=self.cache_transceiver_config is not None,
        )

    # -- requests ----------------------------------------------------------------------
    def generate_async(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: DisaggregatedParams | None = None,
        trace_headers: Any = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        executor = self._live()
        prompt = _token_ids(inputs)
        sp = SamplingParams() if sampling_params is None else sampling_params
        kind = disaggregated_params.request_type if disaggregated_params is not None else None
        if kind == "context_only":
            if self._overlap:
                raise ValueError("context-only requests need disable_overlap_scheduler=True")
            sp.max_tokens = 1  # as the real PyTorch path does for context-only requests
        if (
            len(prompt) + (0 if kind == "context_only" else sp.max_tokens)
            > executor.engine.info.max_model_len
        ):
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({sp.max_tokens}) exceeds max_seq_len "
                f"({executor.engine.info.max_model_len})"
            )
        return executor.submit(prompt, sp, disaggregated_params, streaming)

    def generate(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        kv_cache_retention_config: Any = None,
        disaggregated_params: DisaggregatedParams | None = None,
        scheduling_params: Any = None,
        cache_salt: str | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Synchronous; call it outside a running event loop."""
        unbatched = not isinstance(inputs, list) or (bool(inputs) and isinstance(inputs[0], int))
        batch = [inputs] if unbatched else inputs
        results = [
            self.generate_async(p, sampling_params, disaggregated_params=disaggregated_params) for p in batch
        ]
        for r in results:
            r.result()
        return results[0] if unbatched else results

    # -- runtime views -------------------------------------------------------------------
    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict]:
        if self.kv_cache_config.event_buffer_max_size <= 0 or not self.kv_cache_config.enable_block_reuse:
            return []
        return self._live().feed.take(timeout)

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> _Events:
        return _Events(lambda: self.get_kv_cache_events(timeout))

    def get_stats(self, timeout: float | None = 2) -> list[dict]:
        """One snapshot of the engine when it changed since the last call (real: one per iteration)."""
        if not self._stats_enabled:
            return []
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            s = self._live().engine.stats()
            key = (s.running, s.waiting, s.free_blocks, s.prompt_tokens_computed, s.decode_tokens_computed)
            if key != self._last_stats:
                self._last_stats, self._iter = key, self._iter + 1
                return [_stats_dict(self._iter, s, self._live().engine.info.block_size)]
            if time.monotonic() >= deadline:
                return []
            time.sleep(0.01)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _live(self) -> FakeExecutor:
        if self._executor is None:
            raise RuntimeError("LLM is shutting down")
        return self._executor


class _Events:
    """Async iterator over events, ending after a `timeout` with none (like IterationResult)."""

    def __init__(self, take):
        self._take = take
        self._buffer: list[dict] = []
        self._done = False

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> dict:
        if not self._buffer and not self._done:
            self._buffer = await asyncio.to_thread(self._take)
            self._done = not self._buffer
        if not self._buffer:
            raise StopAsyncIteration
        return self._buffer.pop(0)


def _token_ids(inputs: Any) -> list[int]:
    if isinstance(inputs, dict) and "prompt_token_ids" in inputs:
        inputs = inputs["prompt_token_ids"]
    if isinstance(inputs, list | tuple) and all(isinstance(t, int) for t in inputs):
        return list(inputs)
    raise TypeError("the fake TensorRT-LLM takes token ids only (a list of int or {'prompt_token_ids': ...})")


def _engine_config(model: str, dtype: str, kv: KvCacheConfig, kwargs: dict) -> EngineConfig:
    tpb = kv.tokens_per_block
    where: dict[str, Any] = (
        {"preset": model.removeprefix(PRESET_PREFIX)}
        if model.startswith(PRESET_PREFIX)
        else {"model_path": model}
    )
    return EngineConfig(
        **where,
        dtype="float32" if dtype == "auto" else dtype,
        block_size=tpb,
        num_blocks=kv.max_tokens // tpb if kv.max_tokens else None,
        max_num_seqs=min(kwargs.get("max_batch_size") or 64, 64),
        max_num_batched_tokens=kwargs.get("max_num_tokens") or 8192,
        max_model_len=kwargs.get("max_seq_len"),
        num_threads=1,
        enable_prefix_caching=kv.enable_block_reuse,
        kv_event_buffer=max(kv.event_buffer_max_size, 1),
    )


def _stats_dict(iteration: int, s, tokens_per_block: int) -> dict:
    return {
        "iter": iteration,
        "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
        "numActiveRequests": s.running,
        "numQueuedRequests": s.waiting,
        "kvCacheStats": {
            "maxNumBlocks": s.total_blocks,
            "freeNumBlocks": s.free_blocks,
            "usedNumBlocks": s.total_blocks - s.free_blocks,
            "tokensPerBlock": tokens_per_block,
            "reusedBlocks": s.prompt_tokens_cached // tokens_per_block,
        },
    }
