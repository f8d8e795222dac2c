"""Leases on exported KV blocks: the holder's side of the handoff.

A prefill worker that computed a prompt's KV keeps the blocks out of its pool
under a lease until one of four things happens, whichever comes first:
  - the receiver releases them (NIXL "done" notification, a full gRPC read
    with release_after, or PrefillService.Release)        -> counted `released`
  - the lease's TTL passes (`expire`, called periodically) -> `expired`
  - the receiver's agent is known dead (`agent_dead`)     -> `agent_dead`
  - the holder shuts down (`close`)                       -> `closed`
Then `on_free()` runs exactly once and the blocks go back to the holder's pool
(the prefill service passes `on_free=lambda: engine.release(request_id)`).

A gRPC read in progress pins the lease's blocks (`begin_read` / `end_read`):
a lease that ends mid-read is removed at once (later lookups see a stale
handle), but its blocks are freed only when the last reader stops, so a stream
never sends bytes of blocks already reused. Readers check `lease.ended` between
chunks and abort. NIXL reads are one-sided and cannot be pinned: the receiver
clamps its deadline to the lease's end instead (see `BlockHandle`).

`LeaseManager` is plain and synchronous (one owner, the holder's event loop);
`LeaseKeeper` is the small async helper that calls `expire` periodically and
asks an `AgentLiveness` (the `AgentDirectory`) whether requesters are alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from kvtransfer.errors import NotOwner, StaleHandle

log = structlog.get_logger()


class LeaseEnd(enum.StrEnum):
    RELEASED = "released"
    EXPIRED = "expired"
    AGENT_DEAD = "agent_dead"
    CLOSED = "closed"


@dataclass(eq=False)
class Lease:
    handle_id: str
    block_ids: tuple[int, ...]
    issued_to: str  # worker id allowed to read; "" = anyone
    requester_agent: str  # NIXL agent of the reader; its death ends the lease
    expires_at: float  # on the manager's monotonic clock
    expires_unix_ms: int  # the same instant on the wall clock, for KvHandle
    on_free: Callable[[], None] = field(repr=False)
    pulled: bool = False
    readers: int = 0
    ended: LeaseEnd | None = None
    freed: bool = False


@dataclass(frozen=True)
class LeaseCounters:
    issued: int
    pulled: int
    released: int
    expired: int
    agent_dead: int
    held: int  # leases not yet ended
    held_blocks: int  # blocks not yet returned (includes ended leases still pinned by a reader)


class LeaseManager:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        default_ttl_s: float = 30.0,
        wall_clock: Callable[[], float] = time.time,
        remember_ended: int = 4096,
    ):
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        self._clock = clock
        self._wall = wall_clock
        self.default_ttl_s = default_ttl_s
        self._held: dict[str, Lease] = {}
        # Ended but still being read; by identity, as the handle id may be reissued.
        self._pinned: set[Lease] = set()
        # Recently ended handles and why, so a late reader learns "released"
        # or "expired" rather than "unknown". Bounded: oldest forgotten first.
        self._ended: OrderedDict[str, LeaseEnd] = OrderedDict()
        self._remember = remember_ended
        self._counts = {"issued": 0, "pulled": 0, **{e.value: 0 for e in LeaseEnd}}
        self._on_issue: list[Callable[[Lease], None]] = []

    def add_issue_listener(self, fn: Callable[[Lease], None]) -> None:
        """Call `fn(lease)` after every issue (the NIXL holder wakes its poll loop:
        a READ of the new lease may follow within microseconds)."""
        self._on_issue.append(fn)

    # -- issuing and lookup ------------------------------------------------------
    def issue(
        self,
        handle_id: str,
        block_ids: Iterable[int],
        issued_to: str,
        requester_agent: str = "",
        ttl_s: float | None = None,
        *,
        on_free: Callable[[], None],
    ) -> Lease:
        """Hold `block_ids` for `issued_to` until released, expired or its agent dies."""
        ttl = self.default_ttl_s if ttl_s is None or ttl_s <= 0 else ttl_s
        blocks = tuple(block_ids)
        if not handle_id:
            raise ValueError("handle_id must be non-empty")
        if handle_id in self._held:
            raise ValueError(f"handle {handle_id!r} is already held")
        if not blocks:
            raise ValueError("a lease needs at least one block")
        lease = Lease(
            handle_id=handle_id,
            block_ids=blocks,
            issued_to=issued_to,
            requester_agent=requester_agent,
            expires_at=self._clock() + ttl,
            expires_unix_ms=int((self._wall() + ttl) * 1000),
            on_free=on_free,
        )
        self._held[handle_id] = lease
        self._ended.pop(handle_id, None)
        self._counts["issued"] += 1
        for fn in self._on_issue:
            fn(lease)
        return lease

    def get(self, handle_id: str, requester_id: str | None = None) -> Lease:
        """The live lease; StaleHandle when ended or unknown, NotOwner when
        `requester_id` is given and is not the worker it was issued to."""
        lease = self._held.get(handle_id)
        if lease is None:
            why = self._ended.get(handle_id)
            detail = f"was {why.value}" if why else "is unknown (never issued here, or long gone)"
            raise StaleHandle(f"KV handle {handle_id!r} {detail}")
        if requester_id is not None and lease.issued_to and requester_id != lease.issued_to:
            raise NotOwner(f"KV handle {handle_id!r} was issued to {lease.issued_to!r}, not {requester_id!r}")
        return lease

    def begin_read(self, handle_id: str, requester_id: str) -> Lease:
        """Pin the lease's blocks for a reader (pair with `end_read`)."""
        lease = self.get(handle_id, requester_id)
        lease.readers += 1
        return lease

    def end_read(self, lease: Lease) -> None:
        lease.readers -= 1
        if lease.readers == 0 and lease.ended is not None:
            self._pinned.discard(lease)
            self._free(lease)

    # -- ending leases -----------------------------------------------------------
    def mark_pulled(self, handle_id: str) -> bool:
        """Record that the receiver has the bytes (counted once per lease)."""
        lease = self._held.get(handle_id)
        if lease is None or lease.pulled:
            return False
        lease.pulled = True
        self._counts["pulled"] += 1
        return True

    def release(self, handle_id: str) -> bool:
        """End a lease because the receiver is done; False when not held (idempotent)."""
        return self._end(handle_id, LeaseEnd.RELEASED)

    def expire(self, now: float | None = None) -> list[Lease]:
        """End every lease whose TTL has passed; returns them."""
        t = self._clock() if now is None else now
        due = [lease for lease in self._held.values() if lease.expires_at <= t]
        for lease in due:
            log.info("kv_lease_expired", handle_id=lease.handle_id, blocks=len(lease.block_ids))
            self._end(lease.handle_id, LeaseEnd.EXPIRED)
        return due

    def agent_dead(self, agent_name: str) -> int:
        """End every lease whose requester agent is `agent_name`; returns how many."""
        if not agent_name:
            return 0
        ids = [h for h, lease in self._held.items() if lease.requester_agent == agent_name]
        for h in ids:
            self._end(h, LeaseEnd.AGENT_DEAD)
        if ids:
            log.warning("kv_leases_of_dead_agent_freed", agent=agent_name, leases=len(ids))
        return len(ids)

    def close(self) -> int:
        """End every lease (holder shutting down); returns how many."""
        ids = list(self._held)
        for h in ids:
            self._end(h, LeaseEnd.CLOSED)
        return len(ids)

    def _end(self, handle_id: str, why: LeaseEnd) -> bool:
        lease = self._held.pop(handle_id, None)
        if lease is None:
            return False
        lease.ended = why
        self._counts[why.value] += 1
        self._ended[handle_id] = why
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
        if lease.readers > 0:
            self._pinned.add(lease)  # freed by the last end_read
        else:
            self._free(lease)
        return True

    def _free(self, lease: Lease) -> None:
        if lease.freed:
            return
        lease.freed = True
        try:
            lease.on_free()
        except Exception:  # the pool owner's bug must not wedge every other lease
            log.exception("kv_lease_on_free_failed", handle_id=lease.handle_id)

    # -- views -------------------------------------------------------------------
    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def held_blocks(self) -> int:
        return sum(len(x.block_ids) for x in (*self._held.values(), *self._pinned))

    def held_blocks_of(self, issued_to: str) -> int:
        """Blocks still out for leases issued to `issued_to` (pinned ended ones included)."""
        return sum(
            len(x.block_ids) for x in (*self._held.values(), *self._pinned) if x.issued_to == issued_to
        )

    def requester_agents(self) -> set[str]:
        return {x.requester_agent for x in self._held.values() if x.requester_agent}

    def next_expiry(self) -> float | None:
        return min((x.expires_at for x in self._held.values()), default=None)

    @property
    def counters(self) -> LeaseCounters:
        c = self._counts
        return LeaseCounters(
            issued=c["issued"],
            pulled=c["pulled"],
            released=c[LeaseEnd.RELEASED.value],
            expired=c[LeaseEnd.EXPIRED.value],
            agent_dead=c[LeaseEnd.AGENT_DEAD.value],
            held=self.held,
            held_blocks=self.held_blocks,
        )


