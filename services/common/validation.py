"""Request validation shared by every service, on the wire messages.

(The conversion to the engine's types, `sampling_from_proto` and friends, is in
services/worker/sampling.py: common sits below the engine and cannot import it.)

Each check names the offending field in an `InvalidArgument` so the client
sees, e.g., `INVALID_ARGUMENT: sampling.max_tokens: must be >= 1, got 0`.
Validation happens before anything is allocated.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdmesh.v1 import common_pb2
from services.common.config import require, setting
from services.common.errors import InvalidArgument

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class RequestLimits:
    max_tokens_limit: int = setting(4096, "largest max_tokens a request may ask for")
    max_prompt_tokens: int = setting(32768, "longest prompt accepted (the model context also bounds it)")
    max_stop_strings: int = setting(16, "most stop strings per request")
    max_stop_string_bytes: int = setting(256, "longest stop string in bytes")
    max_stop_token_ids: int = setting(64, "most stop token ids per request")
    max_request_id_bytes: int = setting(128, "longest request id in bytes")
    max_tenant_bytes: int = setting(128, "longest tenant name in bytes")
    min_priority: int = setting(-10, "lowest allowed priority")
    max_priority: int = setting(10, "highest allowed priority")

    def __post_init__(self) -> None:
        require(self.max_tokens_limit >= 1, "max_tokens_limit must be >= 1")
        require(self.max_prompt_tokens >= 1, "max_prompt_tokens must be >= 1")
        require(self.min_priority <= self.max_priority, "min_priority must be <= max_priority")


def _check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise InvalidArgument(f"{field}: {message}")


def check_sampling(
    msg: common_pb2.SamplingParams | None,
    limits: RequestLimits,
    vocab_size: int,
    *,
    assign_seed: bool = True,
) -> common_pb2.SamplingParams:
    """Validate and normalize: defaults filled in (max_tokens, top_p), and an
    unseeded sampled request gets a fresh seed so every worker that samples for
    it agrees (position-deterministic sampling). Returns a new message holding
    only the fields the mesh uses."""
    if msg is None:
        msg = common_pb2.SamplingParams()
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    _check(max_tokens >= 1, "sampling.max_tokens", f"must be >= 1, got {max_tokens}")
    _check(
        max_tokens <= limits.max_tokens_limit,
        "sampling.max_tokens",
        f"must be <= {limits.max_tokens_limit} (the serving limit), got {max_tokens}",
    )
    temp = msg.temperature
    _check(
        math.isfinite(temp) and 0.0 <= temp <= 2.0, "sampling.temperature", f"must be in [0, 2], got {temp}"
    )
    top_p = msg.top_p if msg.top_p != 0.0 else 1.0
    _check(
        math.isfinite(top_p) and 0.0 < top_p <= 1.0, "sampling.top_p", f"must be in (0, 1], got {msg.top_p}"
    )
    _check(0 <= msg.top_k <= vocab_size, "sampling.top_k", f"must be in [0, {vocab_size}], got {msg.top_k}")
    # Counts before copies: len() of a repeated field is its size; tuple() makes an object
    # per entry of whatever the client sent.
    _check(
        len(msg.stop) <= limits.max_stop_strings,
        "sampling.stop",
        f"at most {limits.max_stop_strings} stop strings, got {len(msg.stop)}",
    )
    stops = tuple(msg.stop)
    for s in stops:
        _check(s != "", "sampling.stop", "stop strings must be non-empty")
        _check(
            len(s.encode()) <= limits.max_stop_string_bytes,
            "sampling.stop",
            f"stop strings must be <= {limits.max_stop_string_bytes} bytes",
        )
    _check(
        len(msg.stop_token_ids) <= limits.max_stop_token_ids,
        "sampling.stop_token_ids",
        f"at most {limits.max_stop_token_ids} ids, got {len(msg.stop_token_ids)}",
    )
    stop_ids = tuple(msg.stop_token_ids)
    for t in stop_ids:
        _check(t < vocab_size, "sampling.stop_token_ids", f"token {t} is not in [0, {vocab_size})")
    seed = msg.seed if msg.HasField("seed") else None
    if seed is None and temp > 0.0 and assign_seed:
        seed = random.getrandbits(63)
    checked = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=temp,
        top_p=top_p,
        top_k=msg.top_k,
        stop=list(stops),
        stop_token_ids=list(stop_ids),
        ignore_eos=msg.ignore_eos,
    )
    if seed is not None:
        checked.seed = seed
    return checked


def check_prompt(
    token_ids: Sequence[int],
    max_tokens: int,
    vocab_size: int,
    max_model_len: int,
    limits: RequestLimits,
    field: str = "prompt_token_ids",
) -> None:
    """A prompt must be non-empty, in-vocabulary and fit the context with its output."""
    _check(len(token_ids) > 0, field, "the prompt is empty")
    _check(
        len(token_ids) <= limits.max_prompt_tokens,
        field,
        f"{len(token_ids)} tokens exceed the limit of {limits.max_prompt_tokens}",
    )
    _check(
        len(token_ids) < max_model_len,
        field,
        f"{len(token_ids)} prompt tokens do not fit the model context of {max_model_len}",
    )
    _check(
        len(token_ids) + max_tokens <= max_model_len,
        "sampling.max_tokens",
        f"prompt ({len(token_ids)}) + max_tokens ({max_tokens}) exceed the model context of {max_model_len}",
    )
    bad = next((t for t in token_ids if t >= vocab_size), None)
    _check(bad is None, field, f"token {bad} is not in [0, {vocab_size})")


def check_resume(resume_ids: Sequence[int], max_tokens: int, vocab_size: int) -> None:
    """Tokens an earlier attempt produced (migration): in-vocabulary and fewer than max_tokens."""
    _check(
        len(resume_ids) < max_tokens,
        "resume_token_ids",
        f"{len(resume_ids)} tokens already reach max_tokens {max_tokens}",
    )
    bad = next((t for t in resume_ids if t >= vocab_size), None)
    _check(bad is None, "resume_token_ids", f"token {bad} is not in [0, {vocab_size})")


def check_ident(value: str, field: str, limit: int, required: bool = False) -> None:
    _check(not required or value != "", field, "is required")
    _check(len(value.encode()) <= limit, field, f"must be <= {limit} bytes")


def check_priority(priority: int, limits: RequestLimits) -> None:
    _check(
        limits.min_priority <= priority <= limits.max_priority,
        "priority",
        f"must be in [{limits.min_priority}, {limits.max_priority}], got {priority}",
    )


def check_enum(value: int, enum_type: object, field: str) -> None:
    """Unknown enum numbers (sent by newer or broken clients) are refused."""
    known = {v.number for v in enum_type.DESCRIPTOR.values}  # type: ignore[attr-defined]
    _check(value in known, field, f"unknown value {value}")
