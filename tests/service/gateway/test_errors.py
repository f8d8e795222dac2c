"""The one gRPC -> HTTP map: statuses, OpenAI error objects and Retry-After."""

from __future__ import annotations

import grpc
import pytest

from services.gateway.errors import from_grpc


@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_status_codes(code, status):
    err = from_grpc(code, "why")
    assert err.status == status
    assert err.body() == {
        "error": {"message": "why", "type": err.type, "param": None, "code": code.name.lower()}
    }


def test_resource_exhausted_turns_the_router_hint_into_whole_seconds():
    err = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed", (("retry-after-ms", "1200"),))
    assert err.headers == {"Retry-After": "2", "retry-after-ms": "1200"}
    small = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed", (("retry-after-ms", "50"),))
    assert small.headers["Retry-After"] == "1"  # never 0: that would invite an immediate retry


def test_resource_exhausted_without_a_hint_still_says_when_to_retry():
    assert from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed", ()).headers == {"Retry-After": "1"}
    garbled = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed", (("retry-after-ms", "soon"),))
    assert garbled.headers == {"Retry-After": "1"}


def test_unavailable_passes_the_router_hint_on_too():
    err = from_grpc(grpc.StatusCode.UNAVAILABLE, "draining", (("retry-after-ms", "1100"),))
    assert err.status == 503 and err.headers == {"Retry-After": "2", "retry-after-ms": "1100"}
    assert from_grpc(grpc.StatusCode.UNAVAILABLE, "down", ()).headers == {"Retry-After": "1"}


def test_the_router_field_name_fills_param():
    err = from_grpc(
        grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be <= 4096 (the serving limit), got 5000"
    )
    assert err.status == 400 and err.param == "max_tokens"
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty").param is None
    assert from_grpc(grpc.StatusCode.UNAVAILABLE, "x: down").param is None
