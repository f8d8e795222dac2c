"""How much of the prefill pool callers may pin under leases (issue 13).

Held KV is the one resource a caller keeps after its call returns, so it is
bounded at admission, before the engine computes anything:
  - the pool as a whole: while leases (plus prefills under way that will be
    leased) hold `max_held_share` of the pool, new Prefill calls are shed with
    RESOURCE_EXHAUSTED and a retry hint (when the next lease ends);
  - per requester (the decode worker the lease is issued to): at most
    `max_requester_held_share` of the pool, so one worker cannot starve the
    others even within the pool-wide limit.
Lease length itself is clamped to `max_lease_ms` (`lease_ttl_s`).

`LeaseBudget` is plain and synchronous; the prefill servicer owns one and
brackets each engine prefill with `admit` / `Admission.done`, so concurrent
calls see each other's blocks before any of them is leased.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.leases import LeaseManager
from services.common.errors import ResourceExhausted
from services.prefill.config import PrefillConfig

MIN_RETRY_S = 0.05


@dataclass
class Admission:
    """Blocks counted for one Prefill call until `done()` (idempotent)."""

    budget: LeaseBudget
    requester: str
    blocks: int
    open: bool = True

    def done(self) -> None:
        if self.open:
            self.open = False
            self.budget._pending_done(self)


class LeaseBudget:
    def __init__(
        self,
        config: PrefillConfig,
        leases: LeaseManager,
        pool_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.leases = leases
        self.pool_blocks = pool_blocks
        self._clock = clock
        self._pending: dict[str, int] = {}  # requester -> blocks of prefills under way
        self.shed = 0

    def lease_ttl_s(self, asked_ms: int) -> float:
        """The lease granted for `asked_ms` (0 = the default), clamped to max_lease_ms."""
        if asked_ms <= 0:
            return self.config.lease_ttl_s
        return min(asked_ms, self.config.max_lease_ms) / 1000.0

    def admit(self, requester: str, blocks: int) -> Admission:
        """Count `blocks` for `requester`, or raise ResourceExhausted (nothing counted)."""
        pending = sum(self._pending.values())
        held = self.leases.held_blocks + pending
        limit = self.config.max_held_share * self.pool_blocks
        if held + blocks > limit:
            self.shed += 1
            raise ResourceExhausted(
                f"prefill KV pool: {held} of {self.pool_blocks} blocks are held under leases or being "
                f"prefilled; a new prefill of {blocks} blocks would pass the limit of "
                f"{self.config.max_held_share:.0%}",
                retry_after_s=self._retry_after_s(),
            )
        mine = self.leases.held_blocks_of(requester) + self._pending.get(requester, 0)
        own_limit = self.config.max_requester_held_share * self.pool_blocks
        if mine + blocks > own_limit:
            self.shed += 1
            raise ResourceExhausted(
                f"requester {requester!r} holds {mine} of {self.pool_blocks} prefill KV blocks; "
                f"{blocks} more would pass its share of {self.config.max_requester_held_share:.0%}: "
                "release or pull the handles it has",
                retry_after_s=self._retry_after_s(),
            )
        self._pending[requester] = self._pending.get(requester, 0) + blocks
        return Admission(self, requester, blocks)

    def _pending_done(self, a: Admission) -> None:
        left = self._pending.get(a.requester, 0) - a.blocks
        if left > 0:
            self._pending[a.requester] = left
        else:
            self._pending.pop(a.requester, None)

    def _retry_after_s(self) -> float:
        """Until the next lease ends at the latest (a release may come sooner)."""
        nxt = self.leases.next_expiry()
        if nxt is None:
            return MIN_RETRY_S
        return max(MIN_RETRY_S, nxt - self._clock())

    @property
    def pending_blocks(self) -> int:
        return sum(self._pending.values())
