"""The HTTP door's retry hints (issue 18 item 4): what a shed or unavailable request
gets as `Retry-After` / `retry-after-ms` is the router's hint, jittered like the gRPC
door's trailer, so OpenAI-SDK clients shed together do not come back together."""

from __future__ import annotations

from services.common.errors import ResourceExhausted, Unavailable
from services.router.http_door import http_error


def test_a_shed_gets_429_with_a_jittered_hint_never_below_the_estimate():
    errs = [http_error(ResourceExhausted("queue full", retry_after_s=2.0)) for _ in range(40)]
    assert all(e.status == 429 for e in errs)
    hints = [int(e.headers["retry-after-ms"]) for e in errs]
    assert all(2000 <= h <= 2500 for h in hints) and len(set(hints)) > 5
    assert {e.headers["Retry-After"] for e in errs} <= {"2", "3"}


def test_unavailable_gets_503_with_a_hint_too():
    err = http_error(Unavailable("no healthy decode worker"))
    assert err.status == 503 and err.headers["Retry-After"] == "1"
    assert 500 <= int(err.headers["retry-after-ms"]) <= 625
