"""Request validation shared by every service, on the wire messages.

(The conversion to the engine's types, `check_sampling` and friends, is in
services/worker/sampling.py: common sits below the engine and cannot import it.)

Each check names the offending field in an `InvalidArgument` so the client
sees, e.g., `INVALID_ARGUMENT: max_tokens: must be in [1, 4096] (the serving limit), got 0`
(public names at the router's edge; `sampling.max_tokens` inside the mesh). The
sampling rules themselves live in services.model.sampling, shared with the engines.
Validation happens before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def check_prompt_length(n: int, max_model_len: int, limits: RequestLimits, field: str = "prompt") -> None:
    """The prompt's length alone (callers check it on a repeated field's len() before copying it)."""
    _check(n > 0, field, "the prompt is empty")
    limit = min(limits.max_prompt_tokens, max_model_len - 1)
    why = (
        "the serving limit"
        if limit == limits.max_prompt_tokens
        else f"the model context of {max_model_len} tokens less one output token"
    )
    _check(n <= limit, field, f"{n} tokens exceed the limit of {limit} ({why})")


def check_prompt(
    token_ids: Sequence[int],
    max_tokens: int,
    vocab_size: int,
    max_model_len: int,
    limits: RequestLimits,
    field: str = "prompt_token_ids",
    max_tokens_field: str = "sampling.max_tokens",
) -> None:
    """A prompt must be non-empty, in-vocabulary and fit the context with its output.

    Messages state the limit that applies: the smaller of the serving limit and the
    model context less one output token."""
    n = len(token_ids)
    check_prompt_length(n, max_model_len, limits, field)
    _check(
        n + max_tokens <= max_model_len,
        max_tokens_field,
        f"the prompt ({n} tokens) + max_tokens ({max_tokens}) exceed the model context of "
        f"{max_model_len} tokens; at most {max_model_len - n} output tokens fit",
    )
    # max() in C first: the generator walks a long prompt in Python, once per request.
    bad = (
        next((t for t in token_ids if t >= vocab_size), None)
        if max(token_ids, default=0) >= vocab_size
        else None
    )
    _check(bad is None, field, f"token {bad} is not in [0, {vocab_size}) (the vocabulary)")


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


MAX_WAITED_S = 86_400.0


def check_waited(waited_s: float) -> None:
    """The wait a request brings from earlier attempts: finite, in [0, a day]."""
    _check(0.0 <= waited_s <= MAX_WAITED_S, "waited_s", f"must be in [0, {MAX_WAITED_S:g}], got {waited_s}")


def check_enum(value: int, enum_type: object, field: str) -> None:
    """Unknown enum numbers (sent by newer or broken clients) are refused."""
    known = {v.number for v in enum_type.DESCRIPTOR.values}  # type: ignore[attr-defined]
    _check(value in known, field, f"unknown value {value}")
