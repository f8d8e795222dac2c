"""Fake of `tensorrt_llm/disaggregated_params.py` (TensorRT-LLM 1.3.0rc13).

Same class name, keyword-only slotted dataclass, field names, defaults and
request-type validation (ValueError for an unknown type) as the pinned
version. `get_request_type` returns a small enum instead of the C++ binding's
`tllme.RequestType`; `get_context_phase_params` is not faked (the fake never
builds C++ requests).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

_REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")


class RequestType(enum.IntEnum):
    """Stand-in for tensorrt_llm.bindings.executor.RequestType."""

    REQUEST_TYPE_CONTEXT_AND_GENERATION = 0
    REQUEST_TYPE_CONTEXT_ONLY = 1
    REQUEST_TYPE_GENERATION_ONLY = 2


class DisaggScheduleStyle(enum.IntEnum):
    CONTEXT_FIRST = 0
    GENERATION_FIRST = 1


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    """Parameters of a disaggregated (context-only / generation-only) request.

    The context phase returns them on `CompletionOutput.disaggregated_params`;
    the generation phase gets them back with request_type="generation_only".
    """

    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list | None = None
    first_gen_logits: list | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: DisaggScheduleStyle | None = None
    multimodal_embedding_handles: list[dict[str, Any]] | None = None
    multimodal_hashes: list[list[int]] | None = None
    mrope_position_ids_handle: dict[str, Any] | None = None
    mrope_position_deltas_handle: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.request_type is not None:
            self.request_type = self.request_type.lower()
            if self.request_type not in _REQUEST_TYPES:
                raise ValueError(
                    f"Unknown request type: {self.request_type}. Must be context_only, "
                    "generation_only or context_and_generation"
                )

    def get_request_type(self) -> RequestType:
        if self.request_type == "context_only":
            return RequestType.REQUEST_TYPE_CONTEXT_ONLY
        if self.request_type == "generation_only":
            return RequestType.REQUEST_TYPE_GENERATION_ONLY
        if self.request_type == "context_and_generation":
            return RequestType.REQUEST_TYPE_CONTEXT_AND_GENERATION
        raise ValueError(f"Unknown request type: {self.request_type}")
