"""MembershipGuard (services/router/membership.py): a worker speaks only for itself."""

from __future__ import annotations

import pytest

from services.common.errors import PermissionDenied
from services.router.membership import Caller, MembershipGuard
from services.router.policy import WorkerLoad
from services.router.registry import WorkerInfo, WorkerRecord, WorkerRole, WorkerSource


def record(worker_id: str, source: WorkerSource = WorkerSource.REGISTERED) -> WorkerRecord:
    info = WorkerInfo(worker_id, f"10.0.0.1:{len(worker_id)}", WorkerRole.DECODE, "m", 16)
    return WorkerRecord(info, source, WorkerLoad(), True, 0, 0, 10.0, 10.0, 0.0, 0.0)


def test_only_the_holder_of_the_incarnation_speaks_for_a_worker():
    guard = MembershipGuard()
    rec = record("d0")
    guard.check_register("d0", None, [], Caller())  # a first join needs nothing
    secret = guard.bind("d0")
    guard.check_speaks_for(rec, Caller(incarnation=secret), "heartbeat")
    for wrong in (Caller(), Caller(incarnation="x"), Caller(incarnation=secret + "x")):
        with pytest.raises(PermissionDenied, match="only the process that registered it"):
            guard.check_speaks_for(rec, wrong, "heartbeat")
        with pytest.raises(PermissionDenied, match="registered by another process"):
            guard.check_register("d0", rec, [], wrong)
    again = guard.bind("d0")  # a re-registration issues a new secret; the old one is spent
    with pytest.raises(PermissionDenied):
        guard.check_speaks_for(rec, Caller(incarnation=secret), "deregister")
    guard.check_speaks_for(rec, Caller(incarnation=again), "deregister")
    guard.forget(["d0"])
    with pytest.raises(PermissionDenied):
        guard.check_speaks_for(rec, Caller(incarnation=again), "deregister")


def test_a_certificate_names_the_only_worker_it_may_speak_for():
    guard = MembershipGuard()
    guard.bind("decode-0")
    rec = record("decode-0")
    guard.check_speaks_for(rec, Caller(certified_worker="decode-0"), "heartbeat")  # no secret needed
    guard.check_register("decode-0", rec, [], Caller(certified_worker="decode-0"))
    with pytest.raises(PermissionDenied, match="certificate is for worker 'decode-1'"):
        guard.check_speaks_for(rec, Caller(certified_worker="decode-1"), "heartbeat")
    with pytest.raises(PermissionDenied, match="'decode-1'"):
        guard.check_register("decode-0", None, [], Caller(certified_worker="decode-1"))


def test_static_workers_and_their_addresses_are_off_limits():
    guard = MembershipGuard()
    static = record("s0", WorkerSource.STATIC)
    for caller in (Caller(), Caller(certified_worker="s0")):
        with pytest.raises(PermissionDenied, match="static"):
            guard.check_speaks_for(static, caller, "heartbeat")
        with pytest.raises(PermissionDenied, match="static"):
            guard.check_register("s0", static, [], caller)
    with pytest.raises(PermissionDenied, match="static"):  # a new id at its address would remove it
        guard.check_register("evil", None, [static], Caller())
    other = record("r1")
    guard.bind("r1")
    with pytest.raises(PermissionDenied, match="'r1' is registered by another process"):
        guard.check_register("evil", None, [other], Caller(certified_worker="evil"))
