"""RetriedArrivals' table: bounded, expiring, failures leave at once, reused keys refused."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from pdmesh.v1 import common_pb2, router_pb2
from services.common.errors import FailedPrecondition, InvalidArgument
from services.router.retries import RetriedArrivals, RetryAttachConfig, fingerprint, idempotency_key


@dataclass
class Shared:  # what the table reads of a SharedFlow
    fingerprint: bytes
    done: bool = False
    done_at: float = 0.0
    error: BaseException | None = None


def test_a_running_key_attaches_and_a_finished_one_replays():
    t = RetriedArrivals()
    s = Shared(b"p")
    assert t.find("", "k", b"p") == (None, "new")
    t.add("", "k", s)  # type: ignore[arg-type]
    assert t.find("", "k", b"p") == (s, "attached")
    assert t.find("other-tenant", "k", b"p") == (None, "new")  # keys are per tenant
    s.done, s.done_at = True, time.monotonic()
    assert t.find("", "k", b"p") == (s, "replayed")


def test_a_key_for_another_request_is_refused():
    t = RetriedArrivals()
    t.add("", "k", Shared(b"p"))  # type: ignore[arg-type]
    with pytest.raises(FailedPrecondition):
        t.find("", "k", b"q")


def test_finished_entries_expire_and_failed_ones_leave_at_once():
    t = RetriedArrivals(RetryAttachConfig(ttl_s=30))
    old = Shared(b"p", done=True, done_at=time.monotonic() - 31)
    t.add("", "old", old)  # type: ignore[arg-type]
    failed = Shared(b"p", done=True, done_at=time.monotonic(), error=RuntimeError("x"))
    t.add("", "failed", failed)  # type: ignore[arg-type]
    t.ended("", "failed", failed)  # type: ignore[arg-type]
    assert t.find("", "old", b"p") == (None, "new")
    assert t.find("", "failed", b"p") == (None, "new")
    assert len(t) == 0


def test_the_table_is_bounded_oldest_first():
    t = RetriedArrivals(RetryAttachConfig(max_entries=3))
    for i in range(5):
        t.add("", f"k{i}", Shared(b"p"))  # type: ignore[arg-type]
    assert len(t) == 3
    assert t.find("", "k0", b"p")[1] == "new" and t.find("", "k4", b"p")[1] == "attached"


def test_the_key_is_read_from_metadata_and_checked():
    assert idempotency_key([("authorization", "Bearer x"), ("idempotency-key", "abc")]) == "abc"
    assert idempotency_key([("idempotency-key", b"abc")]) == "abc"
    assert idempotency_key(None) is None and idempotency_key([("idempotency-key", "")]) is None
    with pytest.raises(InvalidArgument):
        idempotency_key([("idempotency-key", "x" * 256)])


def test_the_fingerprint_ignores_the_request_id_only():
    def req(prompt: str, rid: str, max_tokens: int = 4) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(
            request_id=rid, text=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
        )

    assert fingerprint(req("a", "1")) == fingerprint(req("a", "2"))
    assert fingerprint(req("a", "1")) != fingerprint(req("b", "1"))
    assert fingerprint(req("a", "1")) != fingerprint(req("a", "1", max_tokens=5))
