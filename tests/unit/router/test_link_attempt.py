"""DecodeAttempt's bounded buffer and the router's LinkCall, against stand-in calls (no
server here: tests/service/router/test_link.py runs the same paths over real gRPC)."""

from __future__ import annotations

import asyncio

import grpc

from pdmesh.v1 import decode_pb2
from services.common.errors import ResourceExhausted
from services.router.attempt import DecodeAttempt
from services.router.link import DecodeLink
from tests.support.poll import eventually


class EndlessCall:
    """A Generate call stand-in that sends one token per message until cancelled."""

    def __init__(self):
        self.cancelled = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        msg = decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=[7]))
        while not self.cancelled:
            yield msg
            await asyncio.sleep(0)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


async def test_a_consumer_that_never_takes_is_cut_off_at_the_bound():
    call = EndlessCall()
    attempt = DecodeAttempt("w", call, asyncio.Event(), max_buffered_tokens=16)
    await attempt.wait_closed()
    assert attempt.done and call.cancelled and not attempt.pending
    err = attempt.error
    assert err is not None and err.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not err.retryable and not err.worker_fault  # the client's doing: no retry, no breaker
    mesh = err.to_mesh_error("w")
    assert isinstance(mesh, ResourceExhausted) and "stopped reading" in str(mesh)


async def test_a_consumer_that_takes_is_never_cut_off():
    call = EndlessCall()
    wake = asyncio.Event()
    attempt = DecodeAttempt("w", call, wake, max_buffered_tokens=4)
    got = 0
    while got < 200:
        await wake.wait()
        wake.clear()
        got += len(attempt.take())
    assert not attempt.done
    attempt.cancel()
    await attempt.wait_closed()


class FakeLinkCall:
    """The Link stream stand-in: records written frames; its responses never come."""

    def __init__(self):
        self.written: list[decode_pb2.DecodeServiceLinkRequest] = []
        self.cancelled = False
        self._never = asyncio.Event()

    async def write(self, frame):
        self.written.append(frame)

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        await self._never.wait()
        yield  # pragma: no cover

    def cancel(self) -> bool:
        self.cancelled = True
        return True


async def test_a_link_request_past_its_deadline_is_cancelled_on_the_link_and_fails():
    fake = FakeLinkCall()
    link = DecodeLink("w", lambda: fake, lambda r, t: None)
    wake = asyncio.Event()
    req = decode_pb2.DecodeServiceGenerateRequest(request_id="r")
    attempt = DecodeAttempt("w", link.open(req, 0.05), wake)
    while not attempt.done:
        await wake.wait()
        wake.clear()
    assert attempt.error is not None and attempt.error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: len(fake.written) == 2, what="the cancel frame written")
    kinds = [f.WhichOneof("frame") for f in fake.written]
    assert kinds == ["open", "cancel"] and fake.written[0].open.timeout_s == 0.05
    assert link.open_requests == 0 and link.alive
    await link.close()
    assert fake.cancelled and not link.alive
