"""LinkSession (the worker's end of DecodeService.Link) as a plain core, with a stand-in DecodeWorker.

The stand-in (it only yields events when the test lets it) makes an ordering
deterministic that a real engine hits only by chance under load: a request
ending while the session is suspended at its previous frame's yield.
"""

import asyncio

from pdmesh.v1 import decode_pb2
from services.decode.link import LinkSession
from tests.support.poll import eventually


class GatedWorker:
    """STAND-IN for DecodeWorker.generate: one token, then the end once `finish` is set."""

    def __init__(self):
        self.finish = asyncio.Event()

    async def generate(self, job, sink, on_started=None):
        sink([7])  # the link's path: tokens to the sink, only the end is yielded
        await self.finish.wait()
        yield "finished"  # LinkSession hands the yielded end to final_of


def open_frame(lid: int, notify_started: bool = False) -> decode_pb2.DecodeServiceLinkRequest:
    req = decode_pb2.DecodeServiceGenerateRequest(request_id=f"r{lid}")
    return decode_pb2.DecodeServiceLinkRequest(
        open=decode_pb2.LinkOpen(link_id=lid, request=req, notify_started=notify_started)
    )


async def router_frames(frames, hold: asyncio.Event):
    """The router's side of the stream: the given frames, then open until `hold` is set."""
    for f in frames:
        yield f
    await hold.wait()


async def test_a_request_ending_while_the_last_frame_is_written_still_gets_its_end_on_drain():
    # The drained link ends once its requests did, but not before the last one's end is
    # sent: it ended while the session was suspended at its previous frame's yield (the
    # frame being written), and the session returned without a LinkEnd, so the router saw
    # the link end under an open request ("the worker ended the link") and failed it over.
    worker, draining, hold = GatedWorker(), asyncio.Event(), asyncio.Event()
    final = decode_pb2.DecodeFinal(finish_reason=1)
    session = LinkSession(worker, lambda request, timeout: object(), lambda event: final, draining)
    run = session.run(router_frames([open_frame(1)], hold))
    try:
        first = await anext(run)  # the token frame; the session now waits at its yield
        assert [(t.link_id, list(t.token_ids)) for t in first.tokens] == [(1, [7])]
        draining.set()
        worker.finish.set()
        await eventually(lambda: session.open_requests == 0, what="the request ended", timeout=10)
        end_frame = await anext(run)
        assert [(e.link_id, e.WhichOneof("outcome")) for e in end_frame.ends] == [(1, "final")]
        try:
            await anext(run)
            raise AssertionError("the drained link should end after its last request's end")
        except StopAsyncIteration:
            pass
    finally:
        hold.set()
        await run.aclose()


class StartingWorker:
    """STAND-IN for DecodeWorker.generate: reports its start (when asked to) at once, then one
    token once `go` is set, then the end."""

    def __init__(self):
        self.go = asyncio.Event()
        self.asked: dict[str, bool] = {}

    async def generate(self, job, sink, on_started=None):
        self.asked[job] = on_started is not None
        if on_started is not None:
            on_started()
        await self.go.wait()
        sink([7])
        yield "finished"


async def test_a_start_is_reported_once_before_the_tokens_and_only_when_asked():
    worker, hold = StartingWorker(), asyncio.Event()
    final = decode_pb2.DecodeFinal(finish_reason=1)
    frames = [open_frame(1, notify_started=True), open_frame(2)]
    session = LinkSession(worker, lambda request, timeout: request.request_id, lambda event: final)
    run = session.run(router_frames(frames, hold))
    try:
        first = await anext(run)
        # r1 asked and its engine began it: reported, before any token; r2 did not ask
        assert list(first.started) == [1] and not first.tokens and not first.ends
        assert worker.asked == {"r1": True, "r2": False}
        worker.go.set()
        seen: list = []
        while len([e for f in seen for e in f.ends]) < 2:
            seen.append(await anext(run))
        assert not any(f.started for f in seen)  # once
        assert sorted(t.link_id for f in seen for t in f.tokens) == [1, 2]
    finally:
        hold.set()
        await run.aclose()
