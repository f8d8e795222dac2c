"""Polling with a deadline: the one way tests wait for state that other tasks,
threads or processes change (never a bare sleep as synchronisation).

`wait_until` blocks (for another process's state: backoff up to 0.2 s);
`eventually` awaits (for state other tasks or threads on this loop change: it
yields every 10 ms; its predicate may also be a coroutine function, e.g. an RPC). Both return the predicate's first truthy value and fail
with an AssertionError naming what was awaited once `timeout` seconds pass.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """Poll `pred` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)  # polling another process's state, with backoff
        delay = min(delay * 1.5, 0.2)


async def eventually(
    pred: Callable[[], T] | Callable[[], Awaitable[T]], timeout: float = 10.0, what: str = "condition"
) -> T:
    """Poll `pred` on this loop (other tasks run meanwhile) until truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)  # polling state other tasks change, with a deadline
