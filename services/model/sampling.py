"""The sampling rules, written once: every service and engine checks a request with them.

`SamplingParams` and `FinishReason` are the boundary types (the engine re-exports
them). `sampling_problem` is a pure function of the params and the vocabulary size;
it names the first bad field by its public name (`max_tokens`, `top_k`, ...) and
states the limit that applies. Callers turn the answer into their own typed error
(the engine's `InvalidRequestError`, a service's `InvalidArgument`) and may prefix
the field with where it sits in their message (`sampling.`).

`draw_seed` is the one place an unseeded sampled request gets its seed, so every
worker that samples for it agrees (position-deterministic sampling).

`check_sampling` applies them to the wire message (plus the serving limits of
`RequestLimits`) for the router and the workers alike; `sampling_to_proto` and
`FINISH_TO_PROTO` convert back.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import secrets
from dataclasses import dataclass

from pdmesh.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.validation import DEFAULT_MAX_TOKENS, RequestLimits

SEED_BITS = 63  # fits int64 and uint64 alike (proto, torch generators)


def draw_seed() -> int:
    """A fresh seed for a sampled request that came without one."""
    return secrets.randbits(SEED_BITS)


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; checked by `sampling_problem` against the model.

    With a seed, the draw for output position i depends only on (seed, i)
    (position-deterministic), so a token sampled by a prefill worker equals the
    one the decode worker would have drawn.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_problem(
    p: SamplingParams, vocab_size: int, max_tokens_limit: int | None = None
) -> tuple[str, str] | None:
    """(field, message) of the first rule `p` breaks, or None when it is fine.

    `max_tokens_limit` is the serving limit when the caller has one (the router's
    `RequestLimits`); an engine alone bounds max_tokens only from below.
    """
    max_tokens, temperature, top_p, top_k = p.max_tokens, p.temperature, p.top_p, p.top_k
    if max_tokens < 1 or (max_tokens_limit is not None and max_tokens > max_tokens_limit):
        bound = f"in [1, {max_tokens_limit}] (the serving limit)" if max_tokens_limit is not None else ">= 1"
        return "max_tokens", f"must be {bound}, got {max_tokens}"
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        return "temperature", f"must be in [0, 2], got {temperature}"
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        return "top_p", f"must be in (0, 1], got {top_p}"
    if not (0 <= top_k <= vocab_size):
        return "top_k", f"must be in [0, {vocab_size}] (0 = off; the vocabulary size), got {top_k}"
    if p.seed is not None and not (0 <= p.seed < 2**64):
        return "seed", f"must be in [0, {2**64 - 1}], got {p.seed}"
    if any(s == "" for s in p.stop):
        return "stop", "stop strings must be non-empty"
    bad = next((t for t in p.stop_token_ids if not (0 <= t < vocab_size)), None)
    if bad is not None:
        return "stop_token_ids", f"token {bad} is not in [0, {vocab_size}) (the vocabulary)"
    return None


# ---- the wire message (pdmesh.v1.SamplingParams) --------------------------------------


def check_sampling(
    msg: common_pb2.SamplingParams | None,
    limits: RequestLimits,
    vocab_size: int,
    *,
    assign_seed: bool = True,
    prefix: str = "sampling.",
) -> SamplingParams:
    """Validate a request's sampling message (the rules above plus the serving limits)
    and convert it; an unseeded sampled request gets its seed here (`draw_seed`), so
    every worker that samples for it agrees.

    Counts before copies: len() of a repeated field is its size, while tuple() would
    make an object per entry of whatever the client sent. `prefix` is how fields are
    named in messages: "sampling." inside the mesh, "" at the router's public edge
    (the names an OpenAI client knows: `max_tokens`)."""
    if msg is None:
        msg = common_pb2.SamplingParams()
    if len(msg.stop) > limits.max_stop_strings:
        raise InvalidArgument(
            f"{prefix}stop: at most {limits.max_stop_strings} stop strings, got {len(msg.stop)}"
        )
    if len(msg.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument(
            f"{prefix}stop_token_ids: at most {limits.max_stop_token_ids} ids, got {len(msg.stop_token_ids)}"
        )
    params = SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0.0 else 1.0,  # 0 = unset (= 1, off)
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )
    problem = sampling_problem(params, vocab_size, limits.max_tokens_limit)
    if problem is not None:
        raise InvalidArgument(f"{prefix}{problem[0]}: {problem[1]}")
    if any(len(s.encode()) > limits.max_stop_string_bytes for s in params.stop):
        raise InvalidArgument(f"{prefix}stop: stop strings must be <= {limits.max_stop_string_bytes} bytes")
    if params.seed is None and not params.greedy and assign_seed:
        params = dataclasses.replace(params, seed=draw_seed())
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
