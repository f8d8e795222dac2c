"""Sampling and finish reasons between the wire and the engine's types.

`check_sampling` (services/common/validation.py) validates the message; this
module turns the checked message into the engine's `SamplingParams` and back.
It lives in the worker framework because only workers hold an engine.
"""

from __future__ import annotations

from pdmesh.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.validation import RequestLimits, check_sampling
from services.engine.api import FinishReason, InvalidRequestError, SamplingParams


def sampling_from_proto(
    msg: common_pb2.SamplingParams | None,
    limits: RequestLimits,
    vocab_size: int,
    *,
    assign_seed: bool = True,
) -> SamplingParams:
    """Validate (`check_sampling`) and convert to the engine's type."""
    checked = check_sampling(msg, limits, vocab_size, assign_seed=assign_seed)
    params = SamplingParams(
        max_tokens=checked.max_tokens,
        temperature=checked.temperature,
        top_p=checked.top_p,
        top_k=checked.top_k,
        seed=checked.seed if checked.HasField("seed") else None,
        stop=tuple(checked.stop),
        stop_token_ids=tuple(checked.stop_token_ids),
        ignore_eos=checked.ignore_eos,
    )
    try:
        params.validate(vocab_size)
    except InvalidRequestError as e:
        raise InvalidArgument(str(e)) from e
    return params


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


FINISH_TO_PROTO = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
}
