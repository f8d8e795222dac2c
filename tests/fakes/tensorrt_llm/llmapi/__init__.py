"""Fake of `tensorrt_llm.llmapi`: the names pdmesh imports from it."""

from ..disaggregated_params import DisaggregatedParams
from ..sampling_params import SamplingParams
from .llm import LLM, RequestOutput
from .llm_args import CacheTransceiverConfig, KvCacheConfig

__all__ = [
    "LLM",
    "CacheTransceiverConfig",
    "DisaggregatedParams",
    "KvCacheConfig",
    "RequestOutput",
    "SamplingParams",
]
