"""Request validation against an engine's limits, before anything is allocated.

Pure functions of (request, EngineInfo), so the async engine can reject a bad
request on the caller's thread and the core can re-check on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.api import EngineInfo, EngineRequest, InvalidRequestError
from services.model.sampling import sampling_problem


def validate_request(request: EngineRequest, info: EngineInfo) -> None:
    """Raise InvalidRequestError naming the first bad field."""
    if not request.request_id:
        raise InvalidRequestError("request_id", "must be non-empty")
    num_prompt = len(request.prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("prompt_token_ids", "must not be empty")
    check_token_ids("prompt_token_ids", request.prompt_token_ids, info.vocab_size)
    num_resume = len(request.resume_token_ids)
    if num_resume:
        check_token_ids("resume_token_ids", request.resume_token_ids, info.vocab_size)
    if num_prompt + num_resume >= info.max_model_len:
        raise InvalidRequestError(
            "prompt_token_ids",
            f"{num_prompt} prompt + {num_resume} resumed tokens leave no room for output "
            f"in the context limit of {info.max_model_len} tokens",
        )
    problem = sampling_problem(request.sampling, info.vocab_size)
    if problem is not None:
        raise InvalidRequestError(f"sampling.{problem[0]}", problem[1])
    if num_resume >= request.sampling.max_tokens:
        raise InvalidRequestError(
            "resume_token_ids",
            f"{num_resume} resumed tokens already reach max_tokens={request.sampling.max_tokens}",
        )


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    lo, hi = min(token_ids), max(token_ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidRequestError(field, f"token id {bad} not in [0, {vocab_size})")
