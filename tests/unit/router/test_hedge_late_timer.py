"""The hedge timer does not send a copy for the router's own lateness.

The attempt watchdog's case (tests/unit/router/test_attempt_late_watchdog.py) for the
hedge: on uvloop a loop busy in an I/O callback runs its due timers before it polls the
sockets, so a hedge timer that fell due during the callback used to find the primary
without its first message although that message was waiting in the socket, and send a
copy (waste, paid from the retry budget). Run on uvloop on purpose, with real sockets.
The race here has no other worker to send a copy to, so a timer that went ahead counts
`no_worker`: that count is what the tests read.
"""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import uvloop

from pdmesh.v1 import decode_pb2
from services.router.attempt import DecodeAttempt, Wake
from services.router.hedge import HedgeConfig
from services.router.hedge_race import HedgeRace
from tests.unit.router.test_attempt_late_watchdog import SocketCall

DELAY_S = 0.2  # the hedge delay: min_delay_s, above the predicted TTFT


def context(outcomes: list[str]) -> SimpleNamespace:
    return SimpleNamespace(
        hedge=HedgeConfig(enabled=True, multiple=1.0, min_delay_s=DELAY_S, max_hedges=1),
        outliers=SimpleNamespace(predicted_ttft=lambda worker, blocks: 0.01),
        registry=SimpleNamespace(get=lambda worker: None, eligible=lambda role: []),
        budget=SimpleNamespace(can_retry=lambda: True),
        config=SimpleNamespace(block_size=16),
        metrics=SimpleNamespace(hedge=outcomes.append),
    )


def scenario(send: bool, busy_s: float) -> list[str]:
    """A primary attempt and its armed hedge, made inside an I/O callback that then holds the
    loop for `busy_s`; with `send`, the worker's first message goes into the socket in that
    callback. Returns the hedge outcomes counted."""
    worker, router_end = socket.socketpair()
    busy_w, busy_r = socket.socketpair()
    outcomes: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert "uvloop" in type(loop).__module__
        for s in (router_end, busy_r):
            s.setblocking(False)
        made: list[DecodeAttempt] = []

        def busy() -> None:
            busy_r.recv(64)
            loop.remove_reader(busy_r)
            primary = DecodeAttempt("w", SocketCall(router_end), Wake(), stall_timeout_s=60)
            race = HedgeRace(context(outcomes), SimpleNamespace(attempts=()), None, None, None, None)
            race.arm(primary, decode_pb2.DecodeServiceGenerateRequest(), 0, 0, None)
            made.append(primary)
            if send:
                worker.send(b"\x07")
            time.sleep(busy_s)  # the busy callback: the fault this test injects

        loop.add_reader(busy_r, busy)
        busy_w.send(b"x")
        deadline = loop.time() + DELAY_S + busy_s + 2.0
        while not outcomes and not (made and made[0].messages) and loop.time() < deadline:
            await asyncio.sleep(0.01)  # a poll with a deadline
        # Past the (re-armed) timer's latest time: whatever it was going to do, it has done.
        end = loop.time() + 2 * DELAY_S
        while not outcomes and loop.time() < end:
            await asyncio.sleep(0.01)  # a poll with a deadline
        assert made, "the busy callback never ran"
        made[0].cancel()

    try:
        uvloop.run(main())
    finally:
        for s in (worker, router_end, busy_w, busy_r):
            s.close()
    return outcomes


def test_no_copy_for_a_first_message_that_waited_in_the_socket_while_the_loop_was_busy():
    assert scenario(send=True, busy_s=2 * DELAY_S) == []


def test_a_primary_with_nothing_back_is_still_hedged_after_a_busy_loop():
    assert scenario(send=False, busy_s=2 * DELAY_S) == ["no_worker"]


def test_a_primary_with_nothing_back_is_hedged_when_the_loop_is_idle():
    assert scenario(send=False, busy_s=0.0) == ["no_worker"]
