"""`check_sampling` (services/model/sampling.py) is the one check of a request's
sampling, for the router and the workers alike: what the router forwards
(`sampling_to_proto` of the checked params) checks again to the same params on
a worker, seeds are drawn once, and a bad message is refused."""

from __future__ import annotations

import pytest

from pdmesh.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.validation import RequestLimits
from services.model.sampling import check_sampling, sampling_to_proto

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
def test_what_the_router_forwards_checks_to_the_same_params_on_a_worker(msg):
    at_router = check_sampling(msg, LIMITS, 300, prefix="")
    assert check_sampling(sampling_to_proto(at_router), LIMITS, 300) == at_router


def test_an_unseeded_sampled_request_gets_a_seed_and_a_greedy_one_none():
    assert check_sampling(common_pb2.SamplingParams(temperature=1.0), LIMITS, 300).seed is not None
    assert check_sampling(common_pb2.SamplingParams(), LIMITS, 300).seed is None
    assert (
        check_sampling(common_pb2.SamplingParams(temperature=1.0), LIMITS, 300, assign_seed=False).seed
        is None
    )


@pytest.mark.parametrize(
    "kw", [{"max_tokens": 0}, {"max_tokens": 101}, {"temperature": 3.0}, {"top_k": 301}, {"stop": [""]}]
)
def test_bad_sampling_is_refused_with_the_field_named(kw):
    with pytest.raises(InvalidArgument, match=f"^sampling.{next(iter(kw))}:"):
        check_sampling(common_pb2.SamplingParams(**kw), LIMITS, 300)
    with pytest.raises(InvalidArgument, match=f"^{next(iter(kw))}:"):
        check_sampling(common_pb2.SamplingParams(**kw), LIMITS, 300, prefix="")
