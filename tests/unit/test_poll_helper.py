"""tests/support/poll.py: the one poll-with-deadline helper the tests wait with."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.poll import eventually, wait_until


def test_wait_until_returns_the_first_truthy_value():
    values = iter([0, None, "", [3]])
    assert wait_until(lambda: next(values), timeout=10) == [3]


def test_wait_until_fails_naming_what_it_waited_for():
    with pytest.raises(AssertionError, match="waiting for the moon"):
        wait_until(lambda: False, timeout=0.05, what="the moon")


async def test_eventually_lets_other_tasks_run_and_takes_a_coroutine_predicate():
    state = {"done": False}

    async def finish() -> None:
        state["done"] = True

    task = asyncio.create_task(finish())
    assert await eventually(lambda: state["done"], timeout=10) is True

    async def check() -> str:
        return "yes" if task.done() else ""

    assert await eventually(check, timeout=10) == "yes"
    with pytest.raises(AssertionError, match="waiting for never"):
        await eventually(lambda: False, timeout=0.05, what="never")
