"""A FAKE `tensorrt_llm` for pdmesh's CPU tests. Never on sys.path in production.

It stands in for TensorRT-LLM 1.3.0rc13 (the version of the
nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc13 image that docker/Dockerfile.trtllm
uses) so that pdmesh's `trtllm` engine backend runs end to end on a machine
without a GPU. Tests put `tests/fakes` on sys.path / PYTHONPATH to use it.

Faithful (checked against the pinned version's source):
- names and import paths: tensorrt_llm.{LLM, SamplingParams, DisaggregatedParams},
  tensorrt_llm.llmapi.{LLM, SamplingParams, DisaggregatedParams, KvCacheConfig,
  CacheTransceiverConfig, RequestOutput}, tensorrt_llm.disaggregated_params,
  tensorrt_llm.sampling_params, tensorrt_llm.executor.{CompletionOutput, RequestError};
- signatures of LLM(...), generate, generate_async, get_kv_cache_events(_async), get_stats;
  field names and defaults of DisaggregatedParams, SamplingParams, KvCacheConfig,
  CacheTransceiverConfig; unknown LLM kwargs and config fields are errors;
- result shapes: RequestOutput.outputs[0] (CompletionOutput) with cumulative token_ids,
  token_ids_diff, finish_reason in {"stop","length","timeout","cancelled"} and
  disaggregated_params; streaming results are async iterators; abort(); a failed
  request raises RequestError when read;
- disaggregated states: "context_only" forces max_tokens=1, needs
  disable_overlap_scheduler=True and a cache transceiver, returns first_gen_tokens,
  ctx_request_id, opaque_state (bytes), disagg_request_id, ctx_info_endpoint, and keeps
  the KV held until pulled, aborted or kv_transfer_timeout_ms passes; "generation_only"
  with the same prompt continues from first_gen_tokens, and its token_ids start with
  that first token;
- KV events in the real dict format (created / stored with tokens and parent hash /
  removed), with block hashes that are NOT pdmesh's.

Not faithful:
- compute is pdmesh's own TorchEngine on CPU (one thread), not TensorRT-LLM kernels; only
  the sampling pdmesh maps (greedy, temperature, top-k, top-p, seed, stop token ids,
  ignore_eos) is supported, anything else raises NotImplementedError; no detokenization;
  token ids only (no text prompts); one rank (tensor_parallel_size=1); seeded sampling is
  position-deterministic here (pdmesh's rule), which real TensorRT-LLM does not promise;
- THE CACHE TRANSCEIVER IS A STAND-IN (`_pdmesh_fake/transceiver.py`): KV moves over a
  loopback TCP side channel described in opaque_state, not over NIXL/UCX, and
  opaque_state's content is the fake's own JSON, not TensorRT-LLM's serialized comm state;
- get_stats returns one snapshot per change (real: one per executor iteration, and only
  while requests run); the event stream has no "updated" events;
- `model="pdmesh-preset:<name>"` is a fake-only convention for pdmesh's built-in models.
"""

from .disaggregated_params import DisaggregatedParams
from .llmapi import LLM
from .sampling_params import SamplingParams

__version__ = "1.3.0rc13"

__all__ = ["LLM", "DisaggregatedParams", "SamplingParams", "__version__"]
