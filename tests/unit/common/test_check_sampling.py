"""The router checks sampling on the wire message (`check_sampling`, no engine
types); workers convert the same message to the engine's `SamplingParams`. What
the router forwards is what it forwarded when it converted through the engine's
type and back."""

from __future__ import annotations

import pytest

from pdmesh.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.validation import RequestLimits, check_sampling
from services.worker.sampling import sampling_from_proto, sampling_to_proto

LIMITS = RequestLimits(max_tokens_limit=100)
CASES = [
    None,
    common_pb2.SamplingParams(),
    common_pb2.SamplingParams(max_tokens=5, temperature=0.7, top_k=3, stop=["x"], seed=9),
    common_pb2.SamplingParams(
        temperature=0.3, top_p=0.9, stop_token_ids=[1, 2], ignore_eos=True, seed=2**64 - 1
    ),
    common_pb2.SamplingParams(max_tokens=100, top_p=0.0),
]


@pytest.mark.parametrize("msg", CASES)
def test_the_checked_message_equals_the_round_trip_through_the_engine_type(msg):
    assert check_sampling(msg, LIMITS, 300) == sampling_to_proto(sampling_from_proto(msg, LIMITS, 300))


def test_an_unseeded_sampled_request_gets_a_seed_and_a_greedy_one_none():
    assert check_sampling(common_pb2.SamplingParams(temperature=1.0), LIMITS, 300).HasField("seed")
    assert not check_sampling(common_pb2.SamplingParams(), LIMITS, 300).HasField("seed")
    assert not check_sampling(
        common_pb2.SamplingParams(temperature=1.0), LIMITS, 300, assign_seed=False
    ).HasField("seed")


@pytest.mark.parametrize(
    "kw", [{"max_tokens": 0}, {"max_tokens": 101}, {"temperature": 3.0}, {"top_k": 301}, {"stop": [""]}]
)
def test_both_refuse_the_same_bad_sampling(kw):
    msg = common_pb2.SamplingParams(**kw)
    with pytest.raises(InvalidArgument):
        check_sampling(msg, LIMITS, 300)
    with pytest.raises(InvalidArgument):
        sampling_from_proto(msg, LIMITS, 300)
