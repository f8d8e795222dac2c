"""TrtllmConfig: the TensorRT-LLM settings of the trtllm backend, derived from EngineConfig.

Everything comes from EngineConfig fields plus fixed defaults (no environment
reads), so the backend needs no flags of its own:

| TensorRT-LLM argument                                | from                                   |
|------------------------------------------------------|----------------------------------------|
| LLM(model=...)                                       | EngineConfig.model_path (required)     |
| KvCacheConfig.tokens_per_block                       | block_size (must equal the router's)   |
| KvCacheConfig.enable_block_reuse                     | enable_prefix_caching                  |
| KvCacheConfig.event_buffer_max_size                  | kv_event_buffer                        |
| KvCacheConfig.max_tokens                             | num_blocks * block_size when set       |
| max_batch_size / max_num_tokens / max_seq_len        | max_num_seqs / max_num_batched_tokens / max_model_len |
| dtype                                                | dtype                                  |
| CacheTransceiverConfig(backend, kv_transfer_timeout_ms) | "NIXL", KV_TRANSFER_TIMEOUT_MS      |
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.config import EngineConfig

# How long a context worker keeps KV for a generation worker that has not pulled
# it, and how long a generation worker waits for it (TensorRT-LLM cancels the
# request after that). The decode service also bounds the wait by the deadline.
KV_TRANSFER_TIMEOUT_MS = 30_000
FREE_GPU_MEMORY_FRACTION = 0.85
CACHE_TRANSCEIVER_BACKEND = "NIXL"


@dataclass(frozen=True)
class TrtllmConfig:
    model: str
    tokens_per_block: int
    enable_block_reuse: bool
    event_buffer_max_size: int
    max_tokens: int | None
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int | None
    dtype: str
    kv_transfer_timeout_ms: int = KV_TRANSFER_TIMEOUT_MS
    free_gpu_memory_fraction: float = FREE_GPU_MEMORY_FRACTION
    cache_transceiver_backend: str = CACHE_TRANSCEIVER_BACKEND

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> TrtllmConfig:
        if config.model_path is None:
            raise ValueError("the trtllm backend needs a model folder (--engine-model-path)")
        return cls(
            model=config.model_path,
            tokens_per_block=config.block_size,
            enable_block_reuse=config.enable_prefix_caching,
            event_buffer_max_size=config.kv_event_buffer,
            max_tokens=config.num_blocks * config.block_size if config.num_blocks else None,
            max_batch_size=config.max_num_seqs,
            max_num_tokens=config.max_num_batched_tokens,
            max_seq_len=config.max_model_len,
            dtype="auto" if config.dtype == "float32" else config.dtype,
        )

    def llm_kwargs(self, trt) -> dict:
        """Keyword arguments of tensorrt_llm.LLM for every worker role.

        `trt` is the imported `tensorrt_llm.llmapi` module. Prefill and decode
        workers are configured alike: both run the cache transceiver, and the
        overlap scheduler is off because context-only requests require that.
        """
        kv = trt.KvCacheConfig(
            enable_block_reuse=self.enable_block_reuse,
            event_buffer_max_size=self.event_buffer_max_size,
            tokens_per_block=self.tokens_per_block,
            max_tokens=self.max_tokens,
            free_gpu_memory_fraction=self.free_gpu_memory_fraction,
        )
        transceiver = trt.CacheTransceiverConfig(
            backend=self.cache_transceiver_backend, kv_transfer_timeout_ms=self.kv_transfer_timeout_ms
        )
        return {
            "model": self.model,
            "backend": "pytorch",
            "dtype": self.dtype,
            "disable_overlap_scheduler": True,
            "kv_cache_config": kv,
            "cache_transceiver_config": transceiver,
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "max_seq_len": self.max_seq_len,
            "enable_iter_perf_stats": True,
        }
