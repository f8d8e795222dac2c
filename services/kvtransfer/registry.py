"""The NIXL agent registry: who can be read from, and whether they are alive.

One entry per agent name: its latest `AgentRecord`, an incarnation that grows
by one on every (re-)registration under the name (and never goes back, even
after the entry expired or was removed), and a liveness lease renewed by
heartbeats. An entry whose lease has passed is gone for every caller at once,
whether or not `expire` has swept it yet. Plain and synchronous; the servicer
owns the one instance and a periodic task calls `expire`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvtransfer.agents import AgentRecord
from services.common.errors import InvalidArgument, NotFound


class UnknownAgent(NotFound):
    """No live agent under that name (never registered, expired or removed), or a stale incarnation."""


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
        self.registrations = 0
        self.expirations = 0
        self.deregistrations = 0

    def register(self, record: AgentRecord, lease_s: float | None = None) -> tuple[AgentRecord, float]:
        """Store `record` under a new incarnation; returns it and the lease length granted."""
        lease = lease_s or self.default_lease_s
        if lease <= 0:
            raise InvalidArgument(f"lease_ms must be > 0, got {lease * 1000:.0f}")
        lease = min(lease, self.max_lease_s)
        incarnation = self._incarnations.get(record.name, 0) + 1
        self._incarnations[record.name] = incarnation
        stored = replace(record, incarnation=incarnation)
        self._agents[record.name] = _Entry(stored, lease, self._clock() + lease)
        self.registrations += 1
        return stored, lease

    def _live(self, name: str) -> _Entry:
        entry = self._agents.get(name)
        if entry is not None and entry.expires_at <= self._clock():
            self._expire_one(name)
            entry = None
        if entry is None:
            raise UnknownAgent(f"KV agent {name!r} is not registered (or its lease expired)")
        return entry

    def heartbeat(self, name: str, incarnation: int) -> float:
        """Renew the lease of `name` at `incarnation`; returns its length.
        UnknownAgent when unknown, expired or superseded: the caller re-registers."""
        entry = self._live(name)
        if entry.record.incarnation != incarnation:
            raise UnknownAgent(
                f"KV agent {name!r} incarnation {incarnation} is stale (current {entry.record.incarnation})"
            )
        entry.expires_at = self._clock() + entry.lease_s
        return entry.lease_s

    def deregister(self, name: str, incarnation: int) -> bool:
        """Remove `name` if it is still at `incarnation` (a late goodbye from a
        previous process must not remove its successor)."""
        entry = self._agents.get(name)
        if entry is None or entry.record.incarnation != incarnation:
            return False
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
