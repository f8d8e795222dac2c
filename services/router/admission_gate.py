"""The async edge of admission control.

`AdmissionController` (the core) is synchronous and hands out `Waiter`s for
queued requests. `AdmissionGate` owns one future per waiter and resolves it
from the core's answers: `release` grants slots to waiters, a timer at the
core's `next_expiry()` fails the ones whose queue timeout or deadline passed,
and `abort` withdraws one (Router.Cancel while queued). A caller cancelled
while queued (client gone) withdraws itself; a slot granted at that moment is
given back, so no slot is ever lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.router.admission import AdmissionController, Ticket, Waiter
from services.router.workflow_sched import NO_WORKFLOW, WorkflowInfo


class AdmissionGate:
    def __init__(self, controller: AdmissionController, clock: Callable[[], float]):
        self.controller = controller
        self._clock = clock
        self._futures: dict[int, asyncio.Future[Ticket]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    async def acquire(
        self,
        tenant: str,
        priority: int,
        cost_tokens: int,
        deadline: float | None,
        on_queued: Callable[[Waiter], None] | None = None,
        workflow: WorkflowInfo = NO_WORKFLOW,
    ) -> Ticket:
        """A slot, at once or after queueing. Raises the core's rejections."""
        got = self.controller.try_admit(tenant, priority, cost_tokens, deadline, workflow)
        if isinstance(got, Waiter):
            # Queueing may have shed another waiter (sunk-cost shedding): fail it now.
            self.expire_now()
        if isinstance(got, Ticket):
            return got
        fut: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._futures[got.id] = fut
        self._arm()
        if on_queued is not None:
            on_queued(got)
        try:
            return await fut
        except asyncio.CancelledError:
            if not self.controller.cancel(got) and got.ticket is not None:
                self.release(got.ticket)  # granted just as we were cancelled
            raise
        finally:
            self._futures.pop(got.id, None)

    def release(self, ticket: Ticket, served_tokens: int = 0) -> None:
        """`served_tokens` are charged to the ticket's workflow (attained service)."""
        for waiter in self.controller.release(ticket, served_tokens):
            fut = self._futures.get(waiter.id)
            if fut is None or fut.done():
                assert waiter.ticket is not None
                self.release(waiter.ticket)  # its caller is gone: pass the slot on
            else:
                fut.set_result(waiter.ticket)  # type: ignore[arg-type]

    def abort(self, waiter: Waiter, error: BaseException) -> None:
        """Withdraw a queued request; its `acquire` raises `error`."""
        if self.controller.cancel(waiter):
            fut = self._futures.get(waiter.id)
            if fut is not None and not fut.done():
                fut.set_exception(error)

    def expire_now(self) -> int:
        """Fail the waiters whose time is up (the timer calls this; tests may too)."""
        expired = self.controller.expire()
        for waiter in expired:
            fut = self._futures.get(waiter.id)
            if fut is not None and not fut.done():
                assert waiter.rejection is not None
                fut.set_exception(waiter.rejection)
        self._arm()
        return len(expired)

    def _arm(self) -> None:
        at = self.controller.next_expiry()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            delay = max(at - self._clock(), 0.0)
            self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = None
        self.expire_now()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
