"""The stall watchdog does not blame a worker for the router's own lateness.

On uvloop (the loop every service runs on), a loop that was busy in an I/O callback
runs its due timers before it polls the sockets again, so a first-token timeout that
fell due during the busy callback used to fail over an attempt whose first message had
been sitting in the socket for most of that time. These tests run on uvloop on purpose
(asyncio's own loop polls first and would pass without the fix) with real sockets: a
socketpair carries the worker's message, another one triggers the busy callback.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import uvloop

from services.router.attempt import DecodeAttempt


class SocketCall:
    """A link call stand-in: the link's protocol callback pushes what the socket brings
    into the attached attempt, as `RawDecodeLink` does for its frames."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sink: DecodeAttempt | None = None
        self.cancelled = False
        asyncio.get_running_loop().add_reader(sock, self._readable)

    def attach(self, sink: DecodeAttempt) -> None:
        self.sink = sink

    def _readable(self) -> None:
        data = self.sock.recv(64)
        if data and self.sink is not None:
            self.sink.push_tokens(list(data))

    def cancel(self) -> bool:
        self.cancelled = True
        asyncio.get_running_loop().remove_reader(self.sock)
        return True


def in_busy_callback(
    make: Callable[[socket.socket], DecodeAttempt],
    send: bool,
    busy_s: float,
    settled: Callable[[DecodeAttempt], bool],
    wait_s: float,
) -> DecodeAttempt:
    """On uvloop: an I/O callback calls `make(router_end)` (an attempt reading that socket
    through a `SocketCall`), writes the worker's first message into the socket if `send`
    (so it waits there while the loop is busy: no timing between threads), then holds the
    loop for `busy_s`. Polls until `settled(attempt)` or `wait_s` after the callback's
    end, cancels the attempt and returns it. tests/unit/router/test_hedge_late_timer.py
    uses it too."""
    worker, router_end = socket.socketpair()
    busy_w, busy_r = socket.socketpair()

    async def main() -> DecodeAttempt:
        loop = asyncio.get_running_loop()
        assert "uvloop" in type(loop).__module__
        for s in (router_end, busy_r):
            s.setblocking(False)
        made: list[DecodeAttempt] = []

        def busy() -> None:
            busy_r.recv(64)
            loop.remove_reader(busy_r)
            made.append(make(router_end))
            if send:
                worker.send(b"\x07")
            time.sleep(busy_s)  # the busy callback: the fault this test injects

        loop.add_reader(busy_r, busy)
        busy_w.send(b"x")
        deadline = loop.time() + busy_s + wait_s
        while (not made or not settled(made[0])) and loop.time() < deadline:
            await asyncio.sleep(0.01)  # a poll with a deadline
        assert made, "the busy callback never ran"
        made[0].cancel()
        return made[0]

    try:
        return uvloop.run(main())
    finally:
        for s in (worker, router_end, busy_w, busy_r):
            s.close()


def scenario(first_timeout_s: float, send: bool, busy_s: float) -> DecodeAttempt:
    """One attempt with `first_timeout_s`, created inside an I/O callback that then holds the
    loop for `busy_s`; with `send`, the worker's first message is in the socket meanwhile.
    Returns the attempt once its fate is settled."""
    return in_busy_callback(
        lambda sock: DecodeAttempt(
            "w", SocketCall(sock), asyncio.Event(), first_timeout_s=first_timeout_s, stall_timeout_s=60
        ),
        send,
        busy_s,
        settled=lambda a: a.done or a.messages > 0,
        wait_s=first_timeout_s + 2.0,
    )


def test_a_first_message_that_arrived_while_the_loop_was_busy_is_not_a_stall():
    # Due 0.2 s after the attempt starts; its message is in the socket from the start; the loop is busy 0.4 s.
    attempt = scenario(first_timeout_s=0.2, send=True, busy_s=0.4)
    assert attempt.error is None, attempt.error
    assert attempt.messages == 1 and attempt.take() == [7]


def test_a_worker_that_sends_nothing_still_stalls_after_a_busy_loop():
    attempt = scenario(first_timeout_s=0.2, send=False, busy_s=0.4)
    assert attempt.error is not None and "stalled: no its first message" in attempt.error.details
    assert attempt.error.worker_fault and attempt.error.retryable


def test_a_worker_that_sends_nothing_stalls_when_the_loop_is_idle():
    # (scenario gives up waiting 2 s after the limit: an error here means the watchdog fired.)
    attempt = scenario(first_timeout_s=0.2, send=False, busy_s=0.0)
    assert attempt.error is not None and "stalled" in attempt.error.details
