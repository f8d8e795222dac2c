"""HTTP errors of the gateway as OpenAI error objects, and the one gRPC -> HTTP map.

Every failure a client sees is `{"error": {"message", "type", "param", "code"}}`
with a status code that says who should act: 400 for the request (malformed
body, unsupported parameter, or the router's INVALID_ARGUMENT, whose leading
"field:" becomes `param`), 404 for an unknown model (as OpenAI and vLLM answer),
429 with `Retry-After` when the router sheds (RESOURCE_EXHAUSTED and its
"retry-after-ms" trailer, also passed on as the `retry-after-ms` header the
OpenAI SDK reads first), 503 with the same headers when the router is
unreachable or draining (UNAVAILABLE), 504 on DEADLINE_EXCEEDED, 401 with `WWW-Authenticate: Bearer`
on UNAUTHENTICATED (a missing or unknown API key).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import grpc


@dataclass
class GatewayError(Exception):
    """An error the gateway answers with; `body()` is the OpenAI error object."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param, code)


# gRPC status -> (HTTP status, OpenAI error type)
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
}

# Retry-After when the router sheds or is unavailable without a hint (seconds).
DEFAULT_RETRY_AFTER_S = 1


def retry_after_ms(trailing: object) -> int | None:
    """The router's "retry-after-ms" hint from trailing metadata, if any."""
    for key, value in trailing or ():  # type: ignore[union-attr]
        if key == "retry-after-ms":
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


# The router names the offending public field first: "max_tokens: must be <= 4096 ...".
_FIELD = re.compile(r"^(?P<param>[a-z_]+(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*): ")


def from_grpc(code: grpc.StatusCode, details: str, trailing: object = ()) -> GatewayError:
    """The HTTP error for a failed router call (the only gRPC -> HTTP translation)."""
    status, kind = _STATUS.get(code, (500, "internal_error"))
    err = GatewayError(status, details or code.name, kind, code=code.name.lower())
    if status == 400 and (m := _FIELD.match(details or "")):
        err.param = m.group("param")
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        ms = retry_after_ms(trailing)
        # Retry-After is whole seconds (RFC 9110); the exact hint rides along in ms.
        err.headers["Retry-After"] = str(
            max(1, math.ceil(ms / 1000)) if ms is not None else DEFAULT_RETRY_AFTER_S
        )
        if ms is not None:
            err.headers["retry-after-ms"] = str(ms)
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        err.headers["WWW-Authenticate"] = "Bearer"
    return err
