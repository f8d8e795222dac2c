"""The `trtllm` engine backend: pdmesh's Engine protocol over TensorRT-LLM's LLM API.

Pinned: TensorRT-LLM 1.3.0rc13 (image nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc13,
docker/Dockerfile.trtllm). The calls come from these files at that version:

- tensorrt_llm/llmapi/llm.py: LLM(model, backend="pytorch", **TorchLlmArgs),
  LLM.generate_async(inputs, sampling_params, streaming, disaggregated_params) -> RequestOutput
  (awaitable / async-iterable; RequestOutput.abort()), LLM.get_kv_cache_events(timeout),
  LLM.get_stats(timeout), LLM.shutdown();
- tensorrt_llm/llmapi/llm_args.py: KvCacheConfig(enable_block_reuse, event_buffer_max_size,
  tokens_per_block, max_tokens, free_gpu_memory_fraction), CacheTransceiverConfig(backend="NIXL",
  kv_transfer_timeout_ms), TorchLlmArgs.disable_overlap_scheduler / enable_iter_perf_stats;
- tensorrt_llm/disaggregated_params.py: DisaggregatedParams(request_type, first_gen_tokens,
  ctx_request_id, opaque_state, draft_tokens, disagg_request_id, ctx_dp_rank, ctx_info_endpoint);
- tensorrt_llm/sampling_params.py: SamplingParams;
- tensorrt_llm/executor/result.py: CompletionOutput (token_ids, finish_reason, disaggregated_params);
- tensorrt_llm/_utils.py: KVCacheEventSerializer (the event dicts, see kv_events.py).

Nothing here imports tensorrt_llm at import time: `TrtllmEngine.start()` does.
Modules: config (TrtllmConfig from EngineConfig), handoff (pure request/state
conversions), kv_events (event mapping), engine (TrtllmEngine).
"""
