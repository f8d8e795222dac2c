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

import socket
from types import SimpleNamespace

from pdmesh.v1 import decode_pb2
from services.router.attempt import DecodeAttempt, Wake
from services.router.hedge import HedgeConfig
from services.router.hedge_race import HedgeRace
from tests.unit.router.test_attempt_late_watchdog import SocketCall, in_busy_callback

DELAY_S = 0.2  # the hedge delay: min_delay_s, above the predicted TTFT


def context(outcomes: list[str]) -> SimpleNamespace:
    return SimpleNamespace(
        hedge=HedgeConfig(enabled=True, multiple=1.0, min_delay_s=DELAY_S, max_hedges=1),
        outliers=SimpleNamespace(predicted_ttft=lambda worker, blocks: 0.01),
        profiles=None,  # no speeds measured
        registry=SimpleNamespace(get=lambda worker: None, eligible=lambda role: []),
        budget=SimpleNamespace(can_retry=lambda: True),
        config=SimpleNamespace(block_size=16),
        hash_memo=None,
        metrics=SimpleNamespace(hedge=outcomes.append),
    )


def scenario(send: bool, busy_s: float) -> list[str]:
    """A primary attempt and its armed hedge, made inside an I/O callback that then holds the
    loop for `busy_s`; with `send`, the worker's first message is in the socket meanwhile.
    Waits until the hedge counted an outcome, or past the latest time its (re-armed) timer
    can fire, and returns the outcomes counted."""
    outcomes: list[str] = []

    def make(sock: socket.socket) -> DecodeAttempt:
        primary = DecodeAttempt("w", SocketCall(sock), Wake(), stall_timeout_s=60)
        race = HedgeRace(context(outcomes), SimpleNamespace(attempts=()), None, None, None, None)
        race.arm(primary, decode_pb2.DecodeServiceGenerateRequest(), 0, 0, None)
        return primary

    in_busy_callback(make, send, busy_s, settled=lambda _: bool(outcomes), wait_s=3 * DELAY_S + 1.0)
    return outcomes


def test_no_copy_for_a_first_message_that_waited_in_the_socket_while_the_loop_was_busy():
    assert scenario(send=True, busy_s=2 * DELAY_S) == []


def test_a_primary_with_nothing_back_is_still_hedged_after_a_busy_loop():
    assert scenario(send=False, busy_s=2 * DELAY_S) == ["no_worker"]


def test_a_primary_with_nothing_back_is_hedged_when_the_loop_is_idle():
    assert scenario(send=False, busy_s=0.0) == ["no_worker"]
