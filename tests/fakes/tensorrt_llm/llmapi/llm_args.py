"""Fake of the parts of `tensorrt_llm/llmapi/llm_args.py` (1.3.0rc13) that pdmesh uses.

KvCacheConfig and CacheTransceiverConfig are strict pydantic models like the
real ones (unknown fields raise pydantic.ValidationError), with the same field
names and defaults. `TORCH_LLM_ARG_NAMES` lists the keyword arguments the fake
`LLM(...)` accepts (a subset of TorchLlmArgs; anything else is a ValueError,
as the real constructor reports "got invalid argument").
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KvCacheConfig(StrictBaseModel):
    enable_block_reuse: bool = True
    max_tokens: int | None = None
    max_attention_window: list[PositiveInt] | None = None
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = Field(default=0.9, ge=0, le=1)
    host_cache_size: int | None = None
    onboard_blocks: bool = True
    cross_kv_cache_fraction: float | None = None
    secondary_offload_min_priority: int | None = None
    event_buffer_max_size: int = 0
    attention_dp_events_gather_period_ms: int = 5
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    use_uvm: bool = False
    max_gpu_total_bytes: int = Field(default=0, ge=0)
    dtype: str = "auto"
    mamba_ssm_cache_dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    tokens_per_block: int = 32


class CacheTransceiverConfig(StrictBaseModel):
    backend: Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"] | None = None
    max_tokens_in_buffer: int | None = None
    kv_transfer_timeout_ms: PositiveInt | None = None
    kv_transfer_sender_future_timeout_ms: PositiveInt | None = 1000


TORCH_LLM_ARG_NAMES = frozenset(
    {
        "backend",
        "kv_cache_config",
        "cache_transceiver_config",
        "disable_overlap_scheduler",
        "max_batch_size",
        "max_num_tokens",
        "max_seq_len",
        "max_input_len",
        "enable_chunked_prefill",
        "enable_iter_perf_stats",
        "return_perf_metrics",
        "pipeline_parallel_size",
        "gpus_per_node",
        "stream_interval",
    }
)
