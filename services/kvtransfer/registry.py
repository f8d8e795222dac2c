"""The NIXL agent registry: who can be read from, and whether they are alive.

One entry per agent name: its latest `AgentRecord`, an incarnation that grows
by one on every (re-)registration under the name (and never goes back, even
after the entry expired or was removed), and a liveness lease renewed by
heartbeats. An entry whose lease has passed is gone for every caller at once,
whether or not `expire` has swept it yet. Plain and synchronous; the servicer
owns the one instance and a periodic task calls `expire`.

Ownership (issue 13): a name is bound to the `Owner` that registered it, and
only that owner may re-register, heartbeat or deregister it:
  - a name registered with a client certificate that names a worker
    (`pdmesh://<role>/<worker>`) is bound to that identity for good (remembered
    after expiry, like the incarnation): the same certificate may take it back
    at any time, after a restart too (with a new secret); no one else ever;
  - otherwise it is bound to the registrant's secret (the service keeps a
    SHA-256 of it). While the lease lives only that secret opens it. Once the
    lease has passed (or the owner deregistered), anyone may claim the name
    anew: a restarted process has a new secret, and a dead holder's handles
    are dead anyway. Someone who claims a lapsed name gets no KV: the handles
    a decode worker pulls with carry the holder's block digests, so bytes
    read from anyone else's memory are refused (and the rightful owner's
    re-registration is refused too, which is loud: it cannot register).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvtransfer.agents import AgentRecord
from services.common.errors import InvalidArgument, NotFound, PermissionDenied


class UnknownAgent(NotFound):
    """No live agent under that name (never registered, expired or removed), or a stale incarnation."""


class NotOwner(PermissionDenied):
    """The caller is not the owner the agent name is bound to."""


@dataclass(frozen=True)
class Owner:
    """Who registered a name: a certified worker identity, or a secret's hash."""

    identity: str = ""  # "<role>/<worker>" from a client certificate naming a worker, else ""
    secret_hash: bytes = b""

    @classmethod
    def of(cls, identity: str, secret: bytes) -> Owner:
        return cls(identity, hashlib.sha256(secret).digest() if secret else b"")

    def __repr__(self) -> str:  # never log the hash
        return f"Owner({self.identity or 'secret'})"


# The owner of calls made in this process without one (tests, tools). Owners the
# servicer builds never equal it: a certified identity always has a "/".
IN_PROCESS = Owner(identity="in-process")


def _same(bound: Owner, caller: Owner) -> bool:
    if bound.identity:
        return caller.identity == bound.identity
    return bool(caller.secret_hash) and hmac.compare_digest(caller.secret_hash, bound.secret_hash)


@dataclass
class _Entry:
    record: AgentRecord
    lease_s: float
    expires_at: float


class AgentRegistry:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        default_lease_s: float = 10.0,
        max_lease_s: float = 300.0,
    ):
        if not 0 < default_lease_s <= max_lease_s:
            raise ValueError("need 0 < default_lease_s <= max_lease_s")
        self._clock = clock
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        self._agents: dict[str, _Entry] = {}
        self._incarnations: dict[str, int] = {}
        self._owners: dict[str, Owner] = {}  # kept after expiry, like incarnations
        self.refusals = 0  # calls refused because the caller was not the owner
        self.registrations = 0
        self.expirations = 0
        self.deregistrations = 0

    def register(
        self, record: AgentRecord, lease_s: float | None = None, owner: Owner | None = None
    ) -> tuple[AgentRecord, float]:
        """Store `record` under a new incarnation; returns it and the lease length granted.
        NotOwner when another owner holds the name (see the module docstring)."""
        owner = owner or IN_PROCESS
        if not owner.identity and not owner.secret_hash:
            raise InvalidArgument("owner_secret is required (no client certificate names a worker)")
        lease = lease_s or self.default_lease_s
        if lease <= 0:
            raise InvalidArgument(f"lease_ms must be > 0, got {lease * 1000:.0f}")
        bound = self._owners.get(record.name)
        if bound is not None and not _same(bound, owner):
            live = self._live_or_none(record.name) is not None
            if bound.identity or live:
                self.refusals += 1
                who = f"the worker certified as {bound.identity!r}" if bound.identity else "another owner"
                raise NotOwner(f"KV agent name {record.name!r} belongs to {who}")
        self._owners[record.name] = owner
        lease = min(lease, self.max_lease_s)
        incarnation = self._incarnations.get(record.name, 0) + 1
        self._incarnations[record.name] = incarnation
        stored = replace(record, incarnation=incarnation)
        self._agents[record.name] = _Entry(stored, lease, self._clock() + lease)
        self.registrations += 1
        return stored, lease

    def _live_or_none(self, name: str) -> _Entry | None:
        entry = self._agents.get(name)
        if entry is not None and entry.expires_at <= self._clock():
            self._expire_one(name)
            entry = None
        return entry

    def _live(self, name: str) -> _Entry:
        entry = self._live_or_none(name)
        if entry is None:
            raise UnknownAgent(f"KV agent {name!r} is not registered (or its lease expired)")
        return entry

    def _check_owner(self, name: str, owner: Owner | None) -> None:
        bound = self._owners.get(name)
        if bound is not None and not _same(bound, owner or IN_PROCESS):
            self.refusals += 1
            raise NotOwner(f"KV agent {name!r} was registered by another owner")

    def heartbeat(self, name: str, incarnation: int, owner: Owner | None = None) -> float:
        """Renew the lease of `name` at `incarnation`; returns its length.
        UnknownAgent when unknown, expired or superseded: the caller re-registers.
        NotOwner when the caller is not the name's owner."""
        entry = self._live(name)
        self._check_owner(name, owner)
        if entry.record.incarnation != incarnation:
            raise UnknownAgent(
                f"KV agent {name!r} incarnation {incarnation} is stale (current {entry.record.incarnation})"
            )
        entry.expires_at = self._clock() + entry.lease_s
        return entry.lease_s

    def deregister(self, name: str, incarnation: int, owner: Owner | None = None) -> bool:
        """Remove `name` if it is still at `incarnation` (a late goodbye from a
        previous process must not remove its successor). NotOwner when the
        caller is not the name's owner."""
        entry = self._agents.get(name)
        if entry is None or entry.record.incarnation != incarnation:
            return False
        self._check_owner(name, owner)
        del self._agents[name]
        self.deregistrations += 1
        return True

    def get(self, name: str) -> AgentRecord:
        return self._live(name).record

    def expire(self, now: float | None = None) -> list[AgentRecord]:
        """Drop every agent whose lease has passed; returns their records."""
        t = self._clock() if now is None else now
        due = [name for name, e in self._agents.items() if e.expires_at <= t]
        return [self._expire_one(name) for name in due]

    def _expire_one(self, name: str) -> AgentRecord:
        entry = self._agents.pop(name)
        self.expirations += 1
        return entry.record

    def __len__(self) -> int:
        return len(self._agents)

    def names(self) -> list[str]:
        return sorted(self._agents)
