"""Pure conversions between pdmesh requests and TensorRT-LLM's request objects.

- `sampling_kwargs`: pdmesh SamplingParams -> tensorrt_llm SamplingParams kwargs
  (InvalidRequestError for what this backend does not support);
- `state_from_params`: the context phase's DisaggregatedParams -> the engine_state
  dict a PrefillResult carries (keys = fields of the pdmesh.v1.EngineState proto);
- `params_fields`: engine_state -> DisaggregatedParams fields for the
  generation phase (InvalidHandoffError when malformed or not ours).

No tensorrt_llm import here: callers pass the classes in, so this module is
unit-tested without TensorRT-LLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.engine.api import EngineRequest, InvalidHandoffError, InvalidRequestError

BACKEND = "trtllm"
# DisaggregatedParams fields that cross the wire (tensorrt_llm/disaggregated_params.py);
# each is forwarded when not None. request_type is set by each side itself.
INT_FIELDS = ("ctx_request_id", "disagg_request_id", "ctx_dp_rank")
LIST_FIELDS = ("first_gen_tokens", "draft_tokens")
_U64 = 2**64
_I32 = 2**31


def sampling_kwargs(request: EngineRequest) -> dict[str, Any]:
    """TensorRT-LLM SamplingParams(**kwargs) for the tokens still to generate."""
    s = request.sampling
    if s.stop:
        raise InvalidRequestError(
            "sampling.stop",
            "stop strings are not supported by the trtllm backend (workers see token ids); "
            "use stop_token_ids",
        )
    kwargs: dict[str, Any] = {
        "max_tokens": s.max_tokens - len(request.resume_token_ids),
        "ignore_eos": s.ignore_eos,
        # pdmesh includes a stop token in the output; TensorRT-LLM strips it unless told.
        "include_stop_str_in_output": True,
        "detokenize": False,
    }
    if s.stop_token_ids:
        kwargs["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        kwargs["seed"] = s.seed
    if s.greedy:
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = s.temperature
        if s.top_k:
            kwargs["top_k"] = s.top_k
        if s.top_p < 1.0:
            kwargs["top_p"] = s.top_p
    return kwargs


def state_from_params(params: Any) -> dict[str, Any]:
    """engine_state of a context-only result (`outputs[0].disaggregated_params`)."""
    if params is None:
        raise InvalidHandoffError("the context phase returned no disaggregated_params")
    state: dict[str, Any] = {"backend": BACKEND}
    for name in INT_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            state[name] = int(value)
    for name in LIST_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            state[name] = [int(t) for t in value]
    opaque = getattr(params, "opaque_state", None)
    if opaque is not None:
        state["opaque_state"] = bytes(opaque)
    endpoint = getattr(params, "ctx_info_endpoint", None)
    if endpoint is not None:
        state["ctx_info_endpoint"] = str(endpoint)
    return state


def params_fields(state: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """DisaggregatedParams(**fields) of a generation-only request; InvalidHandoffError if malformed."""
    if state.get("backend") != BACKEND:
        raise InvalidHandoffError(f"KV state of backend {state.get('backend')!r}, this engine is {BACKEND!r}")
    unknown = set(state) - {"backend", "opaque_state", "ctx_info_endpoint", *INT_FIELDS, *LIST_FIELDS}
    if unknown:
        raise InvalidHandoffError(f"unknown engine_state fields {sorted(unknown)}")
    first = state.get("first_gen_tokens")
    if not first or not all(isinstance(t, int) and 0 <= t < vocab_size for t in first):
        raise InvalidHandoffError(f"first_gen_tokens must be token ids < {vocab_size}, got {first!r}")
    opaque = state.get("opaque_state")
    if not isinstance(opaque, bytes) or not opaque:
        raise InvalidHandoffError("opaque_state (the context worker's transfer state) is missing")
    if state.get("ctx_request_id") is None and state.get("disagg_request_id") is None:
        raise InvalidHandoffError("neither ctx_request_id nor disagg_request_id is set")
    for name, bound in (("ctx_request_id", _U64), ("disagg_request_id", _U64), ("ctx_dp_rank", _I32)):
        value = state.get(name)
        if value is not None and not (isinstance(value, int) and 0 <= value < bound):
            raise InvalidHandoffError(f"{name} {value!r} out of range")
    fields = {k: v for k, v in state.items() if k != "backend"}
    fields["first_gen_tokens"] = list(first)
    return fields
