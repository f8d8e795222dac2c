"""Pure conversions of the trtllm backend: sampling, and the handed-over engine state."""

from __future__ import annotations

import pytest
from tensorrt_llm.disaggregated_params import DisaggregatedParams

from pdmesh.v1 import common_pb2
from services.decode.remote_prefill import engine_state_from_proto
from services.engine.api import EngineRequest, InvalidHandoffError, InvalidRequestError, SamplingParams
from services.engine.trtllm.handoff import params_fields, sampling_kwargs, state_from_params


def req(resume=(), **sampling) -> EngineRequest:
    return EngineRequest("r", [5, 6, 7], SamplingParams(**sampling), resume_token_ids=resume)


def test_greedy_maps_to_top_k_1_and_resume_tokens_count_against_max_tokens():
    kw = sampling_kwargs(req(resume=(9, 9), max_tokens=10, stop_token_ids=(3,)))
    assert kw["top_k"] == 1 and "temperature" not in kw
    assert kw["max_tokens"] == 8
    assert kw["stop_token_ids"] == [3] and kw["include_stop_str_in_output"] is True


def test_sampled_request_keeps_temperature_top_p_top_k_seed():
    kw = sampling_kwargs(req(temperature=0.7, top_p=0.9, top_k=40, seed=11, ignore_eos=True))
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["seed"], kw["ignore_eos"]) == (
        0.7,
        0.9,
        40,
        11,
        True,
    )


def test_stop_strings_are_refused_with_the_field_named():
    with pytest.raises(InvalidRequestError) as e:
        sampling_kwargs(req(stop=("END",)))
    assert e.value.field == "sampling.stop" and "trtllm" in str(e.value)


def context_params(**over) -> DisaggregatedParams:
    values = {
        "request_type": "context_only",
        "first_gen_tokens": [42],
        "ctx_request_id": 7,
        "opaque_state": b"\x00state",
        "disagg_request_id": 2**61 + 5,
        "ctx_dp_rank": 0,
        "ctx_info_endpoint": "10.0.0.1:1234",
    }
    values.update(over)
    return DisaggregatedParams(**values)


def test_every_set_field_crosses_the_wire_and_comes_back_identical():
    state = state_from_params(context_params())
    assert state == {
        "backend": "trtllm",
        "first_gen_tokens": [42],
        "ctx_request_id": 7,
        "opaque_state": b"\x00state",
        "disagg_request_id": 2**61 + 5,
        "ctx_dp_rank": 0,
        "ctx_info_endpoint": "10.0.0.1:1234",
    }
    assert "draft_tokens" not in state  # None fields are not forwarded
    wire = common_pb2.EngineState.FromString(common_pb2.EngineState(**state).SerializeToString())
    back = engine_state_from_proto(wire)
    assert back == state
    fields = params_fields(back, vocab_size=512)
    gen = DisaggregatedParams(request_type="generation_only", **fields)
    assert gen.opaque_state == b"\x00state" and gen.first_gen_tokens == [42] and gen.ctx_request_id == 7


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"backend": "torch"}, "backend"),
        ({"first_gen_tokens": []}, "first_gen_tokens"),
        ({"first_gen_tokens": [600]}, "first_gen_tokens"),
        ({"opaque_state": None}, "opaque_state"),
        ({"ctx_request_id": None, "disagg_request_id": None}, "request_id"),
        ({"ctx_request_id": -1}, "ctx_request_id"),
        ({"surprise": 1}, "unknown"),
    ],
)
def test_malformed_state_is_refused_before_anything_runs(change, message):
    state = {k: v for k, v in {**state_from_params(context_params()), **change}.items() if v is not None}
    with pytest.raises(InvalidHandoffError) as e:
        params_fields(state, vocab_size=512)
    assert message in str(e.value)
