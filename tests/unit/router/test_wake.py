"""The flow's single-waiter wake-up (services/router/attempt.py `Wake`): no wake-up lost,
none invented, and a cancelled waiter does not swallow the next one."""

from __future__ import annotations

import asyncio

from services.router.attempt import Wake


async def test_a_set_before_arm_is_consumed_once():
    w = Wake()
    w.set()
    w.set()  # two sets before the waiter looks: one wake-up (Event's wait then clear)
    assert w.arm() is None
    fut = w.arm()
    assert fut is not None and not fut.done()


async def test_arm_then_set_completes_the_future():
    w = Wake()
    fut = w.arm()
    assert fut is not None and not fut.done()
    w.set()
    assert fut.done() and not w.is_set()
    await fut


async def test_a_set_while_the_woken_waiter_has_not_run_is_kept():
    w = Wake()
    fut = w.arm()
    w.set()
    w.set()  # tokens after the first wake-up, before the waiter ran: not lost
    assert fut.done() and w.is_set()
    assert w.arm() is None


async def test_a_cancelled_waiter_leaves_the_next_set_as_a_flag():
    w = Wake()
    fut = w.arm()
    assert fut is not None
    fut.cancel()  # what cancelling the task awaiting it does to the future
    w.set()
    assert w.is_set() and w.arm() is None


async def test_wait_returns_on_set_from_another_callback():
    w = Wake()
    asyncio.get_running_loop().call_soon(w.set)
    await asyncio.wait_for(w.wait(), 5)
    assert not w.is_set()
