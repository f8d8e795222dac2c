"""Who may write an agent name in the registry (issue 13, item 1): its owner only.

Before the fix any caller could overwrite or remove any name; the hostile
re-registration of a prefill worker's agent (address + block_bytes) made decode
workers read the wrong blocks.
"""

from dataclasses import replace

import pytest

from kvtransfer.agents import AgentRecord
from kvtransfer.layout import KvLayout
from services.common.errors import InvalidArgument
from services.kvtransfer.registry import AgentRegistry, NotOwner, Owner, UnknownAgent

LAYOUT = KvLayout(2, 2, 16, "float32", 4)
ALICE = Owner.of("", b"a" * 32)  # the prefill worker's process
MALLORY = Owner.of("", b"m" * 32)
ALICE_RESTARTED = Owner.of("", b"A" * 32)  # same worker, new process, new secret
CERT_P0 = Owner.of("prefill/prefill-0", b"")
CERT_P0_NEW_SECRET = Owner.of("prefill/prefill-0", b"x" * 32)
CERT_D1 = Owner.of("decode/decode-1", b"")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def rec(name="prefill-0-7", address=4096):
    return AgentRecord(
        name=name, metadata=b"md", layout=LAYOUT, num_blocks=8, address=address, length=8 * LAYOUT.block_bytes
    )


@pytest.fixture
def reg():
    clock = Clock()
    return clock, AgentRegistry(clock=clock, default_lease_s=10, max_lease_s=60)


def test_a_live_name_cannot_be_overwritten_by_another_secret(reg):
    _, r = reg
    r.register(rec(), owner=ALICE)
    hostile = replace(rec(), address=4096 + LAYOUT.block_bytes, num_blocks=7)
    with pytest.raises(NotOwner):
        r.register(hostile, owner=MALLORY)
    assert r.get("prefill-0-7").address == 4096 and r.get("prefill-0-7").num_blocks == 8
    assert r.refusals == 1


def test_nobody_else_can_heartbeat_or_remove_a_name(reg):
    _, r = reg
    stored, _ = r.register(rec(), owner=ALICE)
    with pytest.raises(NotOwner):
        r.heartbeat("prefill-0-7", stored.incarnation, MALLORY)
    with pytest.raises(NotOwner):
        r.deregister("prefill-0-7", stored.incarnation, MALLORY)
    assert r.get("prefill-0-7").incarnation == stored.incarnation
    assert r.heartbeat("prefill-0-7", stored.incarnation, ALICE) == 10
    assert r.deregister("prefill-0-7", stored.incarnation, ALICE) is True


def test_the_owner_re_registers_with_its_secret(reg):
    _, r = reg
    r.register(rec(), owner=ALICE)
    again, _ = r.register(rec(address=8192), owner=ALICE)
    assert again.incarnation == 2 and r.get("prefill-0-7").address == 8192


def test_a_lapsed_name_may_be_claimed_by_a_restarted_process_with_a_new_secret(reg):
    clock, r = reg
    r.register(rec(), owner=ALICE)
    with pytest.raises(NotOwner):  # still live: the restarted process must wait for the lease
        r.register(rec(), owner=ALICE_RESTARTED)
    clock.t = 10.5
    claimed, _ = r.register(rec(address=12288), owner=ALICE_RESTARTED)
    assert claimed.address == 12288
    with pytest.raises(NotOwner):  # and now the old secret is the stranger
        r.register(rec(), owner=ALICE)


def test_a_deregistered_name_is_free_to_claim(reg):
    _, r = reg
    stored, _ = r.register(rec(), owner=ALICE)
    assert r.deregister("prefill-0-7", stored.incarnation, ALICE)
    assert r.register(rec(), owner=MALLORY)[0].incarnation == 2


def test_a_certified_name_belongs_to_its_certificate_for_good(reg):
    clock, r = reg
    r.register(rec(), owner=CERT_P0)
    with pytest.raises(NotOwner):  # another internal certificate (the issue tried decode-1's)
        r.register(rec(address=0), owner=CERT_D1)
    with pytest.raises(NotOwner):
        r.register(rec(address=0), owner=MALLORY)
    clock.t = 100.0  # lapsed: still the certificate's
    with pytest.raises(NotOwner):
        r.register(rec(address=0), owner=MALLORY)
    # The same certificate after a restart (new process, new secret) takes it back.
    back, _ = r.register(rec(address=16384), owner=CERT_P0_NEW_SECRET)
    assert back.address == 16384
    assert r.heartbeat("prefill-0-7", back.incarnation, CERT_P0) == 10


def test_a_registration_needs_an_owner(reg):
    _, r = reg
    with pytest.raises(InvalidArgument):
        r.register(rec(), owner=Owner())


def test_a_stale_incarnation_is_still_not_found_for_the_owner(reg):
    _, r = reg
    r.register(rec(), owner=ALICE)
    r.register(rec(), owner=ALICE)
    with pytest.raises(UnknownAgent):
        r.heartbeat("prefill-0-7", 1, ALICE)


def test_owner_repr_shows_no_hash():
    assert "a" * 8 not in repr(ALICE) and repr(CERT_P0) == "Owner(prefill/prefill-0)"
