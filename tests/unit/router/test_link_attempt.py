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


class ScriptedLinkCall(FakeLinkCall):
    """FakeLinkCall whose worker frames are the ones the test puts in `frames`."""

    def __init__(self):
        super().__init__()
        self.frames: asyncio.Queue[decode_pb2.DecodeServiceLinkResponse] = asyncio.Queue()

    async def _gen(self):
        while True:
            yield await self.frames.get()


async def test_a_link_asks_for_starts_when_told_and_a_start_marks_the_attempt_computing():
    fake = ScriptedLinkCall()
    link = DecodeLink("w", lambda: fake, lambda r, t: None)
    link.notify_started = True
    wake = asyncio.Event()
    attempt = DecodeAttempt(
        "w", link.open(decode_pb2.DecodeServiceGenerateRequest(request_id="r"), 5.0), wake
    )
    await eventually(lambda: len(fake.written) == 1, what="the open frame written")
    assert fake.written[0].open.notify_started
    assert attempt.computing_at is None
    fake.frames.put_nowait(decode_pb2.DecodeServiceLinkResponse(started=[1]))
    await asyncio.wait_for(wake.wait(), 10)  # the flow is woken: a tied race settles on it
    assert attempt.computing_at is not None and not attempt.messages and not attempt.done
    fake.frames.put_nowait(
        decode_pb2.DecodeServiceLinkResponse(tokens=[decode_pb2.LinkTokens(link_id=1, token_ids=[5])])
    )
    await eventually(lambda: attempt.messages == 1, what="the first token")
    assert attempt.take() == [5]
    # a start for an id that is not open breaks the protocol: the link is dropped
    fake.frames.put_nowait(decode_pb2.DecodeServiceLinkResponse(started=[9]))
    await eventually(lambda: not link.alive, what="the link dropped")
    assert "link_id 9" in (link.broken or "")
    attempt.cancel()
    await link.close()


async def test_a_link_that_is_not_told_does_not_ask_for_starts():
    fake = FakeLinkCall()
    link = DecodeLink("w", lambda: fake, lambda r, t: None)
    link.open(decode_pb2.DecodeServiceGenerateRequest(request_id="r"), 5.0)
    await eventually(lambda: len(fake.written) == 1, what="the open frame written")
    assert not fake.written[0].open.notify_started
    await link.close()
