"""Retried arrivals: a client's retry of a request the router is still running joins it.

Clients retry on errors and timeouts (the OpenAI SDK: twice, with backoff), and
a retry that starts a new prefill while the first attempt still runs doubles the
load exactly when the mesh is slowest. A request that carries an idempotency key
(the HTTP `Idempotency-Key` header, gRPC metadata `idempotency-key`) runs as a
`SharedFlow`: one task drives its RequestFlow and keeps what it yielded, and any
number of followers read it from the start. When its client goes away the flow
keeps running for `detach_grace_s` (no follower left) so that the retry, arriving
after the client's backoff, attaches to it and gets every token from the first
one, with no new prefill and no second admission slot.

`RetriedArrivals` owns the bounded table (tenant, key) -> SharedFlow:
- a key whose request is running: the arrival attaches (outcome "attached");
- a key whose request succeeded less than `ttl_s` ago: its result is replayed
  ("replayed"); a failed or cancelled one leaves the table at once, so a retry
  of a failure runs afresh;
- a key that names a different request (another prompt or parameters):
  FAILED_PRECONDITION ("conflict"), as Stripe and the IETF draft do;
- at most `max_entries` keys: the oldest is forgotten first (its request runs
  on; only a later retry of it is no longer recognised).
Requests without a key are not shared (a duplicate running request id is still
ALREADY_EXISTS), so they pay nothing for this.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from services.common.config import require, setting
from services.common.errors import FailedPrecondition, InvalidArgument, MeshError

log = structlog.get_logger()

HEADER = "idempotency-key"  # gRPC metadata key; the HTTP header of the same name, lowercased
MAX_KEY_BYTES = 255


@dataclass(frozen=True)
class RetryAttachConfig:
    enabled: bool = setting(True, "a retry carrying the idempotency key of a running request joins it")
    max_entries: int = setting(4096, "idempotency keys remembered at once (oldest forgotten first)")
    ttl_s: float = setting(30.0, "a succeeded request's result is replayed to its retries this long")
    detach_grace_s: float = setting(
        10.0, "a keyed request whose client left keeps running this long for its retry (0 = cancel)"
    )

    def __post_init__(self) -> None:
        require(self.max_entries >= 1, "max_entries must be >= 1")
        require(self.ttl_s >= 0 and self.detach_grace_s >= 0, "ttl_s and detach_grace_s must be >= 0")


def idempotency_key(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The request's idempotency key from its metadata, or None (raises InvalidArgument
    on a key that is too long or not printable ASCII)."""
    for name, value in metadata or ():
        if name == HEADER:
            key = value.decode() if isinstance(value, bytes) else str(value)
            if not key:
                return None
            if len(key) > MAX_KEY_BYTES or not (key.isascii() and key.isprintable()):
                raise InvalidArgument(f"{HEADER}: at most {MAX_KEY_BYTES} printable ASCII characters")
            return key
    return None


def fingerprint(request: Any) -> bytes:
    """What makes two arrivals the same request: the GenerateRequest without its id."""
    copy = type(request)()
    copy.CopyFrom(request)
    copy.ClearField("request_id")
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).digest()


class SharedFlow:
    """One RequestFlow driven by its own task; followers read its items from the start.

    `flow` must have been opened (Router.open_flow); `on_done` runs once when it ends
    (the Router closes the flow and the table drops or keeps the entry)."""

    def __init__(
        self,
        flow: Any,
        print_: bytes,
        grace_s: float,
        on_done: Callable[[SharedFlow], None],
    ):
        self.flow = flow
        self.fingerprint = print_
        self.items: list[list[int]] = []
        self.final: Any = None  # FlowFinal
        self.error: BaseException | None = None
        self.done = False
        self.done_at = 0.0
        self.followers = 0
        self._grace_s = grace_s
        self._on_done = on_done
        self._changed = asyncio.Event()
        self._idle: asyncio.TimerHandle | None = None
        self._task = asyncio.get_running_loop().create_task(
            self._drive(), name=f"shared:{flow.req.request_id}"
        )

    async def _drive(self) -> None:
        run = self.flow.run()
        try:
            async for item in run:
                if type(item) is list:
                    self.items.append(item)
                else:
                    self.final = item
                self._notify()
        except asyncio.CancelledError as e:  # the router is closing
            self.error = e
        except MeshError as e:  # the request's status: every follower raises it
            self.error = e
        except Exception as e:  # a bug: logged here, and the followers fail with it
            log.error("shared_flow_failed", request_id=self.flow.req.request_id, exc_info=e)
            self.error = e
        finally:
            await run.aclose()
            self.done = True
            self.done_at = time.monotonic()
            if self._idle is not None:
                self._idle.cancel()
            self._notify()
            self._on_done(self)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self) -> AsyncIterator[Any]:
        """Token-id lists (everything so far first, in one list), then the FlowFinal; raises
        the flow's MeshError. A follower that stops reading leaves the others alone; the
        last one to leave starts the detach grace."""
        self.followers += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        sent = 0
        try:
            while True:
                if sent < len(self.items):
                    batch = self.items[sent:]
                    sent = len(self.items)
                    yield batch[0] if len(batch) == 1 else [t for ids in batch for t in ids]
                    continue
                if self.done:
                    if self.error is not None:
                        if isinstance(self.error, MeshError):
                            raise self.error
                        raise MeshError(f"the shared request ended: {self.error!r}") from self.error
                    yield self.final
                    return
                await self._changed.wait()
        finally:
            self.followers -= 1
            if self.followers == 0 and not self.done:
                self._detached()

    def _detached(self) -> None:
        if self._grace_s <= 0:
            self.flow.cancel("the client went away")
            return
        self._idle = asyncio.get_running_loop().call_later(self._grace_s, self._expire)

    def _expire(self) -> None:
        self._idle = None
        if self.followers == 0 and not self.done:
            self.flow.cancel(f"the client went away and no retry came within {self._grace_s:g} s")

    def cancel(self, why: str) -> None:
        self.flow.cancel(why)


class RetriedArrivals:
    """The bounded table of keyed requests (see the module docstring)."""

    def __init__(self, config: RetryAttachConfig | None = None):
        self.config = config or RetryAttachConfig()
        self._entries: OrderedDict[tuple[str, str], SharedFlow] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, tenant: str, key: str, print_: bytes) -> tuple[SharedFlow | None, str]:
        """(the shared flow to follow or None, outcome): "attached", "replayed", "new";
        raises FailedPrecondition when the key names another request."""
        self._purge()
        shared = self._entries.get((tenant, key))
        if shared is None:
            return None, "new"
        if shared.fingerprint != print_:
            raise FailedPrecondition(
                f"{HEADER} {key!r} was used for a different request (another prompt or parameters)"
            )
        return shared, "replayed" if shared.done else "attached"

    def add(self, tenant: str, key: str, shared: SharedFlow) -> None:
        entries = self._entries
        entries[(tenant, key)] = shared
        entries.move_to_end((tenant, key))
        while len(entries) > self.config.max_entries:
            entries.popitem(last=False)

    def ended(self, tenant: str, key: str, shared: SharedFlow) -> None:
        """The shared flow ended: a failure leaves at once (its retry runs afresh)."""
        if shared.error is not None and self._entries.get((tenant, key)) is shared:
            del self._entries[(tenant, key)]

    def _purge(self) -> None:
        horizon = time.monotonic() - self.config.ttl_s
        stale = [k for k, s in self._entries.items() if s.done and s.done_at < horizon]
        for k in stale:
            del self._entries[k]
