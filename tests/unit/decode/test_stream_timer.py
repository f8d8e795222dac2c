"""The decode worker's per-stream deadline timer (one loop timer per stream, not one per output)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.decode.disagg_policy import Path
from services.decode.worker import _StreamDeadline, _StreamTimer
from tests.support.poll import eventually


async def _stalled():
    await asyncio.Event().wait()  # an engine that never answers
    yield None


async def _ready(n: int):
    for i in range(n):
        yield i


async def test_a_stream_that_stalls_past_its_deadline_ends_with_the_deadline():
    timer = _StreamTimer(time.monotonic() + 0.05, Path.LOCAL)
    try:
        with pytest.raises(_StreamDeadline):
            await timer.next(_stalled())
    finally:
        timer.cancel()
    assert not asyncio.current_task().cancelling()  # the timer's cancel was taken back


async def test_outputs_before_the_deadline_pass_and_the_end_is_none():
    timer = _StreamTimer(time.monotonic() + 60, Path.LOCAL)
    stream = _ready(2)
    try:
        assert [await timer.next(stream), await timer.next(stream), await timer.next(stream)] == [0, 1, None]
    finally:
        timer.cancel()


async def test_a_deadline_that_passed_between_outputs_ends_the_next_wait_at_once():
    timer = _StreamTimer(time.monotonic() + 0.01, Path.REMOTE)
    try:
        # The consumer was busy elsewhere (writing) when it fired.
        await eventually(lambda: timer.expired, what="the deadline to fire")
        with pytest.raises(_StreamDeadline, match="while decoding"):
            await timer.next(_ready(1))
    finally:
        timer.cancel()


async def test_a_cancel_from_outside_stays_a_cancel():
    timer = _StreamTimer(time.monotonic() + 60, Path.LOCAL)
    task = asyncio.ensure_future(timer.next(_stalled()))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    timer.cancel()


async def test_a_cancel_from_outside_after_the_deadline_fired_stays_a_cancel():
    timer = _StreamTimer(time.monotonic() + 0.02, Path.LOCAL)
    started = asyncio.Event()

    async def consume():
        started.set()
        return await timer.next(_stalled())

    task = asyncio.ensure_future(consume())
    await started.wait()
    task.cancel()  # the caller goes away; the deadline fires on the same loop turn or later
    await eventually(lambda: timer.expired, what="the deadline to fire")
    with pytest.raises(asyncio.CancelledError):
        await task
    timer.cancel()