class AgentLiveness(Protocol):
    async def is_alive(self, agent_name: str) -> bool | None:
        """True / False when known; None when it cannot be told now (keep the lease)."""
        ...


class LeaseKeeper:
    """Runs `expire` every `interval_s` and, every `liveness_interval_s`, ends the
    leases of requesters that `liveness` reports dead. The holder starts it once."""

    def __init__(
        self,
        leases: LeaseManager,
        liveness: AgentLiveness | None = None,
        interval_s: float = 0.25,
        liveness_interval_s: float = 1.0,
    ):
        self.leases = leases
        self.liveness = liveness
        self.interval_s = interval_s
        self.liveness_interval_s = liveness_interval_s
        self._task: asyncio.Task[None] | None = None

    async def check_liveness(self) -> int:
        """End the leases of every requester agent reported dead; returns leases ended."""
        if self.liveness is None:
            return 0
        ended = 0
        for agent in sorted(self.leases.requester_agents()):
            if await self.liveness.is_alive(agent) is False:
                ended += self.leases.agent_dead(agent)
        return ended

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_liveness = loop.time()
        while True:
            self.leases.expire()
            if self.liveness is not None and loop.time() >= next_liveness:
                next_liveness = loop.time() + self.liveness_interval_s
                await self.check_liveness()
            await asyncio.sleep(self.interval_s)  # a periodic timer, not synchronisation

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="kv-lease-keeper")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
